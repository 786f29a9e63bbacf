//! The device, its buffers, and the timed dispatches.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use wgpu::util::DeviceExt;

/// Lower is better: any hardware adapter beats a software rasteriser,
/// which is kept only so that the tool can be tested without a GPU.
fn rank(kind: wgpu::DeviceType) -> u8 {
    match kind {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// What the parent process needs to know of the adapter, without a device.
pub struct AdapterInfo {
    pub name: String,
    pub driver: String,
    pub device_type: String,
    pub timestamps: bool,
    /// `Err(why)` where the cooperative-matrix kernels cannot run.
    pub coop: Result<(), String>,
    pub max_workgroup_bytes: u32,
    pub max_invocations: u32,
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub timestamps: bool,
    lost: Arc<AtomicBool>,
    uncaptured: Arc<Mutex<Vec<String>>>,
}

/// Why the adapter cannot run the cooperative kernels, if it cannot: they
/// need 16x16x16 f16 -> f32 cooperative matrices, shader f16, and
/// subgroups of exactly 32 lanes (a subgroup's fragments are 16x16 blocks
/// of 32 lanes' registers; `subgroup_id` must number them).
fn coop_support(adapter: &wgpu::Adapter) -> Result<(), String> {
    let features = adapter.features();
    let info = adapter.get_info();
    if !features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        return Err("the adapter has no cooperative matrices".to_string());
    }
    let f16_f32 = adapter.cooperative_matrix_properties().iter().any(|c| {
        (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
            && c.ab_type == wgpu::CooperativeScalarType::F16
            && c.cr_type == wgpu::CooperativeScalarType::F32
    });
    if !f16_f32 {
        return Err("no 16x16x16 f16 -> f32 cooperative-matrix configuration".to_string());
    }
    if !features.contains(wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP) {
        return Err("no shader-f16 or no subgroups".to_string());
    }
    if (info.subgroup_min_size, info.subgroup_max_size) != (32, 32) {
        return Err(format!(
            "subgroups of {}..{} lanes, not 32",
            info.subgroup_min_size, info.subgroup_max_size
        ));
    }
    Ok(())
}

/// The best Vulkan adapter: hardware before software.
fn adapter() -> Result<wgpu::Adapter, String> {
    // Vulkan only, and no environment overrides: the ceiling must be
    // measured on the backend flashport's kernels run on.
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        flags: wgpu::InstanceFlags::empty(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN));
    adapters.sort_by_key(|a| rank(a.get_info().device_type));
    adapters
        .into_iter()
        .next()
        .ok_or("no Vulkan adapter found (on Linux without a GPU, install Mesa's lavapipe)".into())
}

pub fn describe() -> Result<AdapterInfo, String> {
    let adapter = adapter()?;
    let info = adapter.get_info();
    let limits = adapter.limits();
    let driver = match (info.driver.is_empty(), info.driver_info.is_empty()) {
        (false, false) => format!("{} ({})", info.driver, info.driver_info),
        (false, true) => info.driver.clone(),
        _ => info.driver_info.clone(),
    };
    Ok(AdapterInfo {
        name: info.name.clone(),
        driver,
        device_type: format!("{:?}", info.device_type),
        timestamps: adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY),
        coop: coop_support(&adapter),
        max_workgroup_bytes: limits.max_compute_workgroup_storage_size,
        max_invocations: limits.max_compute_invocations_per_workgroup,
    })
}

