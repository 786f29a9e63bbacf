//! What the Vulkan driver compiled each register-tiled kernel into:
//! registers per invocation, spills, instruction counts, as far as the
//! driver reports them through VK_KHR_pipeline_executable_properties.
//!
//! Why: the tiled kernels are tuned by timing on the lent GPU, and a
//! timing alone cannot tell register pressure (fewer workgroups per SM,
//! or spills) from a memory or latency limit. wgpu does not expose these
//! statistics, so this builds each pipeline directly with ash, from the
//! SPIR-V that naga writes for the same source and overrides the backend
//! uses (src/gpu/spirv.rs), for the tiles the backend would choose on this
//! adapter.
//!
//! Run: cargo run --release -p flashport-kernel-stats -- [--ir DIR] [d ...]
//! (default d = 64 128): the kernels the backend selects on this adapter
//! for float32 and float16 inputs without variants, forward and backward.
//! With `--ir DIR`, the driver's internal representations (where it gives
//! any) are written to DIR, one file per kernel and representation.

use ash::vk;
use flashport_core::gpu::decode::select::{
    coop_decode_tiles, decode_tiles, subgroup_tiles, AdapterKind, DecodeCaps, SubgroupKnobs,
};
use flashport_core::gpu::select::{
    select_backward, select_forward, AdapterCaps, Overrides, PipelineKey,
};
use flashport_core::gpu::shaders::{
    decode_coop_source, decode_source, decode_subgroup_source, overrides, source,
};
use flashport_core::gpu::spirv;
use flashport_core::gpu::tiles::coop_forward_candidates;
use flashport_core::{validate_forward, ArrayInfo, Options};
use std::ffi::CStr;

type Error = Box<dyn std::error::Error>;

struct Args {
    dims: Vec<u32>,
    ir_dir: Option<String>,
}

fn main() -> Result<(), Error> {
    let mut args = Args {
        dims: Vec::new(),
        ir_dir: None,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        match word.as_str() {
            "--ir" => args.ir_dir = Some(words.next().ok_or("--ir needs a directory")?),
            d => args.dims.push(d.parse()?),
        }
    }
    if args.dims.is_empty() {
        args.dims = vec![64, 128];
    }
    // SAFETY: plain Vulkan calls on objects created here, destroyed in
    // reverse order before returning; no handle outlives its parent.
    unsafe { run(&args) }
}

unsafe fn run(args: &Args) -> Result<(), Error> {
    let entry = ash::Entry::load()?;
    let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
    let instance = entry.create_instance(
        &vk::InstanceCreateInfo::default().application_info(&app),
        None,
    )?;
    let result = with_instance(&instance, args);
    instance.destroy_instance(None);
    result
}

