//! Thin Python bindings of flashport-core: NumPy arrays in and out, the GIL
//! released while the core computes, core errors mapped to flashport's
//! Python exceptions. No attention logic lives here.

mod kvcache;

use std::borrow::Cow;
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;

use flashport_core as core;
use flashport_core::problem::MaskDType;
use flashport_core::{
    bf16, f16, Array, ArrayInfo, Buffer, DType, Device, Input, MaskData, Options, Parts, Placement,
    Problem, SeqLens, Slice, VariantArrays,
};
mod scalars;

use numpy::ndarray::{Axis, Slice as AxisRange};
use numpy::{
    Element, PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyKeyboardInterrupt, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

/// Raises the flashport exception class (defined in `flashport._errors`)
/// that corresponds to a core error.
pub(crate) fn to_py_err(py: Python<'_>, err: core::Error) -> PyErr {
    let class = match &err {
        core::Error::Shape(_) => "ShapeError",
        core::Error::DType { .. } => "DTypeError",
        core::Error::Value { .. } => "InvalidArgumentError",
        core::Error::BackendUnavailable(_) => "BackendUnavailableError",
        core::Error::TooLarge(_) => "ProblemTooLargeError",
        core::Error::CacheFull(_) => "CacheFullError",
        core::Error::UnknownSequence { .. } => "UnknownSequenceError",
        core::Error::Gpu(_) => "GpuError",
        // Only when the call's check did not keep what Python raised.
        core::Error::Interrupted => return PyKeyboardInterrupt::new_err(err.to_string()),
    };
    raise(py, class, err.to_string())
}

fn raise(py: Python<'_>, class: &str, message: String) -> PyErr {
    let class = py
        .import("flashport._errors")
        .and_then(|module| module.getattr(class));
    match class {
        Ok(class) => match class.call1((message,)) {
            Ok(instance) => PyErr::from_value(instance),
            Err(e) => e,
        },
        Err(e) => e,
    }
}

/// Runs the core outside the GIL, interruptible (`signals`). A panic (a
/// bug) becomes `flashport.InternalError` instead of crossing into Python.
fn run_detached<R: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> core::Result<R> + Send,
) -> PyResult<R> {
    let (result, raised) = py.detach(|| {
        let signals = Rc::new(Signals::default());
        let check = signals.clone();
        let result = core::interrupt::with_check(
            move || check.interrupted(),
            || catch_unwind(AssertUnwindSafe(f)),
        );
        (result, signals.raised.take())
    });
    // What a signal handler raised (KeyboardInterrupt for Ctrl-C) is the
    // call's outcome: the handler has run, and would be lost otherwise.
    if let Some(err) = raised {
        return Err(err);
    }
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(to_py_err(py, err)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(raise(
                py,
                "InternalError",
                format!("flashport hit an internal error (please report it): {what}"),
            ))
        }
    }
}

/// The core's interrupt check for a call made from Python: runs Python's
/// signal handlers, which only the main thread runs, and keeps what one
/// raised. The core asks only after a call's first 50 ms (and then every
/// 50 ms), so a short call never takes the GIL back for it.
#[derive(Default)]
struct Signals {
    /// Whether this call runs on Python's main thread (asked once).
    main_thread: Cell<Option<bool>>,
    raised: Cell<Option<PyErr>>,
}

impl Signals {
    fn interrupted(&self) -> bool {
        if self.main_thread.get() == Some(false) {
            return false;
        }
        Python::attach(|py| {
            if self.main_thread.get().is_none() {
                // On another thread a check would only wait for the GIL.
                let main = is_main_thread(py).unwrap_or(true);
                self.main_thread.set(Some(main));
                if !main {
                    return false;
                }
            }
            match py.check_signals() {
                Ok(()) => false,
                Err(err) => {
                    self.raised.set(Some(err));
                    true
                }
            }
        })
    }
}

fn is_main_thread(py: Python<'_>) -> PyResult<bool> {
    let threading = py.import("threading")?;
    let main = threading.call_method0("main_thread")?;
    Ok(main.is(&threading.call_method0("current_thread")?))
}

/// Shape and dtype name of an argument, for validation.
struct ArgMeta {
    shape: Vec<usize>,
    dtype: String,
}

