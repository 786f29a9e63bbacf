//! The variant keywords (causal, scale, window, mask, ALiBi slopes,
//! softcap, sinks, dropout, positions) as the Python layer hands them
//! over, one argument type for every entry point, and their arrays held
//! for the call.

use std::borrow::Cow;

use flashport_core as core;
use flashport_core::problem::{MaskDType, MaskSpec};
use flashport_core::{MaskData, VariantArrays, VariantOptions};

use crate::arrays::{contiguous, ArgMeta, Contiguous, Held};
use crate::scalars;
use numpy::PyReadonlyArrayDyn;
use pyo3::prelude::*;

/// The variant keywords of every entry point (attention and its backward,
/// varlen, attention_with_kvcache, KVCache.attention): the dict that
/// `flashport._attention._variants` builds, keyed by the keyword names,
/// each value as the caller gave it (`scalars` has the core check it). A
/// keyword an operation does not take arrives at its off value, and the
/// core refuses it otherwise.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub(crate) struct VariantArgs<'py> {
    causal: Bound<'py, PyAny>,
    scale: Bound<'py, PyAny>,
    window: Bound<'py, PyAny>,
    mask: Option<Bound<'py, PyAny>>,
    alibi_slopes: Option<Bound<'py, PyAny>>,
    softcap: Bound<'py, PyAny>,
    sinks: Option<Bound<'py, PyAny>>,
    dropout_p: Bound<'py, PyAny>,
    seed: Bound<'py, PyAny>,
    q_offset: Bound<'py, PyAny>,
    k_offset: Bound<'py, PyAny>,
}

/// Shapes and dtypes of the variant arrays, read before validation.
pub(crate) struct VariantMetas {
    pub(crate) mask: Option<ArgMeta>,
    pub(crate) alibi_slopes: Option<ArgMeta>,
    pub(crate) sinks: Option<ArgMeta>,
}

impl VariantArgs<'_> {
    pub(crate) fn metas(&self) -> PyResult<VariantMetas> {
        let read = |name: &str, a: &Option<Bound<'_, PyAny>>| {
            a.as_ref().map(|a| ArgMeta::read(name, a)).transpose()
        };
        Ok(VariantMetas {
            mask: read("mask", &self.mask)?,
            alibi_slopes: read("alibi_slopes", &self.alibi_slopes)?,
            sinks: read("sinks", &self.sinks)?,
        })
    }

    /// The keywords as the core takes them, each checked in this order
    /// (the first wrong one is named).
    pub(crate) fn options<'m>(&self, metas: &'m VariantMetas) -> PyResult<VariantOptions<'m>> {
        Ok(VariantOptions {
            causal: scalars::flag("causal", &self.causal)?,
            scale: scalars::optional_real("scale", &self.scale)?,
            window: scalars::window(&self.window)?,
            q_offset: scalars::integer("q_offset", &self.q_offset)?,
            k_offset: scalars::integer("k_offset", &self.k_offset)?,
            softcap: scalars::optional_real("softcap", &self.softcap)?,
            dropout_p: scalars::real("dropout_p", &self.dropout_p)?,
            seed: scalars::integer("seed", &self.seed)?,
            mask: metas.mask.as_ref().map(ArgMeta::info),
            alibi_slopes: metas.alibi_slopes.as_ref().map(ArgMeta::info),
            sinks: metas.sinks.as_ref().map(ArgMeta::info),
        })
    }
}

/// The variant arrays held for a call, after validation.
pub(crate) struct HeldVariants<'py> {
    pub(crate) mask_bool: Option<PyReadonlyArrayDyn<'py, bool>>,
    pub(crate) mask_float: Option<Held<'py>>,
    pub(crate) alibi_slopes: Option<Vec<f64>>,
    pub(crate) sinks: Option<Vec<f64>>,
}

fn as_f64_vec(array: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
    let converted = array.call_method1("astype", ("float64",))?;
    let held: PyReadonlyArrayDyn<'_, f64> = converted.extract()?;
    Ok(held.as_array().iter().copied().collect())
}

impl<'py> HeldVariants<'py> {
    /// The arrays of `args`, the mask as validation found it (`mask`:
    /// the problem's; `None` where the operation takes no mask, which
    /// validation refuses).
    pub(crate) fn new(args: &VariantArgs<'py>, mask: Option<MaskSpec>) -> PyResult<Self> {
        let (mut mask_bool, mut mask_float) = (None, None);
        if let (Some(mask), Some(spec)) = (&args.mask, mask) {
            match spec.dtype {
                MaskDType::Bool => mask_bool = Some(mask.extract()?),
                MaskDType::Float(dtype) => mask_float = Some(Held::host(mask, dtype)?),
            }
        }
        Ok(HeldVariants {
            mask_bool,
            mask_float,
            alibi_slopes: args.alibi_slopes.as_ref().map(as_f64_vec).transpose()?,
            sinks: args.sinks.as_ref().map(as_f64_vec).transpose()?,
        })
    }
}

/// A mask's data as the core takes it: as bools, or floats.
type MaskContiguous<'a> = (Option<Cow<'a, [bool]>>, Option<Contiguous<'a>>);

impl HeldVariants<'_> {
    /// The mask's repeated axes (stride 0), if there is a mask.
    pub(crate) fn mask_repeated_axes(&self) -> Option<Vec<bool>> {
        match (&self.mask_bool, &self.mask_float) {
            (Some(m), _) => {
                let view = m.as_array();
                Some(core::broadcast::repeated_axes(view.shape(), view.strides()))
            }
            (_, Some(m)) => Some(m.repeated_axes()),
            _ => None,
        }
    }
    /// The mask's data, its axes flagged in `once.mask` read once.
    pub(crate) fn masks(&self, once: &core::broadcast::ReadOnce) -> PyResult<MaskContiguous<'_>> {
        let mask_bool = self
            .mask_bool
            .as_ref()
            .map(|m| contiguous("mask", m, &once.mask))
            .transpose()?;
        let mask_float = self
            .mask_float
            .as_ref()
            .map(|m| m.contiguous_once("mask", &once.mask))
            .transpose()?;
        Ok((mask_bool, mask_float))
    }
}

pub(crate) fn variant_arrays<'a>(
    held: &'a HeldVariants<'_>,
    mask_bool: &'a Option<Cow<'a, [bool]>>,
    mask_float: &'a Option<Contiguous<'a>>,
) -> VariantArrays<'a> {
    let mask = match (mask_bool, mask_float) {
        (Some(b), _) => Some(MaskData::Bool(b)),
        (_, Some(f)) => f.slice().map(MaskData::Float),
        _ => None,
    };
    VariantArrays {
        mask,
        alibi_slopes: held.alibi_slopes.as_deref(),
        sinks: held.sinks.as_deref(),
        segments: None,
    }
}
