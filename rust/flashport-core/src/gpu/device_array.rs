//! Arrays that stay in GPU memory between calls ([`DeviceArray`]), so that
//! a forward and its backward do not copy the same q, k and v over PCIe
//! twice, and results need not come back to the host until asked for.
//!
//! An array holds its elements densely, row-major, in its own dtype (float16
//! packed in pairs, as the kernels read them), so a call whose chunk covers
//! the whole array binds its buffer directly. Every other move (a chunk of
//! heads out of an array, chunk results into a whole output, float32 results
//! to float16) runs on the device: shaders/device_arrays.wgsl.

use std::sync::Arc;

use super::adapters::{name, Gpu};
use super::checks::{float16_error, float64_error};
use super::chunks::binding_limit;
use super::context::{self, Context};
use super::guard::{guarded, run_on, with_context};
use super::pool::Pooled;
use super::transfer::{submit_and_read, Submission};
use super::{screen, timing};
use crate::array::{Buffer, Slice};
use crate::error::{Error, Result};
use crate::overrides;
use crate::problem::{ArrayInfo, DType};

/// An array resident on the GPU: a dense, row-major buffer of the context
/// that made it, with its shape and dtype (float32 or float16). Immutable:
/// no call writes into an array it was given; results are new arrays.
/// Cloning shares the buffer.
#[derive(Clone)]
pub struct DeviceArray {
    buffer: Arc<Pooled>,
    ctx: Arc<Context>,
    dtype: DType,
    shape: Vec<usize>,
    /// Known to hold nothing the screen raises its flag for
    /// (src/gpu/screen.rs): tested on the host as `to_device` uploaded it.
    /// Kernels' results are not known clean.
    clean: bool,
}

impl std::fmt::Debug for DeviceArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArray")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("device", &self.device())
            .field("adapter", &self.ctx.adapter.name)
            .finish()
    }
}

fn element_bytes(dtype: DType) -> usize {
    match dtype {
        DType::F16 | DType::BF16 => 2,
        DType::F32 => 4,
        DType::F64 => 8,
    }
}

