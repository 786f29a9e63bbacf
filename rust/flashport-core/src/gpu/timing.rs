//! Where a GPU call's time goes: each kernel's GPU time from timestamp
//! queries, and the wall time of the call's host phases, per thread (calls
//! running at the same time on other threads, a threaded test runner or a
//! user's worker pool, do not mix their times into the caller's).

use std::cell::{Cell, RefCell};
use std::time::Instant;

use super::context::Context;

thread_local! {
    static KERNEL_TIMES: RefCell<Vec<(String, f64)>> = const { RefCell::new(Vec::new()) };
    static KERNEL_TIMING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread's calls measure their kernels with
/// timestamp queries, where the adapter has them. Off by default: the
/// query set, its resolve and the readback that brings the times home
/// cost a call 0.04–0.31 ms on an H100 (a float16 decode at 4k context
/// took 0.64 ms with them, 0.32 without), which users should not pay for
/// a breakdown only benchmarks read.
pub fn set_kernel_timing(enabled: bool) {
    KERNEL_TIMING.with(|c| c.set(enabled));
}

pub(crate) fn enabled() -> bool {
    KERNEL_TIMING.with(Cell::get)
}

/// GPU time of each kernel of the calling thread's last forward or
/// backward call, in seconds, in dispatch order (one entry per kernel and
/// chunk), from timestamp queries (only while [`set_kernel_timing`] is on,
/// and none where the adapter has no timestamp queries); and
/// wall time of the call's host phases: "host:prepare" (selecting,
/// allocating, binding and recording), "host:upload" (recorded only when
/// host data was uploaded: device-array inputs are not), "host:submit"
/// (handing the work to the driver), "host:wait" (until the GPU is done:
/// one per submission that waits; a call on device arrays queues its work
/// and has none), "host:queue_full" (a queued submission waiting for the
/// oldest one in flight, where the queue is full) and
/// "host:readback_copy". The moves of device outputs (float16 rounding,
/// chunk assembly) are timed as passes of their own. An upload into or a
/// readback of a device array is a call too: it starts a new record.
pub fn last_kernel_times() -> Vec<(String, f64)> {
    KERNEL_TIMES.with(|times| times.borrow().clone())
}

/// Starts the calling thread's record of a new call.
pub(crate) fn start_call() {
    KERNEL_TIMES.with(|times| times.borrow_mut().clear());
}

/// Records a host-side phase of the current call, named "host:<name>",
/// from `since` until now.
pub(crate) fn record_host(name: &str, since: Instant) {
    record_host_seconds(name, since.elapsed().as_secs_f64());
}

/// Records a host-side phase of the current call that took `seconds`.
pub(crate) fn record_host_seconds(name: &str, seconds: f64) {
    KERNEL_TIMES.with(|times| times.borrow_mut().push((format!("host:{name}"), seconds)));
}

/// Timestamp queries around each dispatch of one submission.
pub(crate) struct Timer {
    set: wgpu::QuerySet,
    pub resolve: wgpu::Buffer,
    names: Vec<&'static str>,
}

/// Passes a call times at most: a backward's three kernels and the
/// moves of its three outputs, with room to spare.
const TIMER_PASSES: u32 = 16;

impl Timer {
    /// A timer for one submission, where the device has timestamp queries.
    pub fn new(ctx: &Context) -> Option<Timer> {
        if !ctx.timestamps {
            return None;
        }
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("flashport timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * TIMER_PASSES,
        });
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("flashport timestamps"),
            size: 16 * TIMER_PASSES as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Some(Timer {
            set,
            resolve,
            names: Vec::new(),
        })
    }

    /// The timestamp writes of the next pass, if the set has room.
    pub fn next(&mut self, name: &'static str) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let i = self.names.len() as u32;
        if i >= TIMER_PASSES {
            return None;
        }
        self.names.push(name);
        Some(wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }

    /// Records the resolution of the passes' timestamps into `resolve`;
    /// returns the number of f32 words to read back from it.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) -> usize {
        let n = self.names.len() as u32;
        if n > 0 {
            encoder.resolve_query_set(&self.set, 0..2 * n, &self.resolve, 0);
        }
        4 * n as usize
    }

    /// Records the durations from the resolved words (read back as f32s).
    pub fn record(&self, ctx: &Context, words: &[f32]) {
        let period = ctx.queue.get_timestamp_period() as f64 * 1e-9;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec::<f32, u64>(words);
        KERNEL_TIMES.with(|times| {
            let mut times = times.borrow_mut();
            for (i, name) in self.names.iter().enumerate() {
                if let (Some(&a), Some(&b)) = (ticks.get(2 * i), ticks.get(2 * i + 1)) {
                    times.push((name.to_string(), b.wrapping_sub(a) as f64 * period));
                }
            }
        });
    }
}
