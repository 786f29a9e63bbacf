//! The one-subgroup diagnostic of the cooperative-matrix builtins
//! (coop_diagnostic.wgsl beside this file), on a wgpu device of its own
//! with the cooperative-matrix features: built through wgpu's own SPIR-V
//! (Vulkan memory model) and, where the driver takes passthrough shaders,
//! through `gpu::spirv::compile` with the Vulkan and with the GLSL450
//! memory model. Each case is compared with what naga's documentation
//! says it computes, and with the transpose; the GLSL450 build (the one
//! the library's cooperative kernels use) must be as documented.

use super::common::gpu_present;
use flashport_core::f16;
use flashport_core::gpu::spirv;

const SOURCE: &str = include_str!("coop_diagnostic.wgsl");
const CASES: usize = 11;

/// The backends the library uses (src/gpu/context.rs).
const BACKENDS: wgpu::Backends = wgpu::Backends::VULKAN
    .union(wgpu::Backends::METAL)
    .union(wgpu::Backends::DX12);

fn a(i: usize, k: usize) -> f64 {
    i as f64 + k as f64 / 16.0
}

/// Row-major expected result of each case, from its description in the
/// shader (coopLoadT/coopStoreT row-major, coopLoad/coopStore
/// column-major, strides in elements: naga's documentation).
fn expected(case: usize, i: usize, n: usize) -> f64 {
    match case {
        0 => a(i, n),
        // Column-major store of A: out[n * 16 + i] = A[i][n], read here as
        // element (i, n) of the row-major output = A[n][i].
        1 => a(n, i),
        2 => a(n, i),
        3 => a(i, (n + 15) % 16),
        4 => a(i, (n + 1) % 16),
        5 => a(i, n) + 1000.0 * i as f64 + n as f64,
        6 => a(i + 3, n),
        7 => (0..4).map(|c| a(i + c, n)).sum(),
        8 => a(n, i),
        // A + 100 t is rounded to float16 when written (spacing 0.125 at
        // 200, 0.25 at 300).
        9 => (0..4)
            .map(|t| f16::from_f64(a(i, n) + 100.0 * t as f64).to_f64())
            .sum(),
        10 => 8.0 * a(i, n) + 12.0,
        _ => f64::NAN,
    }
}

const WHAT: [&str; CASES] = [
    "A(loadT) x I(loadT) -> storeT",
    "same -> store (column-major)",
    "A(load, column-major) x I",
    "A x P(loadT)",
    "A x P(load, column-major)",
    "A(loadT stride 24) x I + C(loadT storage f32 stride 20)",
    "function-local array of matrices, acc[3]",
    "function-local array, sum of 4 products",
    "storeT to workgroup f32, barrier, scalar transposed read",
    "loop: rewrite workgroup A behind barriers, accumulate",
    "loop: coop -> workgroup f32 -> scalar -> coop load, add",
];

/// Whether `adapter` runs the diagnostic: 16x16x16 float16 → float32
/// cooperative matrices, shader-f16, and subgroups of exactly 32 lanes
/// (its one workgroup of 32 invocations is one subgroup), as the library
/// requires for its cooperative kernels.
fn has_coop(adapter: &wgpu::Adapter) -> bool {
    let info = adapter.get_info();
    let features = adapter.features();
    features.contains(wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
        && info.subgroup_min_size == 32
        && info.subgroup_max_size == 32
        && adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
}

/// A device with the cooperative-matrix features (and passthrough shaders
/// where offered) on the first adapter that has them, hardware first;
/// also its name and whether it takes passthrough shaders.
fn coop_device() -> Option<(wgpu::Device, wgpu::Queue, String, bool)> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: BACKENDS,
        flags: wgpu::InstanceFlags::empty(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let mut adapters = pollster::block_on(instance.enumerate_adapters(BACKENDS));
    adapters.sort_by_key(|a| a.get_info().device_type == wgpu::DeviceType::Cpu);
    let adapter = adapters.into_iter().find(has_coop)?;
    let passthrough = adapter
        .features()
        .contains(wgpu::Features::PASSTHROUGH_SHADERS);
    let mut features = wgpu::Features::SHADER_F16 | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    if passthrough {
        features |= wgpu::Features::PASSTHROUGH_SHADERS;
    }
    let name = adapter.get_info().name;
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("coop diagnostic"),
        required_features: features,
        required_limits: adapter.limits(),
        // SAFETY: wgpu's opt-in for its experimental features: the
        // cooperative matrices, on an adapter that reports the
        // configuration the shader uses.
        experimental_features: unsafe { wgpu::ExperimentalFeatures::enabled() },
        ..Default::default()
    }))
    .unwrap_or_else(|e| panic!("{name}: no device with cooperative matrices: {e}"));
    Some((device, queue, name, passthrough))
}