impl DeviceArray {
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of the elements (the buffer may be padded to a 4-byte multiple).
    pub fn nbytes(&self) -> usize {
        self.len() * element_bytes(self.dtype)
    }
    /// What validation sees: the same checks, and errors, as a host array
    /// of this shape and dtype.
    pub fn info(&self) -> ArrayInfo<'_> {
        ArrayInfo::new(&self.shape, self.dtype.numpy_name())
    }
    /// The name of the adapter that holds the array.
    pub fn adapter_name(&self) -> &str {
        &self.ctx.adapter.name
    }
    /// N of the `gpu:N` that holds the array.
    pub fn index(&self) -> usize {
        self.ctx.index
    }
    /// `"gpu:N"`: the GPU that holds the array.
    pub fn device(&self) -> String {
        name(self.ctx.index)
    }

    /// The array on `gpu`: itself where it is there already (arrays are
    /// immutable, so sharing one is safe), else a copy made through host
    /// memory (read back, then uploaded: GPUs of different drivers share
    /// no memory wgpu can name). `Gpu::Best` is the GPU `"gpu"` opens.
    pub fn to(&self, gpu: Gpu) -> Result<DeviceArray> {
        let target = guarded("copying a device array", || context::get(gpu))?;
        if target.index == self.ctx.index {
            self.alive("the device array")?;
            return Ok(self.clone());
        }
        let host = self.to_host()?;
        let copied = to_device_on(
            Gpu::Index(target.index),
            "the device array",
            host.as_slice(),
            &self.shape,
        )?;
        Ok(DeviceArray {
            clean: self.clean,
            ..copied
        })
    }

    /// Reads the array back into host memory. Like a forward or backward
    /// call, it starts a new record of host phases for
    /// [`super::last_kernel_times`].
    pub fn to_host(&self) -> Result<Buffer> {
        timing::start_call();
        self.read()
    }

    /// A new array with the same elements, copied from buffer to buffer on
    /// the device (one submission, one wait): a copy to change where the
    /// array itself may not be, and what the benchmarks measure as the
    /// device's copy bandwidth.
    pub fn copy(&self) -> Result<DeviceArray> {
        timing::start_call();
        guarded("copying a device array", || {
            self.alive("the device array")?;
            let ctx = self.ctx.clone();
            run_on(&ctx, |ctx| {
                ctx.scoped("copying a device array", || {
                    let mut sub = Submission::new(ctx);
                    sub.keep(&self.buffer);
                    let copy = sub.scratch(self.buffer.bytes());
                    sub.encoder().copy_buffer_to_buffer(
                        self.buffer.buffer(),
                        0,
                        copy.buffer(),
                        0,
                        self.buffer.bytes(),
                    );
                    sub.submit(&[])?;
                    Ok(DeviceArray {
                        clean: self.clean,
                        ..DeviceArray::from_buffer(ctx, copy, self.dtype, self.shape.clone())
                    })
                })
            })
        })
    }

    /// Reads the array back, adding to the current call's host phases.
    pub(crate) fn read(&self) -> Result<Buffer> {
        guarded("reading a device array back", || {
            self.alive("the device array")?;
            let ctx = self.ctx.clone();
            let len = self.len();
            run_on(&ctx, |ctx| {
                ctx.scoped("reading a device array back", || {
                    let encoder = ctx.device.create_command_encoder(&Default::default());
                    let words = self.nbytes().div_ceil(4);
                    let reads = [(self.buffer.buffer(), words)];
                    let mut r = submit_and_read(ctx, encoder, &reads, Vec::new())?;
                    let words = r.pop().unwrap_or_default();
                    Ok(match self.dtype {
                        DType::F16 => {
                            let halves: &[half::f16] = bytemuck::cast_slice(&words);
                            Buffer::F16(halves[..len].to_vec())
                        }
                        _ => Buffer::F32(words),
                    })
                })
            })
        })
    }

    /// An error naming `argument` when the device that holds the array was
    /// lost or reset since (its data is gone with it).
    pub(crate) fn alive(&self, argument: &str) -> Result<()> {
        // A poll delivers a pending device-lost callback.
        let _ = self.ctx.device.poll(wgpu::PollType::Poll);
        self.was_alive(argument)
    }

    /// [`DeviceArray::alive`] as of the last poll of its device.
    pub(crate) fn was_alive(&self, argument: &str) -> Result<()> {
        if self.ctx.is_lost() {
            return Err(Error::Gpu(format!(
                "{argument} is a device array on {} ({}), which was lost or reset since \
                 the array was made: its data is gone; upload it again (flashport.to_device) \
                 or pass a NumPy array",
                self.device(),
                self.ctx.adapter.name
            )));
        }
        Ok(())
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(crate) fn buffer(&self) -> &Arc<Pooled> {
        &self.buffer
    }

    /// Whether the array is known to pass the screen.
    pub(crate) fn clean(&self) -> bool {
        self.clean
    }

    pub(crate) fn from_buffer(
        ctx: &Arc<Context>,
        buffer: Arc<Pooled>,
        dtype: DType,
        shape: Vec<usize>,
    ) -> DeviceArray {
        DeviceArray {
            buffer,
            ctx: ctx.clone(),
            dtype,
            shape,
            clean: false,
        }
    }
}

/// Uploads `data` (of `shape`) into a new array on the GPU `"gpu"` opens
/// ([`to_device_on`]).
pub fn to_device(argument: &str, data: Slice<'_>, shape: &[usize]) -> Result<DeviceArray> {
    to_device_on(Gpu::Best, argument, data, shape)
}

