//! `attention_with_kvcache`: decoding over a contiguous or paged cache.

use flashport_core as core;
use flashport_core::{Placement, VariantArrays};

use crate::arrays::{device_of, int_values, is_device, to_python, ArgMeta, Held};
use crate::detach::run_detached;
use crate::errors::validated;
use crate::scalars;
use crate::variants::{as_f64_vec, KvCacheVariantArgs};
use pyo3::prelude::*;

/// attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
/// causal, scale, device, variants, num_splits) -> (o, lse)
///
/// The private entry point behind `flashport.attention_with_kvcache`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, device, variants, num_splits, return_lse))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_with_kvcache<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    cache_seqlens: &Bound<'py, PyAny>,
    block_table: Option<&Bound<'py, PyAny>>,
    causal: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
    variants: KvCacheVariantArgs<'py>,
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
    let read = |name: &str, a: &Option<Bound<'_, PyAny>>| {
        a.as_ref().map(|a| ArgMeta::read(name, a)).transpose()
    };
    let slopes_meta = read("alibi_slopes", &variants.alibi_slopes)?;
    let sinks_meta = read("sinks", &variants.sinks)?;
    let num_splits = scalars::integer("num_splits", num_splits)?;
    let options = core::KvCacheOptions {
        variants: core::VariantOptions {
            causal: scalars::flag("causal", causal)?,
            scale: scalars::optional_real("scale", scale)?,
            window: scalars::window(&variants.window)?,
            softcap: scalars::optional_real("softcap", &variants.softcap)?,
            alibi_slopes: slopes_meta.as_ref().map(ArgMeta::info),
            sinks: sinks_meta.as_ref().map(ArgMeta::info),
            ..core::VariantOptions::default()
        },
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
    let alibi_slopes = variants.alibi_slopes.as_ref().map(as_f64_vec).transpose()?;
    let sinks = variants.sinks.as_ref().map(as_f64_vec).transpose()?;
    let arrays = VariantArrays {
        mask: None,
        alibi_slopes: alibi_slopes.as_deref(),
        sinks: sinks.as_deref(),
        segments: None,
    };
    let placement = Placement::of_inputs(&inputs);
    let result = run_detached(py, || {
        core::attention_with_kvcache_arrays(device, &problem, inputs, &arrays, placement)
    })?;
    Ok((
        to_python(py, result.out, &problem.out_shape())?,
        to_python(py, result.lse, &problem.lse_shape())?,
    ))
}
