//! Where a call runs: the `device=` argument ([`Device`]: `"cpu"`, `"gpu"`,
//! `"gpu:N"`, `"auto"`), the cost model's choice for `"auto"`, and the
//! rule that device arrays compute on the GPU they are on. The entry
//! points of every operation ask here before they dispatch to `cpu/` or
//! `gpu/`.
//!
//! Which GPU: `"gpu:N"` is adapter N of `flashport.devices()` (ordered by
//! `gpu/adapters.rs`, the same in every process). `"gpu"` and `"auto"`
//! mean the *default GPU*: the one `FLASHPORT_DEVICE=gpu:N` names, as
//! `CUDA_VISIBLE_DEVICES` makes a worker's GPU its `cuda`, otherwise the
//! best (`gpu:0`, or the next if its driver will not open it). With device
//! arrays among the inputs, `None`, `"gpu"` and `"auto"` mean their GPU.

use crate::array::{Input, Placement, Slice};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::problem::Problem;
use crate::{auto, cpu, gpu};

/// Where a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Gpu(Gpu),
    /// A hardware GPU (the default one) where the cost model (`auto`)
    /// expects the call to take less time there, otherwise the CPU. Never
    /// a software adapter.
    Auto,
}

/// Environment variable that overrides the default device `"auto"`.
pub const DEVICE_ENV: &str = "FLASHPORT_DEVICE";

impl Device {
    /// Parses the `device=` argument of a call some of whose inputs are
    /// device tensors (`on_gpu`): then `None` means their GPU, whatever
    /// `FLASHPORT_DEVICE` says (the environment chooses where host arrays
    /// compute; device tensors already are on a GPU), and so do `"gpu"`
    /// and `"auto"`; `"gpu:N"` must be theirs (`gpu/run.rs` checks).
    pub fn parse_for(name: Option<&str>, on_gpu: bool) -> Result<Device> {
        match (name, on_gpu) {
            (None, true) => Ok(Device::Gpu(Gpu::Best)),
            (Some(name), true) => parse_name(name, "device", false),
            (name, false) => Device::parse(name),
        }
    }

    /// Parses the `device=` argument of the Python API; `None` means the
    /// default, which `FLASHPORT_DEVICE` overrides.
    pub fn parse(name: Option<&str>) -> Result<Device> {
        match name {
            Some(name) => parse_name(name, "device", true),
            None => match std::env::var(DEVICE_ENV) {
                Ok(name) => parse_name(&name, DEVICE_ENV, false),
                Err(_) => Ok(Device::Auto),
            },
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
                let gpu = default_gpu()?;
                if auto::prefers_gpu(problem, cpu, gpu::hardware_gpu(gpu)) {
                    Device::Gpu(gpu)
                } else {
                    Device::Cpu
                }
            }
            concrete => concrete,
        })
    }
}

/// The default GPU, what `"gpu"` and `"auto"` mean for host arrays: the
/// one `FLASHPORT_DEVICE` names by index, else the best. An invalid
/// `FLASHPORT_DEVICE` is an error naming it here too.
pub fn default_gpu() -> Result<Gpu> {
    match std::env::var(DEVICE_ENV) {
        Ok(name) => match parse_name(&name, DEVICE_ENV, false)? {
            Device::Gpu(gpu) => Ok(gpu),
            _ => Ok(Gpu::Best),
        },
        Err(_) => Ok(Gpu::Best),
    }
}

/// The GPU of `device=` where only a GPU will do (`to_device`,
/// `DeviceArray.to`): `None`, `"gpu"` and `"auto"` the default GPU,
/// `"gpu:N"` that one; `"cpu"` is an error naming `argument`.
pub fn parse_gpu(name: Option<&str>) -> Result<Gpu> {
    match name.map(|n| parse_name(n, "device", true)).transpose()? {
        None | Some(Device::Auto) => default_gpu(),
        Some(Device::Gpu(gpu)) => Ok(gpu),
        Some(Device::Cpu) => Err(Error::Value {
            argument: "device".to_string(),
            value: "\"cpu\"".to_string(),
            reason: "a DeviceArray lives on a GPU: name one (\"gpu\", \"gpu:N\"), or keep the \
                     array in NumPy for the CPU"
                .to_string(),
        }),
    }
}

/// `name` given as `argument` (`device` or `FLASHPORT_DEVICE`); `"gpu"`
/// is the default GPU where `follow_env`, else [`Gpu::Best`].
fn parse_name(name: &str, argument: &str, follow_env: bool) -> Result<Device> {
    let lower = name.trim().to_ascii_lowercase();
    match lower.as_str() {
        "cpu" => Ok(Device::Cpu),
        "gpu" if follow_env => Ok(Device::Gpu(default_gpu()?)),
        "gpu" => Ok(Device::Gpu(Gpu::Best)),
        "auto" => Ok(Device::Auto),
        _ => match lower.strip_prefix("gpu:") {
            Some(digits) => Ok(Device::Gpu(Gpu::Index(gpu_index(name, digits, argument)?))),
            None => Err(Error::Value {
                argument: argument.to_string(),
                value: format!("{name:?}"),
                reason: format!(
                    "expected \"cpu\", \"gpu\", \"gpu:N\" or \"auto\"; this machine has {}",
                    available()
                ),
            }),
        },
    }
}

