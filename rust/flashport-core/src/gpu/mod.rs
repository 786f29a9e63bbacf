//! The GPU backend: FlashAttention-2 forward and backward as WGSL compute
//! shaders (`shaders/` at the repository root) run through wgpu on Vulkan,
//! Metal or DX12.
//!
//! One context (device, queue, compiled pipelines) is created lazily per
//! process and shared by all threads; a lost device is dropped so that the
//! next call opens a new one. Every call uploads its host inputs, runs one
//! submission per chunk of heads (one in all unless the arrays exceed the
//! adapter's binding size) and reads the outputs back; inputs that are
//! device tensors (`resident.rs`) are bound or copied on the device
//! instead, and outputs can stay there as new device tensors.
//!
//! Inputs are read on the GPU in their own dtype (float16 as packed pairs,
//! which needs no shader-f16 support); all arithmetic and every output is
//! float32 on the GPU, and float16 outputs are rounded on the host exactly
//! as the CPU backend rounds them.

mod context;
mod coop_diag;
mod plan;
mod resident;
#[doc(hidden)]
pub mod shaders;
#[doc(hidden)]
pub mod spirv;
pub mod tiles;

use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};

use crate::variants::{slopes_per_head, AdditiveMask, DropoutMask};
use crate::{
    Array, BackendArrays, BackendGradients, Buffer, DType, Error, ForwardArrays, ForwardOutput,
    Input, Placement, Problem, Result, Slice, VariantArrays,
};
use context::{Context, PipelineKey};
use plan::Chunk;
use shaders::Variants;
use tiles::Kernel;

pub use resident::{round_to_f16_on_device, to_device, DeviceTensor};

/// What `flashport.devices()` reports about one adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// "vulkan", "metal", "dx12", ...
    pub backend: String,
    pub name: String,
    /// "discrete", "integrated", "virtual", "software" or "other".
    pub device_type: String,
    pub driver: String,
    /// Limits the backend uses, as (name, value).
    pub limits: Vec<(String, u64)>,
    /// Optional features the adapter offers that matter to flashport, e.g.
    /// "shader-f16", "subgroups" (the kernels currently require neither).
    pub features: Vec<String>,
}

fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // wgpu reports misuse by panicking in a few places; no panic may cross
    // into Python, so one becomes an error.
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(Error::Gpu(format!(
                "the GPU backend failed while {what}: {msg}"
            )))
        }
    }
}

/// Adapters flashport can use, best first, without creating a device.
pub fn adapters() -> Vec<AdapterInfo> {
    guarded("listing adapters", || {
        Ok(context::enumerate().iter().map(context::describe).collect())
    })
    .unwrap_or_default()
}

/// Whether a non-software adapter exists (what `device="auto"` needs).
/// Enumerated once per process.
pub fn hardware_adapter_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        guarded("listing adapters", || {
            Ok(context::enumerate()
                .iter()
                .any(|a| a.get_info().device_type != wgpu::DeviceType::Cpu))
        })
        .unwrap_or(false)
    })
}

thread_local! {
    static BINDING_LIMIT_OVERRIDE: Cell<Option<u64>> = const { Cell::new(None) };
    static WORKGROUP_STORAGE_OVERRIDE: Cell<Option<u32>> = const { Cell::new(None) };
    static NO_SUBGROUPS: Cell<bool> = const { Cell::new(false) };
    static SIMPLE_KERNELS: Cell<bool> = const { Cell::new(false) };
    static NO_COOP: Cell<bool> = const { Cell::new(false) };
}

/// Makes the calling thread run the scalar float16 kernels where the
/// cooperative-matrix forward would run, so tests can compare the two in
/// one process.
#[doc(hidden)]
pub fn set_no_coop_for_this_thread(off: bool) {
    NO_COOP.with(|c| c.set(off));
}

/// Runs the one-subgroup diagnostic of the cooperative-matrix builtins
/// (shaders/coop_diagnostic.wgsl) and describes each case: through wgpu's
/// own SPIR-V (`via_spirv` false) or through src/gpu/spirv.rs with the
/// memory model switched to GLSL450 where `glsl450`.
#[doc(hidden)]
pub fn coop_diagnostic(via_spirv: bool, glsl450: bool) -> Result<Vec<String>> {
    guarded("running the cooperative-matrix diagnostic", || {
        coop_diag::run(via_spirv, glsl450)
    })
}

/// Whether the current context builds the cooperative forward from the
/// SPIR-V of src/gpu/spirv.rs (GLSL450 memory model).
#[doc(hidden)]
pub fn coop_passthrough() -> bool {
    context::get().is_ok_and(|ctx| ctx.coop_passthrough)
}

/// Whether the current context runs the cooperative-matrix float16 forward
/// (tests report where it is absent instead of passing untested).
#[doc(hidden)]
pub fn coop_available() -> bool {
    context::get().is_ok_and(|ctx| ctx.coop)
}

/// Whether the forward of `p` would run the cooperative-matrix kernel
/// (tests, with tiles pinned for a benchmark).
#[doc(hidden)]
pub fn coop_runs(p: &Problem) -> bool {
    context::get().is_ok_and(|ctx| {
        let caps = caps(&ctx);
        coop_tiles(&ctx, p, caps).is_some()
    })
}

/// The cooperative-matrix forward's tiles for this call, if it runs it:
/// float16 inputs, plain or causal attention (the variants stay on the
/// other kernels, which implement them), head dimensions it supports
/// (context::CoopPolicy).
fn coop_tiles(ctx: &Context, p: &Problem, caps: tiles::DeviceCaps) -> Option<tiles::Tiles> {
    if !ctx.coop || p.dtype != DType::F16 || p.has_variants() || NO_COOP.with(Cell::get) {
        return None;
    }
    tiles::coop_tiles(
        p.head_dim as u32,
        p.value_dim as u32,
        caps,
        coop_pinned_tiles(),
    )
}

/// The cooperative-matrix backward's (dQ, dK/dV) tiles for this call, if
/// it runs them: float16, plain or causal, where they fit
/// (context::CoopPolicy).
fn coop_backward_tiles(
    ctx: &Context,
    p: &Problem,
    caps: tiles::DeviceCaps,
) -> Option<(tiles::Tiles, tiles::Tiles)> {
    if !ctx.coop || p.dtype != DType::F16 || p.has_variants() || NO_COOP.with(Cell::get) {
        return None;
    }
    tiles::coop_backward_tiles(p.head_dim as u32, p.value_dim as u32, caps)
}

/// Whether the backward of `p` would run the cooperative-matrix kernels
/// (tests).
#[doc(hidden)]
pub fn coop_backward_runs(p: &Problem) -> bool {
    context::get().is_ok_and(|ctx| {
        let caps = caps(&ctx);
        !forced_simple() && coop_backward_tiles(&ctx, p, caps).is_some()
    })
}

/// Benchmarks: FLASHPORT_GPU_COOP_TILES=subgroups,keys (e.g. 4,64) pins the
/// cooperative forward's tiles (also read by examples/kernel_stats).
#[doc(hidden)]
pub fn coop_pinned_tiles() -> Option<(u32, u32)> {
    let v = std::env::var("FLASHPORT_GPU_COOP_TILES").ok()?;
    let (w, bk) = v.split_once(',')?;
    Some((w.trim().parse().ok()?, bk.trim().parse().ok()?))
}