unsafe fn with_instance(instance: &ash::Instance, args: &Args) -> Result<(), Error> {
    let ext = ash::khr::pipeline_executable_properties::NAME;
    let physical = instance
        .enumerate_physical_devices()?
        .into_iter()
        .max_by_key(|&pd| {
            let kind = instance.get_physical_device_properties(pd).device_type;
            (
                kind == vk::PhysicalDeviceType::DISCRETE_GPU,
                kind == vk::PhysicalDeviceType::INTEGRATED_GPU,
            )
        })
        .ok_or("no Vulkan device")?;
    let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
    instance.get_physical_device_properties2(physical, &mut props2);
    let props = props2.properties;
    let name = CStr::from_ptr(props.device_name.as_ptr()).to_string_lossy();
    println!("device: {name}, driver version {:#x}", props.driver_version);
    let has_ext = instance
        .enumerate_device_extension_properties(physical)?
        .iter()
        .any(|e| CStr::from_ptr(e.extension_name.as_ptr()) == ext);
    if !has_ext {
        return Err(format!("{name} does not offer {}", ext.to_string_lossy()).into());
    }
    let limits = props.limits;

    let queue_family = instance
        .get_physical_device_queue_family_properties(physical)
        .iter()
        .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
        .ok_or("no compute queue")? as u32;
    let priorities = [1.0];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(queue_family)
        .queue_priorities(&priorities)];
    let coop_ext = ash::khr::cooperative_matrix::NAME;
    let coop = instance
        .enumerate_device_extension_properties(physical)?
        .iter()
        .any(|e| CStr::from_ptr(e.extension_name.as_ptr()) == coop_ext);
    let mut extensions = vec![ext.as_ptr()];
    if coop {
        extensions.push(coop_ext.as_ptr());
    }
    let mut exec_info = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default()
        .pipeline_executable_info(true);
    let mut coop_features =
        vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
    let mut v11 = vk::PhysicalDeviceVulkan11Features::default().storage_buffer16_bit_access(true);
    let mut v12 = vk::PhysicalDeviceVulkan12Features::default()
        .shader_float16(true)
        .vulkan_memory_model(true)
        .vulkan_memory_model_device_scope(true);
    let mut create = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queues)
        .enabled_extension_names(&extensions)
        .push_next(&mut exec_info);
    if coop {
        create = create
            .push_next(&mut coop_features)
            .push_next(&mut v11)
            .push_next(&mut v12);
    }
    // What the backend's selection would see through wgpu: the SPIR-V is
    // written here, so the cooperative kernels count as passthrough ones.
    let caps = AdapterCaps {
        workgroup_storage_bytes: limits.max_compute_shared_memory_size,
        max_invocations: limits.max_compute_work_group_invocations,
        max_workgroup_size_x: limits.max_compute_work_group_size[0],
        subgroups: subgroup.subgroup_size >= 8
            && subgroup
                .supported_operations
                .contains(vk::SubgroupFeatureFlags::SHUFFLE),
        coop: coop && subgroup.subgroup_size == 32,
        passthrough: true,
        subgroup_barrier: false,
        // The WGSL kernels only: the cm2 forward's SPIR-V is not written
        // here.
        cm2: false,
        loop_limit: None,
    };
    println!("{caps:?}");
    let device = instance.create_device(physical, &create, None)?;
    let result = with_device(instance, &device, caps, args);
    device.destroy_device(None);
    result
}

unsafe fn with_device(
    instance: &ash::Instance,
    device: &ash::Device,
    caps: AdapterCaps,
    args: &Args,
) -> Result<(), Error> {
    let stats = ash::khr::pipeline_executable_properties::Device::new(instance, device);
    decode_kernels(device, &stats, caps, args)?;
    for &d in &args.dims {
        for dtype in ["float32", "float16"] {
            let shape = [1, 1, 64, d as usize];
            let info = ArrayInfo::new(&shape, dtype);
            let p = validate_forward(info, info, info, &Options::default())?;
            let none = Overrides::default();
            let f = select_forward(&p, caps, &none);
            let b = select_backward(&p, caps, &none);
            // The cooperative forward's other tiles too: which of them the
            // driver spills or holds to fewer workgroups.
            let others = coop_forward_candidates(d, d, caps)
                .filter(|&t| dtype == "float16" && t != f.forward.tiles)
                .map(|t| {
                    let ov = Overrides {
                        coop_forward: Some(t),
                        ..Overrides::default()
                    };
                    select_forward(&p, caps, &ov).forward
                });
            for key in [f.forward, b.dq, b.dkdv].into_iter().chain(others) {
                println!("\n{} {dtype} d={d} {:?}", key.kernel.name(), key.tiles);
                let label = format!("{}-{dtype}-d{d}", key.kernel.name());
                let lines = pipeline_statistics(device, &stats, &compile(&key)?, &label, args)?;
                for line in lines {
                    println!("  {line}");
                }
            }
        }
    }
    Ok(())
}

