//! `attention_varlen` and its backward: packed batches of sequences.

use flashport_core as core;
use flashport_core::{Options, Placement, SeqLens};

use crate::arrays::{
    as_dtype, backward_contiguous, device_of, dtype_name, hold_backward, is_device, to_python,
    ArgMeta, Contiguous, Held,
};
use crate::detach::run_detached;
use crate::errors::validated;
use crate::scalars;
use crate::variants::{variant_arrays, HeldVariants, VariantArgs};
use numpy::PyArray1;
use pyo3::prelude::*;

/// A `cu_seqlens_*` argument: its shape and dtype, and its entries when it
/// is a vector of integers (validation reads no more than that).
struct HeldSeqLens {
    pub(crate) meta: ArgMeta,
    pub(crate) values: Vec<i128>,
}

impl HeldSeqLens {
    pub(crate) fn read(name: &str, array: &Bound<'_, PyAny>) -> PyResult<HeldSeqLens> {
        let meta = ArgMeta::read(name, array)?;
        let values = if core::problem::is_integer_dtype(&meta.dtype) && meta.shape.len() == 1 {
            array.call_method0("tolist")?.extract::<Vec<i128>>()?
        } else {
            Vec::new()
        };
        Ok(HeldSeqLens { meta, values })
    }

    fn lens(&self) -> SeqLens<'_> {
        SeqLens {
            info: self.meta.info(),
            values: &self.values,
        }
    }
}

/// attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, device, variants,
/// return_lse) -> (o, lse)
///
/// The private entry point behind `flashport.attention_varlen`: packed
/// `(total, heads, dim)` arrays, `variants` as for `attention` (no mask and
/// no positions).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, device, variants, return_lse))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_varlen<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    cu_seqlens_k: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
    variants: VariantArgs<'py>,
    return_lse: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    // Checked for the Python wrapper, which returns lse only when it is set.
    scalars::flag("return_lse", return_lse)?;
    let metas = [
        ArgMeta::read_main("q", q)?,
        ArgMeta::read_main("k", k)?,
        ArgMeta::read_main("v", v)?,
    ];
    let cu_q = HeldSeqLens::read("cu_seqlens_q", cu_seqlens_q)?;
    let cu_k = HeldSeqLens::read("cu_seqlens_k", cu_seqlens_k)?;
    let variant_metas = variants.metas()?;
    let options = Options::from(variants.options(&variant_metas)?);
    let (problem, segments) = validated(
        py,
        core::validate_varlen_forward(
            metas[0].info(),
            metas[1].info(),
            metas[2].info(),
            cu_q.lens(),
            cu_k.lens(),
            &options,
        ),
    )?;
    let on_gpu = [q, k, v].into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let [q, k, v] = [q, k, v].map(|a| Held::new(a, problem.dtype));
    let (q, k, v) = (q?, k?, v?);
    let (qc, kc, vc) = (q.contiguous("q")?, k.contiguous("k")?, v.contiguous("v")?);
    let inputs = [qc.input(), kc.input(), vc.input()];
    let held_variants = HeldVariants::new(&variants, problem.mask)?;
    let arrays = variant_arrays(&held_variants, &None, &None);
    let placement = Placement::of_inputs(&inputs);
    let result = run_detached(py, || {
        core::attention_varlen_arrays(device, &problem, &segments, inputs, &arrays, placement)
    })?;
    let (tq, hq) = (problem.seq_q, problem.heads_q);
    Ok((
        to_python(py, result.out, &[tq, hq, problem.value_dim])?,
        to_python(py, result.lse, &[hq, tq])?,
    ))
}

type VarlenGradients<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
);

/// attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q,
/// cu_seqlens_k, device, variants) -> (dq, dk, dv, dsinks or None)
///
/// The private entry point behind `flashport.attention_varlen_backward`.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, device, variants))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_varlen_backward<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    cu_seqlens_k: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
    variants: VariantArgs<'py>,
) -> PyResult<VarlenGradients<'py>> {
    let names = ["do", "q", "k", "v", "o", "lse"];
    let arrays = [d_out, q, k, v, out, lse];
    let metas = names
        .iter()
        .zip(arrays)
        .map(|(name, a)| ArgMeta::read_main(name, a))
        .collect::<PyResult<Vec<_>>>()?;
    let cu_q = HeldSeqLens::read("cu_seqlens_q", cu_seqlens_q)?;
    let cu_k = HeldSeqLens::read("cu_seqlens_k", cu_seqlens_k)?;
    let variant_metas = variants.metas()?;
    let options = Options::from(variants.options(&variant_metas)?);
    let (problem, segments) = validated(
        py,
        core::validate_varlen_backward(
            metas[0].info(),
            metas[1].info(),
            metas[2].info(),
            metas[3].info(),
            metas[4].info(),
            metas[5].info(),
            cu_q.lens(),
            cu_k.lens(),
            &options,
        ),
    )?;
    let on_gpu = arrays.into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let held = hold_backward(&arrays, &metas[5], problem.dtype)?;
    let contiguous = backward_contiguous(&held, &names)?;
    let inputs = contiguous.each_ref().map(Contiguous::input);
    let held_variants = HeldVariants::new(&variants, problem.mask)?;
    let variant_data = variant_arrays(&held_variants, &None, &None);
    let placement = Placement::of_inputs(&inputs);
    let grads = run_detached(py, || {
        core::attention_varlen_backward_arrays(
            device,
            &problem,
            &segments,
            inputs,
            &variant_data,
            placement,
        )
    })?;
    let dsinks = grads
        .dsinks
        .map(|g| {
            let array = PyArray1::from_vec(py, g).into_any();
            as_dtype(array, dtype_name(&variant_metas.sinks))
        })
        .transpose()?;
    let (tq, tk) = (problem.seq_q, problem.seq_k);
    let (hq, hk) = (problem.heads_q, problem.heads_kv);
    let (d, dv) = (problem.head_dim, problem.value_dim);
    Ok((
        to_python(py, grads.dq, &[tq, hq, d])?,
        to_python(py, grads.dk, &[tk, hk, d])?,
        to_python(py, grads.dv, &[tk, hk, dv])?,
        dsinks,
    ))
}