/// Makes the calling thread run the simple kernels where the tiled ones
/// would run (what FLASHPORT_GPU_KERNELS=simple does for the process), so
/// tests can cover both in one process.
#[doc(hidden)]
pub fn set_simple_kernels_for_this_thread(on: bool) {
    SIMPLE_KERNELS.with(|c| c.set(on));
}

/// Makes the calling thread's kernels reduce through workgroup memory even
/// where the adapter has subgroups, so tests can run both variants.
#[doc(hidden)]
pub fn set_no_subgroups_for_this_thread(off: bool) {
    NO_SUBGROUPS.with(|c| c.set(off));
}

/// Caps the workgroup memory the calling thread chooses tiles for
/// (`None`: the adapter's), so tests can run the tiles of a 16 KiB
/// adapter on a larger one.
#[doc(hidden)]
pub fn set_workgroup_storage_for_this_thread(bytes: Option<u32>) {
    WORKGROUP_STORAGE_OVERRIDE.with(|c| c.set(bytes));
}

fn caps(ctx: &Context) -> tiles::DeviceCaps {
    let mut caps = ctx.caps();
    if let Some(bytes) = WORKGROUP_STORAGE_OVERRIDE.with(Cell::get) {
        caps.workgroup_storage_bytes = caps.workgroup_storage_bytes.min(bytes);
    }
    // Benchmarks: smaller tiles (more workgroups per SM) on the same adapter.
    if let Some(bytes) = std::env::var("FLASHPORT_GPU_WORKGROUP_BYTES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        caps.workgroup_storage_bytes = caps.workgroup_storage_bytes.min(bytes);
    }
    if NO_SUBGROUPS.with(Cell::get) {
        caps.subgroups = false;
    }
    caps
}

/// GPU time of each kernel of the calling thread's last forward or
/// backward call, in seconds, in dispatch order (one entry per kernel and
/// chunk), from timestamp queries (none where the adapter has none); and
/// wall time of the call's host phases, named "host:upload" (recorded only
/// when host data was uploaded: device-tensor inputs are not),
/// "host:submit_and_wait", "host:readback_copy". An upload into or a
/// readback of a device tensor (`to_device`, `DeviceTensor::to_host`) is a
/// call too: it starts a new record with its own host phases.
pub fn last_kernel_times() -> Vec<(String, f64)> {
    with_times(|times| times.clone())
}

/// Destroys the shared context's device, as a driver reset or a removed
/// GPU would, so that tests can check that the failure surfaces as an
/// error, that the CPU keeps working, and that the next GPU call starts
/// afresh. Does nothing when no context exists yet.
#[doc(hidden)]
pub fn lose_device_for_tests() {
    if let Some(ctx) = context::current() {
        ctx.device.destroy();
    }
}

thread_local! {
    // Per thread, so that calls running at the same time on other threads
    // (a threaded test runner, a user's worker pool) do not mix their times
    // into the caller's.
    static KERNEL_TIMES: RefCell<Vec<(String, f64)>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on the calling thread's kernel times.
fn with_times<R>(f: impl FnOnce(&mut Vec<(String, f64)>) -> R) -> R {
    KERNEL_TIMES.with(|times| f(&mut times.borrow_mut()))
}

/// Records a host-side phase of the current call (wall seconds, named
/// "host:..."), beside the kernels' GPU times: where end-to-end time goes.
fn record_host(name: &str, since: std::time::Instant) {
    let elapsed = since.elapsed().as_secs_f64();
    with_times(|times| times.push((format!("host:{name}"), elapsed)));
}

/// Timestamp queries around each dispatch of one submission.
struct Timer {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    names: Vec<&'static str>,
}

const TIMER_PASSES: u32 = 8;

impl Timer {
    fn new(ctx: &Context) -> Option<Timer> {
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
    fn next(&mut self, name: &'static str) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
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

    fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        let n = self.names.len() as u32;
        if n > 0 {
            encoder.resolve_query_set(&self.set, 0..2 * n, &self.resolve, 0);
        }
    }

    /// Records the durations from the resolved words (read back as f32s).
    fn record(&self, ctx: &Context, words: &[f32]) {
        let period = ctx.queue.get_timestamp_period() as f64 * 1e-9;
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec::<f32, u64>(words);
        with_times(|times| {
            for (i, name) in self.names.iter().enumerate() {
                if let (Some(&a), Some(&b)) = (ticks.get(2 * i), ticks.get(2 * i + 1)) {
                    times.push((name.to_string(), b.wrapping_sub(a) as f64 * period));
                }
            }
        });
    }
}

/// A cap on the block height from the environment (benchmarks compare
/// block heights on one adapter); none by default.
fn env_rows(name: &str) -> u32 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(u32::MAX)
}

fn no_prefetch() -> bool {
    // Measures what the register prefetch gains (benchmarks).
    std::env::var("FLASHPORT_GPU_PREFETCH").as_deref() == Ok("0")
}

fn forced_simple() -> bool {
    // Compares the kernels on one adapter (benchmarks/gpu_bench.py).
    SIMPLE_KERNELS.with(Cell::get)
        || std::env::var("FLASHPORT_GPU_KERNELS").as_deref() == Ok("simple")
}

/// Caps the binding size the calling thread plans with (`None`: the
/// adapter's), so tests can exercise the split into chunks on small data.
#[doc(hidden)]
pub fn set_binding_limit_for_this_thread(limit: Option<u64>) {
    BINDING_LIMIT_OVERRIDE.with(|c| c.set(limit));
}

fn binding_limit(ctx: &Context) -> u64 {
    let adapter = ctx
        .limits
        .max_storage_buffer_binding_size
        .min(ctx.limits.max_buffer_size);
    let limit = match BINDING_LIMIT_OVERRIDE.with(Cell::get) {
        Some(cap) => cap.min(adapter),
        None => adapter,
    };
    limit & !3
}

/// The error for float64 data offered to the GPU, naming the argument.
fn float64_error(argument: &str) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: "float64".to_string(),
        reason: "the GPU backend computes in float32 or float16; float64 runs on \
                 device=\"cpu\" (or cast the inputs to float32)"
            .to_string(),
    }
}

/// The error for float16 data on an adapter that cannot unpack it.
fn float16_error(ctx: &Context, argument: &str) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: "float16".to_string(),
        reason: format!(
            "the GPU adapter {} cannot unpack float16 in shaders; cast the inputs to \
             float32 or use device=\"cpu\"",
            ctx.adapter.name
        ),
    }
}

fn check_dtype(problem: &Problem) -> Result<()> {
    if problem.dtype == DType::F64 {
        return Err(float64_error("q"));
    }
    Ok(())
}

/// An input array as the bytes the shaders read (float16 or float32).
fn input_bytes<'a>(name: &str, s: &Slice<'a>) -> Result<&'a [u8]> {
    match *s {
        Slice::F32(x) => Ok(bytemuck::cast_slice(x)),
        Slice::F16(x) => Ok(bytemuck::cast_slice(x)),
        Slice::F64(_) => Err(float64_error(name)),
    }
}

