//! Hooks for the test suites and benchmark tools (cargo feature `testing`,
//! never in the release wheel): what the default GPU's context would run,
//! a device to lose on purpose, which GPUs have contexts, and the device's
//! float16 rounding.

use super::adapters::Gpu;
use super::context;
use super::decode::select::DecodeKernel;
use super::device_array::{to_device, Resident};
use super::guard::{guarded, run_on, with_context};
use super::select::{select_backward, select_forward, AdapterCaps, BackwardPlan, ForwardPlan};
use super::transfer::Submission;
use crate::array::{Buffer, Slice};
use crate::error::{Error, Result};
use crate::overrides;
use crate::problem::{DType, KvCacheProblem, Problem};

/// What the default GPU's adapter offers (creating its context).
pub fn adapter_caps() -> Result<AdapterCaps> {
    Ok(context::get(Gpu::Best)?.caps)
}

/// The kernels the forward and the backward of `p` would run on the shared
/// context with the calling thread's overrides.
pub fn plans(p: &Problem) -> Result<(ForwardPlan, BackwardPlan)> {
    let caps = adapter_caps()?;
    let overrides = overrides::current();
    Ok((
        select_forward(p, caps, &overrides),
        select_backward(p, caps, &overrides),
    ))
}

/// The lanes of the shared context's subgroups, where it has subgroup
/// operations and one subgroup size.
pub fn subgroup_size() -> Result<Option<u32>> {
    Ok(context::get(Gpu::Best)?.subgroup_size)
}

/// The decode kernel and split count `attention_with_kvcache` of `p` would
/// run on the shared context with the calling thread's overrides.
pub fn decode_plan(p: &KvCacheProblem) -> Result<(DecodeKernel, usize)> {
    super::decode::choose(&*context::get(Gpu::Best)?, p, &overrides::current())
}

/// Destroys the device of `gpu:index`, as a driver reset or a removed
/// GPU would, so that tests can check that the failure surfaces as an
/// error, that the CPU and the other GPUs keep working, and that the next
/// call on that GPU starts afresh. Does nothing where it has no context.
pub fn lose_device(index: usize) {
    if let Some(ctx) = context::current(index) {
        ctx.device.destroy();
        // wgpu-core reports a destroyed device lost only once its queue is
        // empty, while a driver reports a real loss at its next check of a
        // fence: waiting out the queued work makes the loss visible now, as
        // a real one would be to the next call.
        let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
    }
}

/// A queued call on the default GPU that the context may hold back (as it
/// holds decoding's) and whose commands wgpu refuses when they are
/// finished (a copy of 2 bytes, not a multiple of 4): a held call that
/// fails. It
/// raises, as any call whose work wgpu refuses, and its context is dropped
/// with the calls held before it, whose arrays then raise when used.
pub fn held_call_that_fails() -> Result<()> {
    with_context(Gpu::Best, "a held call that fails", |ctx| {
        ctx.scoped("a held call that fails", || {
            let mut sub = Submission::new(ctx);
            sub.may_hold();
            let (from, to) = (sub.scratch(16), sub.scratch(16));
            sub.encoder()
                .copy_buffer_to_buffer(from.buffer(), 0, to.buffer(), 0, 2);
            sub.submit_queued()
        })
    })
}

/// The submissions queued without a wait on `gpu:index` that are not yet
/// known to be done (at most `MAX_QUEUED`); 0 without a context.
pub fn queued_submissions(index: usize) -> usize {
    context::current(index).map_or(0, |ctx| ctx.queued_len())
}

/// The queued calls whose commands `gpu:index`'s context holds back, not
/// yet submitted (at most `MAX_PENDING`); 0 without a context.
pub fn held_calls(index: usize) -> usize {
    context::current(index).map_or(0, |ctx| ctx.held_len())
}

/// The indices of the GPUs with a context open in this process, lost
/// ones included until replaced (what a Dask worker test asks of each
/// worker: which GPU its blocks ran on).
pub fn open_gpus() -> Vec<usize> {
    context::open_contexts()
        .iter()
        .map(|ctx| ctx.index)
        .collect()
}

/// The most submissions a context keeps queued without a wait.
pub const MAX_QUEUED: usize = context::MAX_QUEUED;

/// Rounds `values` to float16 with the device's conversion (the one device
/// outputs use), for tests against the host's rounding.
pub fn round_to_f16_on_device(values: &[f32]) -> Result<Vec<half::f16>> {
    let t = to_device("values", Slice::F32(values), &[values.len()])?;
    let ctx = t.context().clone();
    let rounded = guarded("rounding to float16", || {
        run_on(&ctx, |ctx| {
            ctx.scoped("rounding to float16", || {
                let mut resident = Resident::new(values.len());
                let mut sub = Submission::new(ctx);
                resident.put(&mut sub, 0, t.buffer(), values.len());
                let out = resident.finish(ctx, &mut sub, DType::F16, t.shape().to_vec())?;
                sub.submit(&[])?;
                Ok(out)
            })
        })
    })?;
    match rounded.read()? {
        Buffer::F16(x) => Ok(x),
        _ => Err(Error::Gpu(
            "the float16 rounding returned float32".to_string(),
        )),
    }
}

/// The binding limit under which a KV cache made now keeps `blocks` blocks
/// of `block_bytes` (its widest pool's) per pool buffer: one binding holds
/// them with the slack of the adapter's offset alignment.
pub fn kv_pool_binding_limit(block_bytes: u64, blocks: u64) -> Result<u64> {
    let ctx = context::get(Gpu::Best)?;
    let align = ctx.limits.min_storage_buffer_offset_alignment.max(16) as u64;
    // Binding limits are whole words (`chunks::binding_limit`).
    Ok((align + 16 + blocks * block_bytes).next_multiple_of(4))
}

/// Bytes of one parameter arena of a submission (`arena.rs`), for tests
/// that overflow one.
pub const ARENA_BYTES: u64 = super::arena::ARENA_BYTES;

/// Each of `params` handed to one submission as its kernels' words are
/// (`Submission::data`: packed into arenas, or uploaded alone where
/// large), copied by the GPU out of where it was put, and read back.
pub fn params_round_trip(params: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let ctx = context::get(Gpu::Best)?;
    run_on(&ctx, |ctx| {
        let mut sub = Submission::new(ctx);
        let mut outs = Vec::new();
        for words in params {
            let param = sub.data(words)?;
            let (buffer, offset, size) = param.range();
            let out = sub.output(words.len().max(1));
            sub.encoder()
                .copy_buffer_to_buffer(buffer.buffer(), offset, out.buffer(), 0, size);
            outs.push((out, words.len()));
        }
        let reads: Vec<_> = outs.iter().map(|(b, n)| (&**b, *n)).collect();
        let words = sub.submit(&reads)?;
        Ok(words
            .into_iter()
            .map(|w| w.into_iter().map(f32::to_bits).collect())
            .collect())
    })
}