impl Gpu {
    /// A device on the best adapter, with cooperative matrices where
    /// `coop` (the caller has checked `describe().coop`).
    pub fn open(coop: bool) -> Result<Gpu, String> {
        let adapter = adapter()?;
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let mut features = wgpu::Features::empty();
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        if coop {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
                | wgpu::Features::SHADER_F16
                | wgpu::Features::SUBGROUP;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("gemm-ceiling"),
            required_features: features,
            // The adapter's own limits: the defaults cap workgroup memory
            // at 16 KiB, below the larger tiles.
            required_limits: adapter.limits(),
            experimental_features: if coop {
                // SAFETY: wgpu's opt-in for experimental features; only
                // cooperative matrices are asked for, and only where the
                // adapter lists the configuration the kernels use.
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        }))
        .map_err(|e| format!("opening the device: {e}"))?;
        let lost = Arc::new(AtomicBool::new(false));
        let flag = lost.clone();
        device.set_device_lost_callback(move |_, _| flag.store(true, Ordering::SeqCst));
        let uncaptured: Arc<Mutex<Vec<String>>> = Default::default();
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut errors) = sink.lock() {
                errors.push(e.to_string());
            }
        }));
        Ok(Gpu {
            device,
            queue,
            timestamps,
            lost,
            uncaptured,
        })
    }

    /// Errors wgpu raised outside any scope, or the device's loss.
    fn health(&self) -> Result<(), String> {
        if self.lost.load(Ordering::SeqCst) {
            return Err("the device was lost".to_string());
        }
        let errors = std::mem::take(&mut *self.uncaptured.lock().map_err(|e| e.to_string())?);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// A pipeline for entry point `main` of `source`, or the compiler's
    /// complaint.
    pub fn pipeline(&self, label: &str, source: &str) -> Result<wgpu::ComputePipeline, String> {
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        // SAFETY: every index the kernels compute is in bounds by
        // construction: the host runs a kernel only on sizes its tiles
        // divide, and the workgroup arrays are sized for the tiles. naga's
        // clamps on every access would otherwise be part of the measured
        // ceiling.
        let module = unsafe {
            self.device
                .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
        };
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &[],
                    // Every kernel writes its workgroup arrays before it
                    // reads them.
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        let errors: Vec<String> = [
            pollster::block_on(internal.pop()),
            pollster::block_on(validation.pop()),
        ]
        .into_iter()
        .flatten()
        .map(|e| e.to_string())
        .collect();
        if !errors.is_empty() {
            return Err(errors.join("; "));
        }
        self.health()?;
        Ok(pipeline)
    }

    pub fn storage(&self, label: &str, contents: &[u8]) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::COPY_SRC,
            })
    }

    pub fn uniform(&self, label: &str, contents: &[u8]) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::UNIFORM,
            })
    }

    pub fn bind_group(
        &self,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }

    /// Fills `buffer` with NaN, so that an output the kernel never writes
    /// fails the check.
    pub fn poison(&self, buffer: &wgpu::Buffer) {
        let nan = vec![f32::NAN; (buffer.size() / 4) as usize];
        self.queue
            .write_buffer(buffer, 0, bytemuck::cast_slice(&nan));
    }

    fn wait(&self) -> Result<(), String> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| format!("waiting for the GPU: {e}"))?;
        self.health()
    }

    /// The contents of `buffer` as bytes.
    fn read(&self, buffer: &wgpu::Buffer, size: u64) -> Result<Vec<u8>, String> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, size);
        self.queue.submit([encoder.finish()]);
        let (tx, rx) = mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|e| format!("mapping the readback: {e}"))?
            .map_err(|e| format!("mapping the readback: {e}"))?;
        let bytes = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| format!("reading the readback: {e}"))?
            .to_vec();
        staging.unmap();
        Ok(bytes)
    }

    pub fn read_f32(&self, buffer: &wgpu::Buffer) -> Result<Vec<f32>, String> {
        let bytes = self.read(buffer, buffer.size())?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Runs the dispatch `runs` times, one submission each, and returns
    /// each run's GPU time (timestamp queries around the pass; empty where
    /// the adapter has none) and wall time (submit to the end of the wait),
    /// in seconds.
    pub fn run(
        &self,
        pipeline: &wgpu::ComputePipeline,
        group: &wgpu::BindGroup,
        workgroups: (u32, u32),
        runs: usize,
    ) -> Result<(Vec<f64>, Vec<f64>), String> {
        let queries = if self.timestamps && runs > 0 {
            Some(self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("gemm timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * runs as u32,
            }))
        } else {
            None
        };
        let mut wall = Vec::with_capacity(runs);
        for r in 0..runs as u32 {
            let mut encoder = self.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: queries.as_ref().map(|set| {
                        wgpu::ComputePassTimestampWrites {
                            query_set: set,
                            beginning_of_pass_write_index: Some(2 * r),
                            end_of_pass_write_index: Some(2 * r + 1),
                        }
                    }),
                });
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, group, &[]);
                pass.dispatch_workgroups(workgroups.0, workgroups.1, 1);
            }
            let commands = encoder.finish();
            let start = Instant::now();
            self.queue.submit([commands]);
            self.wait()?;
            wall.push(start.elapsed().as_secs_f64());
        }
        let Some(set) = queries else {
            return Ok((Vec::new(), wall));
        };
        let size = 16 * runs as u64;
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.resolve_query_set(&set, 0..2 * runs as u32, &resolve, 0);
        self.queue.submit([encoder.finish()]);
        let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&self.read(&resolve, size)?);
        let period = self.queue.get_timestamp_period() as f64 * 1e-9;
        let gpu = ticks
            .chunks_exact(2)
            .map(|t| t[1].wrapping_sub(t[0]) as f64 * period)
            .collect();
        Ok((gpu, wall))
    }
}
