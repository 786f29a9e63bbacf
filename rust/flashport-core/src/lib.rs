//! flashport-core: exact FlashAttention-2, forward and backward, on the CPU.
//!
//! This crate is pure Rust (no Python): validate a problem with
//! [`validate_forward`] / [`validate_backward`], then run it with
//! [`attention`] / [`attention_backward`] on contiguous row-major buffers in
//! `(batch, heads, seq, dim)` order.
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

pub mod cpu;
pub mod error;
pub mod gpu;
pub mod problem;
pub mod variants;

pub use error::{Error, Result};
pub use half::f16;
pub use problem::{validate_backward, validate_forward, ArrayInfo, DType, Options, Problem};
pub use variants::{MaskData, VariantArrays};

/// A borrowed, contiguous, row-major input array.
#[derive(Debug, Clone, Copy)]
pub enum Slice<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    F64(&'a [f64]),
}

/// An owned, contiguous, row-major output array.
#[derive(Debug, Clone, PartialEq)]
pub enum Buffer {
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Slice<'_> {
    pub fn len(&self) -> usize {
        match self {
            Slice::F16(s) => s.len(),
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
            Slice::F32(_) => DType::F32,
            Slice::F64(_) => DType::F64,
        }
    }
}

impl Buffer {
    pub fn len(&self) -> usize {
        match self {
            Buffer::F16(s) => s.len(),
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
    /// A hardware GPU when there is one and the problem is large enough
    /// to gain from it, otherwise the CPU. Never a software adapter.
    Auto,
}

/// Environment variable that overrides the default device `"auto"`.
pub const DEVICE_ENV: &str = "FLASHPORT_DEVICE";

/// Forward FLOPs above which `device="auto"` prefers a hardware GPU: below
/// it, the host-device copies and the launch cost outweigh the GPU's speed.
pub const AUTO_GPU_MIN_FLOPS: f64 = 1e9;

impl Device {
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

    /// The concrete device a problem runs on.
    pub fn resolve(self, problem: &Problem) -> Device {
        match self {
            Device::Auto => {
                let big_enough = problem.forward_flops() >= AUTO_GPU_MIN_FLOPS;
                if big_enough && problem.dtype != DType::F64 && gpu::hardware_adapter_available() {
                    Device::Gpu
                } else {
                    Device::Cpu
                }
            }
            concrete => concrete,
        }
    }
}

/// Output of the forward pass.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput {
    /// `(batch, heads_q, seq_q, value_dim)`, in the inputs' dtype.
    pub out: Buffer,
    /// `(batch, heads_q, seq_q)`: natural-log log-sum-exp of the scaled
    /// scores of each query row; `-inf` for a row that sees no key.
    pub lse: Buffer,
}

/// Gradients of the backward pass, in the inputs' dtype; `dk` and `dv`
/// have `heads_kv` heads.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    pub dq: Buffer,
    pub dk: Buffer,
    pub dv: Buffer,
    /// `(heads_q,)`, float64, when the problem has sinks.
    pub dsinks: Option<Vec<f64>>,
    /// The float mask's gradient in the mask's shape, in the problem's
    /// compute dtype (float32 or float64), when `return_dmask` was asked.
    pub dmask: Option<Buffer>,
}

/// What a backend's backward returns before the shared variant gradients
/// are added: `dS` over the full `(batch, heads_q, seq_q, seq_k)` when the
/// mask's gradient is wanted.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendGradients {
    pub dq: Buffer,
    pub dk: Buffer,
    pub dv: Buffer,
    pub d_scores: Option<Buffer>,
}

fn check_len(argument: &str, got: &Slice<'_>, want: usize, dtype: DType) -> Result<()> {
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

/// Runs the forward pass of a validated problem.
pub fn attention(
    device: Device,
    problem: &Problem,
    q: Slice<'_>,
    k: Slice<'_>,
    v: Slice<'_>,
    variants: &VariantArrays<'_>,
) -> Result<ForwardOutput> {
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    variants.check(problem)?;
    match device.resolve(problem) {
        Device::Gpu => gpu::forward(problem, q, k, v, variants),
        _ => cpu::forward(problem, q, k, v, variants),
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
    check_len("do", &d_out, problem.out_len(), problem.dtype)?;
    check_len("q", &q, problem.q_len(), problem.dtype)?;
    check_len("k", &k, problem.k_len(), problem.dtype)?;
    check_len("v", &v, problem.v_len(), problem.dtype)?;
    check_len("o", &out, problem.out_len(), problem.dtype)?;
    if lse.len() != problem.lse_len() || lse.dtype() == DType::F16 {
        return Err(Error::Shape(format!(
            "lse holds {} {} elements but the problem needs {} float32 or float64",
            lse.len(),
            lse.dtype().numpy_name(),
            problem.lse_len()
        )));
    }
    variants.check(problem)?;
    let inputs = [d_out, q, k, v, out, lse];
    let grads = match device.resolve(problem) {
        Device::Gpu => gpu::backward(problem, inputs, variants)?,
        _ => cpu::backward(problem, inputs, variants)?,
    };
    let dmask = match grads.d_scores {
        Some(Buffer::F32(full)) => Some(Buffer::F32(variants::reduce_to_mask(problem, &full))),
        Some(Buffer::F64(full)) => Some(Buffer::F64(variants::reduce_to_mask(problem, &full))),
        _ => None,
    };
    Ok(Gradients {
        dq: grads.dq,
        dk: grads.dk,
        dv: grads.dv,
        dsinks: variants
            .sinks
            .map(|sinks| variants::sink_gradient(problem, &d_out, &out, &lse, sinks)),
        dmask,
    })
}