impl ArgMeta {
    /// A NumPy array's, or a device tensor's: validation treats both alike.
    fn read_main(name: &str, array: &Bound<'_, PyAny>) -> PyResult<ArgMeta> {
        match array.cast::<DeviceArray>() {
            Ok(t) => {
                let t = &t.get().inner;
                Ok(ArgMeta {
                    shape: t.shape().to_vec(),
                    dtype: t.dtype().numpy_name().to_string(),
                })
            }
            Err(_) => ArgMeta::read(name, array),
        }
    }

    fn read(name: &str, array: &Bound<'_, PyAny>) -> PyResult<ArgMeta> {
        let untyped = array.cast::<PyUntypedArray>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{name} must be a numpy.ndarray, got {}",
                array
                    .get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |n| n.to_string())
            ))
        })?;
        let dtype = untyped.dtype().getattr("name")?.extract::<String>()?;
        Ok(ArgMeta {
            shape: untyped.shape().to_vec(),
            dtype,
        })
    }
    fn info(&self) -> ArrayInfo<'_> {
        ArrayInfo::new(&self.shape, &self.dtype)
    }
}

/// An input array held for the duration of a call: the NumPy borrow, or
/// the device array.
enum Held<'py> {
    F16(PyReadonlyArrayDyn<'py, f16>),
    /// Through `ml_dtypes`' NumPy dtype: only an array of that dtype gets
    /// here, so the dtype is registered.
    BF16(PyReadonlyArrayDyn<'py, bf16>),
    F32(PyReadonlyArrayDyn<'py, f32>),
    F64(PyReadonlyArrayDyn<'py, f64>),
    Device(Bound<'py, DeviceArray>),
}

/// A held array's data as the core takes it: one contiguous row-major
/// slice (copied only when the NumPy array is not C-contiguous), or the
/// device array.
enum Contiguous<'a> {
    F16(Cow<'a, [f16]>),
    BF16(Cow<'a, [bf16]>),
    F32(Cow<'a, [f32]>),
    F64(Cow<'a, [f64]>),
    Device(&'a core::DeviceArray),
}

/// The array's elements in one row-major slice: the array's own memory
/// when it is C-contiguous, else a copy. The copy's memory is reserved
/// fallibly, so that a view larger than memory (a broadcast stride-0
/// array, say) is a ProblemTooLargeError naming it instead of an abort.
///
/// The axes flagged in `once` (see `core::broadcast`: repeated, stride 0)
/// are read at their first index only.
fn contiguous<'a, T: Element + Clone>(
    name: &str,
    array: &'a PyReadonlyArrayDyn<'_, T>,
    once: &[bool],
) -> PyResult<Cow<'a, [T]>> {
    let mut view = array.as_array();
    for (axis, _) in once.iter().enumerate().filter(|(_, &o)| o) {
        view.slice_axis_inplace(Axis(axis), AxisRange::from(0..1));
    }
    if let Some(slice) = view.to_slice() {
        return Ok(Cow::Borrowed(slice));
    }
    let mut copy = Vec::new();
    let bytes = view.len() as u128 * std::mem::size_of::<T>() as u128;
    if !core::host_memory::admits(bytes) || copy.try_reserve_exact(view.len()).is_err() {
        return Err(to_py_err(
            array.py(),
            core::Error::TooLarge(format!(
                "{name} is not contiguous, and a contiguous copy of it ({bytes} bytes) \
                 could not be allocated{}; pass a smaller array, or for a broadcast one \
                 the array it broadcasts",
                core::host_memory::why()
            )),
        ));
    }
    // Row by row where the last axis is contiguous (a transposed or sliced
    // array, as PyTorch and transformers hand over): a memcpy per row
    // instead of an index computation per element, 5-10x faster.
    match view.ndim() {
        0 => copy.extend(view.iter().cloned()),
        n if view.strides()[n - 1] == 1 => {
            for row in view.rows() {
                match row.as_slice() {
                    Some(row) => copy.extend_from_slice(row),
                    None => copy.extend(row.iter().cloned()),
                }
            }
        }
        _ => copy.extend(view.iter().cloned()),
    }
    Ok(Cow::Owned(copy))
}

impl<'py> Held<'py> {
    /// A device array as it is; a NumPy array as `dtype` (validation has
    /// checked that it has that dtype).
    fn new(array: &Bound<'py, PyAny>, dtype: DType) -> PyResult<Held<'py>> {
        match array.cast::<DeviceArray>() {
            Ok(t) => Ok(Held::Device(t.clone())),
            Err(_) => Held::host(array, dtype),
        }
    }
    /// A NumPy array as `dtype` (variant arrays, `to_device`'s argument).
    fn host(array: &Bound<'py, PyAny>, dtype: DType) -> PyResult<Held<'py>> {
        Ok(match dtype {
            DType::F16 => Held::F16(array.extract()?),
            DType::BF16 => Held::BF16(array.extract()?),
            DType::F32 => Held::F32(array.extract()?),
            DType::F64 => Held::F64(array.extract()?),
        })
    }
    /// The data as the core takes it; `name` is the argument's, for the
    /// error when a copy cannot be made.
    fn contiguous(&self, name: &str) -> PyResult<Contiguous<'_>> {
        self.contiguous_once(name, &[])
    }
    /// As `contiguous`, reading the axes flagged in `once` at their first
    /// index only (a NumPy array's repeated axes; a device array has none).
    fn contiguous_once(&self, name: &str, once: &[bool]) -> PyResult<Contiguous<'_>> {
        Ok(match self {
            Held::F16(a) => Contiguous::F16(contiguous(name, a, once)?),
            Held::BF16(a) => Contiguous::BF16(contiguous(name, a, once)?),
            Held::F32(a) => Contiguous::F32(contiguous(name, a, once)?),
            Held::F64(a) => Contiguous::F64(contiguous(name, a, once)?),
            Held::Device(t) => Contiguous::Device(&t.get().inner),
        })
    }
    /// The axes along which a NumPy array repeats one slice (stride 0).
    fn repeated_axes(&self) -> Vec<bool> {
        fn of<T: Element>(a: &PyReadonlyArrayDyn<'_, T>) -> Vec<bool> {
            let view = a.as_array();
            core::broadcast::repeated_axes(view.shape(), view.strides())
        }
        match self {
            Held::F16(a) => of(a),
            Held::BF16(a) => of(a),
            Held::F32(a) => of(a),
            Held::F64(a) => of(a),
            Held::Device(_) => Vec::new(),
        }
    }
}

impl Contiguous<'_> {
    fn input(&self) -> Input<'_> {
        match self {
            Contiguous::F16(c) => Input::Host(Slice::F16(c)),
            Contiguous::BF16(c) => Input::Host(Slice::BF16(c)),
            Contiguous::F32(c) => Input::Host(Slice::F32(c)),
            Contiguous::F64(c) => Input::Host(Slice::F64(c)),
            Contiguous::Device(t) => Input::Device(t),
        }
    }
    /// The host slice of a host array (variant arrays and `to_device`'s
    /// argument are never device arrays).
    fn slice(&self) -> Option<Slice<'_>> {
        match self.input() {
            Input::Host(s) => Some(s),
            Input::Device(_) => None,
        }
    }
}

fn is_device(array: &Bound<'_, PyAny>) -> bool {
    array.is_instance_of::<DeviceArray>()
}

/// An output: a NumPy array of `shape`, or a device tensor (which has its
/// shape).
fn to_python<'py>(py: Python<'py>, array: Array, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    match array {
        Array::Host(buffer) => to_numpy(py, buffer, shape),
        Array::Device(inner) => Ok(Bound::new(py, DeviceArray { inner })?.into_any()),
    }
}

fn lse_dtype(meta: &ArgMeta) -> DType {
    // validate_backward has accepted only float32 and float64 here.
    DType::from_numpy_name(&meta.dtype).unwrap_or(DType::F32)
}

fn to_numpy<'py>(py: Python<'py>, buffer: Buffer, shape: &[usize]) -> PyResult<Bound<'py, PyAny>> {
    let array = match buffer {
        Buffer::F16(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        // Only a bfloat16 call returns bfloat16, so ml_dtypes is loaded.
        Buffer::BF16(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        Buffer::F32(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
        Buffer::F64(v) => PyArray1::from_vec(py, v).reshape(shape)?.into_any(),
    };
    Ok(array)
}

/// The device a call runs on, from `device=` as the caller gave it.
fn device_of(py: Python<'_>, device: &Bound<'_, PyAny>, on_gpu: bool) -> PyResult<Device> {
    let device = scalars::device_name(device)?;
    validated(py, Device::parse_for(device.as_deref(), on_gpu))
}

/// The six arrays of a backward (do, q, k, v, o, lse) held in the
/// problem's dtype, lse in its own (`lse_meta`).
fn hold_backward<'py>(
    arrays: &[&Bound<'py, PyAny>; 6],
    lse_meta: &ArgMeta,
    dtype: DType,
) -> PyResult<[Held<'py>; 6]> {
    let [d_out, q, k, v, out, lse] = *arrays;
    Ok([
        Held::new(d_out, dtype)?,
        Held::new(q, dtype)?,
        Held::new(k, dtype)?,
        Held::new(v, dtype)?,
        Held::new(out, dtype)?,
        Held::new(lse, lse_dtype(lse_meta))?,
    ])
}

/// The data of a backward's held arrays, named for errors.
fn backward_contiguous<'a>(
    held: &'a [Held<'_>; 6],
    names: &[&str; 6],
) -> PyResult<[Contiguous<'a>; 6]> {
    let [a, b, c, d, e, f] = held;
    Ok([
        a.contiguous(names[0])?,
        b.contiguous(names[1])?,
        c.contiguous(names[2])?,
        d.contiguous(names[3])?,
        e.contiguous(names[4])?,
        f.contiguous(names[5])?,
    ])
}

fn validated<T>(py: Python<'_>, result: core::Result<T>) -> PyResult<T> {
    result.map_err(|e| to_py_err(py, e))
}

/// The variant and position keywords of both entry points: a dict that
/// `flashport._attention` builds, keyed by the keyword names, each value
/// as the caller gave it (`scalars` has the core check it).
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct VariantArgs<'py> {
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
struct VariantMetas {
    mask: Option<ArgMeta>,
    alibi_slopes: Option<ArgMeta>,
    sinks: Option<ArgMeta>,
}

impl VariantArgs<'_> {
    fn metas(&self) -> PyResult<VariantMetas> {
        let read = |name: &str, a: &Option<Bound<'_, PyAny>>| {
            a.as_ref().map(|a| ArgMeta::read(name, a)).transpose()
        };
        Ok(VariantMetas {
            mask: read("mask", &self.mask)?,
            alibi_slopes: read("alibi_slopes", &self.alibi_slopes)?,
            sinks: read("sinks", &self.sinks)?,
        })
    }

    fn options<'m>(
        &self,
        metas: &'m VariantMetas,
        causal: &Bound<'_, PyAny>,
        scale: &Bound<'_, PyAny>,
    ) -> PyResult<Options<'m>> {
        Ok(Options {
            causal: scalars::flag("causal", causal)?,
            scale: scalars::optional_real("scale", scale)?,
            window: scalars::window(&self.window)?,
            q_offset: scalars::integer("q_offset", &self.q_offset)?,
            k_offset: scalars::integer("k_offset", &self.k_offset)?,
            softcap: scalars::optional_real("softcap", &self.softcap)?,
            dropout_p: scalars::real("dropout_p", &self.dropout_p)?,
            seed: scalars::integer("seed", &self.seed)?,
            mask: metas.mask.as_ref().map(ArgMeta::info),
            alibi_slopes: metas.alibi_slopes.as_ref().map(ArgMeta::info),
            sinks: metas.sinks.as_ref().map(ArgMeta::info),
            return_dmask: false,
        })
    }
}