/// Uploads `data` (of `shape`) into a new array on `gpu`. `argument`
/// names it in errors: float64 is refused as the GPU refuses float64
/// inputs, float16 where the adapter cannot read it.
pub fn to_device_on(
    gpu: Gpu,
    argument: &str,
    data: Slice<'_>,
    shape: &[usize],
) -> Result<DeviceArray> {
    let len: usize = shape.iter().product();
    if len != data.len() {
        return Err(Error::Shape(format!(
            "{argument} holds {} elements but its shape {} needs {len}",
            data.len(),
            crate::error::shape_str(shape)
        )));
    }
    let bytes: &[u8] = match data {
        Slice::F32(x) => bytemuck::cast_slice(x),
        Slice::F16(x) => bytemuck::cast_slice(x),
        Slice::BF16(_) => return Err(bfloat16_error(argument)),
        Slice::F64(_) => return Err(float64_error(argument)),
    };
    timing::start_call();
    with_context(gpu, "uploading an array", |ctx| {
        if data.dtype() == DType::F16 && !ctx.f16_inputs {
            return Err(float16_error(ctx, argument));
        }
        fits_one_buffer(ctx, argument, bytes.len() as u64)?;
        let raises = match data.dtype() {
            DType::F16 => screen::raises_f16,
            _ => screen::raises_f32,
        };
        let (buffer, raised) = ctx.scoped("uploading an array", || {
            let mut sub = Submission::new(ctx);
            let uploaded = sub.upload_screened(argument, bytes, Some(raises))?;
            sub.submit(&[])?;
            Ok(uploaded)
        })?;
        Ok(DeviceArray {
            clean: !raised,
            ..DeviceArray::from_buffer(ctx, buffer, data.dtype(), shape.to_vec())
        })
    })
}

/// The error for a bfloat16 array offered to `to_device`. The kernels read
/// float32 or float16, and a float32 copy kept under a bfloat16 name would
/// double the memory the caller expects; bfloat16 calls take NumPy arrays
/// (see `bfloat16.rs`).
pub(crate) fn bfloat16_error(argument: &str) -> Error {
    Error::DType {
        argument: argument.to_string(),
        dtype: "bfloat16".to_string(),
        reason: "the GPU keeps float32 or float16 arrays, not bfloat16: pass the bfloat16 \
                 NumPy array to the call itself (it is widened to float32 for the GPU and \
                 its results rounded back), or upload it as float32 \
                 (array.astype(numpy.float32))"
            .to_string(),
    }
}

/// A new array filled with `value` (the outputs of empty problems),
/// written before `sub`'s work.
pub(crate) fn filled(
    ctx: &Arc<Context>,
    sub: &mut Submission<'_>,
    dtype: DType,
    shape: Vec<usize>,
    value: f32,
) -> Result<DeviceArray> {
    let len: usize = shape.iter().product();
    let bytes = match dtype {
        DType::F16 => bytemuck::cast_slice(&vec![half::f16::from_f32(value); len]).to_vec(),
        _ => bytemuck::cast_slice(&vec![value; len]).to_vec(),
    };
    let buffer = sub.upload("filled", &bytes)?;
    Ok(DeviceArray::from_buffer(ctx, buffer, dtype, shape))
}

/// Heads `first..first + count` (of `per_head` elements each) of `t` as a
/// buffer of their own, filled by commands recorded in `sub`; the array's
/// own buffer when they are all of it.
pub(crate) fn heads(
    ctx: &Context,
    sub: &mut Submission<'_>,
    t: &DeviceArray,
    per_head: usize,
    first: usize,
    count: usize,
) -> Result<Arc<Pooled>> {
    let n = count * per_head;
    if n == t.len() {
        sub.keep(&t.buffer);
        return Ok(t.buffer.clone());
    }
    let eb = element_bytes(t.dtype) as u64;
    let start = (first * per_head) as u64 * eb;
    let chunk = sub.scratch(n as u64 * eb);
    if start % wgpu::COPY_BUFFER_ALIGNMENT == 0 {
        // The padded size stays inside the array's buffer, which is
        // itself padded to a 4-byte multiple.
        sub.encoder().copy_buffer_to_buffer(
            t.buffer.buffer(),
            start,
            chunk.buffer(),
            0,
            chunk.bytes(),
        );
    } else {
        // A float16 head of odd size: the chunk starts mid-word.
        run_helper(
            ctx,
            sub,
            Helper::CopyF16,
            (&t.buffer, (first * per_head) as u64, 2),
            (&chunk, 0, 2),
            n as u64,
        )?;
    }
    Ok(chunk)
}

