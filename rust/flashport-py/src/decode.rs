//! `attention_with_kvcache`: decoding over a contiguous or paged cache.

use flashport_core as core;
use flashport_core::Placement;

use crate::arrays::{device_of, int_values, is_device, to_python, ArgMeta, Held};
use crate::detach::run_detached;
use crate::errors::validated;
use crate::scalars;
use crate::variants::{variant_arrays, HeldVariants, VariantArgs};
use pyo3::prelude::*;

/// attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
/// device, variants, num_splits, return_lse) -> (o, lse)
///
/// The private entry point behind `flashport.attention_with_kvcache`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, cache_seqlens, block_table, device, variants, num_splits, return_lse))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_kvcache<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    cache_seqlens: &Bound<'py, PyAny>,
    block_table: Option<&Bound<'py, PyAny>>,
    device: &Bound<'py, PyAny>,
    variants: VariantArgs<'py>,
    num_splits: &Bound<'py, PyAny>,
    return_lse: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    // Checked for the Python wrapper, which returns lse only when it is set.
    scalars::flag("return_lse", return_lse)?;
    let metas = [
        ArgMeta::read_main("q", q)?,
        ArgMeta::read_main("k_cache", k_cache)?,
        ArgMeta::read_main("v_cache", v_cache)?,
    ];
    // The integer arrays' values are read only where their shapes can be
    // right (one entry, or one table row, per sequence of q): validation
    // refuses any other shape before it looks at a value, and reading a
    // stride-0 view of 2^27 entries first took seconds and a GiB.
    let batch = (metas[0].shape.len() == 4).then(|| metas[0].shape[0]);
    let rows_per_sequence =
        |meta: &ArgMeta, ndim: usize| meta.shape.len() == ndim && Some(meta.shape[0]) == batch;
    let seqlens_meta = ArgMeta::read("cache_seqlens", cache_seqlens)?;
    let seqlens = if rows_per_sequence(&seqlens_meta, 1) {
        int_values("cache_seqlens", cache_seqlens, &seqlens_meta.dtype)?
    } else {
        Vec::new()
    };
    let table_meta = block_table
        .map(|t| ArgMeta::read("block_table", t))
        .transpose()?;
    let table = match (block_table, &table_meta) {
        (Some(t), Some(meta)) if rows_per_sequence(meta, 2) => {
            int_values("block_table", t, &meta.dtype)?
        }
        _ => Vec::new(),
    };
    let variant_metas = variants.metas()?;
    let num_splits = scalars::integer("num_splits", num_splits)?;
    let options = core::KvCacheOptions {
        variants: variants.options(&variant_metas)?,
        num_splits,
    };
    fn int_array<'a>(meta: &'a ArgMeta, values: &'a [i64]) -> core::IntArray<'a> {
        core::IntArray {
            shape: &meta.shape,
            dtype: &meta.dtype,
            values,
        }
    }
    let problem = validated(
        py,
        core::validate_kvcache(
            metas[0].info(),
            metas[1].info(),
            metas[2].info(),
            int_array(&seqlens_meta, &seqlens),
            table_meta.as_ref().map(|m| int_array(m, &table)),
            &options,
        ),
    )?;
    let main = [q, k_cache, v_cache];
    let on_gpu = main.into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let [q, k, v] = main.map(|a| Held::new(a, problem.dtype()));
    let (q, k, v) = (q?, k?, v?);
    let (qc, kc, vc) = (
        q.contiguous("q")?,
        k.contiguous("k_cache")?,
        v.contiguous("v_cache")?,
    );
    let inputs = [qc.input(), kc.input(), vc.input()];
    // The KV cache takes no mask (validation refused one).
    let held_variants = HeldVariants::new(&variants, None)?;
    let arrays = variant_arrays(&held_variants, &None, &None);
    let placement = Placement::of_inputs(&inputs);
    let result = run_detached(py, || {
        core::attention_with_kvcache_arrays(device, &problem, inputs, &arrays, placement)
    })?;
    Ok((
        to_python(py, result.out, &problem.out_shape())?,
        to_python(py, result.lse, &problem.lse_shape())?,
    ))
}
