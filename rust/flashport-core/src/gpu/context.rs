//! The process-wide GPU context: instance, adapter, device, queue and the
//! pipeline cache, created lazily and shared by every thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::tiles::{DeviceCaps, Kernel, Tiles};
use super::AdapterInfo;
use crate::{Error, Result};

/// Native backends only: an OpenGL adapter would be a silent correctness
/// and performance trap, and the browser backend does not apply here.
pub(crate) const BACKENDS: wgpu::Backends = wgpu::Backends::VULKAN
    .union(wgpu::Backends::METAL)
    .union(wgpu::Backends::DX12);

/// One instance per process: loading the Vulkan driver is slow (and some
/// drivers log on every load).
pub(crate) fn instance() -> &'static wgpu::Instance {
    static INSTANCE: OnceLock<wgpu::Instance> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        // Environment overrides (WGPU_BACKEND, ...) are ignored on purpose:
        // only the backends above are ever sound for flashport.
        wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: BACKENDS,
            flags: wgpu::InstanceFlags::empty(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        })
    })
}

/// The adapters, best first.
pub(crate) fn enumerate() -> Vec<wgpu::Adapter> {
    let mut adapters = pollster::block_on(instance().enumerate_adapters(BACKENDS));
    adapters.sort_by_key(|a| rank(a.get_info().device_type));
    adapters
}

/// Lower is better: a hardware GPU beats a software rasteriser.
pub(crate) fn rank(kind: wgpu::DeviceType) -> u8 {
    match kind {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

pub(crate) fn type_name(kind: wgpu::DeviceType) -> &'static str {
    match kind {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "software",
        wgpu::DeviceType::Other => "other",
    }
}

pub(crate) fn describe(adapter: &wgpu::Adapter) -> AdapterInfo {
    let info = adapter.get_info();
    let limits = adapter.limits();
    let features = adapter.features();
    let driver = match (info.driver.is_empty(), info.driver_info.is_empty()) {
        (false, false) => format!("{} ({})", info.driver, info.driver_info),
        (false, true) => info.driver.clone(),
        _ => info.driver_info.clone(),
    };
    let mut feature_names = Vec::new();
    if features.contains(wgpu::Features::SHADER_F16) {
        feature_names.push("shader-f16".to_string());
    }
    if features.contains(wgpu::Features::SUBGROUP) {
        feature_names.push("subgroups".to_string());
    }
    if coop_f16_f32(adapter) {
        feature_names.push("cooperative-matrix-f16".to_string());
    }
    AdapterInfo {
        backend: info.backend.to_string(),
        name: info.name.clone(),
        device_type: type_name(info.device_type).to_string(),
        driver,
        limits: vec![
            (
                "max_compute_workgroup_storage_size".to_string(),
                limits.max_compute_workgroup_storage_size as u64,
            ),
            (
                "max_compute_invocations_per_workgroup".to_string(),
                limits.max_compute_invocations_per_workgroup as u64,
            ),
            (
                "max_compute_workgroups_per_dimension".to_string(),
                limits.max_compute_workgroups_per_dimension as u64,
            ),
            (
                "max_storage_buffer_binding_size".to_string(),
                limits.max_storage_buffer_binding_size,
            ),
            ("max_buffer_size".to_string(), limits.max_buffer_size),
        ],
        features: feature_names,
    }
}

/// Whether the adapter multiplies 16x16x16 float16 cooperative matrices
/// into float32 ones (what shaders/forward_coop.wgsl runs on).
pub(crate) fn coop_f16_f32(adapter: &wgpu::Adapter) -> bool {
    adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
}

/// What FLASHPORT_GPU_COOP asks of the cooperative-matrix kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoopPolicy {
    /// `0`: never; the device is created without cooperative matrices.
    Off,
    /// Unset (the default) or `1`: wherever their tiles fit (d, dv multiples
    /// of 16 up to 128). Measured faster than the tiled kernels at every
    /// head dimension on the H100 (driver 580), forward and backward:
    /// (4,16,4096,64) forward 5.5 ms against 13.7, backward 22 against 57;
    /// (4,16,4096,128) forward 10.7 against 45, backward 40 against 300
    /// (benchmarks/GPU_NOTES.md, sessions 5 to 7).
    On,
}

