//! `attention_with_kvcache` on the GPU (see [`crate::decode`] for what is
//! computed): shaders/decode/decode.wgsl writes each key split's state,
//! (o, lse) in float32, one workgroup per (sequence, key/value head,
//! split, block of query rows); shaders/decode/combine.wgsl merges the
//! splits in order. The layout and the split count come from `select`.
//!
//! The caches are bound as windows of their buffers: a dispatch covers a
//! run of sequences and binds the blocks they use (the sequences' own
//! rows when contiguous). Host caches upload just those windows; device
//! arrays are bound where they are. Everything is checked on the host
//! before any dispatch (lengths and table entries by validation, windows
//! here), and naga's bounds checks stay on in the kernel, so no read
//! leaves its binding.
//!
//! Caches larger than that are read in runs, one per window of whole
//! blocks: a KV cache's pools (`super::kv_pool`), several buffers of
//! whole blocks each bound whole; paged arrays whose blocks one sequence
//! reads span more than a binding, bound as consecutive windows of whole
//! blocks; and a contiguous cache whose one sequence's rows exceed a
//! binding, read as a paged problem of one key/value head per sequence
//! whose blocks are windows of rows (`HeadRows`). Each dispatch then runs
//! once per window its sequences read, the table entries of the other
//! windows' blocks marked as not bound (`SKIPS`): each run's splits see
//! only the keys of its window (a run that sees none of a row's keys
//! leaves that row's states empty, lse -inf, which merge as nothing), and
//! the combine pass merges every run's splits as one set. Attention over
//! a set of keys is the merge of attention over its parts, so a
//! sequence's blocks may lie anywhere. What no window mends is refused by
//! name: a paged block larger than a binding, or split states of every
//! window a sequence reads that do not fit one binding (the combine pass
//! binds them together).

mod plan;
pub mod select;

use std::sync::Arc;
use std::time::Instant;

use bytemuck::{Pod, Zeroable};

use super::adapters::Gpu;
use super::assemble::{check_device_outputs, empty_output, Sink};
use super::bfloat16::{narrow, Widened};
use super::chunks::binding_limit;
use super::context::Context;
use super::inputs::{chunk_input, float16_error, float64_error, source, Source};
use super::merge;
use super::pool::Pooled;
use super::run::with_inputs;
use super::shaders::{
    decode_source, decode_subgroup_source, score_variant_overrides, DECODE_COMBINE,
    DECODE_COMBINE_F16,
};
use super::timing;
use super::transfer::Submission;
use crate::array::{Array, Input, Placement};
use crate::error::{Error, Result};
use crate::gpu::device_array::DeviceArray;
use crate::output::ForwardOutput;
use crate::overrides::{self, Overrides};
use crate::problem::{CacheLayout, DType, KvCacheProblem};
use crate::variants::VariantArrays;
use plan::{
    block_too_large, plan, runs_of, seq_data_of, whole, window, window_blocks, Bind, HeadRows,
    Heads, Limits,
};
use select::{decode_kernel, gpu_splits, AdapterKind, DecodeCaps, DecodeKernel, SubgroupKnobs};

/// The kernel's `struct Decode`, word for word (`uniform_matches_the_shader`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct Uniform {
    pub heads_q: u32,
    pub heads_kv: u32,
    pub group: u32,
    pub seq_q: u32,
    pub rows: u32,
    pub row_blocks: u32,
    pub d: u32,
    pub dv: u32,
    pub block_size: u32,
    pub max_blocks: u32,
    pub splits: u32,
    pub causal: u32,
    pub left: u32,
    pub right: u32,
    pub scale: f32,
    pub softcap: f32,
    pub seqlens_off: u32,
    pub table_off: u32,
    pub slopes_off: u32,
    pub split_base: u32,
    pub k_delta: u32,
    pub v_delta: u32,
    pub out_rows: u32,
    pub pad1: u32,
}

/// The combine pass's `struct Combine`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct CombineUniform {
    pub rows: u32,
    pub dv: u32,
    pub splits: u32,
    pub heads_q: u32,
    pub seq_q: u32,
    pub sinks: u32,
    pub sinks_off: u32,
    pub pad0: u32,
}

