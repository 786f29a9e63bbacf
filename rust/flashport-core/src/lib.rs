//! flashport-core: exact FlashAttention-2, forward and backward, on the CPU
//! (`cpu/`) and on any GPU through wgpu (`gpu/`).
//!
//! This crate is pure Rust (no Python): validate a problem with
//! [`validate_forward`] / [`validate_backward`], then run it with
//! [`attention`] / [`attention_backward`] on contiguous row-major buffers in
//! `(batch, heads, seq, dim)` order. On the GPU, inputs may also be
//! [`DeviceArray`]s (uploaded once with [`to_device`]) and outputs may stay
//! there: [`attention_arrays`] / [`attention_backward_arrays`] take
//! [`Input`]s and return [`Array`]s where the [`Placement`] says.
//!
//! The arrays, by where they live: a [`Slice`] borrows host memory and a
//! [`Buffer`] owns it; a [`DeviceArray`] lives on the GPU; an [`Input`] is
//! either of the borrowed kinds, an [`Array`] either of the owned ones.
//!
//! ```
//! use flashport_core::{attention, validate_forward, ArrayInfo, Device, Options, Buffer, Slice};
//! let (q, k, v) = (vec![0.5f32; 4 * 8], vec![0.25f32; 6 * 8], vec![1.0f32; 6 * 8]);
//! let problem = validate_forward(
//!     ArrayInfo::new(&[4, 8], "float32"),
//!     ArrayInfo::new(&[6, 8], "float32"),
//!     ArrayInfo::new(&[6, 8], "float32"),
//!     &Options { causal: true, ..Options::default() },
//! ).unwrap();
//! let out = attention(
//!     Device::Cpu, &problem, Slice::F32(&q), Slice::F32(&k), Slice::F32(&v), &Default::default(),
//! ).unwrap();
//! let Buffer::F32(o) = out.out else { unreachable!() };
//! assert!(o.iter().all(|x| (x - 1.0).abs() < 1e-6));
//! ```

pub mod auto;
pub mod broadcast;
pub mod cpu;
pub mod decode;
pub mod env;
pub mod error;
pub mod fork;
pub mod gpu;
pub mod host_memory;
pub mod interrupt;
pub mod kvcache;
pub mod merge;
pub mod overrides;
pub mod problem;
pub(crate) mod runtime;
pub mod scalar;
pub mod splits;
pub mod variants;
pub mod varlen;

pub use decode::attention_with_kvcache_arrays;
pub use error::{Error, Result};
pub use gpu::{to_device, DeviceArray};
pub use half::{bf16, f16};
pub use kvcache::KvCache;
pub use merge::{merge_states, merge_states_arrays};
pub use problem::{
    validate_backward, validate_forward, validate_merge, ArrayInfo, DType, MergeProblem, Options,
    Parts, Problem,
};
pub use problem::{validate_kvcache, CacheLayout, IntArray, KvCacheOptions, KvCacheProblem};
pub use problem::{validate_varlen_backward, validate_varlen_forward, Segments, SeqLens};
pub use variants::{MaskData, VariantArrays};
pub use varlen::{
    attention_varlen, attention_varlen_arrays, attention_varlen_backward,
    attention_varlen_backward_arrays,
};

/// A borrowed, contiguous, row-major input array.
#[derive(Debug, Clone, Copy)]
pub enum Slice<'a> {
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// An owned, contiguous, row-major output array.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Slice<'_> {
    pub fn len(&self) -> usize {
        match self {
            Slice::F16(s) => s.len(),
            Slice::BF16(s) => s.len(),
            Slice::F32(s) => s.len(),
            Slice::F64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Slice::F16(_) => DType::F16,
            Slice::BF16(_) => DType::BF16,
            Slice::F32(_) => DType::F32,
            Slice::F64(_) => DType::F64,
        }
    }
}

/// An input array: a host slice, or a tensor resident on the GPU.
#[derive(Debug, Clone, Copy)]
pub enum Input<'a> {
    Host(Slice<'a>),
    Device(&'a DeviceArray),
}

impl<'a> From<Slice<'a>> for Input<'a> {
    fn from(s: Slice<'a>) -> Self {
        Input::Host(s)
    }
}

impl<'a> From<&'a DeviceArray> for Input<'a> {
    fn from(t: &'a DeviceArray) -> Self {
        Input::Device(t)
    }
}