fn coop_policy_from_env() -> CoopPolicy {
    match std::env::var("FLASHPORT_GPU_COOP").as_deref() {
        Ok("0") => CoopPolicy::Off,
        _ => CoopPolicy::On,
    }
}

/// Whether `kernel` runs without naga's index clamps: the register-tiled
/// and cooperative-matrix kernels in release builds, unless
/// FLASHPORT_GPU_CHECKED=1 (see `Context::module`).
fn unchecked(kernel: Kernel) -> bool {
    (kernel.is_tiled() || kernel.is_coop())
        && !cfg!(debug_assertions)
        && std::env::var("FLASHPORT_GPU_CHECKED").as_deref() != Ok("1")
}

/// Which compiled pipeline a dispatch needs; everything that is a WGSL
/// override is part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PipelineKey {
    pub kernel: Kernel,
    pub f16_inputs: bool,
    pub d: u32,
    pub dv: u32,
    pub tiles: Tiles,
    /// Which row-reduction fragment the tiled forward is built with.
    pub subgroups: bool,
    pub variants: super::shaders::Variants,
}

pub(crate) struct Context {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub adapter: AdapterInfo,
    /// Whether WGSL's unpack2x16float works, which float16 inputs need.
    pub f16_inputs: bool,
    /// Subgroup operations are enabled on the device and its subgroups
    /// have at least 8 lanes.
    pub subgroups: bool,
    /// Timestamp queries are enabled: kernel times are measured on the GPU.
    pub timestamps: bool,
    /// The cooperative-matrix float16 kernels can run: 16x16x16 f16 -> f32
    /// cooperative matrices, shader f16 and subgroups of exactly 32 lanes
    /// (its subgroups own 16 rows each, two lanes per row) are enabled, and
    /// the backward's subgroup barriers compile (passthrough, or wgpu's
    /// SUBGROUP_BARRIER feature).
    pub coop: bool,
    /// The cooperative kernels are built from SPIR-V written here with the
    /// GLSL450 memory model (src/gpu/spirv.rs says why) and handed to the
    /// driver through wgpu's passthrough; false where the adapter offers no
    /// passthrough or FLASHPORT_GPU_COOP_SPIRV=naga asks for wgpu's own
    /// SPIR-V (Vulkan memory model without the operands it needs; gave the
    /// same results as the GLSL450 module on the H100).
    pub coop_passthrough: bool,
    lost: Arc<AtomicBool>,
    /// Errors outside any error scope (there should be none): kept for the
    /// next message instead of wgpu's default handler, which panics.
    uncaptured: Arc<Mutex<Vec<String>>>,
    modules: Mutex<HashMap<(Kernel, bool, bool), wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    /// Pipelines of the device-array moves (shaders/device_arrays.wgsl),
    /// by entry point.
    array_pipelines: Mutex<HashMap<&'static str, wgpu::ComputePipeline>>,
    /// Mappable buffers of earlier calls' readbacks, kept for the next
    /// call: allocating (and first touching) a fresh host buffer of the
    /// outputs' size cost more than copying out of it.
    readback_pool: BufferPool,
    /// Mapped staging buffers for uploads, remapped in the background after
    /// each use: wgpu would stage every upload through a fresh host
    /// allocation, whose first touch cost more than the copy.
    upload_pool: BufferPool,
}

/// Host-visible buffers kept between calls for reuse, within bounds on
/// their count, the largest one kept and the bytes held in all: bounds the
/// host memory a finished call leaves behind.
#[derive(Clone)]
struct BufferPool {
    buffers: Arc<Mutex<Vec<wgpu::Buffer>>>,
    max_buffers: usize,
    max_buffer_bytes: u64,
    max_total_bytes: u64,
}

impl BufferPool {
    fn new(max_buffers: usize, max_buffer_bytes: u64, max_total_bytes: u64) -> Self {
        BufferPool {
            buffers: Default::default(),
            max_buffers,
            max_buffer_bytes,
            max_total_bytes,
        }
    }

