//! A KV cache's pools in GPU memory (`KVCache(device="gpu")`), behind
//! [`crate::blocks::Storage`]: the same calls as the CPU's storage, on
//! device buffers.
//!
//! Each layer's key pool and value pool is a list of buffers of whole
//! blocks, `per_buffer` blocks each (the last may hold fewer), each small
//! enough to be bound whole: block `b` is block `b % per_buffer` of buffer
//! `b / per_buffer`. A pool that fits one binding is one buffer. They are
//! allocated once, when the cache is made, and never move.
//!
//! - A write uploads only the appended tokens (or binds a device array
//!   where it is) and runs shaders/kv_scatter.wgsl over the plan's slots,
//!   one dispatch per pool buffer written: O(the tokens written). A batch
//!   of appends (`KvCache::append_batch`) is one write: one upload of its
//!   keys and one of its values, one dispatch per pool buffer, one
//!   submission, queued without waiting.
//! - A copy-on-write copies each block, every layer's keys and values, on
//!   the device, in the submission of the append's writes (copies first):
//!   through a scratch buffer (wgpu copies between distinct buffers only),
//!   and through the scatter shader where a float16 block does not start
//!   on a 4-byte boundary.
//! - Attention is the GPU's `attention_with_kvcache` over the pool
//!   buffers with the cache's block table (`super::decode`), no gather.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};

use crate::error::shape_str;

use super::adapters::{name, Gpu};
use super::checks::{float16_error, float64_error};
use super::chunks::binding_limit;
use super::context::Context;
use super::decode;
use super::device_array::DeviceArray;
use super::guard::{guarded, run_on, with_context};
use super::pool::Pooled;
use super::shaders::KV_SCATTER;
use super::transfer::{poison_outputs, Submission, POISON};
use crate::array::{Array, Buffer, Input, Placement, Slice};
use crate::blocks::plan::{BlockCopy, WriteRun};
use crate::blocks::{CacheShape, Storage};
use crate::error::{Error, Result};
use crate::output::ForwardOutput;
use crate::overrides;
use crate::problem::{DType, KvCacheProblem};
use crate::variants::VariantArrays;

/// The scatter's `struct Scatter`, word for word
/// (`uniform_matches_the_shader`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct ScatterUniform {
    pub n: u32,
    pub count: u32,
    pub heads: u32,
    pub dim: u32,
    pub block_size: u32,
    pub src_delta: u32,
    pub pad0: u32,
    pub pad1: u32,
}

/// Invocations per workgroup of the scatter (lib/grid.wgsl's WG).
const WORKGROUP: u64 = 64;

/// Blocks of `block_bytes` per pool buffer: as many as one binding of
/// `limit` bytes holds with the slack the decode's windows take (an
/// alignment unit and 16 bytes); none when a block alone does not fit.
pub(crate) fn blocks_per_buffer(block_bytes: u64, limit: u64, align: u64) -> Option<usize> {
    let blocks = limit.saturating_sub(align + 16) / block_bytes.max(1);
    (blocks >= 1).then_some(usize::try_from(blocks).unwrap_or(usize::MAX))
}

/// One block's words copied into a gather buffer for a swap-out: from
/// byte `from` of `buffer` (a word boundary) to byte `to` of the gather,
/// `words` bytes of whole words, the block's own `bytes` starting `skip`
/// bytes in.
struct Piece<'p> {
    buffer: &'p DeviceArray,
    from: u64,
    to: u64,
    words: u64,
    skip: u64,
    bytes: u64,
}

/// The pieces of one gather buffer, and its length in bytes.
#[derive(Default)]
struct Gather<'p> {
    pieces: Vec<Piece<'p>>,
    bytes: u64,
}

/// A KV cache's pools on one GPU context.
pub struct GpuStorage {
    shape: CacheShape,
    ctx: Arc<Context>,
    per_buffer: usize,
    /// Per layer, the pool's buffers in block order.
    keys: Vec<Vec<DeviceArray>>,
    values: Vec<Vec<DeviceArray>>,
}