/// The variant arrays held for a call, after validation.
struct HeldVariants<'py> {
    mask_bool: Option<PyReadonlyArrayDyn<'py, bool>>,
    mask_float: Option<Held<'py>>,
    alibi_slopes: Option<Vec<f64>>,
    sinks: Option<Vec<f64>>,
}

fn as_f64_vec(array: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
    let converted = array.call_method1("astype", ("float64",))?;
    let held: PyReadonlyArrayDyn<'_, f64> = converted.extract()?;
    Ok(held.as_array().iter().copied().collect())
}

impl<'py> HeldVariants<'py> {
    fn new(args: &VariantArgs<'py>, problem: &Problem) -> PyResult<Self> {
        let (mut mask_bool, mut mask_float) = (None, None);
        if let (Some(mask), Some(spec)) = (&args.mask, problem.mask) {
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
    fn mask_repeated_axes(&self) -> Option<Vec<bool>> {
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
    fn masks(&self, once: &core::broadcast::ReadOnce) -> PyResult<MaskContiguous<'_>> {
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

/// Original dtype name of an optional argument, to return its gradient in.
fn dtype_name(meta: &Option<ArgMeta>) -> Option<String> {
    meta.as_ref().map(|m| m.dtype.clone())
}

fn as_dtype<'py>(array: Bound<'py, PyAny>, dtype: Option<String>) -> PyResult<Bound<'py, PyAny>> {
    match dtype {
        Some(dtype) => array.call_method1("astype", (dtype,)),
        None => Ok(array),
    }
}

/// attention(q, k, v, causal, scale, device, variants) -> (o, lse)
///
/// The private entry point behind `flashport.attention`; see its docstring
/// for the contract. `variants` holds the variant keywords by name.
#[pyfunction]
#[pyo3(signature = (q, k, v, causal, scale, device, variants, return_lse))]
#[allow(clippy::too_many_arguments)]
fn attention<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
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
    let options = variants.options(&variant_metas, causal, scale)?;
    let problem = validated(
        py,
        core::validate_forward(metas[0].info(), metas[1].info(), metas[2].info(), &options),
    )?;
    let on_gpu = [q, k, v].into_iter().any(is_device);
    let device = device_of(py, device, on_gpu)?;
    let held = [q, k, v].map(|a| Held::new(a, problem.dtype));
    let [q, k, v] = held;
    let (q, k, v) = (q?, k?, v?);
    let held_variants = HeldVariants::new(&variants, &problem)?;
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

fn variant_arrays<'a>(
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

type BackwardOutputs<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<Bound<'py, PyAny>>,
    Option<Bound<'py, PyAny>>,
);

/// attention_backward(do, q, k, v, o, lse, causal, scale, device, variants,
/// return_dmask) -> (dq, dk, dv, dsinks or None, dmask or None)
///
/// The private entry point behind `flashport.attention_backward`.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, out, lse, causal, scale, device, variants, return_dmask))]
#[allow(clippy::too_many_arguments)]
fn attention_backward<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
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
        ..variants.options(&variant_metas, causal, scale)?
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
    let held_variants = HeldVariants::new(&variants, &problem)?;
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

/// A `cu_seqlens_*` argument: its shape and dtype, and its entries when it
/// is a vector of integers (validation reads no more than that).
struct HeldSeqLens {
    meta: ArgMeta,
    values: Vec<i128>,
}

impl HeldSeqLens {
    fn read(name: &str, array: &Bound<'_, PyAny>) -> PyResult<HeldSeqLens> {
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

/// attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
/// device, variants) -> (o, lse)
///
/// The private entry point behind `flashport.attention_varlen`: packed
/// `(total, heads, dim)` arrays, `variants` as for `attention` (no mask and
/// no positions).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, device, variants, return_lse))]
#[allow(clippy::too_many_arguments)]
fn attention_varlen<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    cu_seqlens_k: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
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
    let options = variants.options(&variant_metas, causal, scale)?;
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
    let held_variants = HeldVariants::new(&variants, &problem)?;
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
/// cu_seqlens_k, causal, scale, device, variants) -> (dq, dk, dv, dsinks or
/// None)
///
/// The private entry point behind `flashport.attention_varlen_backward`.
#[pyfunction]
#[pyo3(signature = (d_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale, device, variants))]
#[allow(clippy::too_many_arguments)]
fn attention_varlen_backward<'py>(
    py: Python<'py>,
    d_out: &Bound<'py, PyAny>,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    v: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    lse: &Bound<'py, PyAny>,
    cu_seqlens_q: &Bound<'py, PyAny>,
    cu_seqlens_k: &Bound<'py, PyAny>,
    causal: &Bound<'py, PyAny>,
    scale: &Bound<'py, PyAny>,
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
    let options = variants.options(&variant_metas, causal, scale)?;
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
    let held_variants = HeldVariants::new(&variants, &problem)?;
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
fn merge_states<'py>(
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

/// The variant keywords of attention_with_kvcache: a dict that
/// `flashport._kvcache` builds, keyed by the keyword names.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct KvCacheVariantArgs<'py> {
    window: Bound<'py, PyAny>,
    alibi_slopes: Option<Bound<'py, PyAny>>,
    softcap: Bound<'py, PyAny>,
    sinks: Option<Bound<'py, PyAny>>,
}

/// The entries of an integer argument `name` (cache_seqlens, block_table,
/// tokens) as i64, for the core to check; empty for a dtype that is no
/// integer type (the core refuses it by name). An unsigned length or token
/// above i64::MAX is refused by the core's conversion, by index and value
/// (every one is used); a block table's saturate (see below).
fn int_values(name: &str, array: &Bound<'_, PyAny>, dtype: &str) -> PyResult<Vec<i64>> {
    /// Each entry widened by `f`: read straight from a C-contiguous array
    /// (a block table of 256k entries took a millisecond through
    /// `astype` and ndarray's element iterator).
    fn each<T: Element + Copy>(array: &Bound<'_, PyAny>, f: fn(T) -> i64) -> PyResult<Vec<i64>> {
        let held: PyReadonlyArrayDyn<'_, T> = array.extract()?;
        let view = held.as_array();
        Ok(match view.as_slice() {
            Some(entries) => entries.iter().map(|&v| f(v)).collect(),
            None => view.iter().map(|&v| f(v)).collect(),
        })
    }
    match dtype {
        "int64" => each::<i64>(array, |v| v),
        "int32" => each::<i32>(array, i64::from),
        "int16" => each::<i16>(array, i64::from),
        "int8" => each::<i8>(array, i64::from),
        "uint32" => each::<u32>(array, i64::from),
        "uint16" => each::<u16>(array, i64::from),
        "uint8" => each::<u8>(array, i64::from),
        // A table's entries past a sequence's length are never read and may
        // be anything (-1 cast to uint64 among them): they saturate, and a
        // used one that does is out of range either way.
        "uint64" if name == "block_table" => {
            each::<u64>(array, |v| i64::try_from(v).unwrap_or(i64::MAX))
        }
        "uint64" => {
            let held: PyReadonlyArrayDyn<'_, u64> = array.extract()?;
            let view = held.as_array();
            let widened = core::scalar::int64_entries(name, view.shape(), view.iter().copied());
            widened.map_err(|e| to_py_err(array.py(), e))
        }
        _ => Ok(Vec::new()),
    }
}

/// attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
/// causal, scale, device, variants, num_splits) -> (o, lse)
///
/// The private entry point behind `flashport.attention_with_kvcache`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, device, variants, num_splits, return_lse))]
#[allow(clippy::too_many_arguments)]
fn attention_with_kvcache<'py>(
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
        causal: scalars::flag("causal", causal)?,
        scale: scalars::optional_real("scale", scale)?,
        window: scalars::window(&variants.window)?,
        softcap: scalars::optional_real("softcap", &variants.softcap)?,
        alibi_slopes: slopes_meta.as_ref().map(ArgMeta::info),
        sinks: sinks_meta.as_ref().map(ArgMeta::info),
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

/// DeviceArray: a float32 or float16 array resident on the GPU, made by
/// to_device or kept there by attention / attention_backward.
/// flashport.DeviceArray wraps it; immutable.
#[pyclass(frozen, module = "flashport._core")]
struct DeviceArray {
    inner: core::DeviceArray,
}

#[pymethods]
impl DeviceArray {
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.shape())
    }
    /// The NumPy dtype name: "float32" or "float16".
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().numpy_name()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
    /// The name of the GPU adapter that holds it.
    #[getter]
    fn adapter(&self) -> String {
        self.inner.adapter_name().to_string()
    }
    /// numpy() -> ndarray: a new NumPy array with the tensor's values.
    fn numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let buffer = run_detached(py, || self.inner.to_host())?;
        to_numpy(py, buffer, self.inner.shape())
    }
    /// copy() -> DeviceArray: a new array with the same elements, copied
    /// on the GPU.
    fn copy(&self, py: Python<'_>) -> PyResult<DeviceArray> {
        let inner = run_detached(py, || self.inner.copy())?;
        Ok(DeviceArray { inner })
    }
    fn __repr__(&self) -> String {
        format!(
            "DeviceArray(shape={:?}, dtype={}, adapter={:?})",
            self.inner.shape(),
            self.inner.dtype().numpy_name(),
            self.inner.adapter_name()
        )
    }
}

