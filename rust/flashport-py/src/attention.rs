//! `attention` and `attention_backward`.

use flashport_core as core;
use flashport_core::{Options, Placement, Problem};

use crate::arrays::{
    as_dtype, backward_contiguous, device_of, dtype_name, hold_backward, is_device, to_python,
    ArgMeta, Contiguous, Held,
};
use crate::detach::run_detached;
use crate::errors::validated;
use crate::numpy_out::to_numpy;
use crate::scalars;
use crate::variants::{variant_arrays, HeldVariants, VariantArgs};
use numpy::PyArray1;
use pyo3::prelude::*;

/// attention(q, k, v, device, variants, return_lse) -> (o, lse)
///
/// The private entry point behind `flashport.attention`; see its docstring
/// for the contract. `variants` holds the variant keywords by name.
#[pyfunction]
#[pyo3(signature = (q, k, v, device, variants, return_lse))]
pub(crate) fn attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
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
    let variant_metas = variants.metas()?;
    let options = Options::from(variants.options(&variant_metas)?);
    let problem = validated(
        py,
        core::validate_forward(metas[0].info(), metas[1].info(), metas[2].info(), &options),
    )?;
    let on_gpu = [q, k, v].into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let held = [q, k, v].map(|a| Held::new(a, problem.dtype));
    let [q, k, v] = held;
    let (q, k, v) = (q?, k?, v?);
    let held_variants = HeldVariants::new(&variants, problem.mask)?;
    let (problem, once) = core::broadcast::read_once(
        &problem,
        held_variants.mask_repeated_axes().as_deref(),
        &k.repeated_axes(),
        &v.repeated_axes(),
        false,
    );
    let qc = q.contiguous("q")?;
    let (kc, vc) = (
        k.contiguous_once("k", &once.kv)?,
        v.contiguous_once("v", &once.kv)?,
    );
    let inputs = [qc.input(), kc.input(), vc.input()];
    let (mask_bool, mask_float) = held_variants.masks(&once)?;
    let arrays = variant_arrays(&held_variants, &mask_bool, &mask_float);
    let placement = Placement::of_inputs(&inputs);
    let result = run_detached(py, || {
        core::attention_arrays(device, &problem, inputs, &arrays, placement)
    })?;
    Ok((
        to_python(py, result.out, &problem.out_shape())?,
        to_python(py, result.lse, &problem.lse_shape())?,
    ))
}

type BackwardOutputs<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
);

/// attention_backward(do, q, k, v, o, lse, device, variants, return_dmask)
/// -> (dq, dk, dv, dsinks or None, dmask or None)
///
/// The private entry point behind `flashport.attention_backward`.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, out, lse, device, variants, return_dmask))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
    variants: VariantArgs<'py>,
    return_dmask: &Bound<'py, PyAny>,
) -> PyResult<BackwardOutputs<'py>> {
    let names = ["do", "q", "k", "v", "o", "lse"];
    let arrays = [d_out, q, k, v, out, lse];
    let metas = names
        .iter()
        .zip(arrays)
        .map(|(name, a)| ArgMeta::read_main(name, a))
        .collect::<PyResult<Vec<_>>>()?;
    let variant_metas = variants.metas()?;
    let options = Options {
        return_dmask: scalars::flag("return_dmask", return_dmask)?,
        variants: variants.options(&variant_metas)?,
    };
    let problem: Problem = validated(
        py,
        core::validate_backward(
            metas[0].info(),
            metas[1].info(),
            metas[2].info(),
            metas[3].info(),
            metas[4].info(),
            metas[5].info(),
            &options,
        ),
    )?;
    let on_gpu = arrays.into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let held = hold_backward(&arrays, &metas[5], problem.dtype)?;
    let contiguous = backward_contiguous(&held, &names)?;
    let inputs = contiguous.each_ref().map(Contiguous::input);
    let held_variants = HeldVariants::new(&variants, problem.mask)?;
    let (problem, once) = core::broadcast::read_once(
        &problem,
        held_variants.mask_repeated_axes().as_deref(),
        &[],
        &[],
        true,
    );
    let (mask_bool, mask_float) = held_variants.masks(&once)?;
    let variant_data = variant_arrays(&held_variants, &mask_bool, &mask_float);
    let placement = Placement::of_inputs(&inputs);
    let grads = run_detached(py, || {
        core::attention_backward_arrays(device, &problem, inputs, &variant_data, placement)
    })?;
    let dsinks = grads
        .dsinks
        .map(|g| {
            let array = PyArray1::from_vec(py, g).into_any();
            as_dtype(array, dtype_name(&variant_metas.sinks))
        })
        .transpose()?;
    let dmask = match (grads.dmask, problem.mask) {
        (Some(buffer), Some(spec)) => Some(as_dtype(
            to_numpy(py, buffer, &spec.shape())?,
            dtype_name(&variant_metas.mask),
        )?),
        _ => None,
    };
    Ok((
        to_python(py, grads.dq, &problem.q_shape())?,
        to_python(py, grads.dk, &problem.k_shape())?,
        to_python(py, grads.dv, &problem.v_shape())?,
        dsinks,
        dmask,
    ))
}