impl std::fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuStorage")
            .field("shape", &self.shape)
            .field("adapter", &self.ctx.adapter.name)
            .field("per_buffer", &self.per_buffer)
            .finish()
    }
}

/// The GPU's kernels read float16 and float32 (WGSL has no bfloat16, and
/// other bfloat16 calls widen their inputs on the host, which a pool kept
/// on the device cannot do).
fn bfloat16_pool_error() -> Error {
    Error::DType {
        argument: "dtype".to_string(),
        dtype: "bfloat16".to_string(),
        reason: "a KV cache on the GPU holds float16 or float32; use dtype=numpy.float16 \
                 there, or device=\"cpu\" for a bfloat16 cache"
            .to_string(),
    }
}

fn element_bytes(dtype: DType) -> u64 {
    match dtype {
        DType::F16 => 2,
        _ => 4,
    }
}

impl GpuStorage {
    /// Pools for every layer on `gpu`: float32 or
    /// float16 (where the adapter reads it), in buffers of whole blocks
    /// that each fit one binding. Filled with NaN where outputs are
    /// poisoned (tests), so that a slot read before it is written shows.
    pub fn new(gpu: Gpu, shape: CacheShape) -> Result<GpuStorage> {
        if shape.dtype == DType::F64 {
            return Err(float64_error("dtype"));
        }
        if shape.dtype == DType::BF16 {
            return Err(bfloat16_pool_error());
        }
        let overrides = overrides::current();
        with_context(gpu, "allocating a KV cache's pools", |ctx| {
            if shape.dtype == DType::F16 && !ctx.f16_inputs {
                return Err(float16_error(ctx, "dtype"));
            }
            let eb = element_bytes(shape.dtype);
            let block = |dim: usize| (shape.heads_kv * shape.block_size * dim) as u64 * eb;
            let widest = block(shape.head_dim).max(block(shape.head_dim_v));
            let limit = binding_limit(ctx, &overrides);
            let align = ctx.limits.min_storage_buffer_offset_alignment.max(16) as u64;
            let per_buffer = blocks_per_buffer(widest, limit, align).ok_or_else(|| {
                Error::TooLarge(format!(
                    "one block of this KV cache ({widest} bytes: heads_kv={}, block_size={}, \
                     head_dim={}, head_dim_v={}) is larger than one storage binding of the GPU \
                     {} ({limit} bytes); use a smaller block_size or device=\"cpu\"",
                    shape.heads_kv,
                    shape.block_size,
                    shape.head_dim,
                    shape.head_dim_v,
                    ctx.adapter.name
                ))
            })?;
            // The whole cache against the GPU's memory before any buffer
            // is made: the pools are made buffer by buffer, and a driver
            // that hands out host memory lazily took minutes over a cache
            // of terabytes instead of refusing it.
            let total = shape.nbytes().expect("validated") as u64;
            if let Some(memory) = ctx.device_memory.filter(|&memory| total > memory) {
                return Err(Error::TooLarge(format!(
                    "a KV cache of {} layer(s) of key pools {} and value pools {} takes {total} \
                     bytes, more than the {memory} bytes of all the memory heaps of the GPU \
                     {}; use fewer blocks or layers, or device=\"cpu\"",
                    shape.layers,
                    shape_str(&shape.k_pool_shape()),
                    shape_str(&shape.v_pool_shape()),
                    ctx.adapter.name
                )));
            }
            let mut storage = GpuStorage {
                shape,
                ctx: ctx.clone(),
                per_buffer,
                keys: Vec::with_capacity(shape.layers),
                values: Vec::with_capacity(shape.layers),
            };
            for _ in 0..shape.layers {
                let k = storage.allocate(shape.head_dim)?;
                let v = storage.allocate(shape.head_dim_v)?;
                storage.keys.push(k);
                storage.values.push(v);
            }
            Ok(storage)
        })
    }

