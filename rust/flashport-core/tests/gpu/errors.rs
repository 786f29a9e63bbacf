//! Errors: what the GPU refuses, and device arrays where they cannot go.

use super::common::*;
use flashport_core::gpu::Gpu;
use flashport_core::{
    attention_arrays, gpu, DType, Device, Error, Placement, Slice, VariantArrays,
};

#[test]
fn float64_is_refused_with_a_pointer_to_the_cpu() {
    let c = case((1, 1, 1, 4, 4, 8, 8), false, DType::F64, 1);
    let err = gpu::forward(
        &c.p,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap_err();
    match &err {
        Error::DType { dtype, reason, .. } => {
            assert_eq!(dtype, "float64");
            assert!(reason.contains("cpu"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let lse = vec![0.0f64; c.p.lse_len()];
    let o = vec![0.0f64; c.p.out_len()];
    let err = gpu::backward(
        &c.p,
        [
            Slice::F64(&o),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            Slice::F64(&o),
            Slice::F64(&lse),
        ],
        &VariantArrays::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::DType { .. }));
}

#[test]
fn device_inputs_on_the_cpu_are_an_error_naming_them() {
    if !gpu_present() {
        return;
    }
    let c = case((1, 2, 1, 9, 11, 8, 8), false, DType::F32, 3);
    let tk = gpu::to_device("k", c.k.slice(DType::F32), &c.p.k_shape()).unwrap();
    let inputs = [
        c.q.slice(DType::F32).into(),
        (&tk).into(),
        c.v.slice(DType::F32).into(),
    ];
    let err = attention_arrays(
        Device::Cpu,
        &c.p,
        inputs,
        &VariantArrays::default(),
        Placement::of_inputs(&inputs),
    )
    .unwrap_err();
    match &err {
        Error::Value {
            argument, reason, ..
        } => {
            assert_eq!(argument, "device");
            assert!(reason.contains("k is a device array"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // An array of the wrong size is caught like a slice of the wrong size.
    let small = gpu::to_device("q", Slice::F32(&[1.0; 8]), &[1, 8]).unwrap();
    let err = attention_arrays(
        Device::Gpu(Gpu::Best),
        &c.p,
        [(&small).into(), (&tk).into(), c.v.slice(DType::F32).into()],
        &VariantArrays::default(),
        Placement::Device,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::Shape(m) if m.starts_with("q holds 8")),
        "{err:?}"
    );
}
