//! Where a call runs: the `device=` argument ([`Device`]), the cost
//! model's choice for `"auto"`, and the rule that device arrays compute on
//! the GPU. The entry points of every operation ask here before they
//! dispatch to `cpu/` or `gpu/`.

use crate::array::{Input, Placement, Slice};
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::{auto, cpu, gpu};

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
/// tensor or the outputs are to stay there (an error naming the argument
/// if the caller asked for the CPU then), else `on_host()`.
pub(crate) fn resolve(
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
