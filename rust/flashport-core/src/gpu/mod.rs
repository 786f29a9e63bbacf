//! The GPU backend (WGSL through wgpu). Work in progress: this placeholder
//! reports the backend as unavailable until the kernels land.

use crate::{Error, ForwardOutput, Gradients, Problem, Result, Slice};

/// What `flashport.devices()` reports about one adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// "vulkan", "metal", "dx12", ...
    pub backend: String,
    pub name: String,
    /// "discrete", "integrated", "virtual", "software" or "other".
    pub device_type: String,
    pub driver: String,
    /// Limits the backend uses, as (name, value).
    pub limits: Vec<(String, u64)>,
    /// Optional features the backend uses, e.g. "shader-f16", "subgroups".
    pub features: Vec<String>,
}

fn unavailable() -> Error {
    Error::BackendUnavailable("the GPU backend is not built yet".to_string())
}

/// Adapters flashport can use, without creating a device.
pub fn adapters() -> Vec<AdapterInfo> {
    Vec::new()
}

/// Whether a non-software adapter exists (what `device="auto"` needs).
pub fn hardware_adapter_available() -> bool {
    false
}

pub fn forward(
    _problem: &Problem,
    _q: Slice<'_>,
    _k: Slice<'_>,
    _v: Slice<'_>,
) -> Result<ForwardOutput> {
    Err(unavailable())
}

pub fn backward(
    _problem: &Problem,
    _d_out: Slice<'_>,
    _q: Slice<'_>,
    _k: Slice<'_>,
    _v: Slice<'_>,
    _out: Slice<'_>,
    _lse: Slice<'_>,
) -> Result<Gradients> {
    Err(unavailable())
}