    /// One layer's pool of `dim` elements per token, buffer by buffer,
    /// each in an error scope of its own: the first that the device
    /// refuses stops the allocation (what was made is freed with it).
    fn allocate(&self, dim: usize) -> Result<Vec<DeviceArray>> {
        let s = self.shape;
        let ctx = &self.ctx;
        let mut buffers = Vec::new();
        let mut first = 0;
        while first < s.num_blocks {
            let blocks = self.per_buffer.min(s.num_blocks - first);
            let shape = vec![blocks, s.heads_kv, s.block_size, dim];
            let bytes = (blocks * s.heads_kv * s.block_size * dim) as u64 * element_bytes(s.dtype);
            let buffer = ctx
                .scoped("allocating a KV cache's pools", || {
                    let buffer = ctx.owned_buffer(bytes);
                    if poison_outputs() {
                        poison(ctx, buffer.buffer(), buffer.bytes());
                    }
                    Ok(buffer)
                })
                .map_err(|e| {
                    Error::TooLarge(format!(
                        "the GPU {} could not allocate this KV cache's pools ({} bytes in all): \
                         {e}; use fewer blocks or device=\"cpu\"",
                        ctx.adapter.name,
                        s.nbytes().unwrap_or(usize::MAX)
                    ))
                })?;
            buffers.push(DeviceArray::from_buffer(
                ctx,
                Arc::new(buffer),
                s.dtype,
                shape,
            ));
            first += blocks;
        }
        Ok(buffers)
    }

