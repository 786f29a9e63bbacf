//! The plain kernels (no variant) of each tier against the float64
//! reference: float32 and float16, tiles of a 16 KiB adapter, the tiled
//! forward with and without subgroups, causal rows that see no key, GQA
//! and MQA, split bindings, empty sequences.

use super::common::*;
use flashport_core::gpu::kernel::Tier;
use flashport_core::overrides::{self, Overrides};
use flashport_core::{gpu, Buffer, DType, Error, Slice, VariantArrays};

#[test]
fn float32_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    let mut worst = (0.0f64, 0.0f64);
    for (i, &s) in SHAPES.iter().enumerate() {
        for causal in [false, true] {
            let (f, b) = check(&case(s, causal, DType::F32, 10 * i as u64), 1e-4, 4e-4);
            worst = (worst.0.max(f), worst.1.max(b));
        }
    }
    eprintln!(
        "float32 worst relative error: forward {:e}, backward {:e}",
        worst.0, worst.1
    );
}

#[test]
fn float16_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    // Both kernel sets: the tiled kernels widen float16 as they load it,
    // the simple ones (every other head dim) unpack it element by element.
    // The cooperative-matrix kernels, which would take some of these
    // shapes where the adapter has them, have tests of their own.
    for simple in [true, false] {
        let tier = if simple { Tier::Simple } else { Tier::Tiled };
        let worst = overrides::with(max_tier(tier), || float16_cases(simple));
        eprintln!(
            "float16 worst relative error ({}): forward {:e}, backward {:e}",
            if simple { "simple" } else { "tiled" },
            worst.0,
            worst.1
        );
    }
}

/// The float16 cases of float16_matches_float64_reference on the simple
/// or the tiled kernels; returns the worst (forward, backward) errors.
fn float16_cases(simple: bool) -> (f64, f64) {
    // Which kernels ran is read from their timestamps.
    gpu::set_kernel_timing(true);
    let mut worst = (0.0f64, 0.0f64);
    for (i, &s) in SHAPES.iter().enumerate().skip(1).step_by(2) {
        for causal in [false, true] {
            let (f, b) = check(&case(s, causal, DType::F16, 7 + i as u64), 1e-2, 1e-2);
            worst = (worst.0.max(f), worst.1.max(b));
            // Where the adapter has timestamp queries, they name the
            // kernels of the last call (check's backward).
            let ran = kernels_run();
            assert!(
                ran.is_empty() || !simple || ran[1..] == ["backward_dq", "backward_dkdv"],
                "simple kernels expected, ran {ran:?}"
            );
            // d = 128's backward tiles do not fit lavapipe's 32 KiB.
            let fits_everywhere = s.5 <= 64;
            assert!(
                ran.is_empty()
                    || simple
                    || !fits_everywhere
                    || ran[1..] == ["backward_dq_tiled", "backward_dkdv_tiled"],
                "tiled kernels expected for float16, ran {ran:?}"
            );
        }
    }
    worst
}

#[test]
fn tiles_of_a_16_kib_adapter() {
    if !gpu_present() {
        return;
    }
    // WebGPU's minimum workgroup memory forces the smallest tiles at
    // d = 256 and ragged ones elsewhere.
    overrides::with(workgroup_bytes(16 * 1024), || {
        for (i, s) in [SHAPES[1], SHAPES[4], (1, 2, 1, 9, 14, 200, 256)]
            .into_iter()
            .enumerate()
        {
            for causal in [false, true] {
                check(&case(s, causal, DType::F32, 40 + i as u64), 1e-4, 4e-4);
            }
        }
    });
}

#[test]
fn tiled_forward_with_and_without_subgroups() {
    if !gpu_present() {
        return;
    }
    // Float32 with head dims that are multiples of 4 take the register-tiled
    // forward; its row reductions go through subgroups where the adapter
    // has them (lavapipe: 8 lanes) and through workgroup memory otherwise.
    // Shapes cross the 32-key and 64/32-row tile edges, with GQA, causal
    // rows that see no key, and values narrower and wider than 32.
    let shapes = [
        (1, 2, 1, 130, 77, 64, 64),
        (2, 4, 2, 70, 33, 32, 48),
        (1, 3, 1, 40, 9, 8, 4),
        (1, 1, 1, 33, 100, 128, 128),
        (1, 2, 2, 1, 1, 4, 100),
    ];
    for off in [false, true] {
        let no_subgroups = Overrides {
            no_subgroups: off,
            ..Overrides::NONE
        };
        overrides::with(no_subgroups, || subgroup_cases(off, shapes));
    }
}