/// A window side the kernel treats as unbounded.
const NONE: u32 = u32::MAX;

/// Positions are i32 in the kernel: lengths, seq_q and the block size stay
/// below this, and window sides are capped at it (past every position).
const POSITION_LIMIT: usize = 1 << 30;

/// The smallest cache binding: one vec4<f32>, the widest element the
/// kernel's cache arrays have.
const MIN_WINDOW: u64 = 16;

/// Where the caches are: two arrays (host or device), or a KV cache's
/// pools split over buffers of `per_buffer` blocks (more than one).
#[derive(Clone, Copy)]
enum Caches<'a> {
    Arrays(Source<'a>, Source<'a>),
    Pools {
        keys: &'a [DeviceArray],
        values: &'a [DeviceArray],
        per_buffer: usize,
    },
    /// Two paged arrays read as a pool of windows of `per_window` blocks,
    /// each bound alone.
    Windows(Source<'a>, Source<'a>, usize),
}

/// Decodes on the GPU over a KV cache's pools of one layer, `keys` and
/// `values` each a list of buffers of `per_buffer` whole blocks, bound
/// where they are (the problem's table counts blocks over the whole pool).
pub(crate) fn attention_with_kvcache_pools(
    problem: &KvCacheProblem,
    q: Input<'_>,
    (keys, values, per_buffer): (&[DeviceArray], &[DeviceArray], usize),
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype() == DType::F64 {
        return Err(float64_error("q"));
    }
    crate::array::check_len("q", &q, problem.q_len(), problem.dtype())?;
    variants.check_kvcache(problem)?;
    check_positions(problem)?;
    let (Some(k0), Some(v0)) = (keys.first(), values.first()) else {
        return Err(Error::Shape("a KV cache without blocks".to_string()));
    };
    let q = source("q", q)?;
    let caches = if keys.len() == 1 && values.len() == 1 {
        Caches::Arrays(Source::Device(k0), Source::Device(v0))
    } else {
        Caches::Pools {
            keys,
            values,
            per_buffer,
        }
    };
    let named = [
        ("q", q),
        ("k_cache", Source::Device(k0)),
        ("v_cache", Source::Device(v0)),
    ];
    let overrides = overrides::current();
    // The pools pin the call to the cache's GPU.
    with_inputs("decoding over a KV cache", Gpu::Best, &named, |ctx| {
        decode_on(ctx, problem, q, caches, variants, outputs, &overrides)
    })
}

/// Decodes on `gpu` (or where the device inputs are), leaving the
/// outputs where `outputs` says.
pub fn attention_with_kvcache(
    gpu: Gpu,
    problem: &KvCacheProblem,
    [q, k_cache, v_cache]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    if problem.dtype() == DType::BF16 {
        let named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)];
        let wide = Widened::new(&named, outputs)?;
        let mut wide_problem = problem.clone();
        wide_problem.attention.dtype = DType::F32;
        let inputs = wide.inputs([q, k_cache, v_cache]);
        let r = attention_with_kvcache(gpu, &wide_problem, inputs, variants, outputs)?;
        return Ok(ForwardOutput {
            out: narrow(r.out)?,
            lse: r.lse,
        });
    }
    if problem.dtype() == DType::F64 {
        return Err(float64_error("q"));
    }
    check_positions(problem)?;
    let sources = [
        source("q", q)?,
        source("k_cache", k_cache)?,
        source("v_cache", v_cache)?,
    ];
    let named = [
        ("q", sources[0]),
        ("k_cache", sources[1]),
        ("v_cache", sources[2]),
    ];
    let overrides = overrides::current();
    let [q, k, v] = sources;
    with_inputs("decoding over a KV cache", gpu, &named, |ctx| {
        decode_on(
            ctx,
            problem,
            q,
            Caches::Arrays(k, v),
            variants,
            outputs,
            &overrides,
        )
    })
}

fn check_positions(p: &KvCacheProblem) -> Result<()> {
    let longest = p.seqlens.iter().copied().max().unwrap_or(0);
    let widest = longest.max(p.seq_q()).max(p.block_size());
    if widest >= POSITION_LIMIT {
        return Err(Error::TooLarge(format!(
            "the GPU decodes sequences, query chunks and blocks of fewer than {POSITION_LIMIT} \
             keys (here {widest}); use device=\"cpu\""
        )));
    }
    Ok(())
}