/// Decoding's kernels as the backend picks them on this adapter, for 32
/// query heads over 8 key/value heads (4 rows per group) and a paged
/// cache: the subgroup kernel and the workgroup kernel, float32 and
/// float16.
unsafe fn decode_kernels(
    device: &ash::Device,
    stats: &ash::khr::pipeline_executable_properties::Device,
    caps: AdapterCaps,
    args: &Args,
) -> Result<(), Error> {
    let decode_caps = DecodeCaps {
        kind: AdapterKind::Discrete,
        workgroup_storage_bytes: caps.workgroup_storage_bytes,
        max_invocations: caps.max_invocations,
        loop_limit: None,
        subgroup_size: caps.subgroups.then_some(32),
        coop: caps.coop,
    };
    for &d in &args.dims {
        let d = d as usize;
        for f16 in [false, true] {
            let dtype = if f16 { "float16" } else { "float32" };
            let mut kernels = Vec::new();
            // The default layout, then with and without the prefetch.
            for prefetch in [None, Some(true), Some(false)] {
                let knobs = SubgroupKnobs {
                    prefetch,
                    ..SubgroupKnobs::default()
                };
                if let Some(t) = subgroup_tiles(d, d, 4, f16, decode_caps, knobs) {
                    let source = decode_subgroup_source(f16, t.vec4);
                    let constants = t.overrides(true);
                    kernels.push((format!("decode_subgroup {t:?}"), source, constants));
                }
            }
            if let Some(t) = decode_tiles(d, d, 4, decode_caps) {
                let source = decode_source(f16, t.vec4);
                kernels.push((format!("decode {t:?}"), source, t.overrides(true)));
            }
            for walkers in [None, Some(2), Some(1)] {
                if let Some(t) = coop_decode_tiles(d, d, f16, decode_caps, walkers) {
                    let source = decode_coop_source();
                    kernels.push((format!("decode_coop {t:?}"), source, t.overrides(true)));
                }
            }
            for (name, source, mut constants) in kernels {
                constants.push(("SKIPS", 0.0));
                println!("\n{name} {dtype} d={d}");
                let label = format!(
                    "{}-{dtype}-d{d}",
                    name.split(' ').next().unwrap_or("decode")
                );
                // The cooperative kernel as the passthrough builds it.
                let coop = name.starts_with("decode_coop");
                let compiled = spirv::compile(&source, &constants, coop, coop)?;
                for line in pipeline_statistics(device, stats, &compiled, &label, args)? {
                    println!("  {line}");
                }
            }
        }
    }
    Ok(())
}

/// The SPIR-V naga writes for `key`, as the backend builds it: without
/// bounds clamps for the tiled and cooperative kernels, the cooperative
/// ones with the GLSL450 memory model (src/gpu/spirv.rs).
fn compile(key: &PipelineKey) -> Result<spirv::Compiled, Error> {
    let source = source(key.kernel, key.subgroups, key.f16_inputs);
    let unchecked = key.kernel.is_tiled() || key.kernel.is_coop();
    Ok(spirv::compile(
        &source,
        &overrides(key),
        unchecked,
        key.kernel.is_coop(),
    )?)
}

/// Builds the compute pipeline of `compiled` with statistics captured and
/// returns them as "executable: name = value" lines.
unsafe fn pipeline_statistics(
    device: &ash::Device,
    stats: &ash::khr::pipeline_executable_properties::Device,
    compiled: &spirv::Compiled,
    label: &str,
    args: &Args,
) -> Result<Vec<String>, Error> {
    let module = device.create_shader_module(
        &vk::ShaderModuleCreateInfo::default().code(&compiled.words),
        None,
    )?;
    let bindings: Vec<vk::DescriptorSetLayoutBinding> = compiled
        .bindings
        .iter()
        .map(|b| {
            let ty = match b.ty {
                wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    ..
                } => vk::DescriptorType::UNIFORM_BUFFER,
                _ => vk::DescriptorType::STORAGE_BUFFER,
            };
            vk::DescriptorSetLayoutBinding::default()
                .binding(b.binding)
                .descriptor_type(ty)
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE)
        })
        .collect();
    let set_layout = device.create_descriptor_set_layout(
        &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
        None,
    )?;
    let set_layouts = [set_layout];
    let layout = device.create_pipeline_layout(
        &vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts),
        None,
    )?;
    let stage = vk::PipelineShaderStageCreateInfo::default()
        .stage(vk::ShaderStageFlags::COMPUTE)
        .module(module)
        .name(c"main");
    let info = vk::ComputePipelineCreateInfo::default()
        .stage(stage)
        .layout(layout)
        .flags(
            vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR
                | vk::PipelineCreateFlags::CAPTURE_INTERNAL_REPRESENTATIONS_KHR,
        );
    let created = device.create_compute_pipelines(vk::PipelineCache::null(), &[info], None);
    let mut lines = Vec::new();
    let outcome = match created {
        Ok(pipelines) => {
            let pipeline = pipelines[0];
            let found = collect(stats, pipeline, &mut lines, label, args);
            device.destroy_pipeline(pipeline, None);
            found
        }
        Err((_, e)) => Err(e.into()),
    };
    device.destroy_pipeline_layout(layout, None);
    device.destroy_descriptor_set_layout(set_layout, None);
    device.destroy_shader_module(module, None);
    outcome.map(|()| lines)
}

