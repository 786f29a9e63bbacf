//! One submission of a call and the bytes it moves: uploads (host inputs
//! and the call's parameters) through reused mapped staging buffers,
//! copied by commands in the same encoder as the kernels; output buffers
//! from the device pool (poisoned with NaN where asked); and the outputs
//! that go back to the host, read through one mappable buffer. Everything
//! a call records goes to the GPU in one submission.
//!
//! A submission that reads nothing back, uploads no host array and is not
//! timed is queued without waiting (CUDA's asynchronous launches), and a
//! decoding call's may be held back by the context to go to the queue with
//! later work (`Context::defer`): the queue runs submissions in order, so
//! a later call, a readback or [`synchronize`] sees its results. Its
//! buffers go back to the pool as it is submitted or held, which is safe
//! for the same reason: a pooled buffer handed out again is used only by
//! later work, and no host write reaches a device buffer except through
//! the queue (`Queue::write_buffer`, run before the next submission's
//! commands and after every earlier one's, held ones handed over first:
//! `Context::write_buffer`) or through staging buffers mapped again only
//! once their copies are done.
//! At most `MAX_QUEUED` (context.rs) queued submissions are in flight per
//! context.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::arena::{self, Arena, Param};
use super::context::Context;
use super::pool::{padded, Pooled};
use super::timing::{self, record_host, record_host_seconds, Timer};
use crate::error::{Error, Result};

/// The work of one submission: its encoder, the buffers it uses (kept
/// out of the pool until the work is submitted, or done where the call
/// waits), the staging buffers to reuse afterwards, and the timestamps of
/// its passes where they are measured.
pub(crate) struct Submission<'c> {
    ctx: &'c Context,
    /// The compute pass the untimed dispatches share, open until something
    /// else is recorded (declared before the encoder: it ends first).
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: wgpu::CommandEncoder,
    keep: Vec<Arc<Pooled>>,
    staged: Vec<wgpu::Buffer>,
    /// Where the parameters go (`arena.rs`): the open arena, if any.
    arena: Option<Arena>,
    timer: Option<Timer>,
    /// Host time spent uploading the call's input arrays (`Some` once a
    /// host array was uploaded: such a call waits, as NumPy calls do).
    uploading: Option<Duration>,
    /// Whether outputs are poisoned ([`poison_outputs`]), read at the
    /// first output only: the environment lookup per output showed in a
    /// queued decode call's profile (three outputs a call).
    poison: Option<bool>,
    /// Whether the context may hold the work back if it is queued
    /// ([`Self::may_hold`]).
    hold: bool,
}

impl<'c> Submission<'c> {
    pub fn new(ctx: &'c Context) -> Self {
        Submission {
            ctx,
            pass: None,
            encoder: ctx.device.create_command_encoder(&Default::default()),
            keep: Vec::new(),
            staged: Vec::new(),
            arena: None,
            timer: timing::enabled().then(|| Timer::new(ctx)).flatten(),
            uploading: None,
            poison: None,
            hold: false,
        }
    }