impl Input<'_> {
    pub fn len(&self) -> usize {
        match self {
            Input::Host(s) => s.len(),
            Input::Device(t) => t.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> DType {
        match self {
            Input::Host(s) => s.dtype(),
            Input::Device(t) => t.dtype(),
        }
    }
    pub fn is_device(&self) -> bool {
        matches!(self, Input::Device(_))
    }
}

/// An output array: read back into host memory, or kept on the GPU.
#[derive(Debug, Clone)]
pub enum Array {
    Host(Buffer),
    Device(DeviceArray),
}

impl Array {
    /// The array in host memory, read back if it is on the GPU.
    pub fn into_host(self) -> Result<Buffer> {
        match self {
            Array::Host(b) => Ok(b),
            Array::Device(t) => t.read(),
        }
    }
}

/// Where a call leaves its outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Read back into host memory.
    Host,
    /// Kept on the GPU as [`DeviceArray`]s.
    Device,
}

impl Placement {
    /// Results live where the inputs live: on the GPU if any input does.
    pub fn of_inputs(inputs: &[Input<'_>]) -> Placement {
        if inputs.iter().any(Input::is_device) {
            Placement::Device
        } else {
            Placement::Host
        }
    }
}

impl Buffer {
    /// The buffer as an input slice.
    pub fn as_slice(&self) -> Slice<'_> {
        match self {
            Buffer::F16(x) => Slice::F16(x),
            Buffer::BF16(x) => Slice::BF16(x),
            Buffer::F32(x) => Slice::F32(x),
            Buffer::F64(x) => Slice::F64(x),
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Buffer::F16(s) => s.len(),
            Buffer::BF16(s) => s.len(),
            Buffer::F32(s) => s.len(),
            Buffer::F64(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Gpu,
    /// A hardware GPU where the cost model (`auto`) expects the call to
    /// take less time there, otherwise the CPU. Never a software adapter.
    Auto,
}

/// Environment variable that overrides the default device `"auto"`.
pub const DEVICE_ENV: &str = "FLASHPORT_DEVICE";

impl Device {
    /// Parses the `device=` argument of a call some of whose inputs are
    /// device tensors (`on_gpu`): then `None` means the GPU, whatever
    /// `FLASHPORT_DEVICE` says (the environment chooses where host arrays
    /// compute; device tensors already are on the GPU).
    pub fn parse_for(name: Option<&str>, on_gpu: bool) -> Result<Device> {
        match (name, on_gpu) {
            (None, true) => Ok(Device::Auto),
            _ => Device::parse(name),
        }
    }

    /// Parses the `device=` argument of the Python API; `None` means the
    /// default, which `FLASHPORT_DEVICE` overrides.
    pub fn parse(name: Option<&str>) -> Result<Device> {
        let (name, argument) = match name {
            Some(name) => (name.to_string(), "device"),
            None => match std::env::var(DEVICE_ENV) {
                Ok(name) => (name, DEVICE_ENV),
                Err(_) => return Ok(Device::Auto),
            },
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu),
            "auto" => Ok(Device::Auto),
            _ => Err(Error::Value {
                argument: argument.to_string(),
                value: format!("{name:?}"),
                reason: "expected \"cpu\", \"gpu\" or \"auto\"".to_string(),
            }),
        }
    }

    /// The concrete device a problem runs on. An invalid
    /// `FLASHPORT_NUM_THREADS` is an error here too, even when the GPU
    /// wins: the cost model would otherwise have guessed a thread count.
    pub fn resolve(self, problem: &Problem) -> Result<Device> {
        Ok(match self {
            Device::Auto => {
                let cpu = auto::CpuModel {
                    threads: cpu::num_threads()?,
                    simd: cpu::simd_kernels(),
                };
                if auto::prefers_gpu(problem, cpu, gpu::hardware_gpu()) {
                    Device::Gpu
                } else {
                    Device::Cpu
                }
            }
            concrete => concrete,
        })
    }
}

/// Output of the forward pass, in host [`Buffer`]s or, from the
/// `_arrays` calls, in [`Array`]s where the call's [`Placement`] put them.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput<A = Buffer> {
    /// `(batch, heads_q, seq_q, value_dim)`, in the inputs' dtype.
    pub out: A,
    /// `(batch, heads_q, seq_q)`: natural-log log-sum-exp of the scaled
    /// scores of each query row; `-inf` for a row that sees no key.
    pub lse: A,
}

/// Gradients of the backward pass, in the inputs' dtype; `dk` and `dv`
/// have `heads_kv` heads. As with [`ForwardOutput`], `A` is [`Buffer`] or
/// [`Array`]. `dsinks` and `dmask` are computed on the host and stay
/// there: they are the gradients of host arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients<A = Buffer> {
    pub dq: A,
    pub dk: A,
    pub dv: A,
    /// `(heads_q,)`, float64, when the problem has sinks.
    pub dsinks: Option<Vec<f64>>,
    /// The float mask's gradient in the mask's shape, in the problem's
    /// compute dtype (float32 or float64), when `return_dmask` was asked.
    pub dmask: Option<Buffer>,
}

