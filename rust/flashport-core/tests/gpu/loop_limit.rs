//! Kernels whose threads loop long. Mesa's lavapipe before 25.0 (CI's
//! driver) ends a shader invocation's loops once they have run 65535
//! iterations in all, without an error (src/gpu/tiles/loops.rs): the
//! issue's shapes came back mostly unwritten there. They must come back
//! complete and right on every adapter, and where the driver has the limit
//! a shape past it must be refused rather than computed wrong.

use super::common::*;
use flashport_core::{gpu, DType, Error, Slice, VariantArrays};

/// The forward of `c` against the float64 reference: the relative error
/// of out and lse (the debug build poisons outputs, so an unwritten one is
/// NaN and fails).
fn forward_error(c: &Case) -> f64 {
    let reference = reference_forward(c);
    let got = gpu_forward(c);
    let out = rel_err(&as_f64(&got.out), &as_f64(&reference.out));
    let lse = rel_err(&as_f64(&got.lse), &as_f64(&reference.lse));
    out.max(lse)
}

#[test]
fn long_loops_come_back_complete() {
    if !gpu_present() {
        return;
    }
    // One workgroup's dot products over d = 1024 (the forward; its
    // backward is past lavapipe's limit, below).
    let e = forward_error(&case((1, 1, 1, 64, 64, 1024, 1024), false, DType::F32, 21));
    assert!(e <= 1e-4, "forward d=1024: {e:e}");
    // GQA 4:1: a dK/dV workgroup walks the rows of four query heads.
    check(
        &case((1, 4, 1, 221, 244, 46, 122), false, DType::F32, 22),
        1e-4,
        4e-4,
    );
}

#[test]
fn past_the_loop_limit_the_call_is_refused() {
    if !gpu_present() {
        return;
    }
    if gpu::testing::adapter_caps().unwrap().loop_limit.is_none() {
        eprintln!("NOT TESTED: this adapter's driver has no loop limit");
        return;
    }
    let refused = |e: Error| match e {
        Error::TooLarge(m) => assert!(m.contains("llvmpipe"), "{m}"),
        other => panic!("expected TooLarge, got {other:?}"),
    };
    let c = case((1, 1, 1, 1, 20000, 256, 256), false, DType::F32, 23);
    let err = gpu::forward(
        &c.p,
        c.q.slice(DType::F32),
        c.k.slice(DType::F32),
        c.v.slice(DType::F32),
        &VariantArrays::default(),
    )
    .unwrap_err();
    refused(err);
    let c = case((1, 1, 1, 64, 64, 1024, 1024), false, DType::F32, 24);
    let (o, lse) = (vec![0.0f32; c.p.out_len()], vec![0.0f32; c.p.lse_len()]);
    let err = gpu::backward(
        &c.p,
        [
            Slice::F32(&o),
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            Slice::F32(&o),
            Slice::F32(&lse),
        ],
        &VariantArrays::default(),
    )
    .unwrap_err();
    refused(err);
}

/// Two loops of 40000 iterations, one after the other, in one invocation;
/// `counts` gets the iterations each ran.
const TWO_LOOPS: &str = r#"
@group(0) @binding(0) var<storage, read> trips: array<u32>;
@group(0) @binding(1) var<storage, read_write> counts: array<u32>;
@compute @workgroup_size(1)
fn main() {
    var a = 0u;
    for (var i = 0u; i < trips[0]; i++) { a += 1u; }
    var b = 0u;
    for (var i = 0u; i < trips[1]; i++) { b += 1u; }
    counts[0] = a;
    counts[1] = b;
}
"#;

/// The driver cuts loops short exactly where `driver_loop_limit` says it
/// does, on a device of its own: two loops of 40000 iterations each run in
/// full without the limit, and with it the second stops where the two
/// together reach it (each loop's exit pass counts too).
#[test]
fn the_driver_cuts_loops_where_its_caps_say() {
    if !gpu_present() {
        return;
    }
    let backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends,
        flags: wgpu::InstanceFlags::empty(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    for adapter in pollster::block_on(instance.enumerate_adapters(backends)) {
        let info = adapter.get_info();
        let limit = gpu::select::driver_loop_limit(&info.name, &info.driver, &info.driver_info);
        let (device, queue) =
            pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor::default())).unwrap();
        let counts = run_two_loops(&device, &queue, [40000, 40000]);
        eprintln!("{} ({}): {counts:?}", info.name, info.driver_info);
        match limit {
            None => assert_eq!(counts, [40000, 40000], "{}", info.driver_info),
            Some(l) => assert_eq!(counts, [40000, l - 40001], "{}", info.driver_info),
        }
    }
}

fn run_two_loops(device: &wgpu::Device, queue: &wgpu::Queue, trips: [u32; 2]) -> [u32; 2] {
    use wgpu::util::DeviceExt;
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("two loops"),
        source: wgpu::ShaderSource::Wgsl(TWO_LOOPS.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("two loops"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let input = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: None,
        contents: bytemuck::cast_slice(&trips),
        usage: wgpu::BufferUsages::STORAGE,
    });
    let output = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 8,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 8,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: input.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: output.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &group, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    }
    encoder.copy_buffer_to_buffer(&output, 0, &staging, 0, 8);
    queue.submit([encoder.finish()]);
    staging
        .slice(..)
        .map_async(wgpu::MapMode::Read, |r| r.unwrap());
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let view = staging.slice(..).get_mapped_range().unwrap();
    let words: Vec<u32> = bytemuck::pod_collect_to_vec(&view);
    [words[0], words[1]]
}