    pub fn ctx(&self) -> &'c Context {
        self.ctx
    }

    /// The encoder, for copies and clears between the passes (ending the
    /// open compute pass).
    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        &mut self.encoder
    }

    /// Lets the context hold this work back, where it is queued, until more
    /// work goes to the GPU (`Context::defer`): for the calls of a decode
    /// step (decoding over a cache, a KV cache's writes), which come in
    /// runs and whose host time is mostly their submission. Other queued
    /// calls (a forward, a backward: kernels of milliseconds, where a
    /// caller may overlap its own work with the GPU's) go to the GPU as
    /// they are made, taking the held ones with them.
    pub fn may_hold(&mut self) {
        self.hold = true;
    }

    /// Keeps `buffer` out of the pool until the submission is done.
    pub fn keep(&mut self, buffer: &Arc<Pooled>) {
        self.keep.push(buffer.clone());
    }

    /// A device buffer of `bytes` bytes for this submission, contents as
    /// an earlier call left them.
    pub fn scratch(&mut self, bytes: u64) -> Arc<Pooled> {
        let buffer = Arc::new(self.ctx.device_buffer(bytes));
        self.keep(&buffer);
        buffer
    }

    /// A float32 output of `floats` elements, filled with NaN first where
    /// outputs are poisoned, so that an element no kernel writes shows.
    pub fn output(&mut self, floats: usize) -> Arc<Pooled> {
        self.output_bytes(4 * floats as u64)
    }

    /// An output of `bytes` bytes (a multiple of 4) in any dtype, poisoned
    /// as [`Self::output`] says: every word is `POISON`, a NaN whether read
    /// as one float32 or as two float16s.
    pub fn output_bytes(&mut self, bytes: u64) -> Arc<Pooled> {
        debug_assert_eq!(bytes % 4, 0);
        let buffer = self.scratch(bytes);
        if *self.poison.get_or_insert_with(poison_outputs) && bytes > 0 {
            let nan = vec![POISON; (bytes / 4) as usize];
            self.ctx
                .write_buffer(buffer.buffer(), 0, bytemuck::cast_slice(&nan));
        }
        buffer
    }

    /// A host input array's `bytes` in a device buffer, copied before this
    /// submission's work (the time it takes is the call's "host:upload").
    pub fn upload(&mut self, label: &str, bytes: &[u8]) -> Result<Arc<Pooled>> {
        self.upload_screened(label, bytes, None)
            .map(|(buffer, _)| buffer)
    }

    /// As [`Self::upload`], and whether any of the bytes' chunks made
    /// `raises` true (read as they are copied, while they are in cache).
    pub fn upload_screened(
        &mut self,
        label: &str,
        bytes: &[u8],
        raises: Option<fn(&[u8]) -> bool>,
    ) -> Result<(Arc<Pooled>, bool)> {
        let started = Instant::now();
        let uploaded = self.upload_bytes(label, bytes, raises);
        *self.uploading.get_or_insert_default() += started.elapsed();
        uploaded
    }

    /// The call's own words (lengths, a block table, the variants' data)
    /// for its kernels: in the submission's arena where they are small, in
    /// a buffer of their own otherwise.
    pub fn data(&mut self, words: &[u32]) -> Result<Param> {
        self.param("data", bytemuck::cast_slice(words))
    }

    /// `value`, to bind as a uniform (in the submission's arena).
    pub fn uniform<T: bytemuck::Pod>(&mut self, value: &T) -> Result<Param> {
        self.param("params", bytemuck::bytes_of(value))
    }

    fn param(&mut self, label: &str, bytes: &[u8]) -> Result<Param> {
        if bytes.len() as u64 > arena::INLINE_BYTES {
            return self
                .upload_bytes(label, bytes, None)
                .map(|(buffer, _)| Param::whole(buffer));
        }
        let align = arena::alignment(self.ctx);
        if let Some(param) = self.arena.as_mut().and_then(|a| a.push(bytes, align)) {
            return Ok(param);
        }
        // The first parameter, or the open arena is full: a new one (the
        // full one is sealed with the rest at submission).
        let device = self.scratch(arena::ARENA_BYTES);
        let mut opened = Arena::open(self.ctx, device, self.encoder());
        let param = opened
            .push(bytes, align)
            .expect("a small parameter fits an empty arena");
        if let Some(full) = self.arena.replace(opened) {
            self.staged.push(full.seal()?);
        }
        Ok(param)
    }

    /// Seals the open arena: its bytes are written for the GPU to copy.
    fn seal(&mut self) -> Result<()> {
        if let Some(arena) = self.arena.take() {
            self.staged.push(arena.seal()?);
        }
        Ok(())
    }

    fn upload_bytes(
        &mut self,
        label: &str,
        bytes: &[u8],
        raises: Option<fn(&[u8]) -> bool>,
    ) -> Result<(Arc<Pooled>, bool)> {
        let size = padded(bytes.len() as u64);
        let buffer = self.scratch(size);
        let staging = self.ctx.take_upload_staging(size);
        let raised;
        {
            let mut view = staging.slice(..size).get_mapped_range_mut().map_err(|e| {
                Error::Gpu(format!("could not map the upload buffer of {label}: {e}"))
            })?;
            raised = parallel_copy(view.slice(..bytes.len()), bytes, raises);
            // A reused staging buffer holds an earlier upload: the padding
            // after the data must not carry it over.
            view.slice(bytes.len()..).fill(0);
        }
        staging.unmap();
        self.encoder()
            .copy_buffer_to_buffer(&staging, 0, buffer.buffer(), 0, size);
        self.staged.push(staging);
        Ok((buffer, raised))
    }

    /// Records `pipeline` over an `x` × `y` grid: in the pass the call's
    /// kernels share, or, where the submission measures its passes, in a
    /// pass of its own timed as `name`.
    pub fn dispatch(
        &mut self,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        (x, y): (u32, u32),
        name: &'static str,
    ) {
        if x == 0 || y == 0 {
            return;
        }
        // Untimed dispatches share one pass (wgpu still orders each after
        // the ones whose writes it reads); a timed one has its own, which
        // carries its timestamps.
        let mut own;
        let pass = match self.timer.as_mut().and_then(|t| t.next(name)) {
            Some(timestamp_writes) => {
                self.pass = None;
                own = self
                    .encoder
                    .begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some(name),
                        timestamp_writes: Some(timestamp_writes),
                    })
                    .forget_lifetime();
                &mut own
            }
            None => {
                let encoder = &mut self.encoder;
                self.pass.get_or_insert_with(|| {
                    encoder
                        .begin_compute_pass(&wgpu::ComputePassDescriptor {
                            label: Some("kernels"),
                            timestamp_writes: None,
                        })
                        .forget_lifetime()
                })
            }
        };
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, group, &[]);
        pass.dispatch_workgroups(x, y, 1);
    }

    /// Submits the work (or has the context hold it, where
    /// [`Self::may_hold`] allows) and returns without waiting for the GPU,
    /// whose results only later work on this queue reads (a KV cache's
    /// appends, read by the next attention; a call's device outputs). The
    /// queue runs submissions in order and wgpu keeps every buffer the work
    /// uses alive until it is done (a held command buffer holds them too),
    /// so the buffers it kept go back to the pool now (see the module's
    /// comment). Where `MAX_QUEUED` submissions are already in flight,
    /// waits for the oldest first. A device lost under the work surfaces at
    /// the next call that waits, or that uses the context.
    pub fn submit_queued(mut self) -> Result<()> {
        if let Some(uploading) = self.uploading {
            record_host_seconds("upload", uploading.as_secs_f64());
        }
        self.seal()?;
        let t_submit = Instant::now();
        self.pass = None;
        let commands = self.encoder.finish();
        let staged = std::mem::take(&mut self.staged);
        let oldest = self
            .ctx
            .defer(commands, staged, self.hold)
            .and_then(|index| self.ctx.queued(index));
        record_host("submit", t_submit);
        if let Some(oldest) = oldest {
            let t_wait = Instant::now();
            self.ctx
                .device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(oldest),
                    timeout: None,
                })
                .map_err(|e| Error::Gpu(format!("waiting for the GPU failed: {e}")))?;
            record_host("queue_full", t_wait);
        } else {
            // Delivers the maps of finished work (recycled staging) without
            // blocking.
            self.ctx
                .device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| Error::Gpu(format!("polling the GPU failed: {e}")))?;
        }
        Ok(())
    }

    /// Submits the work and reads `reads` (buffer, float32 words each)
    /// back: the words of each read. Waits for the GPU where there is
    /// something to read, the call uploaded a host array (calls on NumPy
    /// arrays keep their synchronous contract) or it is timed; otherwise
    /// queues the work ([`Self::submit_queued`]) and returns no words.
    pub fn submit(mut self, reads: &[(&Pooled, usize)]) -> Result<Vec<Vec<f32>>> {
        if reads.is_empty() && self.uploading.is_none() && !timing::enabled() {
            self.submit_queued()?;
            return Ok(Vec::new());
        }
        if let Some(uploading) = self.uploading {
            record_host_seconds("upload", uploading.as_secs_f64());
        }
        self.seal()?;
        let mut reads: Vec<(&wgpu::Buffer, usize)> =
            reads.iter().map(|(b, n)| (b.buffer(), *n)).collect();
        self.pass = None;
        let timer = self.timer.take();
        if let Some(t) = &timer {
            reads.push((&t.resolve, t.resolve(&mut self.encoder)));
        }
        let staged = std::mem::take(&mut self.staged);
        let mut results = submit_and_read(self.ctx, self.encoder, &reads, staged)?;
        if let Some(t) = &timer {
            let words = results.pop().unwrap_or_default();
            t.record(self.ctx, &words);
        }
        // Only now may the buffers the work used go back to the pool.
        drop(self.keep);
        Ok(results)
    }
}