/// What a backend's backward returns before the variant gradients both
/// backends share are added: `dS` over the full `(batch, heads_q, seq_q,
/// seq_k)` when the mask's gradient is wanted (always on the host: the
/// host reduces it to the mask's shape).
#[derive(Debug, Clone, PartialEq)]
pub struct BackendGradients<A = Buffer> {
    pub dq: A,
    pub dk: A,
    pub dv: A,
    pub d_scores: Option<Buffer>,
}

impl ForwardOutput<Array> {
    /// The outputs in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<ForwardOutput> {
        Ok(ForwardOutput {
            out: self.out.into_host()?,
            lse: self.lse.into_host()?,
        })
    }
}

impl Gradients<Array> {
    /// The gradients in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<Gradients> {
        Ok(Gradients {
            dq: self.dq.into_host()?,
            dk: self.dk.into_host()?,
            dv: self.dv.into_host()?,
            dsinks: self.dsinks,
            dmask: self.dmask,
        })
    }
}

impl BackendGradients<Array> {
    /// The gradients in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<BackendGradients> {
        Ok(BackendGradients {
            dq: self.dq.into_host()?,
            dk: self.dk.into_host()?,
            dv: self.dv.into_host()?,
            d_scores: self.d_scores,
        })
    }
}

impl BackendGradients<Buffer> {
    /// Host gradients as a call's [`Array`]s.
    pub fn into_arrays(self) -> BackendGradients<Array> {
        BackendGradients {
            dq: Array::Host(self.dq),
            dk: Array::Host(self.dk),
            dv: Array::Host(self.dv),
            d_scores: self.d_scores,
        }
    }
}

fn check_len(argument: &str, got: &Input<'_>, want: usize, dtype: DType) -> Result<()> {
    if got.len() != want {
        return Err(Error::Shape(format!(
            "{argument} holds {} elements but the problem needs {want}",
            got.len()
        )));
    }
    if got.dtype() != dtype {
        return Err(Error::DType {
            argument: argument.to_string(),
            dtype: got.dtype().numpy_name().to_string(),
            reason: format!("the problem was validated for {}", dtype.numpy_name()),
        });
    }
    Ok(())
}

/// A host slice of an input, read back from the device if it is there.
enum HostView<'a> {
    Borrowed(Slice<'a>),
    Read(Buffer),
}

impl<'a> HostView<'a> {
    fn of(input: Input<'a>) -> Result<Self> {
        Ok(match input {
            Input::Host(s) => HostView::Borrowed(s),
            Input::Device(t) => HostView::Read(t.read()?),
        })
    }
    fn slice(&self) -> Slice<'_> {
        match self {
            HostView::Borrowed(s) => *s,
            HostView::Read(b) => b.as_slice(),
        }
    }
}

/// The host slice of an input the CPU computes on (`resolve` sends calls
/// with device inputs to the GPU).
fn on_host<'a>(argument: &str, input: Input<'a>) -> Result<Slice<'a>> {
    match input {
        Input::Host(s) => Ok(s),
        Input::Device(_) => Err(Error::Value {
            argument: argument.to_string(),
            value: "a device array".to_string(),
            reason: "the CPU computes on host arrays; read it back first".to_string(),
        }),
    }
}