unsafe fn collect(
    stats: &ash::khr::pipeline_executable_properties::Device,
    pipeline: vk::Pipeline,
    lines: &mut Vec<String>,
    label: &str,
    args: &Args,
) -> Result<(), Error> {
    let executables = stats
        .get_pipeline_executable_properties(&vk::PipelineInfoKHR::default().pipeline(pipeline))?;
    for (index, exe) in executables.iter().enumerate() {
        let exe_name = exe
            .name_as_c_str()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let info = vk::PipelineExecutableInfoKHR::default()
            .pipeline(pipeline)
            .executable_index(index as u32);
        for s in stats.get_pipeline_executable_statistics(&info)? {
            let name = s
                .name_as_c_str()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let value = match s.format {
                vk::PipelineExecutableStatisticFormatKHR::BOOL32 => format!("{}", s.value.b32 != 0),
                vk::PipelineExecutableStatisticFormatKHR::INT64 => format!("{}", s.value.i64),
                vk::PipelineExecutableStatisticFormatKHR::UINT64 => format!("{}", s.value.u64),
                vk::PipelineExecutableStatisticFormatKHR::FLOAT64 => format!("{}", s.value.f64),
                _ => "?".to_string(),
            };
            lines.push(format!(
                "{exe_name} (subgroup {}): {name} = {value}",
                exe.subgroup_size
            ));
        }
        if let Some(dir) = &args.ir_dir {
            for (i, text) in internal_representations(stats, &info)?.iter().enumerate() {
                let path = format!("{dir}/{label}-{index}-{i}.txt");
                std::fs::write(&path, text)?;
                lines.push(format!("{exe_name}: representation {i} -> {path}"));
            }
        }
    }
    Ok(())
}

/// The internal representations the driver gives for one executable, each
/// as "name: description" and its text (two-call idiom: sizes, then data).
unsafe fn internal_representations(
    stats: &ash::khr::pipeline_executable_properties::Device,
    info: &vk::PipelineExecutableInfoKHR,
) -> Result<Vec<String>, Error> {
    let fp = stats.fp();
    let mut count = 0u32;
    (fp.get_pipeline_executable_internal_representations_khr)(
        stats.device(),
        info,
        &mut count,
        std::ptr::null_mut(),
    )
    .result()?;
    let mut reps = vec![vk::PipelineExecutableInternalRepresentationKHR::default(); count as usize];
    (fp.get_pipeline_executable_internal_representations_khr)(
        stats.device(),
        info,
        &mut count,
        reps.as_mut_ptr(),
    )
    .result()?;
    let mut buffers: Vec<Vec<u8>> = reps.iter().map(|r| vec![0u8; r.data_size]).collect();
    for (r, b) in reps.iter_mut().zip(buffers.iter_mut()) {
        r.p_data = b.as_mut_ptr().cast();
    }
    (fp.get_pipeline_executable_internal_representations_khr)(
        stats.device(),
        info,
        &mut count,
        reps.as_mut_ptr(),
    )
    .result()?;
    Ok(reps
        .iter()
        .zip(buffers)
        .map(|(r, b)| {
            let name = r.name_as_c_str().map(|s| s.to_string_lossy().into_owned());
            let desc = r
                .description_as_c_str()
                .map(|s| s.to_string_lossy().into_owned());
            let body = if r.is_text != 0 {
                String::from_utf8_lossy(&b)
                    .trim_end_matches('\0')
                    .to_string()
            } else {
                format!("({} bytes of binary)", b.len())
            };
            format!(
                "{}: {}\n{body}",
                name.unwrap_or_default(),
                desc.unwrap_or_default()
            )
        })
        .collect())
}