/// The bytes of heads `first..first + count` of an array with `per_head` elements of
/// `elem` bytes each.
fn heads_of(bytes: &[u8], per_head: usize, elem: usize, first: usize, count: usize) -> &[u8] {
    &bytes[first * per_head * elem..(first + count) * per_head * elem]
}

fn padded(bytes: u64) -> u64 {
    bytes.max(4).next_multiple_of(4)
}

fn upload(ctx: &Context, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
    upload_as(ctx, label, bytes, wgpu::BufferUsages::STORAGE)
}

fn upload_as(
    ctx: &Context,
    label: &str,
    bytes: &[u8],
    usage: wgpu::BufferUsages,
) -> Result<wgpu::Buffer> {
    let size = padded(bytes.len() as u64);
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: usage | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let staging = ctx.take_upload_staging(size);
    {
        let mut view = staging
            .slice(..size)
            .get_mapped_range_mut()
            .map_err(|e| Error::Gpu(format!("could not map the upload buffer {label}: {e}")))?;
        parallel_copy(view.slice(..bytes.len()), bytes);
        // A reused staging buffer holds an earlier upload: the padding
        // after the data must not carry it over.
        view.slice(bytes.len()..).fill(0);
    }
    staging.unmap();
    let mut encoder = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("flashport upload"),
        });
    encoder.copy_buffer_to_buffer(&staging, 0, &buffer, 0, size);
    // Submissions run in order, so the kernels submitted after this see the
    // data.
    ctx.queue.submit([encoder.finish()]);
    ctx.recycle_upload_staging(staging);
    Ok(buffer)
}

/// Bytes per task of the host copies into and out of mapped GPU memory:
/// large arrays are copied by several threads, which also spreads the
/// first-touch page faults of fresh host buffers.
const COPY_CHUNK: usize = 4 << 20;

fn parallel_copy(mut dst: wgpu::WriteOnly<'_, [u8]>, src: &[u8]) {
    use rayon::prelude::*;
    /// The mapped destination, shared by the copying threads.
    struct Destination(*mut u8);
    // SAFETY: each thread writes its own disjoint chunk (below).
    unsafe impl Sync for Destination {}
    assert_eq!(dst.len(), src.len(), "upload of the wrong size");
    let destination = Destination(dst.as_raw_ptr().as_ptr() as *mut u8);
    src.par_chunks(COPY_CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let destination = &destination;
            // SAFETY: `dst` is valid for `src.len()` bytes of writes while it
            // is borrowed here, and the chunks are disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    destination.0.add(i * COPY_CHUNK),
                    chunk.len(),
                )
            }
        });
}

/// Whether output buffers are filled with NaN before the kernels run: in
/// debug builds (the Rust tests) and with `FLASHPORT_GPU_POISON=1` (the
/// Python test suite sets it), so that an unwritten element cannot pass for
/// a result. Off otherwise: it costs an upload of every output.
fn poison_outputs() -> bool {
    cfg!(debug_assertions) || std::env::var("FLASHPORT_GPU_POISON").as_deref() == Ok("1")
}

fn output(ctx: &Context, label: &str, floats: usize) -> wgpu::Buffer {
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: padded(4 * floats as u64),
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    if poison_outputs() && floats > 0 {
        // Poison: an element a kernel forgets to write reads back as NaN.
        let nan = vec![f32::NAN; floats];
        ctx.queue
            .write_buffer(&buffer, 0, bytemuck::cast_slice(&nan));
    }
    buffer
}

/// The attention variants of one call as the kernels read them: which
/// overrides are on, the words of the `vx` buffer (shaders/common.wgsl)
/// and the uniform words that locate the arrays in it.
struct VariantData {
    flags: Variants,
    words: Vec<u32>,
    /// Mask strides (4), extents (4) and block counts (2).
    mask: [u32; 10],
    blocks_off: u32,
    slopes_off: u32,
    sinks_off: u32,
}

/// The binding of `vx` in shaders/common.wgsl.
const VX_BINDING: u32 = 15;

fn variant_data(p: &Problem, arrays: &VariantArrays<'_>) -> Result<VariantData> {
    arrays.check(p)?;
    let mut words: Vec<u32> = Vec::new();
    let mut mask_words = [0u32; 10];
    let mut blocks_off = 0;
    if let Some(data) = arrays.mask {
        let mask = AdditiveMask::<f32>::new(p, data)
            .ok_or_else(|| Error::Shape("mask data without a validated mask".to_string()))?;
        // -inf stays -inf: the kernels test its bits to hide the key.
        words.extend(mask.values.iter().map(|x| x.to_bits()));
        blocks_off = words.len() as u32;
        words.extend(mask.blocks.iter().map(|&b| u32::from(b)));
        for axis in 0..4 {
            mask_words[axis] = mask.strides[axis] as u32;
            mask_words[4 + axis] = mask.dims[axis] as u32;
        }
        mask_words[8] = mask.block_counts[0] as u32;
        mask_words[9] = mask.block_counts[1] as u32;
    }
    let slopes_off = words.len() as u32;
    if let Some(slopes) = arrays.alibi_slopes {
        words.extend(
            slopes_per_head(p, slopes)
                .iter()
                .map(|&s| (s as f32).to_bits()),
        );
    }
    let sinks_off = words.len() as u32;
    if let Some(sinks) = arrays.sinks {
        words.extend(sinks.iter().map(|&s| (s as f32).to_bits()));
    }
    Ok(VariantData {
        flags: Variants {
            softcap: p.softcap.is_some(),
            alibi: p.alibi_per_batch.is_some(),
            mask: p.mask.is_some(),
            sinks: p.sinks,
            dropout: p.dropout.is_some(),
            window: p.window.left.is_some(),
            dmask: p.return_dmask,
        },
        words,
        mask: mask_words,
        blocks_off,
        slopes_off,
        sinks_off,
    })
}

/// Uploads `vx` (a one-word dummy when the call has no variant arrays:
/// the kernels name it in code their overrides switch off, and every
/// binding a pipeline names must be bound).
fn upload_variants(ctx: &Context, vd: &VariantData) -> Result<wgpu::Buffer> {
    let bytes = 4 * vd.words.len() as u64;
    if bytes > binding_limit(ctx) {
        return Err(Error::TooLarge(format!(
            "the mask (with its block map, slopes and sinks: {bytes} bytes) is larger than \
             this adapter's largest GPU binding ({} bytes); use device=\"cpu\" or a mask \
             that broadcasts",
            binding_limit(ctx)
        )));
    }
    let words: &[u32] = if vd.words.is_empty() { &[0] } else { &vd.words };
    upload(ctx, "variants", bytemuck::cast_slice(words))
}