    /// The smallest kept buffer of at least `size` bytes, or `create(size)`.
    fn take(&self, size: u64, create: impl FnOnce(u64) -> wgpu::Buffer) -> wgpu::Buffer {
        let mut pool = lock(&self.buffers);
        let best = (0..pool.len())
            .filter(|&i| pool[i].size() >= size)
            .min_by_key(|&i| pool[i].size());
        match best {
            Some(i) => pool.swap_remove(i),
            None => create(size),
        }
    }

    /// Keeps `buffer`, dropping the smallest kept ones while over bounds.
    fn keep(&self, buffer: wgpu::Buffer) {
        if buffer.size() > self.max_buffer_bytes {
            return;
        }
        let mut pool = lock(&self.buffers);
        pool.push(buffer);
        while pool.len() > self.max_buffers
            || pool.iter().map(wgpu::Buffer::size).sum::<u64>() > self.max_total_bytes
        {
            match (0..pool.len()).min_by_key(|&i| pool[i].size()) {
                Some(i) => drop(pool.swap_remove(i)),
                None => break,
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded maps stay consistent even if a holder panicked.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

static CONTEXT: OnceLock<Mutex<Option<Arc<Context>>>> = OnceLock::new();

/// The shared context, created on first use and recreated after the device
/// was lost.
pub(crate) fn get() -> Result<Arc<Context>> {
    let mut slot = lock(CONTEXT.get_or_init(Default::default));
    if let Some(ctx) = slot.as_ref() {
        if !ctx.is_lost() {
            return Ok(ctx.clone());
        }
    }
    *slot = None;
    let ctx = Arc::new(Context::create()?);
    *slot = Some(ctx.clone());
    Ok(ctx)
}

/// The shared context if one exists, without creating one.
pub(crate) fn current() -> Option<Arc<Context>> {
    lock(CONTEXT.get_or_init(Default::default)).clone()
}

/// Forgets a context that failed, so the next call starts afresh.
pub(crate) fn discard(ctx: &Arc<Context>) {
    ctx.lost.store(true, Ordering::SeqCst);
    let mut slot = lock(CONTEXT.get_or_init(Default::default));
    if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, ctx)) {
        *slot = None;
    }
}

impl Context {
    fn create() -> Result<Context> {
        let adapters = enumerate();
        if adapters.is_empty() {
            return Err(Error::BackendUnavailable(
                "no GPU adapter found: flashport needs a Vulkan, Metal or DX12 driver \
                 (on Linux without a GPU, Mesa's lavapipe provides one); use device=\"cpu\""
                    .to_string(),
            ));
        }
        // The best adapter that opens; a broken driver should not hide a
        // working one behind it.
        let mut failures = Vec::new();
        for adapter in adapters {
            match Self::open(&adapter) {
                Ok(ctx) => return Ok(ctx),
                Err(e) => failures.push(e),
            }
        }
        Err(Error::BackendUnavailable(format!(
            "no GPU adapter could be opened: {}; use device=\"cpu\"",
            failures.join("; ")
        )))
    }

    fn open(adapter: &wgpu::Adapter) -> std::result::Result<Context, String> {
        let described = describe(adapter);
        let f16_inputs = adapter
            .get_downlevel_capabilities()
            .flags
            .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32);
        // The defaults cap workgroup memory at 16 KiB and bindings at
        // 128 MiB; the kernels size their tiles from what the adapter has.
        let limits = adapter.limits();
        let info = adapter.get_info();
        let offered = adapter.features();
        // Optional features, each used only where offered: subgroups for
        // the tiled forward's row reductions (a row group spans 8 lanes),
        // timestamps to report kernel time apart from transfers.
        let subgroups = offered.contains(wgpu::Features::SUBGROUP) && info.subgroup_min_size >= 8;
        let timestamps = offered.contains(wgpu::Features::TIMESTAMP_QUERY);
        let coop_policy = coop_policy_from_env();
        let passthrough = offered.contains(wgpu::Features::PASSTHROUGH_SHADERS)
            && std::env::var("FLASHPORT_GPU_COOP_SPIRV").as_deref() != Ok("naga");
        // The backward kernels' subgroupBarrier() must validate when wgpu
        // compiles the WGSL itself; passthrough modules skip wgpu's check.
        let subgroup_barrier = offered.contains(wgpu::Features::SUBGROUP_BARRIER);
        let coop = subgroups
            && info.subgroup_min_size == 32
            && info.subgroup_max_size == 32
            && offered.contains(wgpu::Features::SHADER_F16)
            && coop_f16_f32(adapter)
            && (passthrough || subgroup_barrier)
            && coop_policy != CoopPolicy::Off;
        let coop_passthrough = coop && passthrough;
        let mut features = wgpu::Features::empty();
        if coop {
            features |=
                wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        if coop && subgroup_barrier {
            features |= wgpu::Features::SUBGROUP_BARRIER;
        }
        if coop_passthrough {
            features |= wgpu::Features::PASSTHROUGH_SHADERS;
        }
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("flashport"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: if coop {
                // SAFETY: wgpu's opt-in for its experimental features; only
                // the cooperative-matrix forward uses one, and only where
                // the adapter reports the configuration it runs on.
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        }))
        .map_err(|e| format!("{} ({}): {e}", described.name, described.backend))?;
        let lost = Arc::new(AtomicBool::new(false));
        let flag = lost.clone();
        device.set_device_lost_callback(move |_, _| flag.store(true, Ordering::SeqCst));
        let uncaptured: Arc<Mutex<Vec<String>>> = Default::default();
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut errors = lock(&sink);
            if errors.len() < 16 {
                errors.push(e.to_string());
            }
        }));
        Ok(Context {
            device,
            queue,
            limits,
            adapter: described,
            f16_inputs,
            subgroups,
            timestamps,
            coop,
            coop_passthrough,
            lost,
            uncaptured,
            modules: Default::default(),
            pipelines: Default::default(),
            array_pipelines: Default::default(),
            // A call's outputs read back through one buffer; its inputs
            // upload through one each (up to six, plus the parameters).
            readback_pool: BufferPool::new(2, 256 << 20, 512 << 20),
            upload_pool: BufferPool::new(8, 256 << 20, 512 << 20),
        })
    }

    /// A mapped MAP_WRITE | COPY_SRC buffer of at least `size` bytes: the
    /// smallest kept one that fits, or a new one.
    pub fn take_upload_staging(&self, size: u64) -> wgpu::Buffer {
        self.upload_pool.take(size, |size| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport upload"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })
    }

    /// Maps an upload staging buffer again once the copy out of it (already
    /// submitted) is done, and keeps it for later calls. The map completes
    /// at the next poll, which every call makes while waiting for its
    /// results.
    pub fn recycle_upload_staging(&self, staging: wgpu::Buffer) {
        if staging.size() > self.upload_pool.max_buffer_bytes {
            return;
        }
        let pool = self.upload_pool.clone();
        let kept = staging.clone();
        staging.map_async(wgpu::MapMode::Write, .., move |mapped| {
            if mapped.is_ok() {
                pool.keep(kept);
            }
        });
    }

    /// An unmapped MAP_READ | COPY_DST buffer of at least `size` bytes:
    /// the smallest kept one that fits, or a new one.
    pub fn take_readback_buffer(&self, size: u64) -> wgpu::Buffer {
        self.readback_pool.take(size, |size| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// Keeps an unmapped readback buffer for later calls.
    pub fn return_readback_buffer(&self, buffer: wgpu::Buffer) {
        self.readback_pool.keep(buffer);
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            workgroup_storage_bytes: self.limits.max_compute_workgroup_storage_size,
            max_invocations: self.limits.max_compute_invocations_per_workgroup,
            max_workgroup_size_x: self.limits.max_compute_workgroup_size_x,
            subgroups: self.subgroups,
        }
    }

    pub fn take_uncaptured(&self) -> Vec<String> {
        std::mem::take(&mut *lock(&self.uncaptured))
    }

    /// Runs `f` with wgpu's errors captured: validation, out-of-memory and
    /// internal errors become `Error::Gpu` instead of reaching the
    /// uncaptured-error handler.
    pub fn scoped<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let result = f();
        let errors = [
            pollster::block_on(validation.pop()),
            pollster::block_on(internal.pop()),
            pollster::block_on(oom.pop()),
        ];
        let mut messages: Vec<String> = errors
            .into_iter()
            .flatten()
            .map(|e| e.to_string())
            .collect();
        messages.extend(self.take_uncaptured());
        if !messages.is_empty() {
            return Err(Error::Gpu(format!(
                "GPU error while {what} on {}: {}",
                self.adapter.name,
                messages.join("; ")
            )));
        }
        result
    }

    fn module(&self, kernel: Kernel, subgroups: bool, f16: bool) -> Result<wgpu::ShaderModule> {
        // Only the tiled kernels' text depends on the input type.
        let f16 = f16 && kernel.is_tiled();
        if let Some(m) = lock(&self.modules).get(&(kernel, subgroups, f16)) {
            return Ok(m.clone());
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name()),
            source: wgpu::ShaderSource::Wgsl(super::shaders::source(kernel, subgroups, f16).into()),
        };
        // The register-tiled kernels run without the index clamps (and loop
        // bounds) naga adds to every array access: measured on the H100,
        // the clamps cost 1.47x at d=64 and 1.9x at d=128 in the tiled
        // forward (benchmarks/GPU_NOTES.md). Their indices are in bounds by
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
        lock(&self.modules).insert((kernel, subgroups, f16), module.clone());
        Ok(module)
    }

    /// A compute pipeline for `source` (entry point `main`) built from SPIR-V
    /// written by naga here, with `constants` applied before, the memory
    /// model switched to GLSL450 where `glsl450` (src/gpu/spirv.rs) and an
    /// explicit layout of every group-0 binding the module declares.
    pub fn spirv_pipeline(
        &self,
        label: &str,
        source: &str,
        constants: &[(&str, f64)],
        unchecked: bool,
        glsl450: bool,
    ) -> Result<wgpu::ComputePipeline> {
        let compiled = super::spirv::compile(source, constants, unchecked, glsl450)
            .map_err(|e| Error::Gpu(format!("compiling {label} to SPIR-V: {e}")))?;
        self.scoped("building a SPIR-V pipeline", || {
            let [x, y, z] = compiled.workgroup_size;
            let entry_points = [wgpu::PassthroughShaderEntryPoint {
                name: "main".into(),
                workgroup_size: (x, y, z),
            }];
            // SAFETY: the words are naga's own output for a module naga
            // validated, changed only in the memory model it declares
            // (spirv::glsl450_memory_model), which the device supports.
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
        if let Some(p) = lock(&self.array_pipelines).get(entry) {
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
        lock(&self.array_pipelines).insert(entry, pipeline.clone());
        Ok(pipeline)
    }

    /// The pipeline for `key`, compiled once per process. Only pipelines
    /// that compiled without error are cached.
    pub fn pipeline(&self, key: PipelineKey) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = lock(&self.pipelines).get(&key) {
            return Ok(p.clone());
        }
        if key.kernel.is_coop() && self.coop_passthrough {
            let source = super::shaders::source(key.kernel, key.subgroups, key.f16_inputs);
            let constants = super::shaders::overrides(&key);
            let pipeline = self.spirv_pipeline(
                key.kernel.name(),
                &source,
                &constants,
                unchecked(key.kernel),
                true,
            )?;
            lock(&self.pipelines).insert(key, pipeline.clone());
            return Ok(pipeline);
        }
        let module = self.module(key.kernel, key.subgroups, key.f16_inputs)?;
        let mut constants = super::shaders::overrides(&key);
        if matches!(
            key.kernel,
            Kernel::BackwardDqCoop | Kernel::BackwardDkDvCoop
        ) {
            // wgpu's SPIR-V gives subgroupBarrier() SubgroupMemory
            // semantics, which Vulkan ignores: wait workgroup-wide instead
            // (shaders/backward_dkdv_coop.wgsl, SUBGROUP_SCRATCH).
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
        lock(&self.pipelines).insert(key, pipeline.clone());
        Ok(pipeline)
    }
}