/// Runs `f` with wgpu's validation and internal errors captured as an
/// error message.
fn scoped<T>(device: &wgpu::Device, f: impl FnOnce() -> T) -> Result<T, String> {
    let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let result = f();
    let errors: Vec<String> = [
        pollster::block_on(validation.pop()),
        pollster::block_on(internal.pop()),
    ]
    .into_iter()
    .flatten()
    .map(|e| e.to_string())
    .collect();
    if errors.is_empty() {
        Ok(result)
    } else {
        Err(errors.join("; "))
    }
}

/// The diagnostic's pipeline, from wgpu's WGSL front end (`spirv` None)
/// or from the SPIR-V of `gpu::spirv::compile` with the GLSL450 memory
/// model (`Some(true)`) or naga's Vulkan one (`Some(false)`), passed
/// through to the driver.
fn pipeline(device: &wgpu::Device, spirv: Option<bool>) -> Result<wgpu::ComputePipeline, String> {
    let Some(glsl450) = spirv else {
        return scoped(device, || {
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some("coop_diagnostic"),
                source: wgpu::ShaderSource::Wgsl(SOURCE.into()),
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some("coop_diagnostic"),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            })
        });
    };
    let compiled = spirv::compile(SOURCE, &[], false, glsl450)
        .map_err(|e| format!("compiling the diagnostic to SPIR-V: {e}"))?;
    assert_eq!(
        spirv::memory_model(&compiled.words),
        Some(if glsl450 { 1 } else { 3 })
    );
    scoped(device, || {
        let [x, y, z] = compiled.workgroup_size;
        let entry_points = [wgpu::PassthroughShaderEntryPoint {
            name: "main".into(),
            workgroup_size: (x, y, z),
        }];
        // SAFETY: the words are naga's own output for a module naga
        // validated, changed only in the memory model it declares, which
        // the device supports.
        let module = unsafe {
            device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                label: Some("coop_diagnostic"),
                entry_points: entry_points.as_slice().into(),
                spirv: Some(compiled.words.as_slice().into()),
                ..Default::default()
            })
        };
        let group = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("coop_diagnostic"),
            entries: &compiled.bindings,
        });
        let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("coop_diagnostic"),
            bind_group_layouts: &[Some(&group)],
            immediate_size: 0,
        });
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("coop_diagnostic"),
            layout: Some(&layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
    })
}

/// Runs the diagnostic (one workgroup) and returns its CASES x 256 floats.
fn run(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    pipeline: &wgpu::ComputePipeline,
) -> Result<Vec<f32>, String> {
    let cin: Vec<f32> = (0..16 * 20)
        .map(|e| (1000 * (e / 20) + e % 20) as f32)
        .collect();
    let bytes = (4 * CASES * 256) as u64;
    let (out, staging) = scoped(device, || {
        let cb = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cin"),
            size: 4 * cin.len() as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        queue.write_buffer(&cb, 0, bytemuck::cast_slice(&cin));
        let ob = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("out"),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let staging = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: ob.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: cb.as_entire_binding(),
                },
            ],
        });
        let mut encoder = device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        encoder.copy_buffer_to_buffer(&ob, 0, &staging, 0, bytes);
        queue.submit([encoder.finish()]);
        (ob, staging)
    })?;
    let (tx, rx) = std::sync::mpsc::channel();
    staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    device
        .poll(wgpu::PollType::wait_indefinitely())
        .map_err(|e| format!("waiting for the GPU: {e}"))?;
    rx.recv()
        .map_err(|e| format!("the readback was never mapped: {e}"))?
        .map_err(|e| format!("mapping the readback: {e}"))?;
    let values = {
        let view = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| format!("reading the readback: {e}"))?;
        bytemuck::pod_collect_to_vec::<u8, f32>(&view)
    };
    staging.unmap();
    drop(out);
    Ok(values)
}