/// The uniform block every kernel reads; mirrors `struct Params` in
/// shaders/common.wgsl.
fn params(ctx: &Context, p: &Problem, chunk: &Chunk, vd: &VariantData) -> Result<wgpu::Buffer> {
    let off = p.causal_offset() as i64;
    // Row i sees keys up to i + off + right (causal: right = 0). A right
    // bound of seq_q or more cuts nothing, so larger ones are clamped to
    // keep the sums in i32 (check_sizes bounds the sequences).
    let right = match (p.causal, p.window.right) {
        (true, _) => Some(0),
        (false, Some(r)) => Some(r.min(p.seq_q) as i64),
        (false, None) => None,
    };
    let left = p.window.left.map_or(0, |l| l.min(p.seq_k) as i64);
    let (softcap, keep_scale, threshold, seed) = (
        p.softcap.map_or(1.0, |c| c as f32),
        p.dropout.map_or(1.0, |d| (1.0 / (1.0 - d.p)) as f32),
        p.dropout.map_or(0, |d| DropoutMask::new(d).threshold),
        p.dropout.map_or([0, 0], |d| DropoutMask::new(d).key),
    );
    let mut words = vec![
        p.seq_q as u32,
        p.seq_k as u32,
        p.group_size() as u32,
        chunk.g0 as u32,
        right.is_some() as u32,
        ((off + right.unwrap_or(0)) as i32) as u32,
        (p.scale as f32).to_bits(),
        chunk.g_count as u32,
        chunk.q0(p.group_size()) as u32,
        p.heads_q as u32,
        (off as i32) as u32,
        ((off - left) as i32) as u32,
        softcap.to_bits(),
        keep_scale.to_bits(),
        threshold,
        seed[0],
        seed[1],
    ];
    words.extend(vd.mask);
    words.extend([vd.blocks_off, vd.slopes_off, vd.sinks_off, 0, 0]);
    debug_assert_eq!(words.len(), 32);
    upload_as(
        ctx,
        "params",
        bytemuck::cast_slice(&words),
        wgpu::BufferUsages::UNIFORM,
    )
}

/// A one-word buffer for a read-write binding a pipeline names but this
/// call does not use.
fn dummy_output(ctx: &Context) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("unused"),
        size: 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    })
}

/// Binds `buffers` to bindings 0, 1, ... and `vx` to its own binding.
fn bind(
    ctx: &Context,
    pipeline: &wgpu::ComputePipeline,
    buffers: &[&wgpu::Buffer],
    vx: Option<&wgpu::Buffer>,
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .iter()
        .enumerate()
        .map(|(i, b)| (i as u32, *b))
        .chain(vx.map(|b| (VX_BINDING, b)))
        .map(|(binding, b)| wgpu::BindGroupEntry {
            binding,
            resource: b.as_entire_binding(),
        })
        .collect();
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

fn dispatch(
    encoder: &mut wgpu::CommandEncoder,
    pipeline: &wgpu::ComputePipeline,
    group: &wgpu::BindGroup,
    x: u32,
    y: u32,
    timer: Option<(&mut Timer, &'static str)>,
) {
    if x == 0 || y == 0 {
        return;
    }
    let timestamp_writes = timer.and_then(|(t, name)| t.next(name));
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: None,
        timestamp_writes,
    });
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, group, &[]);
    pass.dispatch_workgroups(x, y, 1);
}

/// Copies `outputs` into one mappable buffer, submits, waits and returns
/// each output's floats.
fn submit_and_read(
    ctx: &Context,
    mut encoder: wgpu::CommandEncoder,
    outputs: &[(&wgpu::Buffer, usize)],
    timer: Option<&Timer>,
) -> Result<Vec<Vec<f32>>> {
    let mut outputs = outputs.to_vec();
    if let Some(t) = timer {
        t.resolve(&mut encoder);
        outputs.push((&t.resolve, 4 * t.names.len()));
    }
    let mut results = read_back(ctx, encoder, &outputs)?;
    if let Some(t) = timer {
        let words = results.pop().unwrap_or_default();
        t.record(ctx, &words);
    }
    Ok(results)
}

