//! What a context has compiled, kept for its lifetime: the maps only.
//! `pipelines.rs` compiles into them through the context; the cache sits
//! below the context that owns it, so that the two do not import each
//! other.

use std::collections::HashMap;
use std::sync::Mutex;

use super::kernel::Kernel;
use super::select::PipelineKey;

/// A context's shader modules and compute pipelines, by what they were
/// built from.
#[derive(Default)]
pub(crate) struct PipelineCache {
    /// The attention kernels' modules, by kernel, subgroups and float16
    /// inputs (their WGSL text: `shaders::source`).
    pub(super) modules: Mutex<HashMap<(Kernel, bool, bool), wgpu::ShaderModule>>,
    pub(super) pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    /// The device-array moves' pipelines (shaders' device-array helpers),
    /// by entry point and source text (its address: the texts are static,
    /// and two modules may share an entry point's name).
    pub(super) arrays: Mutex<HashMap<(&'static str, usize), wgpu::ComputePipeline>>,
    /// Pipelines of modules outside the attention tiers (decoding), by
    /// their label (which names the source) and override values.
    pub(super) specialised: Mutex<HashMap<SpecialisedKey, wgpu::ComputePipeline>>,
}

/// A module's label, its override values (as bits) in order, and whether
/// it runs without naga's index clamps.
pub(super) type SpecialisedKey = (&'static str, Vec<(&'static str, u64)>, bool);