/// Bytes per task of the host copies into and out of mapped GPU memory:
/// large arrays are copied by several threads, which also spreads the
/// first-touch page faults of fresh host buffers.
const COPY_CHUNK: usize = 4 << 20;
/// Bytes copied, then tested, at a time within a chunk: a multiple of
/// every element size, well within a core's L2 cache.
const SCREEN_PIECE: usize = 256 << 10;

/// Copies `src` into `dst`, by several threads where it is large, and
/// returns whether `raises` held for any chunk of it (false without one).
fn parallel_copy(
    mut dst: wgpu::WriteOnly<'_, [u8]>,
    src: &[u8],
    raises: Option<fn(&[u8]) -> bool>,
) -> bool {
    use rayon::prelude::*;
    /// The mapped destination, shared by the copying threads.
    struct Destination(*mut u8);
    // SAFETY: each thread writes its own disjoint chunk (below).
    unsafe impl Sync for Destination {}
    assert_eq!(dst.len(), src.len(), "upload of the wrong size");
    let destination = Destination(dst.as_raw_ptr().as_ptr() as *mut u8);
    let copy = |i: usize, chunk: &[u8]| {
        // The whole struct, which is Sync, not its pointer field.
        let destination = &destination;
        let mut raised = false;
        // Each piece tested right after its copy, while it is in cache.
        for (j, piece) in chunk.chunks(SCREEN_PIECE).enumerate() {
            // SAFETY: `dst` is valid for `src.len()` bytes of writes while
            // it is borrowed here, and the pieces are disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    piece.as_ptr(),
                    destination.0.add(i * COPY_CHUNK + j * SCREEN_PIECE),
                    piece.len(),
                )
            }
            raised |= raises.is_some_and(|raises| raises(piece));
        }
        raised
    };
    if src.len() <= COPY_CHUNK {
        // One chunk (a call's parameters, its block table): handing it to
        // a pool thread and waiting for it to wake cost more than the copy.
        return copy(0, src);
    }
    // Not rayon's global pool: a forked child would wait on its threads.
    crate::runtime::parallel::install(|| {
        src.par_chunks(COPY_CHUNK)
            .enumerate()
            .map(|(i, chunk)| copy(i, chunk))
            .reduce(|| false, |a, b| a | b)
    })
}