/// to_device(array) -> DeviceArray: uploads a float32 or float16 NumPy
/// array to the GPU. The private entry point behind flashport.to_device.
#[pyfunction]
fn to_device(py: Python<'_>, array: &Bound<'_, PyAny>) -> PyResult<DeviceArray> {
    let meta = ArgMeta::read("array", array)?;
    let dtype = DType::from_numpy_name(&meta.dtype).ok_or_else(|| {
        to_py_err(
            py,
            core::Error::DType {
                argument: "array".to_string(),
                dtype: meta.dtype.clone(),
                reason: "the GPU computes in float32 or float16".to_string(),
            },
        )
    })?;
    let held = Held::host(array, dtype)?;
    // The GPU's limit first: an array no device buffer can hold is refused
    // before a contiguous copy of it is made.
    if dtype != DType::F64 {
        let element = if dtype == DType::F16 { 2 } else { 4 };
        let bytes = meta.shape.iter().map(|&n| n as u64).product::<u64>() * element;
        validated(py, core::gpu::check_array_bytes("array", bytes))?;
    }
    let contiguous = held.contiguous("array")?;
    let slice = contiguous
        .slice()
        .ok_or_else(|| PyTypeError::new_err("array must be a numpy.ndarray"))?;
    let inner = run_detached(py, || core::to_device("array", slice, &meta.shape))?;
    Ok(DeviceArray { inner })
}