/// N of `"gpu:N"`, checked against the adapters there are: an error naming
/// `argument`, the value and the devices that exist otherwise.
fn gpu_index(name: &str, digits: &str, argument: &str) -> Result<usize> {
    let index = index_of(digits);
    let count = gpu::adapter_count();
    match index {
        Some(_) if count == 0 => Err(Error::BackendUnavailable(format!(
            "{argument}={name:?}: no GPU adapter found: flashport needs a Vulkan, Metal or DX12 \
             driver (on Linux without a GPU, Mesa's lavapipe provides one); use device=\"cpu\""
        ))),
        Some(index) if index < count => Ok(index),
        Some(_) => Err(Error::Value {
            argument: argument.to_string(),
            value: format!("{name:?}"),
            reason: format!("no such GPU: this machine has {}", available()),
        }),
        None => Err(Error::Value {
            argument: argument.to_string(),
            value: format!("{name:?}"),
            reason: format!(
                "N of \"gpu:N\" is a GPU's index in flashport.devices(), a whole number from \
                 0; this machine has {}",
                available()
            ),
        }),
    }
}

/// N of `gpu:N`, digits only: "gpu:-1", "gpu:+1", "gpu: 1" and "gpu:x"
/// name nothing (Rust's parse would take the "+").
fn index_of(digits: &str) -> Option<usize> {
    Some(digits)
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse().ok())
}

/// The devices there are, for errors: `cpu, gpu:0 (name, kind), ...`.
fn available() -> String {
    let mut names = vec!["cpu".to_string()];
    names.extend(gpu::adapters().iter().map(|a| {
        format!(
            "{} ({}, {})",
            gpu::device_name(a.index),
            a.name,
            a.device_type
        )
    }));
    if names.len() == 1 {
        names.push("no GPU".to_string());
    }
    names.join(", ")
}

/// The host slice of an input the CPU computes on (`resolve` sends calls
/// with device inputs to the GPU).
pub(crate) fn on_host<'a>(argument: &str, input: Input<'a>) -> Result<Slice<'a>> {
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
/// tensor (theirs; `gpu/run.rs` checks that they share it) or the outputs
/// are to stay there (an error naming the argument if the caller asked for
/// the CPU then), else `on_host()`.
pub(crate) fn resolve(
    device: Device,
    on_host: impl FnOnce() -> Result<Device>,
    inputs: &[(&str, Input<'_>)],
    outputs: Placement,
) -> Result<Device> {
    let on_gpu = inputs.iter().find_map(|(n, i)| match i {
        Input::Device(t) => Some((*n, t.device())),
        Input::Host(_) => None,
    });
    if on_gpu.is_none() && outputs == Placement::Host {
        return on_host();
    }
    if device == Device::Cpu {
        let reason = match on_gpu {
            Some((name, gpu)) => format!(
                "{name} is a device array (it lives on {gpu}): compute with device=\"{gpu}\" \
                 (or None, \"gpu\", \"auto\"), or read it back to the host ({name}.numpy()) \
                 to compute on the CPU"
            ),
            None => {
                "outputs kept on the GPU need device=\"gpu\", \"gpu:N\" or \"auto\"".to_string()
            }
        };
        return Err(Error::Value {
            argument: "device".to_string(),
            value: "\"cpu\"".to_string(),
            reason,
        });
    }
    Ok(Device::Gpu(match device {
        Device::Gpu(gpu) => gpu,
        _ if on_gpu.is_some() => Gpu::Best,
        _ => default_gpu()?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_indices_are_digits_only() {
        for (digits, want) in [
            ("0", Some(0)),
            ("7", Some(7)),
            ("012", Some(12)),
            ("", None),
            ("-1", None),
            ("+1", None),
            (" 1", None),
            ("1 ", None),
            ("x", None),
            ("1.0", None),
            ("99999999999999999999999", None),
        ] {
            assert_eq!(index_of(digits), want, "{digits:?}");
        }
    }

    #[test]
    fn names_without_an_index_need_no_adapter() {
        // Parsed without enumerating adapters (no GPU needed here).
        assert_eq!(parse_name("CPU", "device", false), Ok(Device::Cpu));
        assert_eq!(
            parse_name(" gpu ", "device", false),
            Ok(Device::Gpu(Gpu::Best))
        );
        assert_eq!(parse_name("auto", "device", false), Ok(Device::Auto));
        match parse_name("cuda:0", "device", false) {
            Err(Error::Value {
                argument, value, ..
            }) => {
                assert_eq!(
                    (argument.as_str(), value.as_str()),
                    ("device", "\"cuda:0\"")
                )
            }
            other => panic!("{other:?}"),
        }
    }
}