/// The word poisoned outputs are filled with: a quiet NaN as a float32
/// (0x7fc0_7fc0) whose halves are float16 quiet NaNs (0x7fc0) too.
pub(crate) const POISON: u32 = 0x7fc0_7fc0;

/// Whether output buffers are filled with NaN before the kernels run: in
/// debug builds (the Rust tests) and with `FLASHPORT_GPU_POISON=1` (the
/// Python test suite sets it), so that an unwritten element cannot pass for
/// a result. Off otherwise: it costs an upload of every output.
pub(crate) fn poison_outputs() -> bool {
    cfg!(debug_assertions) || crate::env::switch_on(crate::env::GPU_POISON)
}

/// Submits `encoder` after the queued calls held back (then recycles
/// `staged`, its upload staging), waits until the GPU is done and returns
/// the float32 words of each of `reads` (buffer, words), copied through
/// one mappable buffer.
pub(crate) fn submit_and_read(
    ctx: &Context,
    mut encoder: wgpu::CommandEncoder,
    reads: &[(&wgpu::Buffer, usize)],
    staged: Vec<wgpu::Buffer>,
) -> Result<Vec<Vec<f32>>> {
    let mut offsets = Vec::with_capacity(reads.len());
    let mut total = 0u64;
    for (_, words) in reads {
        offsets.push(total);
        total += 4 * *words as u64;
    }
    let staging = (!reads.is_empty()).then(|| ctx.take_readback_buffer(total.max(4)));
    if let Some(staging) = &staging {
        for ((buffer, words), &offset) in reads.iter().zip(&offsets) {
            if *words > 0 {
                encoder.copy_buffer_to_buffer(buffer, 0, staging, offset, 4 * *words as u64);
            }
        }
    }
    let t_submit = Instant::now();
    // Every queued submission before this one is done once it is.
    let before = ctx.queued_count();
    let index = ctx.submit(encoder.finish(), staged);
    record_host("submit", t_submit);
    let t_wait = Instant::now();
    let (tx, rx) = mpsc::channel();
    if let Some(staging) = &staging {
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
    }
    ctx.wait(Some(index)).map_err(|e| {
        Error::Gpu(format!(
            "waiting for the GPU failed on {}: {e}",
            ctx.adapter.name
        ))
    })?;
    ctx.done_before(before);
    let Some(staging) = staging else {
        record_host("wait", t_wait);
        return Ok(Vec::new());
    };
    // The wait above runs the callbacks of finished work; the loop only
    // covers a map that another thread's poll has not delivered yet.
    let mapped = loop {
        match rx.try_recv() {
            Ok(r) => break r,
            Err(mpsc::TryRecvError::Empty) => {
                if ctx.is_lost() {
                    return Err(Error::Gpu(format!(
                        "the GPU device {} was lost",
                        ctx.adapter.name
                    )));
                }
                ctx.device
                    .poll(wgpu::PollType::wait_indefinitely())
                    .map_err(|e| Error::Gpu(format!("waiting for the GPU failed: {e}")))?;
                std::thread::yield_now();
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                return Err(Error::Gpu(
                    "the readback buffer was never mapped".to_string(),
                ))
            }
        }
    };
    mapped.map_err(|e| {
        Error::Gpu(format!(
            "could not read the results back from {}: {e}",
            ctx.adapter.name
        ))
    })?;
    // A device lost under queued work may still signal it done (Vulkan
    // leaves memory undefined then): its bytes are refused, not returned.
    if ctx.is_lost() {
        return Err(Error::Gpu(format!(
            "the GPU device {} was lost",
            ctx.adapter.name
        )));
    }
    record_host("wait", t_wait);
    let t_copy = Instant::now();
    let view = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|e| Error::Gpu(format!("could not read the results back: {e}")))?;
    let results = reads
        .iter()
        .zip(&offsets)
        .map(|((_, words), &offset)| {
            let start = offset as usize;
            let bytes = &view[start..start + 4 * words];
            match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                // Collected in parallel straight into the result, without
                // zeroing it first.
                Ok(values) if bytes.len() <= COPY_CHUNK => values.to_vec(),
                Ok(values) => {
                    use rayon::prelude::*;
                    crate::runtime::parallel::install(|| values.par_iter().copied().collect())
                }
                Err(_) => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
            }
        })
        .collect();
    drop(view);
    staging.unmap();
    ctx.return_readback_buffer(staging);
    record_host("readback_copy", t_copy);
    Ok(results)
}