/// What the adapter is, as the layout and the split count see it.
fn caps_of(ctx: &Context, overrides: &Overrides) -> DecodeCaps {
    let caps = overrides.apply(ctx.caps);
    DecodeCaps {
        kind: AdapterKind::from_name(&ctx.adapter.device_type),
        workgroup_storage_bytes: caps.workgroup_storage_bytes,
        max_invocations: caps.max_invocations,
        loop_limit: caps.loop_limit,
        subgroup_size: ctx.subgroup_size.filter(|_| caps.subgroups),
    }
}

/// The kernel that decodes `p` on `ctx`, and its split count.
pub(crate) fn choose(
    ctx: &Context,
    p: &KvCacheProblem,
    overrides: &Overrides,
) -> Result<(DecodeKernel, usize)> {
    let (d, dv) = (p.attention.head_dim, p.attention.value_dim);
    let caps = caps_of(ctx, overrides);
    let knobs = SubgroupKnobs {
        workgroup: overrides.decode_workgroup,
        keys: overrides.decode_keys,
        lanes: overrides.decode_lanes,
        prefetch: overrides.decode_prefetch,
    };
    let f16 = p.dtype() == DType::F16;
    let kernel = decode_kernel(d, dv, p.group_rows(), f16, caps, knobs).ok_or_else(|| {
        Error::BackendUnavailable(format!(
            "the GPU decodes head dimensions up to {} (here d={d}, d_v={dv}) with this \
             adapter's workgroup memory; use device=\"cpu\"",
            select::MAX_HEAD_DIM
        ))
    })?;
    let splits = gpu_splits(p, kernel, caps)?;
    Ok((kernel, splits))
}

