//! The GPU contexts: instance, adapter, device and queue, with what the
//! adapter offers (`AdapterCaps`), its pipeline cache and its buffer pools;
//! one per adapter (`gpu:N`, in the order of `adapters.rs`), each created
//! lazily, shared by every thread, and replaced after its device is lost.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::adapters::{self, Gpu};
use super::caps::{driver_loop_limit, AdapterCaps};
use super::pipeline_cache::PipelineCache;
use super::pool::{Pooled, Pools};
use crate::error::{Error, Result};
use crate::fork::{self, ForkLocal};
use crate::runtime::lock;

/// Native backends only: an OpenGL adapter would be a silent correctness
/// and performance trap, and the browser backend does not apply here.
pub(crate) const BACKENDS: wgpu::Backends = wgpu::Backends::VULKAN
    .union(wgpu::Backends::METAL)
    .union(wgpu::Backends::DX12);

/// One instance per process: loading the Vulkan driver is slow (and some
/// drivers log on every load). A forked child makes its own (`fork.rs`):
/// the parent's belongs to driver threads the child does not have.
pub(crate) fn instance() -> &'static wgpu::Instance {
    static INSTANCE: ForkLocal<Option<&'static wgpu::Instance>> = ForkLocal::new();
    INSTANCE.lock().get_or_insert_with(|| {
        // Environment overrides (WGPU_BACKEND, ...) are ignored on purpose:
        // only the backends above are ever sound for flashport.
        Box::leak(Box::new(wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: BACKENDS,
            flags: wgpu::InstanceFlags::empty(),
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        })))
    })
}

/// The adapters in `gpu:N` order (`adapters::order`), enumerated once per
/// process: every `device="gpu:N"` is checked against the list, and an
/// enumeration costs milliseconds (each adapter's properties queried).
/// A device lost and opened again comes from the same adapter.
pub(crate) fn enumerate() -> Vec<wgpu::Adapter> {
    static ADAPTERS: ForkLocal<Option<Arc<Vec<wgpu::Adapter>>>> = ForkLocal::new();
    let listed = ADAPTERS
        .lock()
        .get_or_insert_with(|| {
            let adapters = pollster::block_on(instance().enumerate_adapters(BACKENDS));
            let infos: Vec<wgpu::AdapterInfo> = adapters.iter().map(|a| a.get_info()).collect();
            Arc::new(
                adapters::order(&infos)
                    .into_iter()
                    .map(|i| adapters[i].clone())
                    .collect(),
            )
        })
        .clone();
    let copies = test_copies();
    let mut adapters = Vec::with_capacity(listed.len() * copies);
    for _ in 0..copies {
        adapters.extend(listed.iter().cloned());
    }
    adapters
}

/// The test suites' way to a machine with several GPUs: with the
/// `testing` feature, `FLASHPORT_TEST_GPU_COPIES=N` (1 to 8) lists every
/// adapter N times, copy `c` of adapter `a` as `gpu:(c * count + a)`, each
/// opened as a device of its own (Vulkan lets one physical device have
/// several). Read at each enumeration, clamped to 1 to 8; a value that is
/// no number is one copy.
fn test_copies() -> usize {
    #[cfg(feature = "testing")]
    if let Ok(Ok(n)) = std::env::var(TEST_GPU_COPIES).map(|v| v.parse::<usize>()) {
        return n.clamp(1, 8);
    }
    1
}

/// See [`test_copies`].
#[cfg(feature = "testing")]
pub const TEST_GPU_COPIES: &str = "FLASHPORT_TEST_GPU_COPIES";

pub(crate) fn type_name(kind: wgpu::DeviceType) -> &'static str {
    match kind {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "software",
        wgpu::DeviceType::Other => "other",
    }
}

/// What `flashport.devices()` reports about one adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterInfo {
    /// N of `gpu:N`.
    pub index: usize,
    /// `domain:bus:device.function`, where the backend reports it (Vulkan
    /// and DX12 do): what identifies the card across processes.
    pub pci_bus_id: String,
    /// "vulkan", "metal", "dx12", ...
    pub backend: String,
    pub name: String,
    /// "discrete", "integrated", "virtual", "software" or "other".
    pub device_type: String,
    pub driver: String,
    /// Limits the backend uses, as (name, value).
    pub limits: Vec<(String, u64)>,
    /// Optional features the adapter offers that the kernels use where
    /// present: "shader-f16", "subgroups", "cooperative-matrix-f16".
    pub features: Vec<String>,
}