fn read_back(
    ctx: &Context,
    mut encoder: wgpu::CommandEncoder,
    outputs: &[(&wgpu::Buffer, usize)],
) -> Result<Vec<Vec<f32>>> {
    let mut offsets = Vec::with_capacity(outputs.len());
    let mut total = 0u64;
    for (buffer, _) in outputs {
        offsets.push(total);
        total += buffer.size();
    }
    let staging = ctx.take_readback_buffer(total.max(4));
    for ((buffer, _), &offset) in outputs.iter().zip(&offsets) {
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, offset, buffer.size());
    }
    let t_submit = std::time::Instant::now();
    let index = ctx.queue.submit([encoder.finish()]);
    let (tx, rx) = mpsc::channel();
    staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    let wait = ctx.device.poll(wgpu::PollType::Wait {
        submission_index: Some(index),
        timeout: None,
    });
    if let Err(e) = wait {
        return Err(Error::Gpu(format!(
            "waiting for the GPU failed on {}: {e}",
            ctx.adapter.name
        )));
    }
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
    record_host("submit_and_wait", t_submit);
    let t_copy = std::time::Instant::now();
    let view = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|e| Error::Gpu(format!("could not read the results back: {e}")))?;
    let results = outputs
        .iter()
        .zip(&offsets)
        .map(|((_, floats), &offset)| {
            let start = offset as usize;
            let bytes = &view[start..start + 4 * floats];
            match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                // Collected in parallel straight into the result, without
                // zeroing it first.
                Ok(values) => {
                    use rayon::prelude::*;
                    values.par_iter().copied().collect()
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

fn grid(count: usize, tile: u32, ctx: &Context, what: &str) -> Result<u32> {
    let n = count.div_ceil(tile.max(1) as usize);
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    if n > max {
        return Err(Error::TooLarge(format!(
            "{what} of {count} rows needs {n} workgroups, more than this adapter's \
             {max} per dimension; use device=\"cpu\""
        )));
    }
    Ok(n as u32)
}

fn check_f16(ctx: &Context, problem: &Problem) -> Result<()> {
    if problem.dtype == DType::F16 && !ctx.f16_inputs {
        return Err(float16_error(ctx, "q"));
    }
    Ok(())
}

fn check_sizes(problem: &Problem) -> Result<()> {
    let limit = i32::MAX as usize / 2;
    if problem.seq_q > limit || problem.seq_k > limit {
        return Err(Error::TooLarge(format!(
            "sequences longer than {limit} are not supported on the GPU; use device=\"cpu\""
        )));
    }
    Ok(())
}

/// Runs `f` on the shared context; a device that failed is dropped so that
/// the next call creates a new one.
fn with_context<T>(what: &str, f: impl FnOnce(&Arc<Context>) -> Result<T>) -> Result<T> {
    guarded(what, || run_on(&context::get()?, f))
}

/// Runs `f` on `ctx`, dropping the context if the GPU fails.
fn run_on<T>(ctx: &Arc<Context>, f: impl FnOnce(&Arc<Context>) -> Result<T>) -> Result<T> {
    match f(ctx) {
        Err(Error::Gpu(message)) => {
            // Whatever failed first (often a buffer the dead device
            // refuses), the user needs to know the device is gone and
            // that the next call will open a new one.
            // A poll delivers a pending device-lost callback.
            let _ = ctx.device.poll(wgpu::PollType::Poll);
            let lost = ctx.is_lost();
            context::discard(ctx);
            Err(Error::Gpu(if lost {
                format!(
                    "the GPU device {} was lost ({message}); the next GPU call opens it again",
                    ctx.adapter.name
                )
            } else {
                format!("{message}; the next GPU call starts on a fresh device")
            }))
        }
        result => result,
    }
}

/// Runs `f` on the context of the call's device inputs (all of one
/// context, which must still be alive: an error names the argument
/// otherwise), or on the shared context when there are none.
fn with_inputs<T>(
    what: &str,
    inputs: &[(&str, Source<'_>)],
    f: impl FnOnce(&Arc<Context>) -> Result<T>,
) -> Result<T> {
    guarded(what, || {
        let tensors: Vec<(&str, &DeviceTensor)> = inputs
            .iter()
            .filter_map(|(name, s)| match s {
                Source::Device(t) => Some((*name, *t)),
                Source::Host(_) => None,
            })
            .collect();
        let Some(&(_, first)) = tensors.first() else {
            return run_on(&context::get()?, f);
        };
        for (name, t) in &tensors {
            t.alive(name)?;
        }
        let ctx = first.context().clone();
        if let Some((name, _)) = tensors
            .iter()
            .find(|(_, t)| !Arc::ptr_eq(t.context(), &ctx))
        {
            return Err(Error::Value {
                argument: name.to_string(),
                value: "a device array of another GPU context".to_string(),
                reason: format!(
                    "the device arrays of one call must come from the same GPU context \
                     (this one is on {})",
                    ctx.adapter.name
                ),
            });
        }
        run_on(&ctx, |ctx| match f(ctx) {
            Err(Error::Gpu(message)) => {
                let _ = ctx.device.poll(wgpu::PollType::Poll);
                if !ctx.is_lost() {
                    return Err(Error::Gpu(message));
                }
                // Lost during the call: the arrays went with the device.
                let names: Vec<&str> = tensors.iter().map(|(name, _)| *name).collect();
                Err(Error::Gpu(format!(
                    "{message}; the device arrays {} were lost with it: upload them again",
                    names.join(", ")
                )))
            }
            result => result,
        })
    })
}

fn to_buffer(values: Vec<f32>, dtype: DType) -> Buffer {
    match dtype {
        DType::F16 => Buffer::F16(round_to_f16(&values)),
        _ => Buffer::F32(values),
    }
}

/// Elements per task of the host's float32 → float16 rounding.
const ROUND_CHUNK: usize = 1 << 18;

/// `values` rounded to float16 (nearest, ties to even), by slices (F16C
/// where the CPU has it) on several threads. Element by element on one
/// thread this was most of a float16 call's end-to-end time: on the H100
/// machine a (4,16,4096,64) forward took 107 ms NumPy to NumPy against
/// 36 ms in float32, for a 13.6 ms kernel.
fn round_to_f16(values: &[f32]) -> Vec<half::f16> {
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    let mut out = Vec::with_capacity(values.len());
    crate::cpu::buffers::spare(&mut out, values.len())
        .par_chunks_mut(ROUND_CHUNK)
        .zip(values.par_chunks(ROUND_CHUNK))
        .for_each(|(dst, src)| {
            crate::cpu::buffers::zero_init(dst).convert_from_f32_slice(src);
        });
    // SAFETY: the chunks cover all `values.len()` elements, each
    // initialised above.
    unsafe { out.set_len(values.len()) };
    out
}

/// Where a call's input comes from: host bytes uploaded chunk by chunk, or
/// a tensor already on the device.
#[derive(Clone, Copy)]
enum Source<'a> {
    Host(&'a [u8]),
    Device(&'a DeviceTensor),
}

fn source<'a>(name: &str, input: Input<'a>) -> Result<Source<'a>> {
    match input {
        Input::Host(s) => Ok(Source::Host(input_bytes(name, &s)?)),
        Input::Device(t) if t.dtype() == DType::F64 => Err(float64_error(name)),
        Input::Device(t) => Ok(Source::Device(t)),
    }
}

/// Heads `first..first + count` of an input, `per_head` elements of `eb`
/// bytes each, as a buffer the chunk binds: uploaded from the host (and
/// `uploaded` set), or taken from the device tensor by commands recorded
/// in `encoder`.
#[allow(clippy::too_many_arguments)]
fn chunk_input(
    ctx: &Context,
    encoder: &mut wgpu::CommandEncoder,
    name: &str,
    input: Source<'_>,
    per_head: usize,
    eb: usize,
    first: usize,
    count: usize,
    uploaded: &mut bool,
) -> Result<wgpu::Buffer> {
    match input {
        Source::Host(bytes) => {
            *uploaded = true;
            upload(ctx, name, heads_of(bytes, per_head, eb, first, count))
        }
        Source::Device(t) => resident::heads(ctx, encoder, t, per_head, first, count),
    }
}

pub fn forward(
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    let r = forward_arrays(
        problem,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?;
    Ok(ForwardOutput {
        out: r.out.into_host()?,
        lse: r.lse.into_host()?,
    })
}

/// The forward pass on host or device inputs, its outputs left where
/// `outputs` says.
pub fn forward_arrays(
    problem: &Problem,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardArrays> {
    check_dtype(problem)?;
    check_sizes(problem)?;
    let sources = [source("q", q)?, source("k", k)?, source("v", v)?];
    let vd = variant_data(problem, variants)?;
    let named = [("q", sources[0]), ("k", sources[1]), ("v", sources[2])];
    with_inputs("running the forward pass", &named, |ctx| {
        forward_on(ctx, problem, sources, &vd, outputs)
    })
}

/// An output assembled from the chunks' results. When one chunk covers it
/// all (the usual case) its readback becomes the output as it is: copying
/// it into a zero-filled array cost a pass over fresh memory per output.
struct Assembled {
    len: usize,
    fill: f32,
    data: Option<Vec<f32>>,
}

impl Assembled {
    fn new(len: usize, fill: f32) -> Self {
        Assembled {
            len,
            fill,
            data: None,
        }
    }

    /// The whole output, filled with `fill` where no chunk wrote yet.
    fn slot(&mut self) -> &mut Vec<f32> {
        let (len, fill) = (self.len, self.fill);
        self.data.get_or_insert_with(|| vec![fill; len])
    }

    /// Puts one chunk's result at `offset`.
    fn put(&mut self, offset: usize, part: Vec<f32>) {
        if self.data.is_none() && offset == 0 && part.len() == self.len {
            self.data = Some(part);
        } else {
            self.slot()[offset..offset + part.len()].copy_from_slice(&part);
        }
    }

    /// Adds one chunk's result to the one at `offset` (the pieces of a GQA
    /// group cut across chunks, summed in chunk order so the result is
    /// still reproducible).
    fn add(&mut self, offset: usize, part: &[f32]) {
        let rows = &mut self.slot()[offset..offset + part.len()];
        rows.iter_mut().zip(part).for_each(|(a, b)| *a += b);
    }

    fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(self.slot())
    }
}

/// One output of a call: assembled in host memory from the chunks'
/// readbacks, or kept on the device.
enum Sink {
    Host(Assembled),
    Device(resident::Resident),
}

impl Sink {
    fn new(outputs: Placement, len: usize, fill: f32) -> Self {
        match outputs {
            Placement::Host => Sink::Host(Assembled::new(len, fill)),
            Placement::Device => Sink::Device(resident::Resident::new(len)),
        }
    }

    /// Records the commands that keep a chunk's `n` results (at element
    /// `offset`, added to what is there when `add`) on the device; a host
    /// sink asks for the buffer to be read back into `reads` instead.
    #[allow(clippy::too_many_arguments)]
    fn collect<'b>(
        &mut self,
        ctx: &Context,
        encoder: &mut wgpu::CommandEncoder,
        part: &'b wgpu::Buffer,
        offset: usize,
        n: usize,
        add: bool,
        reads: &mut Vec<(&'b wgpu::Buffer, usize)>,
    ) -> Result<()> {
        match self {
            Sink::Host(_) => reads.push((part, n)),
            Sink::Device(r) if add => r.add(ctx, encoder, offset, part, n)?,
            Sink::Device(r) => r.put(ctx, encoder, offset, part, n),
        }
        Ok(())
    }

    /// Places a chunk's readback (the next of `reads`) into a host sink.
    fn place(&mut self, offset: usize, add: bool, reads: &mut std::vec::IntoIter<Vec<f32>>) {
        if let Sink::Host(a) = self {
            let part = reads.next().unwrap_or_default();
            if add {
                a.add(offset, &part);
            } else {
                a.put(offset, part);
            }
        }
    }

    /// The output: host values rounded to `dtype`, or a device tensor
    /// rounded on the device by commands recorded in `encoder`.
    fn finish(
        self,
        ctx: &Arc<Context>,
        encoder: &mut wgpu::CommandEncoder,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Array> {
        Ok(match self {
            Sink::Host(a) => Array::Host(to_buffer(a.into_vec(), dtype)),
            Sink::Device(r) => Array::Device(r.finish(ctx, encoder, dtype, shape)?),
        })
    }
}

/// Finishes the outputs of a call (`(sink, dtype, shape)` each): device
/// outputs' last commands are submitted and waited for, so the call's
/// work is done when it returns.
fn finish_outputs<const N: usize>(
    ctx: &Arc<Context>,
    sinks: [(Sink, DType, Vec<usize>); N],
) -> Result<[Array; N]> {
    let mut encoder = ctx.device.create_command_encoder(&Default::default());
    let mut arrays = Vec::with_capacity(N);
    let mut on_device = false;
    for (sink, dtype, shape) in sinks {
        on_device |= matches!(sink, Sink::Device(_));
        arrays.push(sink.finish(ctx, &mut encoder, dtype, shape)?);
    }
    if on_device {
        let index = ctx.queue.submit([encoder.finish()]);
        ctx.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(|e| {
                Error::Gpu(format!(
                    "waiting for the GPU failed on {}: {e}",
                    ctx.adapter.name
                ))
            })?;
    }
    arrays
        .try_into()
        .map_err(|_| Error::Gpu("an output went missing".to_string()))
}

/// Outputs kept on the device are assembled in float32 buffers of their
/// whole size (float16 ones rounded afterwards), which must fit one GPU
/// buffer even where the chunks' bindings are smaller.
fn check_device_outputs(ctx: &Context, outputs: Placement, lens: &[(&str, usize)]) -> Result<()> {
    if outputs == Placement::Host {
        return Ok(());
    }
    let max = ctx.limits.max_buffer_size;
    match lens.iter().find(|(_, len)| 4 * *len as u64 > max) {
        Some((name, len)) => Err(Error::TooLarge(format!(
            "keeping {name} on the GPU needs a buffer of {} bytes, more than the {max} of the \
             GPU {}; pass NumPy arrays to have the results read back chunk by chunk",
            4 * *len as u64,
            ctx.adapter.name
        ))),
        None => Ok(()),
    }
}

/// The outputs of an empty problem, filled with `fill`, where `outputs`
/// says.
fn empty_output(
    ctx: &Arc<Context>,
    outputs: Placement,
    dtype: DType,
    shape: Vec<usize>,
    fill: f32,
) -> Array {
    match outputs {
        Placement::Host => {
            let len = shape.iter().product();
            Array::Host(to_buffer(vec![fill; len], dtype))
        }
        Placement::Device => Array::Device(resident::filled(ctx, dtype, shape, fill)),
    }
}

fn forward_on(
    ctx: &Arc<Context>,
    p: &Problem,
    [q, k, v]: [Source<'_>; 3],
    vd: &VariantData,
    outputs: Placement,
) -> Result<ForwardArrays> {
    check_f16(ctx, p)?;
    if (p.out_len() == 0 && p.lse_len() == 0) || p.seq_k == 0 {
        return ctx.scoped("making the outputs", || {
            Ok(ForwardArrays {
                out: empty_output(ctx, outputs, p.dtype, p.out_shape(), 0.0),
                lse: empty_output(ctx, outputs, DType::F32, p.lse_shape(), f32::NEG_INFINITY),
            })
        });
    }
    check_device_outputs(ctx, outputs, &[("o", p.out_len()), ("lse", p.lse_len())])?;
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, p.lse_len(), f32::NEG_INFINITY);
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let f16 = p.dtype == DType::F16;
    let eb = if f16 { 2 } else { 4 };
    let caps = caps(ctx);
    let coop = coop_tiles(ctx, p, caps);
    let (kernel, tiles) = if forced_simple() {
        (
            Kernel::Forward,
            tiles::choose(Kernel::Forward, d as u32, dv as u32, caps),
        )
    } else if let Some(t) = coop {
        (Kernel::ForwardCoop, t)
    } else {
        let (kernel, mut tiles) = tiles::forward_kernel_of_at_most(
            d as u32,
            dv as u32,
            caps,
            env_rows("FLASHPORT_GPU_FORWARD_ROWS"),
        );
        if no_prefetch() {
            tiles.prefetch = 0;
        }
        (kernel, tiles)
    };
    let key = PipelineKey {
        kernel,
        f16_inputs: f16,
        d: d as u32,
        dv: dv as u32,
        tiles,
        subgroups: caps.subgroups,
        variants: Variants {
            dmask: false,
            ..vd.flags
        },
    };
    with_times(Vec::clear);
    let x = grid(sq, key.tiles.q_rows, ctx, "the forward pass")?;
    let chunks = plan::plan(
        p,
        binding_limit(ctx),
        ctx.limits.max_compute_workgroups_per_dimension,
    )?;
    let pipeline = ctx.pipeline(key)?;
    let vx = ctx.scoped("uploading the variants", || upload_variants(ctx, vd))?;
    let g = p.group_size();
    for chunk in &chunks {
        let (q0, nq) = (chunk.q0(g), chunk.q_count());
        let (kv0, nkv) = (chunk.kv0, chunk.kv_count);
        let reads = ctx.scoped("running the forward pass", || {
            let uniform = params(ctx, p, chunk, vd)?;
            let mut encoder = ctx.device.create_command_encoder(&Default::default());
            let t_up = std::time::Instant::now();
            let mut up = false;
            let enc = &mut encoder;
            let qb = chunk_input(ctx, enc, "q", q, sq * d, eb, q0, nq, &mut up)?;
            let kb = chunk_input(ctx, enc, "k", k, sk * d, eb, kv0, nkv, &mut up)?;
            let vb = chunk_input(ctx, enc, "v", v, sk * dv, eb, kv0, nkv, &mut up)?;
            if up {
                record_host("upload", t_up);
            }
            let ob = output(ctx, "out", nq * sq * dv);
            let lb = output(ctx, "lse", nq * sq);
            let group = bind(
                ctx,
                &pipeline,
                &[&uniform, &qb, &kb, &vb, &ob, &lb],
                Some(&vx),
            );
            let mut timer = Timer::new(ctx);
            dispatch(
                &mut encoder,
                &pipeline,
                &group,
                x,
                nq as u32,
                timer.as_mut().map(|t| (t, kernel.name())),
            );
            let mut reads = Vec::new();
            let enc = &mut encoder;
            out.collect(ctx, enc, &ob, q0 * sq * dv, nq * sq * dv, false, &mut reads)?;
            lse.collect(ctx, enc, &lb, q0 * sq, nq * sq, false, &mut reads)?;
            submit_and_read(ctx, encoder, &reads, timer.as_ref())
        })?;
        let mut reads = reads.into_iter();
        out.place(q0 * sq * dv, false, &mut reads);
        lse.place(q0 * sq, false, &mut reads);
    }
    let [out, lse] = ctx.scoped("keeping the outputs on the device", || {
        finish_outputs(
            ctx,
            [
                (out, p.dtype, p.out_shape()),
                (lse, DType::F32, p.lse_shape()),
            ],
        )
    })?;
    Ok(ForwardArrays { out, lse })
}

pub fn backward(
    problem: &Problem,
    inputs: [Slice<'_>; 6],
    variants: &VariantArrays<'_>,
) -> Result<BackendGradients> {
    let g = backward_arrays(problem, inputs.map(Input::Host), variants, Placement::Host)?;
    Ok(BackendGradients {
        dq: g.dq.into_host()?,
        dk: g.dk.into_host()?,
        dv: g.dv.into_host()?,
        d_scores: g.d_scores,
    })
}

/// The backward pass on host or device inputs `[do, q, k, v, o, lse]`,
/// `dq`, `dk` and `dv` left where `outputs` says (the score gradient, for
/// the mask's, is always read back: the host reduces it).
pub fn backward_arrays(
    problem: &Problem,
    inputs: [Input<'_>; 6],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<BackendArrays> {
    let [d_out, q, k, v, out, lse] = inputs;
    check_dtype(problem)?;
    check_sizes(problem)?;
    let lse_f32: Vec<f32>;
    let lse = match lse {
        Input::Host(Slice::F32(x)) => Source::Host(bytemuck::cast_slice(x)),
        Input::Host(Slice::F64(x)) => {
            lse_f32 = x.iter().map(|&l| l as f32).collect();
            Source::Host(bytemuck::cast_slice(&lse_f32))
        }
        Input::Device(t) if t.dtype() == DType::F32 => Source::Device(t),
        other => {
            return Err(Error::DType {
                argument: "lse".to_string(),
                dtype: other.dtype().numpy_name().to_string(),
                reason: "lse must be float32 or float64 (as returned by attention)".to_string(),
            })
        }
    };
    let inputs = BackwardInputs {
        d_out: source("do", d_out)?,
        q: source("q", q)?,
        k: source("k", k)?,
        v: source("v", v)?,
        out: source("o", out)?,
        lse,
    };
    let vd = variant_data(problem, variants)?;
    let named = [
        ("do", inputs.d_out),
        ("q", inputs.q),
        ("k", inputs.k),
        ("v", inputs.v),
        ("o", inputs.out),
        ("lse", inputs.lse),
    ];
    with_inputs("running the backward pass", &named, |ctx| {
        backward_on(ctx, problem, &inputs, &vd, outputs)
    })
}

struct BackwardInputs<'a> {
    d_out: Source<'a>,
    q: Source<'a>,
    k: Source<'a>,
    v: Source<'a>,
    out: Source<'a>,
    /// float32.
    lse: Source<'a>,
}

fn backward_on(
    ctx: &Arc<Context>,
    p: &Problem,
    x: &BackwardInputs<'_>,
    vd: &VariantData,
    outputs: Placement,
) -> Result<BackendArrays> {
    check_f16(ctx, p)?;
    // d_out, q, k, v, (lse, D), two outputs, and vx.
    const STORAGE_BUFFERS: u32 = 8;
    if ctx.limits.max_storage_buffers_per_shader_stage < STORAGE_BUFFERS {
        return Err(Error::BackendUnavailable(format!(
            "the GPU backward binds {STORAGE_BUFFERS} storage buffers, more than the {} of \
             the adapter {}; use device=\"cpu\"",
            ctx.limits.max_storage_buffers_per_shader_stage, ctx.adapter.name
        )));
    }
    let scores_len = p.batch * p.heads_q * p.seq_q * p.seq_k;
    if p.batch == 0 || p.seq_q == 0 || p.seq_k == 0 {
        return ctx.scoped("making the outputs", || {
            Ok(BackendArrays {
                dq: empty_output(ctx, outputs, p.dtype, p.q_shape(), 0.0),
                dk: empty_output(ctx, outputs, p.dtype, p.k_shape(), 0.0),
                dv: empty_output(ctx, outputs, p.dtype, p.v_shape(), 0.0),
                d_scores: p.return_dmask.then(|| Buffer::F32(vec![0.0; scores_len])),
            })
        });
    }
    check_device_outputs(
        ctx,
        outputs,
        &[("dq", p.q_len()), ("dk", p.k_len()), ("dv", p.v_len())],
    )?;
    let mut dq = Sink::new(outputs, p.q_len(), 0.0);
    let mut dk = Sink::new(outputs, p.k_len(), 0.0);
    let mut dv_all = Sink::new(outputs, p.v_len(), 0.0);
    // Read back whatever the placement: the host reduces it to the mask's
    // shape.
    let mut d_scores = p.return_dmask.then(|| Assembled::new(scores_len, 0.0));
    let (d, dv, sq, sk) = (p.head_dim, p.value_dim, p.seq_q, p.seq_k);
    let f16 = p.dtype == DType::F16;
    let eb = if f16 { 2 } else { 4 };
    let caps = caps(ctx);
    let coop = if forced_simple() {
        None
    } else {
        coop_backward_tiles(ctx, p, caps)
    };
    let tiled = if forced_simple() || coop.is_some() {
        None
    } else {
        let max_rows = env_rows("FLASHPORT_GPU_BACKWARD_ROWS");
        tiles::backward_kernels_of_at_most(d as u32, dv as u32, caps, max_rows).map(
            |(mut tq, mut tkv)| {
                if no_prefetch() {
                    tq.prefetch = 0;
                    tkv.prefetch = 0;
                }
                (tq, tkv)
            },
        )
    };
    let key = |kernel, tiles| PipelineKey {
        kernel,
        f16_inputs: f16,
        d: d as u32,
        dv: dv as u32,
        tiles,
        subgroups: caps.subgroups,
        variants: vd.flags,
    };
    let simple = |kernel| key(kernel, tiles::choose(kernel, d as u32, dv as u32, caps));
    let kp = simple(Kernel::BackwardPreprocess);
    let (kq, kkv) = match (coop, tiled) {
        (Some((tq, tkv)), _) => (
            key(Kernel::BackwardDqCoop, tq),
            key(Kernel::BackwardDkDvCoop, tkv),
        ),
        (None, Some((tq, tkv))) => (
            key(Kernel::BackwardDqTiled, tq),
            key(Kernel::BackwardDkDvTiled, tkv),
        ),
        (None, None) => (simple(Kernel::BackwardDq), simple(Kernel::BackwardDkDv)),
    };
    with_times(Vec::clear);
    let xp = grid(sq, kp.tiles.workgroup, ctx, "the backward pre-pass")?;
    let xq = grid(sq, kq.tiles.q_rows, ctx, "the dQ pass")?;
    let xkv = grid(sk, kkv.tiles.k_rows, ctx, "the dK/dV pass")?;
    let chunks = plan::plan(
        p,
        binding_limit(ctx),
        ctx.limits.max_compute_workgroups_per_dimension,
    )?;
    let (pre, dq_pipe, dkdv_pipe) = (ctx.pipeline(kp)?, ctx.pipeline(kq)?, ctx.pipeline(kkv)?);
    let vx = ctx.scoped("uploading the variants", || upload_variants(ctx, vd))?;
    let g = p.group_size();
    let (sq_sk, dmask) = (sq * sk, p.return_dmask);
    for chunk in &chunks {
        let (q0, nq) = (chunk.q0(g), chunk.q_count());
        let (kv0, nkv) = (chunk.kv0, chunk.kv_count);
        // A group cut into pieces: its pieces are summed in order, so the
        // result is still reproducible.
        let add = chunk.g0 != 0;
        let reads = ctx.scoped("running the backward pass", || {
            let uniform = params(ctx, p, chunk, vd)?;
            let mut encoder = ctx.device.create_command_encoder(&Default::default());
            let t_up = std::time::Instant::now();
            let mut up = false;
            let enc = &mut encoder;
            let dob = chunk_input(ctx, enc, "do", x.d_out, sq * dv, eb, q0, nq, &mut up)?;
            let ob = chunk_input(ctx, enc, "o", x.out, sq * dv, eb, q0, nq, &mut up)?;
            let qb = chunk_input(ctx, enc, "q", x.q, sq * d, eb, q0, nq, &mut up)?;
            let kb = chunk_input(ctx, enc, "k", x.k, sk * d, eb, kv0, nkv, &mut up)?;
            let vb = chunk_input(ctx, enc, "v", x.v, sk * dv, eb, kv0, nkv, &mut up)?;
            let lb = chunk_input(ctx, enc, "lse", x.lse, sq, 4, q0, nq, &mut up)?;
            if up {
                record_host("upload", t_up);
            }
            // (lse, D) per query row: written by the pre-pass.
            let stats = output(ctx, "stats", 2 * nq * sq);
            let dqb = output(ctx, "dq", nq * sq * d);
            let dkb = output(ctx, "dk", nkv * sk * d);
            let dvb = output(ctx, "dv", nkv * sk * dv);
            let dsb = if dmask {
                output(ctx, "d_scores", nq * sq_sk)
            } else {
                dummy_output(ctx)
            };
            let g_pre = bind(ctx, &pre, &[&uniform, &dob, &ob, &lb, &stats], None);
            let g_dq = bind(
                ctx,
                &dq_pipe,
                &[&uniform, &dob, &qb, &kb, &vb, &stats, &dqb, &dsb],
                Some(&vx),
            );
            let g_kv = bind(
                ctx,
                &dkdv_pipe,
                &[&uniform, &dob, &qb, &kb, &vb, &stats, &dkb, &dvb],
                Some(&vx),
            );
            let mut timer = Timer::new(ctx);
            dispatch(
                &mut encoder,
                &pre,
                &g_pre,
                xp,
                nq as u32,
                timer.as_mut().map(|t| (t, "backward_preprocess")),
            );
            dispatch(
                &mut encoder,
                &dq_pipe,
                &g_dq,
                xq,
                nq as u32,
                timer.as_mut().map(|t| (t, kq.kernel.name())),
            );
            dispatch(
                &mut encoder,
                &dkdv_pipe,
                &g_kv,
                xkv,
                nkv as u32,
                timer.as_mut().map(|t| (t, kkv.kernel.name())),
            );
            let mut reads = Vec::new();
            let enc = &mut encoder;
            dq.collect(ctx, enc, &dqb, q0 * sq * d, nq * sq * d, false, &mut reads)?;
            let (k_off, v_off) = (kv0 * sk * d, kv0 * sk * dv);
            dk.collect(ctx, enc, &dkb, k_off, nkv * sk * d, add, &mut reads)?;
            dv_all.collect(ctx, enc, &dvb, v_off, nkv * sk * dv, add, &mut reads)?;
            if dmask {
                reads.push((&dsb, nq * sq_sk));
            }
            submit_and_read(ctx, encoder, &reads, timer.as_ref())
        })?;
        let mut reads = reads.into_iter();
        dq.place(q0 * sq * d, false, &mut reads);
        dk.place(kv0 * sk * d, add, &mut reads);
        dv_all.place(kv0 * sk * dv, add, &mut reads);
        if let Some(all) = d_scores.as_mut() {
            all.put(q0 * sq_sk, reads.next().unwrap_or_default());
        }
    }
    let [dq, dk, dv] = ctx.scoped("keeping the outputs on the device", || {
        finish_outputs(
            ctx,
            [
                (dq, p.dtype, p.q_shape()),
                (dk, p.dtype, p.k_shape()),
                (dv_all, p.dtype, p.v_shape()),
            ],
        )
    })?;
    Ok(BackendArrays {
        dq,
        dk,
        dv,
        d_scores: d_scores.map(|s| Buffer::F32(s.into_vec())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threaded slice rounding gives the bits of `f16::from_f32`
    /// element by element, across chunk boundaries and for ties,
    /// subnormals, overflow, infinities and NaN.
    #[test]
    fn host_f16_rounding_matches_elementwise() {
        let specials = [
            0.0f32,
            -0.0,
            1.0 + f32::EPSILON,
            // Halfway between two float16 values: ties go to even.
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            65504.0,
            65520.0,
            1e-7,
            -6.0e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut state = 0x2545_f491_u32;
        let values: Vec<f32> = (0..2 * ROUND_CHUNK + 77)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let x = f32::from_bits(state);
                if i % 3 == 0 {
                    specials[i % specials.len()]
                } else if x.is_finite() {
                    // Mostly within float16's range.
                    x.clamp(-7.0e4, 7.0e4)
                } else {
                    x
                }
            })
            .collect();
        let rounded = round_to_f16(&values);
        assert_eq!(rounded.len(), values.len());
        for (i, (&got, &x)) in rounded.iter().zip(&values).enumerate() {
            let want = half::f16::from_f32(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "element {i}: {x:e} rounded to {got} ({:#06x}), want {want} ({:#06x})",
                got.to_bits(),
                want.to_bits()
            );
        }
    }
}