/// One line per case: its verdict against naga's documentation ("as
/// documented", "TRANSPOSED" or "WRONG") and three of its rows.
fn verdicts(got: &[f32]) -> Vec<String> {
    let mut lines = Vec::new();
    for (case, what) in WHAT.iter().enumerate() {
        let at = |i: usize, n: usize| got[case * 256 + i * 16 + n] as f64;
        let (mut err, mut err_t) = (0.0f64, 0.0f64);
        for i in 0..16 {
            for n in 0..16 {
                err = err.max((at(i, n) - expected(case, i, n)).abs());
                err_t = err_t.max((at(n, i) - expected(case, i, n)).abs());
            }
        }
        let verdict = if err == 0.0 {
            "as documented".to_string()
        } else if err_t == 0.0 {
            "TRANSPOSED".to_string()
        } else {
            format!("WRONG (max error {err}, vs transpose {err_t})")
        };
        let row = |i: usize| {
            (0..16)
                .map(|n| format!("{}", at(i, n)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        lines.push(format!(
            "case {case} ({what}): {verdict}; row 0: [{}]; row 1: [{}]; row 15: [{}]",
            row(0),
            row(1),
            row(15)
        ));
    }
    lines
}

/// The diagnostic compiles to SPIR-V with either memory model on any
/// machine (no GPU needed).
#[test]
fn coop_diagnostic_compiles_with_both_memory_models() {
    for (glsl450, model) in [(false, 3), (true, 1)] {
        let compiled = spirv::compile(SOURCE, &[], false, glsl450).unwrap();
        assert_eq!(spirv::memory_model(&compiled.words), Some(model));
        assert_eq!(compiled.workgroup_size, [32, 1, 1]);
        let bindings: Vec<u32> = compiled.bindings.iter().map(|b| b.binding).collect();
        assert_eq!(bindings, [0, 1]);
    }
}

/// Prints what each case computed through each build; fails where the
/// GLSL450 build differs from naga's documentation.
#[test]
fn coop_one_tile_diagnostic() {
    if !gpu_present() {
        return;
    }
    let Some((device, queue, name, passthrough)) = coop_device() else {
        eprintln!(
            "NOT TESTED: no adapter here has 16x16x16 float16 cooperative matrices \
             with 32-lane subgroups: the cooperative-matrix diagnostic does not run"
        );
        return;
    };
    eprintln!("diagnostic on {name} (passthrough shaders: {passthrough})");
    let mut wrong = Vec::new();
    for (spirv, label) in [
        (None, "wgpu's SPIR-V (Vulkan memory model)"),
        (Some(false), "SPIR-V written here, Vulkan memory model"),
        (Some(true), "SPIR-V written here, GLSL450 memory model"),
    ] {
        let glsl450 = spirv == Some(true);
        if spirv.is_some() && !passthrough {
            eprintln!("diagnostic, {label}: no passthrough shaders here");
            continue;
        }
        match pipeline(&device, spirv).and_then(|p| run(&device, &queue, &p)) {
            Ok(got) => {
                for l in verdicts(&got) {
                    eprintln!("diagnostic, {label}: {l}");
                    if glsl450 && !l.contains("as documented") {
                        wrong.push(l);
                    }
                }
            }
            Err(e) => {
                eprintln!("diagnostic, {label}: failed: {e}");
                if glsl450 {
                    wrong.push(e);
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