/// synchronize(device=None) -> None: waits until the GPU has done every
/// call queued on it ("cpu": nothing to wait for, CPU calls return done);
/// GpuError if the device was lost on the way. The private entry point
/// behind flashport.synchronize.
#[pyfunction]
#[pyo3(signature = (device=None))]
fn synchronize(py: Python<'_>, device: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
    let name = match device {
        Some(device) => scalars::device_name(device)?,
        None => None,
    };
    // Not `Device::parse`'s default: FLASHPORT_DEVICE picks where calls
    // run, while queued work can only be on the GPU.
    if let Some(name) = name {
        if validated(py, Device::parse(Some(&name)))? == Device::Cpu {
            return Ok(());
        }
    }
    run_detached(py, core::gpu::synchronize)
}

/// devices() -> list[dict]: the CPU and every GPU adapter flashport can use.
#[pyfunction]
fn devices<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    let cpu = PyDict::new(py);
    cpu.set_item("device", "cpu")?;
    cpu.set_item("backend", "cpu")?;
    cpu.set_item("name", std::env::consts::ARCH)?;
    cpu.set_item("type", "cpu")?;
    cpu.set_item("threads", validated(py, core::cpu::num_threads())?)?;
    cpu.set_item(
        "cache_bytes_per_core",
        core::cpu::tiles::per_core_cache_bytes(),
    )?;
    list.append(cpu)?;
    let adapters = py
        .detach(|| catch_unwind(core::gpu::adapters))
        .unwrap_or_default();
    for adapter in adapters {
        let entry = PyDict::new(py);
        entry.set_item("device", "gpu")?;
        entry.set_item("backend", adapter.backend)?;
        entry.set_item("name", adapter.name)?;
        entry.set_item("type", adapter.device_type)?;
        entry.set_item("driver", adapter.driver)?;
        let limits = PyDict::new(py);
        for (name, value) in adapter.limits {
            limits.set_item(name, value)?;
        }
        entry.set_item("limits", limits)?;
        entry.set_item("features", adapter.features)?;
        list.append(entry)?;
    }
    Ok(list)
}