    /// Runs `f` on the cache's context, with `inputs` (device arrays among
    /// them) checked to be of that context and alive.
    fn on_device<T>(
        &self,
        what: &str,
        inputs: &[(&str, Input<'_>)],
        f: impl FnOnce(&Arc<Context>) -> Result<T>,
    ) -> Result<T> {
        guarded(what, || {
            let _ = self.ctx.device.poll(wgpu::PollType::Poll);
            if self.ctx.is_lost() {
                return Err(Error::Gpu(format!(
                    "this KV cache's pools were on the GPU {}, which was lost or reset since: \
                     their contents are gone; make a new KVCache",
                    self.ctx.adapter.name
                )));
            }
            for (name, input) in inputs {
                if let Input::Device(t) = input {
                    t.was_alive(name)?;
                    self.check_same_gpu(name, t)?;
                }
            }
            run_on(&self.ctx, f)
        })
    }

    /// An error naming `argument` unless device array `t` is on the
    /// pools' GPU (and context: one made before that GPU was lost is not).
    fn check_same_gpu(&self, argument: &str, t: &DeviceArray) -> Result<()> {
        if Arc::ptr_eq(t.context(), &self.ctx) {
            return Ok(());
        }
        let here = name(self.ctx.index);
        Err(Error::Value {
            argument: argument.to_string(),
            value: format!("a device array on {}", t.device()),
            reason: format!(
                "this KV cache's pools are on {here}: pass a NumPy array, or the array copied \
                 there ({argument}.to(\"{here}\"))"
            ),
        })
    }

    /// An error where the GPU that holds the pools is gone: lost or reset,
    /// or the parent's, in a process forked after the cache was made.
    fn alive(&self) -> Result<()> {
        if self.ctx.is_lost() {
            let forked = if self.ctx.forked() {
                " (this process was forked after the cache was made: a forked child \
                 cannot use its parent's GPU memory)"
            } else {
                ""
            };
            return Err(Error::Gpu(format!(
                "this KV cache's pools were on the GPU {}, which is gone{forked}: its \
                 contents are lost; make a new KVCache",
                self.ctx.adapter.name
            )));
        }
        Ok(())
    }

    fn limit(&self) -> u64 {
        binding_limit(&self.ctx, &overrides::current())
    }

    /// Records the scatter of `input` `(rows.len(), heads_kv, n, dim)`
    /// into `pool`'s slots that each row's runs name.
    #[allow(clippy::too_many_arguments)]
    fn write_pool(
        &self,
        sub: &mut Submission<'_>,
        pool: &[DeviceArray],
        name: &str,
        input: Input<'_>,
        n: usize,
        dim: usize,
        rows: &[&[WriteRun]],
    ) -> Result<()> {
        if rows
            .iter()
            .flat_map(|runs| runs.iter())
            .all(|r| r.source.is_empty())
            || dim == 0
        {
            return Ok(());
        }
        let limit = self.limit();
        let src = match input {
            Input::Host(slice) => {
                let bytes: &[u8] = match slice {
                    Slice::F32(x) => bytemuck::cast_slice(x),
                    Slice::F16(x) => bytemuck::cast_slice(x),
                    Slice::F64(_) => return Err(float64_error(name)),
                    Slice::BF16(_) => return Err(bfloat16_pool_error()),
                };
                self.source_fits(name, bytes.len() as u64, limit)?;
                sub.upload(name, bytes)?
            }
            Input::Device(t) => {
                self.source_fits(name, t.nbytes() as u64, limit)?;
                sub.keep(t.buffer());
                t.buffer().clone()
            }
        };
        // The slots of each pool buffer: (source token, block, slot). The
        // shader reads token `t` of head `h` at `(h * n + t) * dim`; row
        // `r`'s token `t`, at `((r * heads + h) * n + t) * dim` of the
        // batch's `(rows, heads, n, dim)`, is therefore token `r * heads *
        // n + t` to it, and the whole batch is one source and one dispatch
        // per pool buffer.
        let row_tokens = self.shape.heads_kv * n;
        let mut slots: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for (r, runs) in rows.iter().enumerate() {
            for run in runs.iter() {
                let words = slots.entry(run.block / self.per_buffer).or_default();
                let block = (run.block % self.per_buffer) as u32;
                for (i, token) in run.source.clone().enumerate() {
                    let token = r * row_tokens + token;
                    words.extend([token as u32, block, (run.offset + i) as u32]);
                }
            }
        }
        for (buffer, words) in slots {
            self.scatter(sub, &src, &pool[buffer], (n, 0), dim, &words)?;
        }
        Ok(())
    }

    fn source_fits(&self, name: &str, bytes: u64, limit: u64) -> Result<()> {
        if bytes > limit {
            return Err(Error::TooLarge(format!(
                "{name} ({bytes} bytes) is larger than one storage binding of the GPU {} \
                 ({limit} bytes); append fewer positions at a time",
                self.ctx.adapter.name
            )));
        }
        Ok(())
    }

    /// Records one dispatch of the scatter: the tokens `slots` names (three
    /// words each) of `src` (`n` tokens per head, from element `delta`)
    /// into `dst`.
    fn scatter(
        &self,
        sub: &mut Submission<'_>,
        src: &Pooled,
        dst: &DeviceArray,
        (n, delta): (usize, u64),
        dim: usize,
        slots: &[u32],
    ) -> Result<()> {
        let ctx = &self.ctx;
        let s = self.shape;
        let count = slots.len() / 3;
        let total = (s.heads_kv * count * dim) as u64;
        let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1) as u64;
        let groups = total.div_ceil(WORKGROUP);
        let x = groups.min(max_dim);
        let y = groups.div_ceil(x.max(1));
        if total > u32::MAX as u64 || y > max_dim {
            return Err(Error::TooLarge(format!(
                "writing {count} positions of {} heads of {dim} elements at once is more \
                 than the GPU {} dispatches in one pass; append fewer positions at a time",
                s.heads_kv, ctx.adapter.name
            )));
        }
        let f16 = s.dtype == DType::F16;
        let entry = if f16 { "scatter_f16" } else { "scatter_f32" };
        let pipeline = ctx.array_pipeline(entry, KV_SCATTER)?;
        let uniform = sub.uniform(&ScatterUniform {
            n: n as u32,
            count: count as u32,
            heads: s.heads_kv as u32,
            dim: dim as u32,
            block_size: s.block_size as u32,
            src_delta: delta as u32,
            pad0: 0,
            pad1: 0,
        })?;
        let slots = sub.data(slots)?;
        sub.keep(dst.buffer());
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                entry_of(0, uniform.binding()),
                entry_of(1, src.binding()),
                entry_of(2, slots.binding()),
                entry_of(3, dst.buffer().binding()),
            ],
        });
        sub.dispatch(&pipeline, &group, (x as u32, y as u32), entry);
        Ok(())
    }

    /// Records the copy of block `copy.src` of `pool` into block
    /// `copy.dst` (`dim` elements per token).
    fn copy_block(
        &self,
        sub: &mut Submission<'_>,
        pool: &[DeviceArray],
        dim: usize,
        copy: BlockCopy,
    ) -> Result<()> {
        let s = self.shape;
        let eb = element_bytes(s.dtype);
        let block_bytes = (s.heads_kv * s.block_size * dim) as u64 * eb;
        if block_bytes == 0 {
            return Ok(());
        }
        let locate = |b: usize| {
            (
                &pool[b / self.per_buffer],
                (b % self.per_buffer) as u64 * block_bytes,
            )
        };
        let ((src, src_at), (dst, dst_at)) = (locate(copy.src), locate(copy.dst));
        // wgpu copies 4-byte aligned ranges between distinct buffers: the
        // block goes through a scratch buffer, from the word that holds
        // its first element to the word that holds its last.
        let start = src_at / 4 * 4;
        let end = (src_at + block_bytes).next_multiple_of(4);
        let scratch = sub.scratch(end - start);
        sub.keep(src.buffer());
        sub.encoder().copy_buffer_to_buffer(
            src.buffer().buffer(),
            start,
            scratch.buffer(),
            0,
            end - start,
        );
        if start == src_at && dst_at % 4 == 0 && block_bytes % 4 == 0 {
            sub.keep(dst.buffer());
            sub.encoder().copy_buffer_to_buffer(
                scratch.buffer(),
                0,
                dst.buffer().buffer(),
                dst_at,
                block_bytes,
            );
            return Ok(());
        }
        // A float16 block that starts or ends mid-word: its elements,
        // (heads_kv, block_size, dim) from the scratch, scattered into
        // the slots of the destination block.
        let block = (copy.dst % self.per_buffer) as u32;
        let slots: Vec<u32> = (0..s.block_size as u32)
            .flat_map(|t| [t, block, t])
            .collect();
        let delta = (src_at - start) / eb;
        self.scatter(sub, &scratch, dst, (s.block_size, delta), dim, &slots)
    }

    /// The copies, then the writes, recorded in one submission and queued
    /// without waiting (the next attention, on this queue, reads what they
    /// write). When recording fails (an input larger than a binding) the
    /// submission is dropped unsubmitted: no block has changed, not even a
    /// copy's target.
    fn record(
        &self,
        layer: usize,
        n: usize,
        copies: &[BlockCopy],
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        let writes = rows
            .iter()
            .any(|runs| runs.iter().any(|r| !r.source.is_empty()));
        if copies.is_empty() && !writes {
            return Ok(());
        }
        let s = self.shape;
        self.on_device("writing to a KV cache", &[("k", k), ("v", v)], |ctx| {
            ctx.scoped("writing to a KV cache", || {
                let mut sub = Submission::new(ctx);
                sub.may_hold();
                for &copy in copies {
                    for (k, v) in self.keys.iter().zip(&self.values) {
                        self.copy_block(&mut sub, k, s.head_dim, copy)?;
                        self.copy_block(&mut sub, v, s.head_dim_v, copy)?;
                    }
                }
                if writes {
                    self.write_pool(&mut sub, &self.keys[layer], "k", k, n, s.head_dim, rows)?;
                    self.write_pool(&mut sub, &self.values[layer], "v", v, n, s.head_dim_v, rows)?;
                }
                sub.submit_queued()?;
                Ok(())
            })
        })
    }

    /// Where block `b` of a pool of `dim`-element tokens lies: its buffer,
    /// its first byte there, and its bytes.
    fn locate<'p>(
        &self,
        pool: &'p [DeviceArray],
        dim: usize,
        b: usize,
    ) -> (&'p DeviceArray, u64, u64) {
        let s = self.shape;
        let block_bytes = (s.heads_kv * s.block_size * dim) as u64 * element_bytes(s.dtype);
        (
            &pool[b / self.per_buffer],
            (b % self.per_buffer) as u64 * block_bytes,
            block_bytes,
        )
    }

    /// Every layer's key and value pools with their token widths, in the
    /// order swapping lays them out.
    fn pools(&self) -> Vec<(&[DeviceArray], usize)> {
        let s = self.shape;
        self.keys
            .iter()
            .zip(&self.values)
            .flat_map(|(k, v)| [(k.as_slice(), s.head_dim), (v.as_slice(), s.head_dim_v)])
            .collect()
    }

    /// One pool's buffers read back and joined, in block order.
    fn read_pool(&self, pool: &[DeviceArray]) -> Result<Buffer> {
        let mut out = match self.shape.dtype {
            DType::F16 => Buffer::F16(Vec::new()),
            _ => Buffer::F32(Vec::new()),
        };
        for array in pool {
            match (&mut out, array.read()?) {
                (Buffer::F16(o), Buffer::F16(x)) => o.extend(x),
                (Buffer::F32(o), Buffer::F32(x)) => o.extend(x),
                _ => {
                    return Err(Error::Gpu(
                        "a KV cache pool read back in another dtype".to_string(),
                    ))
                }
            }
        }
        Ok(out)
    }
}