fn decode_on(
    ctx: &Arc<Context>,
    p: &KvCacheProblem,
    q: Source<'_>,
    caches: Caches<'_>,
    variants: &VariantArrays<'_>,
    outputs: Placement,
    overrides: &Overrides,
) -> Result<ForwardOutput<Array>> {
    let a = &p.attention;
    if a.dtype == DType::F16 && !ctx.f16_inputs {
        return Err(float16_error(ctx, "q"));
    }
    timing::start_call();
    let prepared = Instant::now();
    if p.lse_len() == 0 {
        return ctx.scoped("making the outputs", || {
            let mut sub = Submission::new(ctx);
            let out = empty_output(ctx, &mut sub, outputs, a.dtype, p.out_shape(), 0.0)?;
            let lse = empty_output(
                ctx,
                &mut sub,
                outputs,
                DType::F32,
                p.lse_shape(),
                f32::NEG_INFINITY,
            )?;
            sub.submit(&[])?;
            Ok(ForwardOutput { out, lse })
        });
    }
    check_device_outputs(ctx, outputs, &[("o", p.out_len()), ("lse", p.lse_len())])?;
    let (d, dv) = (a.head_dim, a.value_dim);
    let (kernel, splits) = choose(ctx, p, overrides)?;
    let f16 = a.dtype == DType::F16;
    let eb = if f16 { 2 } else { 4 };
    let limits = Limits {
        binding: binding_limit(ctx, overrides),
        grid: ctx.limits.max_compute_workgroups_per_dimension as u64,
        align: ctx.limits.min_storage_buffer_offset_alignment.max(16) as u64,
    };
    // Caches larger than a binding are bound window by window, one run of
    // the kernel per window, each run's splits apart (so are a pool's
    // buffers); the combine pass merges every run's splits.
    let mut head_rows = None;
    let (caches, dispatches) = match caches {
        Caches::Arrays(k, v) => match plan(p, kernel, splits, eb, &limits, Bind::Blocks) {
            Ok(dispatches) => (caches, dispatches),
            // A sequence's blocks span more than a binding, or something
            // else does not fit (the windows' plan then names it).
            Err(_) => {
                let paged = matches!(p.layout, CacheLayout::Paged { .. });
                let rows = (!paged)
                    .then(|| HeadRows::new(p, variants, eb, &limits))
                    .flatten();
                let view = rows.as_ref().map_or(p, |r| &r.problem);
                let per = window_blocks(view, eb, &limits)
                    .ok_or_else(|| block_too_large(p, eb, &limits))?;
                let heads = rows.as_ref().map(|_| Heads {
                    heads_kv: p.heads_kv(),
                    capacity: p.block_size(),
                });
                let bind = Bind::Runs { per, heads };
                let dispatches = plan(view, kernel, splits, eb, &limits, bind)?;
                head_rows = rows;
                (Caches::Windows(k, v, per), dispatches)
            }
        },
        Caches::Pools { per_buffer, .. } => {
            let bind = Bind::Runs {
                per: per_buffer,
                heads: None,
            };
            (caches, plan(p, kernel, splits, eb, &limits, bind)?)
        }
        Caches::Windows(..) => unreachable!("made here"),
    };
    // The problem the kernel sees: `p`, or its sequences' key/value heads
    // apart (`HeadRows`; the same q, o and lse).
    let view = head_rows.as_ref().map_or(p, |r| &r.problem);
    let va = &view.attention;
    let paged = matches!(view.layout, CacheLayout::Paged { .. });
    let skips = !matches!(caches, Caches::Arrays(..));
    let mut constants = kernel.overrides(paged);
    constants.extend(score_variant_overrides(
        a.softcap.is_some(),
        a.alibi_per_batch.is_some(),
    ));
    constants.push(("SKIPS", if skips { 1.0 } else { 0.0 }));
    let vec4 = kernel.vec4();
    let pipeline = match kernel {
        DecodeKernel::Workgroup(_) => {
            let label = match (f16, vec4) {
                (false, true) => "decode_f32_vec4",
                (false, false) => "decode_f32_elements",
                (true, true) => "decode_f16_vec4",
                (true, false) => "decode_f16_elements",
            };
            let source = || decode_source(f16, vec4);
            ctx.specialised_pipeline(label, source, &constants, false)?
        }
        DecodeKernel::Subgroup(_) => {
            let label = match (f16, vec4) {
                (false, true) => "decode_subgroup_f32_vec4",
                (false, false) => "decode_subgroup_f32_elements",
                (true, true) => "decode_subgroup_f16_vec4",
                (true, false) => "decode_subgroup_f16_elements",
            };
            // Its indices are in bounds by construction, so a release
            // build drops naga's clamps (as the tiled kernels do): table
            // entries are checked on the host against the blocks bound
            // (the windows' own NONE where not bound, never loaded), keys
            // stay below the lengths, and the workgroup arrays are sized
            // from the same overrides that index them (`select`).
            let unchecked = super::pipelines::clamps_off() && !overrides.decode_checked;
            let source = || decode_subgroup_source(f16, vec4);
            ctx.specialised_pipeline(label, source, &constants, unchecked)?
        }
    };
    // A float16 output kept on the device is rounded by the combine pass
    // itself where it writes whole words of one row (d_v even) of the
    // whole output (one dispatch): one pass and one buffer fewer a call.
    let halves = f16 && outputs == Placement::Device && dispatches.len() == 1 && dv % 2 == 0;
    let combine = if halves {
        ctx.array_pipeline("decode_combine", DECODE_COMBINE_F16)?
    } else {
        ctx.array_pipeline("decode_combine", DECODE_COMBINE)?
    };
    let row_blocks = kernel.row_blocks(view.group_rows());
    let per_sequence = va.heads_q * va.seq_q;
    let side = |x: Option<usize>| x.map_or(NONE, |x| x.min(POSITION_LIMIT) as u32);
    let mut out = Sink::new(outputs, p.out_len(), 0.0);
    let mut lse = Sink::new(outputs, p.lse_len(), f32::NEG_INFINITY);
    for (i, dispatch) in dispatches.iter().enumerate() {
        let (b0, n) = (dispatch.sequences.start, dispatch.sequences.len());
        let out_rows = n * per_sequence;
        let last = i + 1 == dispatches.len();
        let reads = ctx.scoped("decoding over a KV cache", || {
            let mut sub = Submission::new(ctx);
            sub.may_hold();
            let runs: Vec<Option<(usize, std::ops::Range<usize>)>> = match caches {
                Caches::Arrays(..) => vec![None],
                Caches::Pools { per_buffer, .. } => runs_of(view, dispatch, per_buffer, true)
                    .into_iter()
                    .map(Some)
                    .collect(),
                Caches::Windows(_, _, per) => runs_of(view, dispatch, per, false)
                    .into_iter()
                    .map(Some)
                    .collect(),
            };
            let variants = match &head_rows {
                Some(r) => r.variants(dispatch, variants, p.heads_kv()),
                None => *variants,
            };
            let all_splits = splits * runs.len();
            let part_o = sub.output(all_splits * out_rows * dv);
            let part_lse = sub.output(all_splits * out_rows);
            let qb = chunk_input(&mut sub, "q", q, (per_sequence * d, eb as usize), (b0, n))?;
            let mut seq_data = None;
            let mut sinks_offset = 0;
            for (i, run) in runs.iter().enumerate() {
                let bound = run.as_ref().map(|(_, blocks)| blocks);
                let (words, [seqlens_off, table_off, slopes_off, sinks_off]) =
                    seq_data_of(view, dispatch, &variants, bound);
                let data = sub.data(&words)?;
                let (kw, vw) = match (caches, run) {
                    (Caches::Pools { keys, values, .. }, Some((buffer, _))) => (
                        whole(&keys[*buffer], &mut sub),
                        whole(&values[*buffer], &mut sub),
                    ),
                    (
                        Caches::Arrays(k_cache, v_cache) | Caches::Windows(k_cache, v_cache, _),
                        _,
                    ) => {
                        let blocks = (dispatch.origin, bound.unwrap_or(&dispatch.blocks));
                        let (k, v, align) = ("k_cache", "v_cache", limits.align);
                        (
                            window(&mut sub, k, k_cache, view, blocks, d, eb, align)?,
                            window(&mut sub, v, v_cache, view, blocks, dv, eb, align)?,
                        )
                    }
                    (Caches::Pools { .. }, None) => unreachable!("a pool's runs are buffers"),
                };
                let uniform = sub.uniform(&Uniform {
                    heads_q: va.heads_q as u32,
                    heads_kv: va.heads_kv as u32,
                    group: va.group_size() as u32,
                    seq_q: a.seq_q as u32,
                    rows: view.group_rows() as u32,
                    row_blocks: row_blocks as u32,
                    d: d as u32,
                    dv: dv as u32,
                    block_size: view.block_size() as u32,
                    max_blocks: match &view.layout {
                        CacheLayout::Paged { max_blocks, .. } => *max_blocks as u32,
                        CacheLayout::Contiguous { .. } => 1,
                    },
                    splits: splits as u32,
                    causal: u32::from(a.causal),
                    left: side(a.window.left),
                    right: side(a.window.right),
                    scale: a.scale as f32,
                    softcap: a.softcap.map_or(1.0, |c| c as f32),
                    seqlens_off,
                    table_off,
                    slopes_off,
                    split_base: (i * splits) as u32,
                    k_delta: kw.delta,
                    v_delta: vw.delta,
                    out_rows: out_rows as u32,
                    pad1: 0,
                })?;
                let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some("decode"),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &[
                        entry(0, uniform.binding()),
                        entry(1, qb.binding()),
                        entry(2, kw.binding()),
                        entry(3, vw.binding()),
                        entry(4, data.binding()),
                        entry(5, part_o.binding()),
                        entry(6, part_lse.binding()),
                    ],
                });
                let y = (n * va.heads_kv * row_blocks) as u32;
                let name = match kernel {
                    DecodeKernel::Workgroup(_) => "decode",
                    DecodeKernel::Subgroup(_) => "decode_subgroup",
                };
                sub.dispatch(&pipeline, &group, (splits as u32, y), name);
                // Every run's words agree on the sinks the combine reads.
                sinks_offset = sinks_off;
                seq_data = Some(data);
            }
            let seq_data = seq_data.expect("at least one run");
            let combine_uniform = sub.uniform(&CombineUniform {
                rows: out_rows as u32,
                dv: dv as u32,
                splits: all_splits as u32,
                heads_q: va.heads_q as u32,
                seq_q: a.seq_q as u32,
                sinks: u32::from(a.sinks),
                sinks_off: sinks_offset,
                pad0: 0,
            })?;
            let ob = if halves {
                sub.output_bytes(2 * (out_rows * dv) as u64)
            } else {
                sub.output(out_rows * dv)
            };
            let lb = sub.output(out_rows);
            let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("decode_combine"),
                layout: &combine.get_bind_group_layout(0),
                entries: &[
                    entry(0, combine_uniform.binding()),
                    entry(1, part_o.binding()),
                    entry(2, part_lse.binding()),
                    entry(3, seq_data.binding()),
                    entry(4, ob.binding()),
                    entry(5, lb.binding()),
                ],
            });
            let count = if halves {
                out_rows * dv / 2
            } else {
                out_rows * dv.max(1)
            };
            merge::run(ctx, &mut sub, (&combine, "decode_combine"), &group, count)?;
            let mut reads = Vec::new();
            let first_row = b0 * per_sequence;
            if halves {
                out = Sink::Done(DeviceArray::from_buffer(ctx, ob, a.dtype, p.out_shape()));
            } else {
                out.collect(
                    ctx,
                    &mut sub,
                    &ob,
                    first_row * dv,
                    out_rows * dv,
                    false,
                    &mut reads,
                )?;
            }
            lse.collect(ctx, &mut sub, &lb, first_row, out_rows, false, &mut reads)?;
            if last {
                out.finish_on_device(ctx, &mut sub, a.dtype, p.out_shape())?;
                lse.finish_on_device(ctx, &mut sub, DType::F32, p.lse_shape())?;
            }
            if i == 0 {
                timing::record_host("prepare", prepared);
            }
            let reads: Vec<(&Pooled, usize)> = reads.iter().map(|(b, n)| (&**b, *n)).collect();
            sub.submit(&reads)
        })?;
        let mut reads = reads.into_iter();
        let first_row = b0 * per_sequence;
        out.place(first_row * dv, false, &mut reads);
        lse.place(first_row, false, &mut reads);
    }
    Ok(ForwardOutput {
        out: out.into_array(a.dtype)?,
        lse: lse.into_array(DType::F32)?,
    })
}

