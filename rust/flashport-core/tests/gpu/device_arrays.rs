//! Device arrays: inputs that stay on the GPU between calls, outputs kept
//! there. They must give the bits of the host path, chunked or not; and
//! the device's float16 rounding is the host's.

use super::common::*;
use flashport_core::gpu::testing::round_to_f16_on_device;
use flashport_core::gpu::Gpu;
use flashport_core::overrides;
use flashport_core::{
    attention_arrays, attention_backward_arrays, f16, gpu, Array, Buffer, DType, Device,
    DeviceArray, Error, Input, Placement, Slice, VariantArrays,
};

pub fn on_device(a: &Array) -> &DeviceArray {
    match a {
        Array::Device(t) => t,
        Array::Host(_) => panic!("expected a device array, got a host one"),
    }
}

fn read(a: &Array) -> Buffer {
    on_device(a).to_host().unwrap()
}

fn host_buffer(a: Array) -> Buffer {
    match a {
        Array::Host(b) => b,
        Array::Device(_) => panic!("expected a host array, got a device one"),
    }
}

#[test]
fn device_arrays_round_trip_exactly() {
    if !gpu_present() {
        return;
    }
    let values: Vec<f32> = random(37 * 3, 4).iter().map(|&x| x as f32 * 3.0).collect();
    let t = gpu::to_device("q", Slice::F32(&values), &[37, 3]).unwrap();
    assert_eq!(
        (t.shape(), t.dtype(), t.len(), t.nbytes()),
        (&[37usize, 3][..], DType::F32, 111, 444)
    );
    assert_eq!(
        bits(&t.to_host().unwrap()),
        bits(&Buffer::F32(values.clone()))
    );

    // An odd count of float16 elements (the buffer is padded to a word),
    // with the special values.
    let mut halves: Vec<f16> = random(35, 5)
        .iter()
        .map(|&x| f16::from_f64(x * 100.0))
        .collect();
    for (i, bits) in [0x7e01u16, 0xfc00, 0x8000, 0x0001, 0x7bff]
        .into_iter()
        .enumerate()
    {
        halves[i * 7] = f16::from_bits(bits);
    }
    let t = gpu::to_device("k", Slice::F16(&halves), &[5, 7]).unwrap();
    assert_eq!((t.dtype(), t.nbytes()), (DType::F16, 70));
    assert_eq!(
        bits(&t.to_host().unwrap()),
        bits(&Buffer::F16(halves.clone()))
    );

    let empty = gpu::to_device("v", Slice::F16(&[]), &[0, 4]).unwrap();
    assert_eq!(empty.to_host().unwrap(), Buffer::F16(vec![]));

    // float64 is refused as the GPU refuses float64 inputs.
    let wide = vec![0.5f64; 6];
    match gpu::to_device("q", Slice::F64(&wide), &[2, 3]) {
        Err(Error::DType {
            argument,
            dtype,
            reason,
        }) => {
            assert_eq!((argument.as_str(), dtype.as_str()), ("q", "float64"));
            assert!(reason.contains("cpu"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let err = gpu::to_device("q", Slice::F32(&values), &[36, 3]).unwrap_err();
    assert!(
        matches!(&err, Error::Shape(m) if m.contains("q") && m.contains("(36, 3)")),
        "{err:?}"
    );
}

#[test]
fn float16_rounding_on_device_matches_the_host() {
    if !gpu_present() {
        return;
    }
    // The boundaries of the conversion: signed zeros, ties to even in the
    // normal and subnormal ranges, overflow to infinity, underflow to
    // zero, float32 subnormals, infinities and NaNs with payloads.
    let mut words: Vec<u32> = vec![
        0x0000_0000,
        0x8000_0000,
        0x3f80_0000,
        0xbf80_0000,
        0x477f_e000,
        0x477f_efff,
        0x477f_f000,
        0x477f_f001,
        0x4780_0000,
        0x3380_0000,
        0x3300_0000,
        0x3300_0001,
        0x3340_0000,
        0x387f_c000,
        0x3880_0000,
        0x3f80_1000,
        0x3f80_3000,
        0x3f80_1001,
        0x0000_0001,
        0x807f_ffff,
        0x0080_0000,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xffc1_2345,
        0x7fff_ffff,
        0x3555_5555,
        0xc2f7_0a3d,
    ];
    // Then every exponent with random mantissas: more than the 2^20
    // elements one pass of the capped grid rounds (8192 workgroups of 64
    // invocations, two each), and an odd count, whose last word holds
    // one element.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let random = (1 << 20) + 60_000 + (words.len() + 1) % 2;
    for _ in 0..random {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        words.push((state >> 32) as u32);
    }
    let values: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
    let got = round_to_f16_on_device(&values).unwrap();
    for (i, (&x, g)) in values.iter().zip(&got).enumerate() {
        let want = f16::from_f32(x);
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "value {i}: {x:e} ({:#010x}) rounded to {:#06x} on the device, {:#06x} on the host",
            x.to_bits(),
            g.to_bits(),
            want.to_bits()
        );
    }
}

/// Runs forward and backward of `c` through the host path and through
/// device arrays (inputs uploaded once, forward outputs fed straight into
/// the backward, outputs kept on the device) and checks that both give
/// the same bits; also mixed host and device inputs.
fn check_device_path(c: &Case, seed: u64) {
    let dt = c.p.dtype;
    let d_out = Inputs::new(random(c.p.out_len(), seed), dt);
    let none = VariantArrays::default();
    let host_f = gpu::forward(&c.p, c.q.slice(dt), c.k.slice(dt), c.v.slice(dt), &none).unwrap();
    let host_g = gpu::backward(
        &c.p,
        [
            d_out.slice(dt),
            c.q.slice(dt),
            c.k.slice(dt),
            c.v.slice(dt),
            host_f.out.as_slice(),
            host_f.lse.as_slice(),
        ],
        &none,
    )
    .unwrap();
    assert!(
        gpu::last_kernel_times()
            .iter()
            .any(|(n, _)| n == "host:upload"),
        "the host backward records its uploads"
    );

    let p = &c.p;
    let tq = gpu::to_device("q", c.q.slice(dt), &p.q_shape()).unwrap();
    let tk = gpu::to_device("k", c.k.slice(dt), &p.k_shape()).unwrap();
    let tv = gpu::to_device("v", c.v.slice(dt), &p.v_shape()).unwrap();
    let tdo = gpu::to_device("do", d_out.slice(dt), &p.out_shape()).unwrap();
    let f = attention_arrays(
        Device::Auto,
        p,
        [(&tq).into(), (&tk).into(), (&tv).into()],
        &none,
        Placement::Device,
    )
    .unwrap();
    assert_eq!(on_device(&f.out).shape(), p.out_shape().as_slice());
    assert_eq!(on_device(&f.out).dtype(), dt);
    assert_eq!(on_device(&f.lse).shape(), p.lse_shape().as_slice());
    assert_eq!(on_device(&f.lse).dtype(), DType::F32);
    assert_eq!(bits(&read(&f.out)), bits(&host_f.out), "out {p:?}");
    assert_eq!(bits(&read(&f.lse)), bits(&host_f.lse), "lse {p:?}");

    let g = attention_backward_arrays(
        Device::Gpu(Gpu::Best),
        p,
        [
            (&tdo).into(),
            (&tq).into(),
            (&tk).into(),
            (&tv).into(),
            Input::Device(on_device(&f.out)),
            Input::Device(on_device(&f.lse)),
        ],
        &none,
        Placement::Device,
    )
    .unwrap();
    let uploads: Vec<_> = gpu::last_kernel_times()
        .into_iter()
        .filter(|(n, _)| n.starts_with("host:upload"))
        .collect();
    assert!(
        uploads.is_empty(),
        "device inputs were uploaded: {uploads:?}"
    );
    for (name, got, want, shape) in [
        ("dq", &g.dq, &host_g.dq, p.q_shape()),
        ("dk", &g.dk, &host_g.dk, p.k_shape()),
        ("dv", &g.dv, &host_g.dv, p.v_shape()),
    ] {
        assert_eq!(on_device(got).shape(), shape.as_slice(), "{name}");
        assert_eq!(bits(&read(got)), bits(want), "{name} {p:?}");
    }

    // Mixed host and device inputs, outputs read back.
    let g = attention_backward_arrays(
        Device::Gpu(Gpu::Best),
        p,
        [
            d_out.slice(dt).into(),
            (&tq).into(),
            c.k.slice(dt).into(),
            (&tv).into(),
            host_f.out.as_slice().into(),
            Input::Device(on_device(&f.lse)),
        ],
        &none,
        Placement::Host,
    )
    .unwrap();
    assert_eq!(bits(&host_buffer(g.dq)), bits(&host_g.dq));
    assert_eq!(bits(&host_buffer(g.dk)), bits(&host_g.dk));
    assert_eq!(bits(&host_buffer(g.dv)), bits(&host_g.dv));
    let inputs = [c.q.slice(dt).into(), (&tk).into(), c.v.slice(dt).into()];
    let f = attention_arrays(
        Device::Gpu(Gpu::Best),
        p,
        inputs,
        &none,
        Placement::of_inputs(&inputs),
    )
    .unwrap();
    assert_eq!(bits(&read(&f.out)), bits(&host_f.out));
    assert_eq!(bits(&read(&f.lse)), bits(&host_f.lse));

    // No call wrote into its inputs.
    for (t, x) in [(&tq, &c.q), (&tk, &c.k), (&tv, &c.v), (&tdo, &d_out)] {
        assert_eq!(bits(&t.to_host().unwrap()), slice_bits(x.slice(dt)));
    }
}

fn slice_bits(s: Slice<'_>) -> Vec<u64> {
    match s {
        Slice::F16(x) => bits(&Buffer::F16(x.to_vec())),
        Slice::BF16(x) => bits(&Buffer::BF16(x.to_vec())),
        Slice::F32(x) => bits(&Buffer::F32(x.to_vec())),
        Slice::F64(x) => bits(&Buffer::F64(x.to_vec())),
    }
}

#[test]
fn device_inputs_give_the_bits_of_host_inputs() {
    if !gpu_present() {
        return;
    }
    for dtype in [DType::F32, DType::F16] {
        for (i, s) in [
            // GQA, seq_q != seq_k, d != d_v, nothing a tile multiple.
            (2, 4, 2, 37, 53, 16, 24),
            (1, 2, 1, 65, 17, 64, 32),
            // Odd float16 heads.
            (1, 3, 3, 21, 13, 5, 7),
        ]
        .into_iter()
        .enumerate()
        {
            for causal in [false, true] {
                check_device_path(&case(s, causal, dtype, 40 + i as u64), 7 + i as u64);
            }
        }
    }
}

#[test]
fn device_arrays_across_split_bindings() {
    if !gpu_present() {
        return;
    }
    // float32 MQA with a group cut across chunks (dK/dV pieces summed on
    // the device), then float16 with odd heads: chunks that start
    // mid-word, group cuts, outputs rounded in several pieces.
    let cases = [
        (
            (2, 4, 1, 33, 21, 16, 8),
            DType::F32,
            vec![4 * 33 * 16 * 2, 4 * 33 * 16],
        ),
        (
            (1, 6, 2, 37, 29, 5, 7),
            DType::F16,
            vec![4 * 37 * 7, 4 * 37 * 7 * 2],
        ),
        (
            (2, 3, 3, 19, 23, 3, 5),
            DType::F16,
            vec![4 * 23 * 5, 4 * 23 * 5 * 3],
        ),
    ];
    for (s, dtype, limits) in cases {
        for limit in limits {
            for causal in [false, true] {
                let c = case(s, causal, dtype, limit as u64);
                overrides::with(binding_limit(limit), || check_device_path(&c, 3));
            }
        }
    }
}