/// One output of a call kept on the device: float32 results placed into
/// one buffer chunk by chunk (the chunk's own buffer when it covers the
/// output), rounded to the output's dtype at the end.
pub(crate) struct Resident {
    len: usize,
    full: Option<Arc<Pooled>>,
}

impl Resident {
    pub fn new(len: usize) -> Self {
        Resident { len, full: None }
    }

    /// Puts a chunk's `n` results at element `offset`.
    pub fn put(&mut self, sub: &mut Submission<'_>, offset: usize, part: &Arc<Pooled>, n: usize) {
        if self.full.is_none() && offset == 0 && n == self.len {
            self.full = Some(part.clone());
            return;
        }
        let full = self.full(sub);
        if n > 0 {
            sub.encoder().copy_buffer_to_buffer(
                part.buffer(),
                0,
                full.buffer(),
                4 * offset as u64,
                4 * n as u64,
            );
        }
    }

    /// Adds a chunk's `n` results to those at element `offset` (the pieces
    /// of a GQA group cut across chunks, summed in chunk order).
    pub fn add(
        &mut self,
        ctx: &Context,
        sub: &mut Submission<'_>,
        offset: usize,
        part: &Arc<Pooled>,
        n: usize,
    ) -> Result<()> {
        let full = self.full(sub);
        run_helper(
            ctx,
            sub,
            Helper::AddF32,
            (part, 0, 4),
            (&full, offset as u64, 4),
            n as u64,
        )
    }

    /// The whole output's buffer, taken from the pool on first use and kept
    /// alive by every submission that writes it.
    fn full(&mut self, sub: &mut Submission<'_>) -> Arc<Pooled> {
        let len = self.len;
        let full = self
            .full
            .get_or_insert_with(|| Arc::new(sub.ctx().device_buffer(4 * len as u64)))
            .clone();
        sub.keep(&full);
        full
    }

    /// The output as an array of `dtype`, float16 rounded on the device
    /// (recorded in `sub`).
    pub fn finish(
        mut self,
        ctx: &Arc<Context>,
        sub: &mut Submission<'_>,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<DeviceArray> {
        let full = self.full(sub);
        if dtype != DType::F16 {
            return Ok(DeviceArray::from_buffer(ctx, full, dtype, shape));
        }
        let halves = Arc::new(ctx.device_buffer(2 * self.len as u64));
        sub.keep(&halves);
        run_helper(
            ctx,
            sub,
            Helper::ToF16,
            (&full, 0, 4),
            (&halves, 0, 2),
            self.len as u64,
        )?;
        Ok(DeviceArray::from_buffer(ctx, halves, dtype, shape))
    }
}

/// The entry points of shaders/device_arrays.wgsl.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Helper {
    CopyF16,
    AddF32,
    ToF16,
}

impl Helper {
    pub fn entry(self) -> &'static str {
        match self {
            Helper::CopyF16 => "copy_f16",
            Helper::AddF32 => "add_f32",
            Helper::ToF16 => "to_f16",
        }
    }
}

const HELPER_WORKGROUP: u64 = 64;
/// The most workgroups of `to_f16`, whose invocations stride over the
/// words: fewer passes (at most 2^29 words / 2^19 invocations = 1024,
/// within lavapipe's loop limit) than one word each.
const TO_F16_MAX_WORKGROUPS: u64 = 8192;