/// Fills `bytes` of `buffer` with the poison word, a few MiB at a time.
fn poison(ctx: &Context, buffer: &wgpu::Buffer, bytes: u64) {
    const PIECE: u64 = 4 << 20;
    let words = vec![POISON; (PIECE.min(bytes) / 4) as usize];
    let mut at = 0;
    while at < bytes {
        let n = PIECE.min(bytes - at);
        ctx.write_buffer(buffer, at, bytemuck::cast_slice(&words[..(n / 4) as usize]));
        at += n;
    }
}

fn entry_of(binding: u32, resource: wgpu::BindingResource<'_>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry { binding, resource }
}

impl Storage for GpuStorage {
    fn device(&self) -> String {
        name(self.ctx.index)
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<()> {
        self.alive()?;
        let none = Input::Host(Slice::F32(&[]));
        self.record(0, 0, copies, &[], none, none)
    }

    fn write(
        &mut self,
        layer: usize,
        n: usize,
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        self.alive()?;
        self.record(layer, n, &[], rows, k, v)
    }

    fn append(
        &mut self,
        layer: usize,
        n: usize,
        copies: &[BlockCopy],
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        self.alive()?;
        self.record(layer, n, copies, rows, k, v)
    }

    fn attention(
        &self,
        layer: usize,
        problem: &KvCacheProblem,
        q: Input<'_>,
        variants: &VariantArrays<'_>,
        outputs: Placement,
    ) -> Result<ForwardOutput<Array>> {
        self.alive()?;
        let (keys, values) = (&self.keys[layer], &self.values[layer]);
        if let Input::Device(t) = q {
            self.check_same_gpu("q", t)?;
        }
        decode::attention_with_kvcache_pools(
            problem,
            q,
            (keys, values, self.per_buffer),
            variants,
            outputs,
        )
    }

    fn read(&self, layer: usize) -> Result<(Buffer, Buffer)> {
        self.alive()?;
        Ok((
            self.read_pool(&self.keys[layer])?,
            self.read_pool(&self.values[layer])?,
        ))
    }

    /// Each block's 4-byte words (wgpu copies whole words) copied into
    /// gather buffers of at most a binding each, read back in one
    /// submission; the blocks' bytes cut out of the words on the host.
    fn read_blocks(&self, blocks: &[usize]) -> Result<Vec<(Buffer, Buffer)>> {
        self.alive()?;
        let s = self.shape;
        let limit = self.limit();
        let pools = self.pools();
        // The word spans to copy, in pool-major order (each pool's blocks in
        // order), cut into gathers of at most a binding each.
        let mut gathers: Vec<Gather> = vec![Gather::default()];
        for &(pool, dim) in &pools {
            for &b in blocks {
                let (buffer, at, bytes) = self.locate(pool, dim, b);
                let words = (at + bytes).next_multiple_of(4) - at / 4 * 4;
                if words > limit {
                    return Err(Error::TooLarge(format!(
                        "a KV cache block of {bytes} bytes is larger than the GPU's largest \
                         buffer"
                    )));
                }
                if gathers.last().expect("one").bytes + words > limit {
                    gathers.push(Gather::default());
                }
                let g = gathers.last_mut().expect("one");
                g.pieces.push(Piece {
                    buffer,
                    from: at / 4 * 4,
                    to: g.bytes,
                    words,
                    skip: at % 4,
                    bytes,
                });
                g.bytes += words;
            }
        }
        self.on_device("swapping a KV cache's blocks out", &[], |ctx| {
            ctx.scoped("swapping a KV cache's blocks out", || {
                let mut sub = Submission::new(ctx);
                let mut targets = Vec::with_capacity(gathers.len());
                for g in &gathers {
                    let target = sub.scratch(g.bytes.max(4));
                    for piece in &g.pieces {
                        sub.keep(piece.buffer.buffer());
                        sub.encoder().copy_buffer_to_buffer(
                            piece.buffer.buffer().buffer(),
                            piece.from,
                            target.buffer(),
                            piece.to,
                            piece.words,
                        );
                    }
                    targets.push(target);
                }
                let reads: Vec<(&Pooled, usize)> = targets
                    .iter()
                    .zip(&gathers)
                    .map(|(t, g)| (t.as_ref(), (g.bytes / 4) as usize))
                    .collect();
                let words = sub.submit(&reads)?;
                // Per pool, its blocks' bytes in order.
                let mut out: Vec<Vec<u8>> = vec![Vec::new(); pools.len()];
                let pieces = gathers.iter().zip(&words).flat_map(|(g, w)| {
                    let all: &[u8] = bytemuck::cast_slice(w);
                    g.pieces.iter().map(move |piece| {
                        let start = (piece.to + piece.skip) as usize;
                        &all[start..start + piece.bytes as usize]
                    })
                });
                for (i, bytes) in pieces.enumerate() {
                    out[i / blocks.len()].extend_from_slice(bytes);
                }
                let buffer = |bytes: &[u8]| match s.dtype {
                    DType::F16 => Buffer::F16(bytemuck::pod_collect_to_vec(bytes)),
                    _ => Buffer::F32(bytemuck::pod_collect_to_vec(bytes)),
                };
                Ok(out
                    .chunks(2)
                    .map(|kv| (buffer(&kv[0]), buffer(&kv[1])))
                    .collect())
            })
        })
    }

    /// The blocks' bytes uploaded (each from a 4-byte boundary, in upload
    /// buffers of at most a binding each) and copied into their blocks in
    /// one submission; a float16 block that does not start and end on a
    /// word of its pool goes through the scatter shader, as a
    /// copy-on-write's does.
    fn write_blocks(&mut self, blocks: &[usize], data: &[(Buffer, Buffer)]) -> Result<()> {
        self.alive()?;
        let s = self.shape;
        let limit = self.limit();
        let eb = element_bytes(s.dtype);
        let layers: Vec<&Buffer> = data.iter().flat_map(|(k, v)| [k, v]).collect();
        self.on_device("swapping a KV cache's blocks in", &[], |ctx| {
            ctx.scoped("swapping a KV cache's blocks in", || {
                let pools = self.pools();
                let mut sub = Submission::new(ctx);
                let mut staged: Vec<u8> = Vec::new();
                // (pool index, block, first byte in the upload, bytes).
                let mut pending: Vec<(usize, usize, u64, u64)> = Vec::new();
                let flush = |sub: &mut Submission<'_>,
                             staged: &mut Vec<u8>,
                             pending: &mut Vec<(usize, usize, u64, u64)>|
                 -> Result<()> {
                    if pending.is_empty() {
                        return Ok(());
                    }
                    let up = sub.upload("swapped blocks", staged)?;
                    for &(p, b, from, bytes) in pending.iter() {
                        let (pool, dim) = pools[p];
                        let (dst, at, _) = self.locate(pool, dim, b);
                        if at % 4 == 0 && bytes % 4 == 0 {
                            sub.keep(dst.buffer());
                            sub.encoder().copy_buffer_to_buffer(
                                up.buffer(),
                                from,
                                dst.buffer().buffer(),
                                at,
                                bytes,
                            );
                        } else {
                            let block = (b % self.per_buffer) as u32;
                            let slots: Vec<u32> = (0..s.block_size as u32)
                                .flat_map(|t| [t, block, t])
                                .collect();
                            self.scatter(sub, &up, dst, (s.block_size, from / eb), dim, &slots)?;
                        }
                    }
                    staged.clear();
                    pending.clear();
                    Ok(())
                };
                for (p, layer) in layers.iter().enumerate() {
                    let bytes_all: &[u8] = match layer {
                        Buffer::F16(x) => bytemuck::cast_slice(x),
                        Buffer::F32(x) => bytemuck::cast_slice(x),
                        _ => return Err(float64_error("swapped blocks")),
                    };
                    let per = bytes_all.len() / blocks.len().max(1);
                    for (i, &b) in blocks.iter().enumerate() {
                        let chunk = &bytes_all[i * per..(i + 1) * per];
                        let padded = (chunk.len() as u64).next_multiple_of(4);
                        if staged.len() as u64 + padded > limit {
                            flush(&mut sub, &mut staged, &mut pending)?;
                        }
                        pending.push((p, b, staged.len() as u64, chunk.len() as u64));
                        staged.extend_from_slice(chunk);
                        staged.resize(staged.len().next_multiple_of(4), 0);
                    }
                }
                flush(&mut sub, &mut staged, &mut pending)?;
                sub.submit_queued()?;
                Ok(())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use wgpu::naga;

    #[test]
    fn uniform_matches_the_shader() {
        let module = naga::front::wgsl::parse_str(KV_SCATTER).expect("the shader parses");
        let (span, members) = module
            .types
            .iter()
            .find_map(|(_, ty)| match (&ty.name, &ty.inner) {
                (Some(n), naga::TypeInner::Struct { members, span }) if n == "Scatter" => {
                    Some((*span, members.clone()))
                }
                _ => None,
            })
            .expect("struct Scatter in the shader");
        let shader: Vec<(String, usize)> = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
            .collect();
        macro_rules! offsets {
            ($($field:ident),*) => {
                vec![$((stringify!($field).to_string(), offset_of!(ScatterUniform, $field))),*]
            };
        }
        let rust = offsets!(n, count, heads, dim, block_size, src_delta, pad0, pad1);
        assert_eq!(shader, rust);
        assert_eq!(span as usize, size_of::<ScatterUniform>());
    }

    #[test]
    fn blocks_per_buffer_keeps_the_windows_slack() {
        // 256 B alignment + 16: a 1 KiB binding holds 3 blocks of 250 B.
        assert_eq!(blocks_per_buffer(250, 1024, 256), Some(3));
        assert_eq!(blocks_per_buffer(752, 1024, 256), Some(1));
        assert_eq!(blocks_per_buffer(753, 1024, 256), None);
        assert_eq!(blocks_per_buffer(4, 100, 256), None);
        assert_eq!(blocks_per_buffer(1, 1 << 31, 256), Some((1 << 31) - 272));
    }
}
