//! Packed batches of variable-length sequences on the GPU (see
//! `crate::varlen`): the table in `vx` that tells the kernels each row's
//! keys (read under the `VARLEN` override of shaders/lib/common.wgsl), and
//! the transposes of device arrays between the packed layout and the
//! kernels' (shaders/varlen.wgsl).

use super::adapters::Gpu;
use super::chunks::binding_limit;
use super::device_array::DeviceArray;
use super::inputs::Source;
use super::pool::padded;
use super::run::with_inputs;
use super::shaders::VARLEN;
use super::transfer::Submission;
use crate::error::{Error, Result};
use crate::overrides;
use crate::problem::{DType, Problem, Segments};

/// Words per row of the row table: the first visible key, the end of the
/// visible keys, the diagonal offset (i32 bits) and the sequence.
pub(crate) const ROW_WORDS: usize = 4;

/// The words the kernels read under `VARLEN`, from the table's start in
/// `vx`: `ROW_WORDS` per row (common.wgsl: `visible_start`, `visible_end`,
/// the ALiBi diagonal and the sequence of its slopes), then two per key
/// boundary `j` in `0..=seq_k`: the first row whose keys end after `j`
/// and the first row whose keys start at or after `j`. Both ends of the
/// rows' ranges are non-decreasing, so the rows that see any key of
/// `[k0, k1)` are exactly those from the first word of `k0` to the second
/// of `k1` (the dK/dV kernels' first row and `rows_seeing_end`).
pub(crate) fn table_words(p: &Problem, segments: &Segments) -> Vec<u32> {
    let rows = segments.rows(p);
    let mut words = Vec::with_capacity(ROW_WORDS * p.seq_q + 2 * (p.seq_k + 1));
    for (keys, &b) in rows.visible.iter().zip(&rows.sequence) {
        // Within ±i32::MAX / 2: inputs::check_sizes bounds the totals.
        let diagonal = segments.diagonal(b) as i32;
        words.extend([
            keys.start as u32,
            keys.end as u32,
            diagonal as u32,
            b as u32,
        ]);
    }
    let (mut ended, mut started) = (0, 0);
    for j in 0..=p.seq_k {
        while ended < p.seq_q && rows.visible[ended].end <= j {
            ended += 1;
        }
        while started < p.seq_q && rows.visible[started].start < j {
            started += 1;
        }
        words.extend([ended as u32, started as u32]);
    }
    words
}

/// Device arrays `(name, array, (a, b, w))` of shape `(a, b, w)` as new
/// arrays of shape `(b, a, w)`, in one submission on their context.
pub fn swap_leading(arrays: &[(&str, &DeviceArray, [usize; 3])]) -> Result<Vec<DeviceArray>> {
    if arrays.is_empty() {
        return Ok(Vec::new());
    }
    let sources: Vec<(&str, Source<'_>)> = arrays
        .iter()
        .map(|&(name, t, _)| (name, Source::Device(t)))
        .collect();
    with_inputs(
        "moving device arrays between layouts",
        Gpu::Best,
        &sources,
        |ctx| {
            ctx.scoped("moving device arrays between layouts", || {
                let limit = binding_limit(ctx, &overrides::current());
                let max_dim = ctx.limits.max_compute_workgroups_per_dimension.max(1) as u64;
                let mut sub = Submission::new(ctx);
                let mut moved = Vec::with_capacity(arrays.len());
                for &(name, t, [a, b, w]) in arrays {
                    let bytes = padded(t.nbytes() as u64);
                    if bytes > limit {
                        return Err(Error::TooLarge(format!(
                            "{name} ({} bytes) is larger than one binding of the GPU {} ({limit} \
                         bytes), which attention_varlen's move to the kernels' layout needs; \
                         pass NumPy arrays (split by heads) or use device=\"cpu\"",
                            t.nbytes(),
                            ctx.adapter.name
                        )));
                    }
                    // Poisoned where outputs are: the move writes every element.
                    let dst = sub.output_bytes(bytes);
                    let count = t.len() as u64;
                    if count > 0 {
                        let (entry, invocations) = match t.dtype() {
                            DType::F16 => ("varlen_swap_f16", count.div_ceil(2)),
                            _ => ("varlen_swap_f32", count),
                        };
                        let pipeline = ctx.array_pipeline(entry, VARLEN)?;
                        let dims = sub.uniform(&[a as u32, b as u32, w as u32, count as u32])?;
                        sub.keep(t.buffer());
                        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some(entry),
                            layout: &pipeline.get_bind_group_layout(0),
                            entries: &[
                                wgpu::BindGroupEntry {
                                    binding: 0,
                                    resource: dims.binding(),
                                },
                                wgpu::BindGroupEntry {
                                    binding: 1,
                                    resource: t.buffer().binding(),
                                },
                                wgpu::BindGroupEntry {
                                    binding: 2,
                                    resource: dst.binding(),
                                },
                            ],
                        });
                        let groups = invocations.div_ceil(64);
                        let x = groups.min(max_dim);
                        let y = groups.div_ceil(x);
                        if y > max_dim {
                            return Err(Error::TooLarge(format!(
                                "moving {name} ({count} elements) needs more workgroups than the \
                             GPU {} allows",
                                ctx.adapter.name
                            )));
                        }
                        sub.dispatch(&pipeline, &group, (x as u32, y as u32), entry);
                    }
                    moved.push(DeviceArray::from_buffer(ctx, dst, t.dtype(), vec![b, a, w]));
                }
                sub.submit(&[])?;
                Ok(moved)
            })
        },
    )
}
