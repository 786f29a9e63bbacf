//! `merge_states`: attention states of key parts merged by their
//! log-sum-exps.

use flashport_core as core;
use flashport_core::{ArrayInfo, Input, Parts, Placement};

use crate::arrays::{device_of, is_device, to_python, ArgMeta, Contiguous, Held};
use crate::detach::run_detached;
use crate::errors::validated;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// One argument of merge_states: a list of parts, or one array holding
/// them all.
fn parts_of<'py>(x: &Bound<'py, PyAny>) -> (bool, Vec<Bound<'py, PyAny>>) {
    match x.cast::<PyList>() {
        Ok(list) => (false, list.iter().collect()),
        Err(_) => (true, vec![x.clone()]),
    }
}

/// merge_states(outs, lses, device) -> (out, lse)
///
/// The private entry point behind `flashport.merge_states`: `outs` and
/// `lses` are each a list of parts or one array with a leading parts axis.
#[pyfunction]
#[pyo3(signature = (outs, lses, device))]
pub(crate) fn merge_states<'py>(
    py: Python<'py>,
    outs: &Bound<'py, PyAny>,
    lses: &Bound<'py, PyAny>,
    device: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let (outs_stacked, outs) = parts_of(outs);
    let (lses_stacked, lses) = parts_of(lses);
    let metas = |argument: &str, stacked: bool, arrays: &[Bound<'py, PyAny>]| {
        arrays
            .iter()
            .enumerate()
            .map(|(i, a)| match stacked {
                true => ArgMeta::read_main(argument, a),
                false => ArgMeta::read_main(&format!("{argument}[{i}]"), a),
            })
            .collect::<PyResult<Vec<_>>>()
    };
    let (out_metas, lse_metas) = (
        metas("outs", outs_stacked, &outs)?,
        metas("lses", lses_stacked, &lses)?,
    );
    let out_infos: Vec<ArrayInfo<'_>> = out_metas.iter().map(ArgMeta::info).collect();
    let lse_infos: Vec<ArrayInfo<'_>> = lse_metas.iter().map(ArgMeta::info).collect();
    fn parts<'a>(stacked: bool, infos: &'a [ArrayInfo<'a>]) -> Parts<'a> {
        match (stacked, infos) {
            (true, [info]) => Parts::Stacked(*info),
            (_, infos) => Parts::Each(infos),
        }
    }
    let problem = validated(
        py,
        core::validate_merge(
            parts(outs_stacked, &out_infos[..]),
            parts(lses_stacked, &lse_infos[..]),
        ),
    )?;
    let on_gpu = outs.iter().chain(&lses).any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let held_outs = outs
        .iter()
        .map(|a| Held::new(a, problem.dtype))
        .collect::<PyResult<Vec<_>>>()?;
    let held_lses = lses
        .iter()
        .map(|a| Held::new(a, problem.dtype.lse_dtype()))
        .collect::<PyResult<Vec<_>>>()?;
    let out_data: Vec<Contiguous<'_>> = held_outs
        .iter()
        .map(|h| h.contiguous("outs"))
        .collect::<PyResult<_>>()?;
    let lse_data: Vec<Contiguous<'_>> = held_lses
        .iter()
        .map(|h| h.contiguous("lses"))
        .collect::<PyResult<_>>()?;
    let out_inputs: Vec<Input<'_>> = out_data.iter().map(Contiguous::input).collect();
    let lse_inputs: Vec<Input<'_>> = lse_data.iter().map(Contiguous::input).collect();
    let placement = Placement::of_inputs(&[out_inputs.as_slice(), &lse_inputs].concat());
    let merged = run_detached(py, || {
        core::merge_states_arrays(device, &problem, &out_inputs, &lse_inputs, placement)
    })?;
    Ok((
        to_python(py, merged.out, &problem.out_shape)?,
        to_python(py, merged.lse, &problem.lse_shape())?,
    ))
}
