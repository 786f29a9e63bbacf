//! Compiling the kernels: shader modules and compute pipelines, cached
//! per context by their key (in its `PipelineCache`), built from wgpu's
//! WGSL or, for the cooperative kernels where the driver takes it, from
//! SPIR-V written here.

use super::context::Context;
use super::kernel::{Kernel, Pass, Tier};
use super::pipeline_cache::SpecialisedKey;
use super::select::PipelineKey;
use crate::error::{Error, Result};
use crate::runtime::lock;

/// Whether `kernel` runs without naga's index clamps: the register-tiled
/// and cooperative-matrix kernels in release builds, unless
/// `FLASHPORT_GPU_CHECKED=1`, a debugging switch users have (see
/// `Context::module`).
fn unchecked(kernel: Kernel) -> bool {
    (kernel.is_tiled() || kernel.is_coop()) && clamps_off()
}

/// Whether kernels whose indices are in bounds by construction run
/// without naga's index clamps: release builds, unless
/// `FLASHPORT_GPU_CHECKED=1`.
pub(crate) fn clamps_off() -> bool {
    !cfg!(debug_assertions) && !crate::env::switch_on(crate::env::GPU_CHECKED)
}

impl Context {
    fn module(&self, kernel: Kernel, subgroups: bool, f16: bool) -> Result<wgpu::ShaderModule> {
        if let Some(m) = lock(&self.cache.modules).get(&(kernel, subgroups, f16)) {
            return Ok(m.clone());
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name()),
            source: wgpu::ShaderSource::Wgsl(super::shaders::source(kernel, subgroups, f16).into()),
        };
        // The register-tiled kernels run without the index clamps (and loop
        // bounds) naga adds to every array access: measured on the H100,
        // the clamps cost 1.47x at d=64 and 1.9x at d=128 in the tiled
        // forward (docs/gpu.md#no-bounds-checks-in-release). Their indices are in bounds by
        // construction: every global access is guarded by a row/column
        // bound, every workgroup index is below the host-computed array
        // size (tiles::tiled_workgroup_vec4s). Debug builds (the Rust
        // tests) and FLASHPORT_GPU_CHECKED=1 keep the clamps.
        // The cooperative kernels' indices are in bounds the same way
        // (tiles::coop_elems and CoopBackwardLayout size their arrays).
        let unchecked = unchecked(kernel);
        let module = self.scoped("compiling a shader", || {
            Ok(if unchecked {
                // SAFETY: see above; the tiled kernels' indices are bounded by
                // their guards and the host-computed array sizes.
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            } else {
                self.device.create_shader_module(desc)
            })
        })?;
        lock(&self.cache.modules).insert((kernel, subgroups, f16), module.clone());
        Ok(module)
    }

    /// A compute pipeline for `source` (entry point `main`) built from SPIR-V
    /// written by naga here, with `constants` applied before, the memory
    /// model switched to GLSL450 (src/gpu/spirv.rs) and an explicit layout
    /// of every group-0 binding the module declares.
    fn spirv_pipeline(
        &self,
        label: &str,
        source: &str,
        constants: &[(&str, f64)],
        unchecked: bool,
    ) -> Result<wgpu::ComputePipeline> {
        let compiled = super::spirv::compile(source, constants, unchecked, true)
            .map_err(|e| Error::Gpu(format!("compiling {label} to SPIR-V: {e}")))?;
        // SAFETY: the words are naga's own output for a module naga
        // validated, changed only in the memory model it declares
        // (spirv::glsl450_memory_model), which the device supports.
        unsafe { self.passthrough_pipeline(label, &compiled) }
    }

    /// The cooperative-matrix-2 kernel of `key` (gpu/cm2.rs), its sizes
    /// set in its SPIR-V. Its bindings are the other tiers': the uniform,
    /// the forward's q, k, v (read) and o, lse; the backward's do, q, k, v,
    /// stats (read) and dQ with the score gradient's stand-in, or dK and
    /// dV; the variants' arrays (binding 15, read).
    fn cm2_pipeline(&self, key: &PipelineKey) -> Result<wgpu::ComputePipeline> {
        use super::cm2::{
            kernel_words, SPEC_ALIBI, SPEC_BC, SPEC_BR, SPEC_CLAMP, SPEC_D, SPEC_DV, SPEC_MASK,
            SPEC_SINKS, SPEC_SOFTCAP, SPEC_WINDOW,
        };
        let t = key.tiles;
        let words = kernel_words(
            key.kernel,
            &[
                (SPEC_D, key.d),
                (SPEC_DV, key.dv),
                (SPEC_BR, t.q_rows),
                (SPEC_BC, t.k_rows),
                (SPEC_CLAMP, u32::from(!key.exact_tiles)),
                (SPEC_SOFTCAP, u32::from(key.variants.softcap)),
                (SPEC_WINDOW, u32::from(key.variants.window)),
                (SPEC_ALIBI, u32::from(key.variants.alibi)),
                (SPEC_MASK, u32::from(key.variants.mask)),
                (SPEC_SINKS, u32::from(key.variants.sinks)),
            ],
        )
        .map_err(|e| Error::Gpu(format!("specialising {}: {e}", key.kernel.name())))?;
        let storage = |binding: u32, read_only: bool| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let mut bindings = vec![wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        }];
        let reads = if key.kernel.pass() == Pass::Forward {
            3
        } else {
            5
        };
        bindings.extend((1..=reads).map(|b| storage(b, true)));
        bindings.extend((reads + 1..=reads + 2).map(|b| storage(b, false)));
        bindings.push(storage(15, true));
        let compiled = super::spirv::Compiled {
            words,
            bindings,
            workgroup_size: [t.workgroup, 1, 1],
        };
        // SAFETY: glslang's module, checked by spirv-val when it was
        // written (scripts/cm2.sh); the device was opened with every
        // capability it declares (gpu/cm2.rs), and only its constants'
        // values changed.
        unsafe { self.passthrough_pipeline(key.kernel.name(), &compiled) }
    }

    /// A pipeline of `compiled`'s words as they are, its layout the
    /// bindings it lists.
    ///
    /// # Safety
    /// The words must be a valid module for this device.
    unsafe fn passthrough_pipeline(
        &self,
        label: &str,
        compiled: &super::spirv::Compiled,
    ) -> Result<wgpu::ComputePipeline> {
        self.scoped("building a SPIR-V pipeline", || {
            let [x, y, z] = compiled.workgroup_size;
            let entry_points = [wgpu::PassthroughShaderEntryPoint {
                name: "main".into(),
                workgroup_size: (x, y, z),
            }];
            // SAFETY: the caller's (see above).
            let module = unsafe {
                self.device.create_shader_module_passthrough(
                    wgpu::ShaderModuleDescriptorPassthrough {
                        label: Some(label),
                        entry_points: entry_points.as_slice().into(),
                        spirv: Some(compiled.words.as_slice().into()),
                        ..Default::default()
                    },
                )
            };
            let group = self
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(label),
                    entries: &compiled.bindings,
                });
            let layout = self
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some(label),
                    bind_group_layouts: &[Some(&group)],
                    immediate_size: 0,
                });
            Ok(self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(label),
                    layout: Some(&layout),
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                }))
        })
    }

    /// The pipeline of entry point `entry` of `source` (one module per
    /// entry: the device-array moves), compiled once per context.
    pub fn array_pipeline(
        &self,
        entry: &'static str,
        source: &'static str,
    ) -> Result<wgpu::ComputePipeline> {
        let key = (entry, source.as_ptr() as usize);
        if let Some(p) = lock(&self.cache.arrays).get(&key) {
            return Ok(p.clone());
        }
        let pipeline = self.scoped("building a device-array pipeline", || {
            let module = self
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(entry),
                    source: wgpu::ShaderSource::Wgsl(source.into()),
                });
            Ok(self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                }))
        })?;
        lock(&self.cache.arrays).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// The pipeline of entry point `main` of the WGSL `source()` names
    /// (one text per label), specialised with `constants`, compiled once
    /// per context; without naga's index clamps where `unchecked` (see
    /// `Context::module` for when a kernel may drop them).
    pub fn specialised_pipeline(
        &self,
        label: &'static str,
        source: impl FnOnce() -> String,
        constants: &[(&'static str, f64)],
        unchecked: bool,
    ) -> Result<wgpu::ComputePipeline> {
        let key: SpecialisedKey = (
            label,
            constants.iter().map(|&(n, v)| (n, v.to_bits())).collect(),
            unchecked,
        );
        if let Some(p) = lock(&self.cache.specialised).get(&key) {
            return Ok(p.clone());
        }
        let pipeline = self.scoped("building a pipeline", || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source().into()),
            };
            let module = if unchecked {
                // SAFETY: the caller's kernel keeps its indices in bounds
                // by construction (its module says how).
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            } else {
                self.device.create_shader_module(desc)
            };
            Ok(self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(label),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        // The kernels write their workgroup arrays before
                        // they read them.
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                }))
        })?;
        lock(&self.cache.specialised).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// As [`Context::specialised_pipeline`] for a cooperative-matrix
    /// kernel: built from SPIR-V written here with the GLSL450 memory
    /// model where the driver takes passthrough SPIR-V, as the cooperative
    /// attention kernels are (`Context::pipeline`), unless `naga_spirv`
    /// (the test knob of that name).
    pub fn coop_pipeline(
        &self,
        label: &'static str,
        source: impl FnOnce() -> String,
        constants: &[(&'static str, f64)],
        unchecked: bool,
        naga_spirv: bool,
    ) -> Result<wgpu::ComputePipeline> {
        if !self.caps.passthrough || naga_spirv {
            return self.specialised_pipeline(label, source, constants, unchecked);
        }
        let key: SpecialisedKey = (
            label,
            constants.iter().map(|&(n, v)| (n, v.to_bits())).collect(),
            unchecked,
        );
        if let Some(p) = lock(&self.cache.specialised).get(&key) {
            return Ok(p.clone());
        }
        let pipeline = self.spirv_pipeline(label, &source(), constants, unchecked)?;
        lock(&self.cache.specialised).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    /// The pipeline for `key`, compiled once per process. Only pipelines
    /// that compiled without error are cached.
    pub fn pipeline(&self, key: PipelineKey) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = lock(&self.cache.pipelines).get(&key) {
            return Ok(p.clone());
        }
        if key.kernel.tier() == Tier::Cm2 {
            let pipeline = self.cm2_pipeline(&key)?;
            lock(&self.cache.pipelines).insert(key, pipeline.clone());
            return Ok(pipeline);
        }
        if key.passthrough {
            let source = super::shaders::source(key.kernel, key.subgroups, key.f16_inputs);
            let constants = super::shaders::overrides(&key);
            let pipeline = self.spirv_pipeline(
                key.kernel.name(),
                &source,
                &constants,
                unchecked(key.kernel),
            )?;
            lock(&self.cache.pipelines).insert(key, pipeline.clone());
            return Ok(pipeline);
        }
        let module = self.module(key.kernel, key.subgroups, key.f16_inputs)?;
        let mut constants = super::shaders::overrides(&key);
        if matches!(
            (key.kernel.pass(), key.kernel.tier()),
            (Pass::BackwardDq | Pass::BackwardDkDv, Tier::Coop)
        ) {
            // wgpu's SPIR-V gives subgroupBarrier() SubgroupMemory
            // semantics, which Vulkan ignores: wait workgroup-wide instead
            // (lib/coop.wgsl, SUBGROUP_SCRATCH).
            constants.push(("SUBGROUP_SCRATCH", 0.0));
        }
        let pipeline = self.scoped("building a pipeline", || {
            Ok(self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(key.kernel.name()),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &constants,
                        // Every kernel writes its workgroup arrays before it
                        // reads them; zeroing them first is wasted work.
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                }))
        })?;
        lock(&self.cache.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }
}