pub(crate) fn describe(index: usize, adapter: &wgpu::Adapter) -> AdapterInfo {
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
        index,
        pci_bus_id: info.device_pci_bus_id.clone(),
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
/// into float32 ones (what shaders/coop/forward.wgsl runs on).
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

pub(crate) struct Context {
    /// N of `gpu:N`: the adapter's place in `enumerate()`.
    pub index: usize,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub adapter: AdapterInfo,
    /// Whether WGSL's unpack2x16float works, which float16 inputs need.
    pub f16_inputs: bool,
    /// What kernel selection needs to know of the adapter and the device
    /// made from it (the features it offers are all enabled).
    pub caps: AdapterCaps,
    /// Timestamp queries are enabled: kernel times are measured on the GPU.
    pub timestamps: bool,
    /// Bytes of all the adapter's memory heaps, where the backend says
    /// (`memory.rs`): a KV cache's pools are checked against it.
    pub device_memory: Option<u64>,
    /// The lanes of every subgroup, where subgroup operations are enabled
    /// and the adapter's subgroups have one size (decoding's subgroup
    /// kernel lays its walkers out by it).
    pub subgroup_size: Option<u32>,
    /// A call polls for its work instead of sleeping until the driver
    /// wakes it, for up to this long (zero on a software adapter, whose
    /// threads need the CPU): src/gpu/transfer.rs, `wait_for`.
    pub spin: std::time::Duration,
    lost: Arc<AtomicBool>,
    /// The process that opened the device (`fork::generation`): in a
    /// forked child the device is as good as lost.
    generation: u64,
    /// Errors outside any error scope (there should be none): kept for the
    /// next message instead of wgpu's default handler, which panics.
    uncaptured: Arc<Mutex<Vec<String>>>,
    /// What the context has compiled (src/gpu/pipelines.rs compiles it).
    pub cache: PipelineCache,
    /// Buffers kept between calls (src/gpu/pool.rs).
    pools: Pools,
    /// Submissions queued without a wait that may still be running.
    queued: Mutex<Queued>,
    /// Queued calls' command buffers not yet handed to the queue.
    pending: Mutex<Pending>,
}

/// The command buffers of queued decoding calls and KV cache writes held
/// back, oldest first, and the upload staging buffers they copy from
/// (recycled once they are submitted). wgpu's `Queue::submit` costs the
/// host 20-30 µs however little it submits (H200: 25 of a queued decode
/// call's 71 µs), and a decode step makes two such calls per layer; held
/// ones go to the queue together, in one submission. The queue runs them
/// in this order, after everything submitted before and before anything
/// submitted after: every submission and every `Queue::write_buffer` of
/// the context goes through [`Context::defer`], [`Context::submit`],
/// [`Context::flush`] or [`Context::write_buffer`], which hand the held
/// ones over first, under this lock.
#[derive(Default)]
struct Pending {
    commands: Vec<wgpu::CommandBuffer>,
    staged: Vec<wgpu::Buffer>,
}

/// The most queued calls whose command buffers are held back: they go to
/// the GPU when this many are held, with the next call that is not held
/// (any other queued call, one that waits, a read), or at `synchronize()`.
pub(crate) const MAX_PENDING: usize = 8;

/// The submissions of a context queued without a wait, oldest first, each
/// numbered in the order it was queued.
#[derive(Default)]
struct Queued {
    in_flight: VecDeque<(u64, wgpu::SubmissionIndex)>,
    /// Submissions queued so far: the next one's number.
    count: u64,
}

/// The most submissions queued without a wait that a context lets run at
/// once: the next one waits for the oldest first. wgpu keeps each one's
/// command buffer, bind groups and upload staging buffers until it is
/// done, so a loop of calls that never waits would otherwise grow memory
/// without bound while the host outruns the GPU. Deep enough that the GPU
/// never idles behind a host that is faster than it (a decode call's
/// kernels take tens of microseconds, its host work about as long).
pub(crate) const MAX_QUEUED: usize = 32;

/// How long a call polls for its GPU work before it sleeps: a sleeping
/// thread wakes 0.1-0.15 ms after the GPU finishes (H100, driver 580), a
/// third of a small call and 1-3% of calls of 4-14 ms; past 20 ms that is
/// under 0.75%, and the core is not held any longer
/// (docs/gpu.md#host-transfers).
const SPIN: std::time::Duration = std::time::Duration::from_millis(20);

/// The contexts opened so far, by adapter index, and the index `"gpu"`
/// settled on.
#[derive(Default)]
struct Registry {
    contexts: Vec<Option<Arc<Context>>>,
    /// The first adapter that opened for [`Gpu::Best`], until its context
    /// is dropped: a driver that refuses a device is not asked again on
    /// every call.
    best: Option<usize>,
}

impl Registry {
    fn live(&self, index: usize) -> Option<&Arc<Context>> {
        self.contexts
            .get(index)
            .and_then(Option::as_ref)
            .filter(|ctx| !ctx.is_lost())
    }

    /// Adapter `index`'s context, opened if it has none (or a lost one).
    fn open(
        &mut self,
        index: usize,
        adapter: &wgpu::Adapter,
    ) -> std::result::Result<Arc<Context>, String> {
        if let Some(ctx) = self.live(index) {
            return Ok(ctx.clone());
        }
        if self.contexts.len() <= index {
            self.contexts.resize(index + 1, None);
        }
        self.contexts[index] = None;
        let ctx = Arc::new(Context::open(index, adapter)?);
        self.contexts[index] = Some(ctx.clone());
        Ok(ctx)
    }
}

/// A forked child opens contexts of its own (`fork.rs`).
static CONTEXTS: ForkLocal<Registry> = ForkLocal::new();

/// The context of `gpu`, created on first use and recreated after its
/// device was lost. The registry stays locked while a device opens, so
/// that two threads asking for one GPU at once open it once.
pub(crate) fn get(gpu: Gpu) -> Result<Arc<Context>> {
    let mut registry = CONTEXTS.lock();
    let known = match gpu {
        Gpu::Best => registry.best,
        Gpu::Index(n) => Some(n),
    };
    if let Some(ctx) = known.and_then(|i| registry.live(i)) {
        return Ok(ctx.clone());
    }
    // A child forked from a process that used the GPU: the driver's exit
    // handlers would wait for the parent's threads (fork.rs).
    crate::fork::end_child_before_driver_exit_handlers();
    let adapters = enumerate();
    if adapters.is_empty() {
        return Err(Error::BackendUnavailable(
            "no GPU adapter found: flashport needs a Vulkan, Metal or DX12 driver \
             (on Linux without a GPU, Mesa's lavapipe provides one); use device=\"cpu\""
                .to_string(),
        ));
    }
    let candidates = match gpu {
        // The best adapter that opens; a broken driver should not hide a
        // working one behind it.
        Gpu::Best => 0..adapters.len(),
        Gpu::Index(n) if n < adapters.len() => n..n + 1,
        Gpu::Index(n) => {
            // `Device::parse` checks indices; one can only get here with
            // an index made in Rust.
            return Err(Error::BackendUnavailable(format!(
                "there is no gpu:{n}: this machine has {} GPU adapter(s)",
                adapters.len()
            )));
        }
    };
    let mut failures = Vec::new();
    for index in candidates {
        match registry.open(index, &adapters[index]) {
            Ok(ctx) => {
                if gpu == Gpu::Best {
                    registry.best = Some(index);
                }
                return Ok(ctx);
            }
            Err(e) => failures.push(e),
        }
    }
    // NVIDIA's Vulkan driver refuses a device to a child forked from a
    // process that had one ("Parent device is lost"), as CUDA does.
    let forked = if crate::fork::generation() > 0 {
        " (this process was forked after flashport was first used: some drivers, \
         NVIDIA's among them, open no device in such a child; start workers with \
         multiprocessing's \"spawn\" or \"forkserver\" method to use the GPU there)"
    } else {
        ""
    };
    Err(Error::BackendUnavailable(format!(
        "no GPU adapter could be opened{}: {}{forked}; use device=\"cpu\"",
        match gpu {
            Gpu::Best => String::new(),
            Gpu::Index(n) => format!(" as gpu:{n}"),
        },
        failures.join("; ")
    )))
}

/// The context of adapter `index` if one is open, without creating one
/// (a lost one too, until a call replaces it).
pub(crate) fn current(index: usize) -> Option<Arc<Context>> {
    CONTEXTS.lock().contexts.get(index).cloned().flatten()
}

/// Every context open now, by index (lost ones too, until replaced).
pub(crate) fn open_contexts() -> Vec<Arc<Context>> {
    CONTEXTS.lock().contexts.iter().flatten().cloned().collect()
}

/// Forgets a context that failed, so the next call on its GPU starts
/// afresh; the other GPUs' contexts are untouched.
pub(crate) fn discard(ctx: &Arc<Context>) {
    ctx.lost.store(true, Ordering::SeqCst);
    let mut registry = CONTEXTS.lock();
    let slot = registry.contexts.get_mut(ctx.index);
    if let Some(slot) = slot.filter(|s| s.as_ref().is_some_and(|c| Arc::ptr_eq(c, ctx))) {
        *slot = None;
        if registry.best == Some(ctx.index) {
            registry.best = None;
        }
    }
}

impl Context {
    fn open(index: usize, adapter: &wgpu::Adapter) -> std::result::Result<Context, String> {
        let described = describe(index, adapter);
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
        let passthrough = offered.contains(wgpu::Features::PASSTHROUGH_SHADERS);
        // The backward kernels' subgroupBarrier() must validate when wgpu
        // compiles the WGSL itself; passthrough modules skip wgpu's check.
        let subgroup_barrier = offered.contains(wgpu::Features::SUBGROUP_BARRIER);
        let coop = subgroups
            && info.subgroup_min_size == 32
            && info.subgroup_max_size == 32
            && offered.contains(wgpu::Features::SHADER_F16)
            && coop_f16_f32(adapter)
            && (passthrough || subgroup_barrier);
        let mut features = wgpu::Features::empty();
        if coop {
            features |=
                wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
            if subgroup_barrier {
                features |= wgpu::Features::SUBGROUP_BARRIER;
            }
            if passthrough {
                features |= wgpu::Features::PASSTHROUGH_SHADERS;
            }
        }
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        // NVIDIA's cooperative matrices 2, for the float16 forward: the
        // device is then opened through wgpu-hal (gpu/cm2.rs).
        let cm2 = coop && passthrough && super::cm2::offered(adapter);
        let mut caps = AdapterCaps {
            workgroup_storage_bytes: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_workgroup_size_x: limits.max_compute_workgroup_size_x,
            subgroups,
            coop,
            passthrough: coop && passthrough,
            subgroup_barrier: coop && subgroup_barrier,
            cm2,
            loop_limit: driver_loop_limit(&info.name, &info.driver, &info.driver_info),
        };
        let desc = wgpu::DeviceDescriptor {
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
        };
        // A driver that lists the extension but will not open a device
        // with it still opens one without it: the cm2 forward then does
        // not run, the rest as before.
        let opened = match cm2.then(|| super::cm2::open(adapter, &desc)) {
            Some(Ok(opened)) => Ok(opened),
            _ => {
                caps.cm2 = false;
                pollster::block_on(adapter.request_device(&desc)).map_err(|e| e.to_string())
            }
        };
        let (device, queue) =
            opened.map_err(|e| format!("{} ({}): {e}", described.name, described.backend))?;
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
            index,
            device,
            queue,
            limits,
            adapter: described,
            f16_inputs,
            caps,
            timestamps,
            device_memory: super::memory::device_memory(adapter),
            subgroup_size: (subgroups && info.subgroup_min_size == info.subgroup_max_size)
                .then_some(info.subgroup_min_size),
            spin: if info.device_type == wgpu::DeviceType::Cpu {
                std::time::Duration::ZERO
            } else {
                SPIN
            },
            lost,
            generation: fork::generation(),
            uncaptured,
            cache: PipelineCache::default(),
            pools: Pools::new(),
            queued: Default::default(),
            pending: Default::default(),
        })
    }

    /// A device-local buffer of the pool ([`Pools::device_buffer`]).
    pub fn device_buffer(&self, bytes: u64) -> Pooled {
        self.pools.device_buffer(&self.device, bytes)
    }

    /// A device-local buffer of its own ([`Pools::owned_buffer`]).
    pub fn owned_buffer(&self, bytes: u64) -> Pooled {
        Pools::owned_buffer(&self.device, bytes)
    }

    /// A mapped upload staging buffer ([`Pools::take_upload_staging`]).
    pub fn take_upload_staging(&self, size: u64) -> wgpu::Buffer {
        self.pools.take_upload_staging(&self.device, size)
    }

    /// Keeps an upload staging buffer once its copy is done
    /// ([`Pools::recycle_upload_staging`]).
    pub fn recycle_upload_staging(&self, staging: wgpu::Buffer) {
        self.pools.recycle_upload_staging(staging);
    }

    /// An unmapped readback buffer ([`Pools::take_readback_buffer`]).
    pub fn take_readback_buffer(&self, size: u64) -> wgpu::Buffer {
        self.pools.take_readback_buffer(&self.device, size)
    }

    /// Keeps an unmapped readback buffer for later calls.
    pub fn return_readback_buffer(&self, buffer: wgpu::Buffer) {
        self.pools.return_readback_buffer(buffer);
    }

    /// Hands a queued call's `commands` (and its `staged` upload buffers)
    /// to the queue after the held ones, or, where the call may be held
    /// (`hold`) and fewer than `MAX_PENDING` calls are, holds them back too.
    /// The submission's index where it was submitted.
    pub(crate) fn defer(
        &self,
        commands: wgpu::CommandBuffer,
        staged: Vec<wgpu::Buffer>,
        hold: bool,
    ) -> Option<wgpu::SubmissionIndex> {
        let mut pending = lock(&self.pending);
        pending.commands.push(commands);
        pending.staged.extend(staged);
        if hold && pending.commands.len() < MAX_PENDING {
            return None;
        }
        Some(self.submit_pending(&mut pending))
    }

    /// Submits the calls held back, then `commands`, in one submission;
    /// recycles the upload staging of both (`staged`: `commands`' own).
    pub(crate) fn submit(
        &self,
        commands: wgpu::CommandBuffer,
        staged: Vec<wgpu::Buffer>,
    ) -> wgpu::SubmissionIndex {
        let mut pending = lock(&self.pending);
        pending.commands.push(commands);
        pending.staged.extend(staged);
        self.submit_pending(&mut pending)
    }

    /// Submits the calls held back, if any.
    pub(crate) fn flush(&self) {
        let mut pending = lock(&self.pending);
        if !pending.commands.is_empty() {
            let index = self.submit_pending(&mut pending);
            self.count_queued(index);
        }
    }

    /// `Queue::write_buffer`, after the calls held back: wgpu runs such a
    /// write before the commands of the next submission, so one made while
    /// calls are held back would otherwise run before them.
    pub(crate) fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, data: &[u8]) {
        let mut pending = lock(&self.pending);
        if !pending.commands.is_empty() {
            let index = self.submit_pending(&mut pending);
            self.count_queued(index);
        }
        self.queue.write_buffer(buffer, offset, data);
    }

    /// Submits `pending`'s command buffers in one submission and recycles
    /// their upload staging.
    fn submit_pending(&self, pending: &mut Pending) -> wgpu::SubmissionIndex {
        let index = self.queue.submit(pending.commands.drain(..));
        for staging in pending.staged.drain(..) {
            self.recycle_upload_staging(staging);
        }
        index
    }

    /// Counts a submission made by [`Context::flush`] or
    /// [`Context::write_buffer`] as queued without a wait, waiting for the
    /// oldest where `MAX_QUEUED` are in flight (as a queued call does). A
    /// failure of that wait is the device's, which the next call that
    /// waits or uses the context reports.
    fn count_queued(&self, index: wgpu::SubmissionIndex) {
        if let Some(oldest) = self.queued(index) {
            let _ = self.device.poll(wgpu::PollType::Wait {
                submission_index: Some(oldest),
                timeout: None,
            });
        }
    }

    /// Counts `index` as queued without a wait; the oldest queued
    /// submission, taken out of the count, where it must be waited for
    /// (`MAX_QUEUED` are in flight).
    pub(crate) fn queued(&self, index: wgpu::SubmissionIndex) -> Option<wgpu::SubmissionIndex> {
        let mut queued = lock(&self.queued);
        let number = queued.count;
        queued.count += 1;
        queued.in_flight.push_back((number, index));
        (queued.in_flight.len() > MAX_QUEUED)
            .then(|| queued.in_flight.pop_front().map(|(_, index)| index))
            .flatten()
    }

    /// The number the next queued submission will have: those below it
    /// are done once a submission made after this call is.
    pub(crate) fn queued_count(&self) -> u64 {
        lock(&self.queued).count
    }

    /// The queued submissions not yet known to be done.
    #[cfg(feature = "testing")]
    pub(crate) fn queued_len(&self) -> usize {
        lock(&self.queued).in_flight.len()
    }

    /// The queued calls whose commands are held back now.
    #[cfg(feature = "testing")]
    pub(crate) fn held_len(&self) -> usize {
        lock(&self.pending).commands.len()
    }

    /// Forgets the queued submissions numbered below `count`, done.
    pub(crate) fn done_before(&self, count: u64) {
        let mut queued = lock(&self.queued);
        while queued.in_flight.front().is_some_and(|&(n, _)| n < count) {
            queued.in_flight.pop_front();
        }
    }

    /// Waits until the GPU has done submission `index` (every submission
    /// so far where `None`) and its callbacks ran: polls for up to
    /// `self.spin` (or the overrides' time), as CUDA's default
    /// synchronisation spins, then sleeps in the driver, which wakes the
    /// thread 0.1-0.15 ms after the GPU is done (`SPIN`). Done is told by a
    /// work-done callback that a plain poll runs: a poll that waits with a
    /// zero timeout instead trips an assertion inside wgpu-core 30
    /// (device/resource.rs, "If the queue is empty, the current submission
    /// index ... should be at least the wait submission index") when the
    /// submission tracks no resources.
    pub(crate) fn wait(
        &self,
        index: Option<wgpu::SubmissionIndex>,
    ) -> std::result::Result<(), wgpu::PollError> {
        let spin = crate::overrides::current().spin.unwrap_or(self.spin);
        if !spin.is_zero() {
            let done = Arc::new(AtomicBool::new(false));
            let flag = done.clone();
            self.queue
                .on_submitted_work_done(move || flag.store(true, Ordering::Release));
            let until = Instant::now() + spin;
            loop {
                self.device.poll(wgpu::PollType::Poll)?;
                if done.load(Ordering::Acquire) {
                    // Everything submitted so far is done, and the poll
                    // ran its callbacks.
                    return Ok(());
                }
                if Instant::now() >= until {
                    break;
                }
                std::thread::yield_now();
            }
        }
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: index,
                timeout: None,
            })
            .map(|_| ())
    }

    /// Waits until the GPU has done everything submitted to this context
    /// so far, and returns an error if the device was lost, or wgpu
    /// reported an error outside any call, on the way: what
    /// `flashport.synchronize()` raises.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.flush();
        let count = self.queued_count();
        let waited = self.wait(None);
        if self.is_lost() {
            return Err(Error::Gpu(format!(
                "the work queued on {} and every device array it held are gone",
                self.adapter.name
            )));
        }
        waited.map_err(|e| {
            Error::Gpu(format!(
                "waiting for the GPU {} failed: {e}",
                self.adapter.name
            ))
        })?;
        let errors = self.take_uncaptured();
        if !errors.is_empty() {
            return Err(Error::Gpu(format!(
                "GPU error on {}: {}",
                self.adapter.name,
                errors.join("; ")
            )));
        }
        self.done_before(count);
        Ok(())
    }

    /// Whether this process was forked after the context was made (its
    /// device is the parent's, as good as lost here).
    pub fn forked(&self) -> bool {
        self.generation != fork::generation()
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst) || self.generation != fork::generation()
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
}