/// The device a call runs on: the GPU whenever an input is a device
/// tensor or the outputs are to stay there (an error naming the argument
/// if the caller asked for the CPU then), else `on_host()`.
fn resolve(
    device: Device,
    on_host: impl FnOnce() -> Result<Device>,
    inputs: &[(&str, Input<'_>)],
    outputs: Placement,
) -> Result<Device> {
    let on_gpu = inputs.iter().find(|(_, i)| i.is_device()).map(|(n, _)| *n);
    if on_gpu.is_none() && outputs == Placement::Host {
        return on_host();
    }
    if device == Device::Cpu {
        let reason = match on_gpu {
            Some(name) => format!(
                "{name} is a device array (it lives on the GPU): compute with device=\"gpu\" \
                 or \"auto\", or read it back to the host ({name}.numpy()) to compute on \
                 the CPU"
            ),
            None => "outputs kept on the GPU need device=\"gpu\" or \"auto\"".to_string(),
        };
        return Err(Error::Value {
            argument: "device".to_string(),
            value: "\"cpu\"".to_string(),
            reason,
        });
    }
    Ok(Device::Gpu)
}

/// Runs the forward pass of a validated problem.
pub fn attention(
    device: Device,
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    attention_arrays(
        device,
        problem,
        [q.into(), k.into(), v.into()],
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// Runs the forward pass of a validated problem on inputs that may be
/// device tensors, leaving the outputs where `outputs` says. Device inputs
/// or outputs run on the GPU (`device` may then be `Gpu` or `Auto`).
pub fn attention_arrays(
    device: Device,
    problem: &Problem,
    [q, k, v]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    variants.check(problem)?;
    let named = [("q", q), ("k", k), ("v", v)];
    match resolve(device, || device.resolve(problem), &named, outputs)? {
        Device::Gpu => gpu::forward_arrays(problem, [q, k, v], variants, outputs),
        _ => {
            let r = cpu::forward(
                problem,
                on_host("q", q)?,
                on_host("k", k)?,
                on_host("v", v)?,
                variants,
            )?;
            Ok(ForwardOutput {
                out: Array::Host(r.out),
                lse: Array::Host(r.lse),
            })
        }
    }
}

/// Runs the backward pass of a validated problem, recomputing the
/// attention probabilities from `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    device: Device,
    problem: &Problem,
    d_out: Slice<'_>,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    out: Slice<'_>,
    lse: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<Gradients> {
    attention_backward_arrays(
        device,
        problem,
        [d_out, q, k, v, out, lse].map(Input::Host),
        variants,
        Placement::Host,
    )?
    .into_host()
}

/// The backward pass on inputs `[do, q, k, v, o, lse]` that may be device
/// tensors, leaving `dq`, `dk` and `dv` where `outputs` says (see
/// [`attention_arrays`]). With sinks, `do`, `o` and `lse` are read back
/// from the device for the sinks' gradient, which the host computes.
pub fn attention_backward_arrays(
    device: Device,
    problem: &Problem,
    inputs: [Input<'_>; 6],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<Gradients<Array>> {
    let [d_out, q, k, v, out, lse] = inputs;
    check_len("do", &d_out, problem.out_len(), problem.dtype)?;
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    check_len("o", &out, problem.out_len(), problem.dtype)?;
    if lse.len() != problem.lse_len() || lse.dtype().is_half() {
        return Err(Error::Shape(format!(
            "lse holds {} {} elements but the problem needs {} float32 or float64",
            lse.len(),
            lse.dtype().numpy_name(),
            problem.lse_len()
        )));
    }
    variants.check(problem)?;
    let named = [
        ("do", d_out),
        ("q", q),
        ("k", k),
        ("v", v),
        ("o", out),
        ("lse", lse),
    ];
    let grads = match resolve(device, || device.resolve(problem), &named, outputs)? {
        Device::Gpu => gpu::backward_arrays(problem, inputs, variants, outputs)?,
        _ => {
            let [d_out, q, k, v, out, lse] = named.map(|(name, input)| on_host(name, input));
            cpu::backward(problem, [d_out?, q?, k?, v?, out?, lse?], variants)?.into_arrays()
        }
    };
    let dmask = match grads.d_scores {
        Some(Buffer::F32(full)) => Some(Buffer::F32(variants::reduce_to_mask(problem, &full))),
        Some(Buffer::F64(full)) => Some(Buffer::F64(variants::reduce_to_mask(problem, &full))),
        _ => None,
    };
    let dsinks = match variants.sinks {
        Some(sinks) => {
            // The host computes it in float64 from do, o and lse.
            let (d_out, out, lse) = (HostView::of(d_out)?, HostView::of(out)?, HostView::of(lse)?);
            Some(variants::sink_gradient(
                problem,
                &d_out.slice(),
                &out.slice(),
                &lse.slice(),
                sinks,
            ))
        }
        None => None,
    };
    Ok(Gradients {
        dq: grads.dq,
        dk: grads.dk,
        dv: grads.dv,
        dsinks,
        dmask,
    })
}