/// tiled_forward_with_and_without_subgroups with subgroups `off` or not.
fn subgroup_cases(off: bool, shapes: [Shape; 5]) {
    // Which kernels ran is read from their timestamps.
    gpu::set_kernel_timing(true);
    for (i, s) in shapes.into_iter().enumerate() {
        for causal in [false, true] {
            check(&case(s, causal, DType::F32, 60 + i as u64), 1e-4, 4e-4);
        }
    }
    let p = problem(shapes[0], false, "float32");
    let x = random(p.q_len(), 1)
        .iter()
        .map(|&v| v as f32)
        .collect::<Vec<_>>();
    gpu::forward(
        &p,
        Slice::F32(&x),
        Slice::F32(&x[..p.k_len()]),
        Slice::F32(&x[..p.v_len()]),
        &VariantArrays::default(),
    )
    .unwrap();
    let times = kernel_times_run();
    eprintln!(
        "subgroups off={off}: features {:?}, kernel times {times:?}",
        gpu::adapters()[0].features
    );
    // Where the adapter has timestamp queries, they name the kernel run.
    assert!(times
        .iter()
        .all(|(name, t)| name == "forward_tiled" && *t >= 0.0));
    let o = vec![0.5f32; p.out_len()];
    let lse = vec![1.0f32; p.lse_len()];
    gpu::backward(
        &p,
        [
            Slice::F32(&o),
            Slice::F32(&x),
            Slice::F32(&x[..p.k_len()]),
            Slice::F32(&x[..p.v_len()]),
            Slice::F32(&o),
            Slice::F32(&lse),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    let names = kernels_run();
    eprintln!("backward kernels: {names:?}");
    assert!(names.is_empty() || names[1..] == ["backward_dq_tiled", "backward_dkdv_tiled"]);
}

#[test]
fn causal_with_more_queries_than_keys_and_gqa_mqa() {
    if !gpu_present() {
        return;
    }
    // seq_q > seq_k under causal: the first rows see no key.
    for s in [
        (1, 3, 1, 40, 9, 8, 5),
        (2, 6, 3, 19, 4, 32, 16),
        (1, 4, 1, 5, 70, 12, 12),
    ] {
        check(&case(s, true, DType::F32, 3), 1e-4, 4e-4);
    }
}

#[test]
fn split_bindings_give_the_same_results() {
    if !gpu_present() {
        return;
    }
    // MQA with a group too large for one binding: heads are cut within the
    // group and dK/dV are summed over the pieces.
    let c = case((2, 4, 1, 33, 21, 16, 8), true, DType::F32, 11);
    let whole = check(&c, 1e-4, 4e-4);
    for limit in [4 * 33 * 16 * 2, 4 * 33 * 16 * 4, 4 * 33 * 16] {
        let split = overrides::with(binding_limit(limit), || check(&c, 1e-4, 4e-4));
        assert!(split.0 <= 1e-4 && split.1 <= 4e-4, "{whole:?} vs {split:?}");
    }
    let err = overrides::with(binding_limit(100), || {
        gpu::forward(
            &c.p,
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            &VariantArrays::default(),
        )
    });
    assert!(matches!(err, Err(Error::TooLarge(_))), "{err:?}");
}

#[test]
fn empty_sequences() {
    if !gpu_present() {
        return;
    }
    for (s, causal) in [
        ((1, 2, 1, 0, 5, 8, 8), false),
        ((1, 2, 1, 4, 0, 8, 8), true),
        ((2, 2, 2, 3, 0, 8, 3), false),
        ((0, 2, 1, 3, 4, 8, 8), false),
        ((1, 1, 1, 0, 0, 4, 4), true),
    ] {
        let c = case(s, causal, DType::F32, 1);
        let f = gpu::forward(
            &c.p,
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            &VariantArrays::default(),
        )
        .unwrap();
        assert_eq!(f.out, Buffer::F32(vec![0.0; c.p.out_len()]));
        assert_eq!(f.lse, Buffer::F32(vec![f32::NEG_INFINITY; c.p.lse_len()]));
        let d_out = vec![1.0f32; c.p.out_len()];
        let lse = vec![f32::NEG_INFINITY; c.p.lse_len()];
        let o = vec![0.0f32; c.p.out_len()];
        let g = gpu::backward(
            &c.p,
            [
                Slice::F32(&d_out),
                c.q.slice(DType::F32),
                c.k.slice(DType::F32),
                c.v.slice(DType::F32),
                Slice::F32(&o),
                Slice::F32(&lse),
            ],
            &VariantArrays::default(),
        )
        .unwrap();
        assert_eq!(g.dq, Buffer::F32(vec![0.0; c.p.q_len()]));
        assert_eq!(g.dk, Buffer::F32(vec![0.0; c.p.k_len()]));
        assert_eq!(g.dv, Buffer::F32(vec![0.0; c.p.v_len()]));
    }
    // An empty value dimension still has a log-sum-exp.
    check(
        &case((1, 2, 1, 7, 9, 8, 0), true, DType::F32, 2),
        1e-4,
        4e-4,
    );
}