/// Records `helper` over `count` elements, reading from element `start` of
/// `src` and writing from element `start` of `dst` (each given as
/// `(buffer, start, element bytes)`). Each dispatch binds windows of the
/// two buffers at aligned offsets, so arrays larger than one binding are
/// covered in pieces.
pub(crate) fn run_helper(
    ctx: &Context,
    sub: &mut Submission<'_>,
    helper: Helper,
    (src, src_start, src_eb): (&Pooled, u64, u64),
    (dst, dst_start, dst_eb): (&Pooled, u64, u64),
    count: u64,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let pipeline = ctx.array_pipeline(helper.entry(), super::shaders::DEVICE_ARRAYS)?;
    let align = ctx.limits.min_storage_buffer_offset_alignment.max(4) as u64;
    // Elements per dispatch: a window holds them plus up to one alignment
    // unit before and a word of rounding after. Even, so that each piece
    // of a float16 destination starts on a word.
    let widest = src_eb.max(dst_eb);
    let limit = binding_limit(ctx, &overrides::current());
    let room = limit.saturating_sub(align + 8) / widest;
    let piece = (room.min(1 << 30) & !1).max(2);
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1) as u64;
    let mut done = 0;
    while done < count {
        let n = piece.min(count - done);
        let window = |buffer: &Pooled, start: u64, eb: u64| {
            let begin = (start + done) * eb;
            let offset = begin / align * align;
            let end = ((begin + n * eb).next_multiple_of(4)).min(buffer.bytes());
            ((begin - offset) / eb, offset, end - offset)
        };
        let (src_el, src_off, src_size) = window(src, src_start, src_eb);
        let (dst_el, dst_off, dst_size) = window(dst, dst_start, dst_eb);
        let span = sub.uniform(&[src_el as u32, dst_el as u32, n as u32, 0u32])?;
        let binding = |buffer, offset, size| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset,
                size: wgpu::BufferSize::new(size),
            })
        };
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(helper.entry()),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: span.binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: binding(src.buffer(), src_off, src_size),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: binding(dst.buffer(), dst_off, dst_size),
                },
            ],
        });
        let invocations = if helper == Helper::AddF32 {
            n
        } else {
            n.div_ceil(2)
        };
        let mut groups = invocations.div_ceil(HELPER_WORKGROUP);
        if helper == Helper::ToF16 {
            // Its invocations loop over the words (shaders/device_arrays.wgsl).
            groups = groups.min(TO_F16_MAX_WORKGROUPS);
        }
        let x = groups.min(max_dim);
        let y = groups.div_ceil(x);
        if y > max_dim {
            return Err(Error::TooLarge(format!(
                "a device-array copy of {n} elements needs more workgroups than the GPU {} \
                 allows",
                ctx.adapter.name
            )));
        }
        sub.dispatch(&pipeline, &group, (x as u32, y as u32), helper.entry());
        done += n;
    }
    Ok(())
}

/// An error naming `argument` unless `bytes` fit one buffer of `ctx`.
fn fits_one_buffer(ctx: &Context, argument: &str, bytes: u64) -> Result<()> {
    let max = ctx.limits.max_buffer_size;
    if bytes.next_multiple_of(4) > max {
        return Err(Error::TooLarge(format!(
            "{argument} ({bytes} bytes) is larger than the largest buffer of the GPU {} \
             ({max} bytes); keep it in NumPy (device=\"cpu\", or device=\"gpu\" with \
             NumPy arrays, which are split by heads)",
            ctx.adapter.name
        )));
    }
    Ok(())
}

/// Whether an array of `bytes` bytes could become a device array on
/// `gpu`: checked before the host makes a contiguous copy of a strided one.
pub fn check_array_bytes(gpu: Gpu, argument: &str, bytes: u64) -> Result<()> {
    with_context(gpu, "checking an array's size", |ctx| {
        fits_one_buffer(ctx, argument, bytes)
    })
}