/// _gpu_kernel_times() -> list[tuple[str, float]]: the host phases of the
/// last GPU call on this thread and, while `_gpu_kernel_timing(True)` is
/// set, the GPU time in seconds of each of its kernels, from timestamp
/// queries (none where the adapter has none). For benchmarks.
#[pyfunction]
fn _gpu_kernel_times() -> Vec<(String, f64)> {
    core::gpu::last_kernel_times()
}

/// _gpu_kernel_timing(enabled): whether the calling thread's GPU calls
/// measure their kernels with timestamp queries (off by default: they cost
/// each call a readback).
#[pyfunction]
fn _gpu_kernel_timing(enabled: bool) {
    core::gpu::set_kernel_timing(enabled);
}

/// The core's test hooks (cargo feature `testing`: the development build,
/// never the wheel).
#[cfg(feature = "testing")]
mod testing {
    use super::*;
    use flashport_core::gpu::kernel::Tier;
    use flashport_core::gpu::tiles::Tiles;
    use flashport_core::overrides::{self, Overrides};

    /// _testing_set_overrides(**knobs): the calling thread's overrides
    /// (flashport_core::overrides::Overrides), all off when none is given.
    #[pyfunction]
    #[pyo3(signature = (*, max_tier=None, workgroup_bytes=None, no_subgroups=false,
                        binding_limit=None, naga_spirv=false, portable_cpu=false,
                        decode_workgroup=None, decode_keys=None, decode_lanes=None,
                        decode_prefetch=None, decode_checked=false, coop_forward=None,
                        spin_us=None))]
    #[allow(clippy::too_many_arguments)]
    pub fn _testing_set_overrides(
        max_tier: Option<&str>,
        workgroup_bytes: Option<u32>,
        no_subgroups: bool,
        binding_limit: Option<u64>,
        naga_spirv: bool,
        portable_cpu: bool,
        decode_workgroup: Option<u32>,
        decode_keys: Option<u32>,
        decode_lanes: Option<u32>,
        decode_prefetch: Option<bool>,
        decode_checked: bool,
        coop_forward: Option<(u32, u32)>,
        spin_us: Option<u64>,
    ) -> PyResult<()> {
        let max_tier = match max_tier {
            None => None,
            Some("simple") => Some(Tier::Simple),
            Some("tiled") => Some(Tier::Tiled),
            Some("coop") => Some(Tier::Coop),
            Some("cm2") => Some(Tier::Cm2),
            Some(other) => {
                return Err(PyTypeError::new_err(format!(
                    "max_tier={other:?}: expected \"simple\", \"tiled\", \"coop\" or \"cm2\""
                )))
            }
        };
        overrides::set(Overrides {
            max_tier,
            workgroup_bytes,
            no_subgroups,
            binding_limit,
            naga_spirv,
            portable_cpu,
            decode_workgroup,
            decode_keys,
            decode_lanes,
            decode_prefetch,
            decode_checked,
            // (subgroups, key rows)
            coop_forward: coop_forward.map(|(w, bk)| Tiles {
                q_rows: 16 * w,
                k_rows: bk,
                workgroup: 32 * w,
                kv_shared: false,
                prefetch: 0,
            }),
            spin: spin_us.map(std::time::Duration::from_micros),
        });
        Ok(())
    }

    /// _testing_lose_device(): destroys the GPU device flashport holds, as
    /// a driver reset would (the failure-path tests).
    #[pyfunction]
    pub fn _testing_lose_device(py: Python<'_>) {
        py.detach(|| {
            let _ = catch_unwind(core::gpu::testing::lose_device);
        });
    }

    /// _testing_queued_submissions() -> int: the GPU submissions queued
    /// without a wait that the shared context has not yet seen finish (the
    /// bound on them is what the tests check).
    #[pyfunction]
    pub fn _testing_queued_submissions() -> usize {
        core::gpu::testing::queued_submissions()
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DeviceArray>()?;
    m.add_class::<kvcache::KvCacheHandle>()?;
    m.add_function(wrap_pyfunction!(to_device, m)?)?;
    m.add_function(wrap_pyfunction!(attention, m)?)?;
    m.add_function(wrap_pyfunction!(attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(merge_states, m)?)?;
    m.add_function(wrap_pyfunction!(attention_varlen, m)?)?;
    m.add_function(wrap_pyfunction!(attention_varlen_backward, m)?)?;
    m.add_function(wrap_pyfunction!(attention_with_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(_gpu_kernel_times, m)?)?;
    m.add_function(wrap_pyfunction!(_gpu_kernel_timing, m)?)?;
    #[cfg(feature = "testing")]
    {
        m.add_function(wrap_pyfunction!(testing::_testing_set_overrides, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_lose_device, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_queued_submissions, m)?)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
