//! A device lost under device arrays. Its own test binary (own process):
//! losing the shared device would fail the GPU tests running beside it.

#[path = "gpu/require.rs"]
mod require;

use flashport_core::gpu::testing::lose_device;
use flashport_core::gpu::Gpu;
use flashport_core::{
    attention_arrays, gpu, validate_forward, ArrayInfo, Buffer, Device, Error, Options, Placement,
    Slice, VariantArrays,
};

#[test]
fn lost_device_arrays_are_errors_naming_them_and_the_cpu_keeps_working() {
    if !require::gpu_present() {
        return;
    }
    let shape = [2, 9, 8];
    let info = ArrayInfo::new(&shape, "float32");
    let p = validate_forward(info, info, info, &Options::default()).unwrap();
    let values: Vec<f32> = (0..p.q_len())
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let run = |device, inputs| {
        attention_arrays(
            device,
            &p,
            inputs,
            &VariantArrays::default(),
            Placement::Host,
        )
        .map(|r| r.out.into_host().unwrap())
    };
    let x = Slice::F32(&values);
    let want = run(Device::Cpu, [x.into(), x.into(), x.into()]).unwrap();
    let tk = gpu::to_device("k", x, &shape).unwrap();
    let before = run(Device::Gpu(Gpu::Best), [x.into(), (&tk).into(), x.into()]).unwrap();

    // Work queued (a copy on the device returns without waiting) and not
    // yet waited for when the device goes.
    let queued = tk.copy().unwrap();
    lose_device(0);
    let err = gpu::synchronize(None).unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(m) if m.contains("lost")),
        "{err:?}"
    );
    let err = queued.to_host().unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(m) if m.contains("lost")),
        "{err:?}"
    );
    // Raised once: the lost device is dropped, nothing is left to wait for.
    gpu::synchronize(None).unwrap();
    let err = run(Device::Gpu(Gpu::Best), [x.into(), (&tk).into(), x.into()]).unwrap_err();
    assert!(
        matches!(&err, Error::Gpu(m) if m.starts_with("k is a device array") && m.contains("lost")),
        "{err:?}"
    );
    assert!(matches!(tk.to_host(), Err(Error::Gpu(_))));
    assert_eq!(
        run(Device::Cpu, [x.into(), x.into(), x.into()]).unwrap(),
        want
    );

    // A fresh device for new arrays.
    let tk = gpu::to_device("k", x, &shape).unwrap();
    let again = run(Device::Gpu(Gpu::Best), [x.into(), (&tk).into(), x.into()]).unwrap();
    let (Buffer::F32(a), Buffer::F32(b)) = (&again, &before) else {
        panic!("float32 outputs expected")
    };
    assert_eq!(a, b);
}