fn entry(binding: u32, resource: wgpu::BindingResource<'_>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry { binding, resource }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use wgpu::naga;

    /// Every member of the shader's uniform, in order, at the offset of
    /// the member of the same name here (see gpu/params.rs for why).
    fn check_struct(source: &str, name: &str, rust: &[(&str, usize)], size: usize) {
        let module = naga::front::wgsl::parse_str(source).expect("the shader parses");
        let (span, members) = module
            .types
            .iter()
            .find_map(|(_, ty)| match (&ty.name, &ty.inner) {
                (Some(n), naga::TypeInner::Struct { members, span }) if n == name => {
                    Some((*span, members.clone()))
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("struct {name} in the shader"));
        let shader: Vec<(String, usize)> = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
            .collect();
        let rust: Vec<(String, usize)> = rust.iter().map(|(n, o)| (n.to_string(), *o)).collect();
        assert_eq!(shader, rust);
        assert_eq!(span as usize, size);
        assert_eq!(4 * rust.len(), size);
    }

    macro_rules! offsets {
        ($ty:ty: $($field:ident),* $(,)?) => {
            [$((stringify!($field), offset_of!($ty, $field))),*]
        };
    }

    #[test]
    fn uniforms_match_the_shaders() {
        let rust = offsets!(Uniform: heads_q, heads_kv, group, seq_q, rows, row_blocks, d, dv,
            block_size, max_blocks, splits, causal, left, right, scale, softcap, seqlens_off,
            table_off, slopes_off, split_base, k_delta, v_delta, out_rows, pad1);
        check_struct(
            &decode_source(false, true),
            "Decode",
            &rust,
            size_of::<Uniform>(),
        );
        let rust =
            offsets!(CombineUniform: rows, dv, splits, heads_q, seq_q, sinks, sinks_off, pad0);
        check_struct(
            DECODE_COMBINE,
            "Combine",
            &rust,
            size_of::<CombineUniform>(),
        );
    }
}
