//! The GPU backend against a float64 reference (the CPU backend in
//! float64 on upcast inputs), on whatever adapter wgpu finds: Mesa's
//! lavapipe in CI. Having no adapter at all fails the suite unless
//! FLASHPORT_ALLOW_NO_GPU=1, so a broken driver install cannot pass as
//! "skipped".

use flashport_core::{
    cpu, f16, gpu, validate_forward, ArrayInfo, Buffer, DType, Error, Options, Problem, Slice,
    VariantArrays,
};

fn gpu_present() -> bool {
    if !gpu::adapters().is_empty() {
        return true;
    }
    if std::env::var("FLASHPORT_ALLOW_NO_GPU").as_deref() == Ok("1") {
        eprintln!("no GPU adapter; skipped because FLASHPORT_ALLOW_NO_GPU=1");
        return false;
    }
    panic!(
        "no GPU adapter found (install Mesa's lavapipe: mesa-vulkan-drivers), \
         or set FLASHPORT_ALLOW_NO_GPU=1 to skip the GPU tests"
    );
}

/// Deterministic values in [-1, 1), never exactly 0.
fn random(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = ((state >> 11) as f64) / ((1u64 << 53) as f64) * 2.0 - 1.0;
            if x == 0.0 {
                0.5
            } else {
                x
            }
        })
        .collect()
}

type Shape = (usize, usize, usize, usize, usize, usize, usize);

const SHAPES: [Shape; 5] = [
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 2, 37, 53, 16, 24),
    (1, 2, 1, 65, 17, 64, 32),
    (1, 1, 1, 130, 130, 128, 128),
    (1, 2, 2, 20, 33, 256, 8),
];

fn problem(s: Shape, causal: bool, dtype: &str) -> Problem {
    let (b, hq, hkv, sq, sk, d, dv) = s;
    validate_forward(
        ArrayInfo::new(&[b, hq, sq, d], dtype),
        ArrayInfo::new(&[b, hkv, sk, d], dtype),
        ArrayInfo::new(&[b, hkv, sk, dv], dtype),
        &Options {
            causal,
            ..Options::default()
        },
    )
    .unwrap()
}

fn f64_problem(p: &Problem) -> Problem {
    Problem {
        dtype: DType::F64,
        ..*p
    }
}

fn as_f64(b: &Buffer) -> Vec<f64> {
    match b {
        Buffer::F16(x) => x.iter().map(|v| v.to_f64()).collect(),
        Buffer::F32(x) => x.iter().map(|&v| v as f64).collect(),
        Buffer::F64(x) => x.clone(),
    }
}

/// Values rounded to the dtype under test, kept as f64 for the reference.
struct Inputs {
    f64: Vec<f64>,
    f32: Vec<f32>,
    f16: Vec<f16>,
}

impl Inputs {
    fn new(values: Vec<f64>, dtype: DType) -> Inputs {
        let f16: Vec<f16> = values.iter().map(|&x| f16::from_f64(x)).collect();
        let f32: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        let f64 = match dtype {
            DType::F16 => f16.iter().map(|x| x.to_f64()).collect(),
            _ => f32.iter().map(|&x| x as f64).collect(),
        };
        Inputs { f64, f32, f16 }
    }
    fn slice(&self, dtype: DType) -> Slice<'_> {
        match dtype {
            DType::F16 => Slice::F16(&self.f16),
            DType::F32 => Slice::F32(&self.f32),
            DType::F64 => Slice::F64(&self.f64),
        }
    }
}

/// max |got − want| / max |want| (with a floor for all-zero references),
/// and the number of non-finite values in `got`.
/// The GPU kernels the last call on this thread ran, by name (empty where
/// the adapter has no timestamp queries).
fn kernels_run() -> Vec<String> {
    gpu::last_kernel_times()
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !n.starts_with("host:"))
        .collect()
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if w.is_infinite() {
                if g == w {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else if g.is_finite() {
                (g - w).abs() / scale
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

struct Case {
    p: Problem,
    q: Inputs,
    k: Inputs,
    v: Inputs,
}

fn case(s: Shape, causal: bool, dtype: DType, seed: u64) -> Case {
    let p = problem(s, causal, dtype.numpy_name());
    Case {
        q: Inputs::new(random(p.q_len(), seed), dtype),
        k: Inputs::new(random(p.k_len(), seed + 1), dtype),
        v: Inputs::new(random(p.v_len(), seed + 2), dtype),
        p,
    }
}

/// Checks forward and backward of one case; returns (forward, backward)
/// relative errors.
fn check(c: &Case, fwd_tol: f64, bwd_tol: f64) -> (f64, f64) {
    let dt = c.p.dtype;
    let p64 = f64_problem(&c.p);
    let reference = cpu::forward(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let got = gpu::forward(
        &c.p,
        c.q.slice(dt),
        c.k.slice(dt),
        c.v.slice(dt),
        &VariantArrays::default(),
    )
    .unwrap();
    assert_eq!(got.out.len(), c.p.out_len());
    assert!(matches!(got.lse, Buffer::F32(_)), "lse must be float32");
    let ref_out = as_f64(&reference.out);
    let ref_lse = as_f64(&reference.lse);
    let e_out = rel_err(&as_f64(&got.out), &ref_out);
    let e_lse = rel_err(&as_f64(&got.lse), &ref_lse);
    let fwd = e_out.max(e_lse);
    assert!(
        fwd <= fwd_tol,
        "forward {:?}: out error {e_out:e}, lse error {e_lse:e}",
        c.p
    );
    // Rows that see no key: exactly 0 and -inf.
    let dv = c.p.value_dim;
    for (row, &l) in ref_lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(as_f64(&got.lse)[row], f64::NEG_INFINITY);
            assert!(as_f64(&got.out)[row * dv..(row + 1) * dv]
                .iter()
                .all(|&x| x == 0.0));
        }
    }

    // The backward gets the reference O and lse, rounded to the dtype
    // under test, so both sides see the same inputs.
    let o = Inputs::new(ref_out, dt);
    let lse32: Vec<f32> = ref_lse.iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), 99), dt);
    let ref_g = cpu::backward(
        &p64,
        [
            d_out.slice(DType::F64),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            o.slice(DType::F64),
            Slice::F64(&lse64),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    let g = gpu::backward(
        &c.p,
        [
            d_out.slice(dt),
            c.q.slice(dt),
            c.k.slice(dt),
            c.v.slice(dt),
            o.slice(dt),
            Slice::F32(&lse32),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    let errs = [
        rel_err(&as_f64(&g.dq), &as_f64(&ref_g.dq)),
        rel_err(&as_f64(&g.dk), &as_f64(&ref_g.dk)),
        rel_err(&as_f64(&g.dv), &as_f64(&ref_g.dv)),
    ];
    let bwd = errs.iter().cloned().fold(0.0, f64::max);
    assert!(
        bwd <= bwd_tol,
        "backward {:?}: dq/dk/dv errors {errs:?}",
        c.p
    );
    (fwd, bwd)
}

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
    gpu::set_no_coop_for_this_thread(true);
    for simple in [true, false] {
        gpu::set_simple_kernels_for_this_thread(simple);
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
        gpu::set_simple_kernels_for_this_thread(false);
        eprintln!(
            "float16 worst relative error ({}): forward {:e}, backward {:e}",
            if simple { "simple" } else { "tiled" },
            worst.0,
            worst.1
        );
    }
    gpu::set_no_coop_for_this_thread(false);
}

#[test]
fn tiles_of_a_16_kib_adapter() {
    if !gpu_present() {
        return;
    }
    // WebGPU's minimum workgroup memory forces the smallest tiles at
    // d = 256 and ragged ones elsewhere.
    gpu::set_workgroup_storage_for_this_thread(Some(16 * 1024));
    for (i, s) in [SHAPES[1], SHAPES[4], (1, 2, 1, 9, 14, 200, 256)]
        .into_iter()
        .enumerate()
    {
        for causal in [false, true] {
            check(&case(s, causal, DType::F32, 40 + i as u64), 1e-4, 4e-4);
        }
    }
    gpu::set_workgroup_storage_for_this_thread(None);
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
        gpu::set_no_subgroups_for_this_thread(off);
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
        let times: Vec<(String, f64)> = gpu::last_kernel_times()
            .into_iter()
            .filter(|(n, _)| !n.starts_with("host:"))
            .collect();
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
    gpu::set_no_subgroups_for_this_thread(false);
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
fn results_are_bitwise_reproducible() {
    if !gpu_present() {
        return;
    }
    let c = case((2, 4, 2, 37, 53, 16, 24), true, DType::F32, 5);
    let run = || {
        gpu::forward(
            &c.p,
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            &VariantArrays::default(),
        )
        .unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    let Buffer::F32(lse) = &a.lse else { panic!() };
    let d_out = Inputs::new(random(c.p.out_len(), 8), DType::F32);
    let o = Inputs::new(as_f64(&a.out), DType::F32);
    let grad = || {
        gpu::backward(
            &c.p,
            [
                d_out.slice(DType::F32),
                c.q.slice(DType::F32),
                c.k.slice(DType::F32),
                c.v.slice(DType::F32),
                o.slice(DType::F32),
                Slice::F32(lse),
            ],
            &VariantArrays::default(),
        )
        .unwrap()
    };
    assert_eq!(grad(), grad());

    // Concurrent callers share the context and still get the same bits.
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let (q, k, v) = (c.q.f32.clone(), c.k.f32.clone(), c.v.f32.clone());
            let p = c.p;
            std::thread::spawn(move || {
                gpu::forward(
                    &p,
                    Slice::F32(&q),
                    Slice::F32(&k),
                    Slice::F32(&v),
                    &VariantArrays::default(),
                )
                .unwrap()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), a);
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
        gpu::set_binding_limit_for_this_thread(Some(limit as u64));
        let split = check(&c, 1e-4, 4e-4);
        gpu::set_binding_limit_for_this_thread(None);
        assert!(split.0 <= 1e-4 && split.1 <= 4e-4, "{whole:?} vs {split:?}");
    }
    gpu::set_binding_limit_for_this_thread(Some(100));
    let err = gpu::forward(
        &c.p,
        c.q.slice(DType::F32),
        c.k.slice(DType::F32),
        c.v.slice(DType::F32),
        &VariantArrays::default(),
    );
    gpu::set_binding_limit_for_this_thread(None);
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
fn adapters_are_listed_consistently() {
    if !gpu_present() {
        return;
    }
    let adapters = gpu::adapters();
    for a in &adapters {
        assert!(
            ["discrete", "integrated", "virtual", "software", "other"]
                .contains(&a.device_type.as_str()),
            "{a:?}"
        );
        assert!(!a.backend.to_lowercase().contains("gl"), "{a:?}");
        assert!(a
            .limits
            .iter()
            .any(|(n, v)| n == "max_compute_workgroup_storage_size" && *v >= 16 * 1024));
    }
    let hardware = adapters.iter().any(|a| a.device_type != "software");
    assert_eq!(gpu::hardware_adapter_available(), hardware);
}

/// Not a test: `cargo test --test gpu -- --ignored --nocapture` prints the
/// adapter and rough timings (the first call includes pipeline builds).
#[test]
#[ignore]
fn timing_report() {
    if !gpu_present() {
        return;
    }
    for a in gpu::adapters() {
        eprintln!("adapter: {a:?}");
    }
    let sizes: usize = std::env::var("FLASHPORT_BENCH_SEQ")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512);
    for dtype in [DType::F32, DType::F16] {
        let c = case((1, 8, 8, sizes, sizes, 64, 64), false, dtype, 1);
        let flops = c.p.forward_flops();
        for round in 0..2 {
            let t = std::time::Instant::now();
            let f = gpu::forward(
                &c.p,
                c.q.slice(dtype),
                c.k.slice(dtype),
                c.v.slice(dtype),
                &VariantArrays::default(),
            )
            .unwrap();
            let tf = t.elapsed().as_secs_f64();
            let Buffer::F32(lse) = &f.lse else { panic!() };
            let o = Inputs::new(as_f64(&f.out), dtype);
            let t = std::time::Instant::now();
            gpu::backward(
                &c.p,
                [
                    o.slice(dtype),
                    c.q.slice(dtype),
                    c.k.slice(dtype),
                    c.v.slice(dtype),
                    o.slice(dtype),
                    Slice::F32(lse),
                ],
                &VariantArrays::default(),
            )
            .unwrap();
            let tb = t.elapsed().as_secs_f64();
            eprintln!(
                "{} seq={sizes} round {round}: forward {:.3} s ({:.2} GFLOP/s), backward {:.3} s ({:.2} GFLOP/s)",
                dtype.numpy_name(),
                tf,
                flops / tf / 1e9,
                tb,
                2.5 * flops / tb / 1e9
            );
        }
    }
}

// ---------------------------------------------------------------------
// Attention variants: the GPU against the float64 CPU reference.

use flashport_core::variants::{DropoutMask, MaskData};

#[derive(Clone, Default)]
enum MaskArg {
    #[default]
    None,
    Bool(Vec<usize>),
    Float(Vec<usize>),
    /// A boolean mask of the given shape, keeping where `keep(row, key)`
    /// (of the last two axes).
    Blocks(Vec<usize>, fn(usize, usize) -> bool),
}

#[derive(Clone, Default)]
struct Spec {
    causal: bool,
    window: Option<(i64, i64)>,
    softcap: Option<f64>,
    dropout_p: f64,
    mask: MaskArg,
    /// Shape of the ALiBi slopes: `[heads_q]` or `[batch, heads_q]`.
    alibi: Option<Vec<usize>>,
    sinks: bool,
    dmask: bool,
}

/// A mask's values: mostly finite (or True), every 5th -inf (False), and
/// the first 16x16 block of each (row, key) plane entirely hidden so that
/// tiles are skipped.
fn mask_pattern(dims: &[usize], seed: u64) -> Vec<Option<f64>> {
    let n: usize = dims.iter().product();
    let (rows, keys) = match dims.len() {
        1 => (1, dims[0]),
        _ => (dims[dims.len() - 2], dims[dims.len() - 1]),
    };
    random(n, seed)
        .into_iter()
        .enumerate()
        .map(|(e, x)| {
            let (r, c) = ((e / keys) % rows, e % keys);
            let hidden = e % 5 == 3 || (r < 16 && c < 16 && rows > 1 && keys > 16);
            (!hidden).then_some(x)
        })
        .collect()
}

fn mask_pattern_of(shape: Option<&(Vec<usize>, bool)>, seed: u64) -> Vec<Option<f64>> {
    shape
        .map(|(shape, _)| mask_pattern(shape, seed))
        .unwrap_or_default()
}

/// Max relative errors of (out, lse, dq, dk, dv, dmask).
fn check_spec(
    s: Shape,
    dtype: DType,
    spec: &Spec,
    seed: u64,
    fwd_tol: f64,
    bwd_tol: f64,
) -> [f64; 6] {
    let (b, hq, hkv, sq, sk, d, dv) = s;
    let dt_name = dtype.numpy_name();
    let mask_shape: Option<(Vec<usize>, bool)> = match &spec.mask {
        MaskArg::None => None,
        MaskArg::Bool(shape) => Some((shape.clone(), true)),
        MaskArg::Float(shape) => Some((shape.clone(), false)),
        MaskArg::Blocks(shape, _) => Some((shape.clone(), true)),
    };
    let pattern = match &spec.mask {
        MaskArg::Blocks(shape, keep) => {
            let (rows, keys) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let n: usize = shape.iter().product();
            (0..n)
                .map(|e| keep((e / keys) % rows, e % keys).then_some(1.0))
                .collect()
        }
        _ => mask_pattern_of(mask_shape.as_ref(), seed + 7),
    };
    let mask_bool: Vec<bool> = pattern.iter().map(Option::is_some).collect();
    let mask_f32: Vec<f32> = pattern
        .iter()
        .map(|x| x.map_or(f32::NEG_INFINITY, |v| v as f32))
        .collect();
    let slopes: Vec<f64> = spec
        .alibi
        .as_ref()
        .map(|shape| {
            random(shape.iter().product(), seed + 8)
                .iter()
                .map(|x| (x.abs() * 0.5) as f32 as f64)
                .collect()
        })
        .unwrap_or_default();
    let sinks: Vec<f64> = random(hq, seed + 9)
        .iter()
        .map(|x| (2.0 * x) as f32 as f64)
        .collect();
    let sinks_shape = [hq];
    let options = Options {
        causal: spec.causal,
        window: spec.window,
        softcap: spec.softcap,
        dropout_p: spec.dropout_p,
        seed: (spec.dropout_p > 0.0).then_some(0x1234_5678_9abc + seed as i128),
        mask: mask_shape.as_ref().map(|(shape, is_bool)| {
            ArrayInfo::new(shape, if *is_bool { "bool" } else { "float32" })
        }),
        alibi_slopes: spec
            .alibi
            .as_ref()
            .map(|shape| ArrayInfo::new(shape, "float32")),
        sinks: spec.sinks.then(|| ArrayInfo::new(&sinks_shape, "float32")),
        ..Options::default()
    };
    let p = validate_forward(
        ArrayInfo::new(&[b, hq, sq, d], dt_name),
        ArrayInfo::new(&[b, hkv, sk, d], dt_name),
        ArrayInfo::new(&[b, hkv, sk, dv], dt_name),
        &options,
    )
    .unwrap();
    let arrays = VariantArrays {
        mask: mask_shape.as_ref().map(|(_, is_bool)| {
            if *is_bool {
                MaskData::Bool(&mask_bool)
            } else {
                MaskData::Float(Slice::F32(&mask_f32))
            }
        }),
        alibi_slopes: spec.alibi.as_ref().map(|_| slopes.as_slice()),
        sinks: spec.sinks.then_some(sinks.as_slice()),
    };
    let c = Case {
        q: Inputs::new(random(p.q_len(), seed), dtype),
        k: Inputs::new(random(p.k_len(), seed + 1), dtype),
        v: Inputs::new(random(p.v_len(), seed + 2), dtype),
        p,
    };
    let p64 = f64_problem(&c.p);
    let reference = cpu::forward(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &arrays,
    )
    .unwrap();
    let got = gpu::forward(
        &c.p,
        c.q.slice(dtype),
        c.k.slice(dtype),
        c.v.slice(dtype),
        &arrays,
    )
    .unwrap();
    let ref_out = as_f64(&reference.out);
    let ref_lse = as_f64(&reference.lse);
    let e_out = rel_err(&as_f64(&got.out), &ref_out);
    let e_lse = rel_err(&as_f64(&got.lse), &ref_lse);

    let o = Inputs::new(ref_out, dtype);
    let lse32: Vec<f32> = ref_lse.iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), seed + 99), dtype);
    let pb = Problem {
        return_dmask: spec.dmask,
        ..c.p
    };
    let ref_g = cpu::backward(
        &f64_problem(&pb),
        [
            d_out.slice(DType::F64),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            o.slice(DType::F64),
            Slice::F64(&lse64),
        ],
        &arrays,
    )
    .unwrap();
    let g = gpu::backward(
        &pb,
        [
            d_out.slice(dtype),
            c.q.slice(dtype),
            c.k.slice(dtype),
            c.v.slice(dtype),
            o.slice(dtype),
            Slice::F32(&lse32),
        ],
        &arrays,
    )
    .unwrap();
    let e_dmask = match (&g.d_scores, &ref_g.d_scores) {
        (Some(a), Some(b)) => rel_err(&as_f64(a), &as_f64(b)),
        (None, None) => 0.0,
        _ => panic!("d_scores returned by only one backend"),
    };
    let errs = [
        e_out,
        e_lse,
        rel_err(&as_f64(&g.dq), &as_f64(&ref_g.dq)),
        rel_err(&as_f64(&g.dk), &as_f64(&ref_g.dk)),
        rel_err(&as_f64(&g.dv), &as_f64(&ref_g.dv)),
        e_dmask,
    ];
    assert!(
        errs[0].max(errs[1]) <= fwd_tol && errs[2..].iter().all(|&e| e <= bwd_tol),
        "{dtype:?} {s:?} simple={}: out/lse/dq/dk/dv/dmask errors {errs:?}",
        std::env::var("FLASHPORT_GPU_KERNELS").is_ok()
    );
    errs
}

/// Runs `f` with the simple kernels and with the tiled ones, and reports
/// the worst errors of each under `name`.
fn both_kernels(name: &str, mut f: impl FnMut() -> [f64; 6]) {
    for simple in [true, false] {
        gpu::set_simple_kernels_for_this_thread(simple);
        let errs = f();
        gpu::set_simple_kernels_for_this_thread(false);
        eprintln!(
            "{name} ({}): out {:.1e} lse {:.1e} dq {:.1e} dk {:.1e} dv {:.1e} dmask {:.1e}",
            if simple { "simple" } else { "tiled" },
            errs[0],
            errs[1],
            errs[2],
            errs[3],
            errs[4],
            errs[5]
        );
    }
}

fn worst(a: [f64; 6], b: [f64; 6]) -> [f64; 6] {
    std::array::from_fn(|i| a[i].max(b[i]))
}

/// Shapes that are no tile multiples; the second has more queries than
/// keys, so causal rows that see no key.
const VARIANT_SHAPES: [Shape; 2] = [(2, 4, 2, 37, 53, 16, 24), (1, 2, 1, 45, 30, 32, 8)];

fn each_shape(spec: &Spec, seed: u64) -> [f64; 6] {
    VARIANT_SHAPES
        .iter()
        .enumerate()
        .map(|(i, &s)| check_spec(s, DType::F32, spec, seed + 10 * i as u64, 1e-4, 4e-4))
        .fold([0.0; 6], worst)
}

#[test]
fn variant_window() {
    if !gpu_present() {
        return;
    }
    for (w, causal) in [
        ((5, 3), false),
        ((7, -1), false),
        ((-1, 2), false),
        ((4, 0), true),
    ] {
        let spec = Spec {
            window: Some(w),
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("window {w:?} causal={causal}"), || {
            each_shape(&spec, 100)
        });
    }
}

#[test]
fn variant_softcap() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        softcap: Some(0.3),
        ..Spec::default()
    };
    both_kernels("softcap", || each_shape(&spec, 200));
}

#[test]
fn variant_alibi() {
    if !gpu_present() {
        return;
    }
    for (name, shape) in [("per head", vec![4]), ("per batch", vec![2, 4])] {
        let spec = Spec {
            alibi: Some(shape),
            causal: true,
            ..Spec::default()
        };
        both_kernels(&format!("alibi {name}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 300, 1e-4, 4e-4)
        });
    }
}

#[test]
fn variant_masks() {
    if !gpu_present() {
        return;
    }
    let (b, hq, sq, sk) = (2, 4, 37, 53);
    for (name, mask) in [
        ("float (sk,)", MaskArg::Float(vec![sk])),
        ("float (b,1,sq,sk)", MaskArg::Float(vec![b, 1, sq, sk])),
        ("bool (b,h,sq,sk)", MaskArg::Bool(vec![b, hq, sq, sk])),
        ("bool (sq,sk)", MaskArg::Bool(vec![sq, sk])),
    ] {
        let spec = Spec {
            mask,
            ..Spec::default()
        };
        both_kernels(&format!("mask {name}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 400, 1e-4, 4e-4)
        });
    }
}

#[test]
fn variant_dmask() {
    if !gpu_present() {
        return;
    }
    let (b, sq, sk) = (2, 37, 53);
    for causal in [false, true] {
        let spec = Spec {
            mask: MaskArg::Float(vec![b, 1, sq, sk]),
            dmask: true,
            causal,
            window: causal.then_some((9, -1)),
            ..Spec::default()
        };
        both_kernels(&format!("dmask causal={causal}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 500, 1e-4, 4e-4)
        });
    }
    // Split into chunks: the score gradient is assembled from the pieces.
    let spec = Spec {
        mask: MaskArg::Float(vec![45, 30]),
        dmask: true,
        ..Spec::default()
    };
    gpu::set_binding_limit_for_this_thread(Some(4 * 45 * 32));
    both_kernels("dmask split", || {
        check_spec(VARIANT_SHAPES[1], DType::F32, &spec, 510, 1e-4, 4e-4)
    });
    gpu::set_binding_limit_for_this_thread(None);
}

#[test]
fn variant_sinks() {
    if !gpu_present() {
        return;
    }
    for causal in [false, true] {
        // The second shape, causal: rows that see no key (output 0, lse =
        // sink).
        let spec = Spec {
            sinks: true,
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("sinks causal={causal}"), || each_shape(&spec, 600));
    }
}

#[test]
fn variant_dropout() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        dropout_p: 0.3,
        causal: true,
        ..Spec::default()
    };
    both_kernels("dropout", || each_shape(&spec, 700));
}

/// The GPU's dropout mask is the CPU's, bit for bit: with every score
/// equal and v the identity, out[i, j] = keep(i, j) / ((1 - p) seq_k).
#[test]
fn dropout_mask_matches_the_cpu_exactly() {
    if !gpu_present() {
        return;
    }
    let (b, h, sq, sk) = (2, 3, 21, 40);
    let options = Options {
        dropout_p: 0.4,
        seed: Some(0xdead_beef_1234_5678),
        ..Options::default()
    };
    let p = validate_forward(
        ArrayInfo::new(&[b, h, sq, 4], "float32"),
        ArrayInfo::new(&[b, h, sk, 4], "float32"),
        ArrayInfo::new(&[b, h, sk, sk], "float32"),
        &options,
    )
    .unwrap();
    let q = vec![0.0f32; p.q_len()];
    let k = vec![0.5f32; p.k_len()];
    let v: Vec<f32> = (0..p.v_len())
        .map(|e| ((e / sk) % sk == e % sk) as u32 as f32)
        .collect();
    let mask = DropoutMask::new(p.dropout.unwrap());
    for simple in [true, false] {
        gpu::set_simple_kernels_for_this_thread(simple);
        let got = gpu::forward(
            &p,
            Slice::F32(&q),
            Slice::F32(&k),
            Slice::F32(&v),
            &VariantArrays::default(),
        )
        .unwrap();
        gpu::set_simple_kernels_for_this_thread(false);
        let out = as_f64(&got.out);
        let mut kept = 0;
        for bh in 0..b * h {
            for i in 0..sq {
                for j in 0..sk {
                    let x = out[(bh * sq + i) * sk + j];
                    let want = mask.keeps(bh, i, j);
                    assert_eq!(x > 0.0, want, "simple={simple} bh={bh} i={i} j={j}: {x}");
                    kept += want as usize;
                }
            }
        }
        assert!(kept > 0 && kept < b * h * sq * sk);
    }
}

#[test]
fn variant_combinations() {
    if !gpu_present() {
        return;
    }
    let gqa_more_keys = VARIANT_SHAPES[0];
    let combos = [
        (
            "window+causal+GQA+alibi+sinks",
            Spec {
                window: Some((6, -1)),
                causal: true,
                alibi: Some(vec![2, 4]),
                sinks: true,
                ..Spec::default()
            },
        ),
        (
            "softcap+mask+dropout+dmask",
            Spec {
                softcap: Some(0.5),
                mask: MaskArg::Float(vec![2, 4, 37, 53]),
                dropout_p: 0.2,
                dmask: true,
                ..Spec::default()
            },
        ),
        (
            "everything",
            Spec {
                window: Some((8, 3)),
                causal: false,
                softcap: Some(0.4),
                dropout_p: 0.25,
                mask: MaskArg::Float(vec![53]),
                alibi: Some(vec![4]),
                sinks: true,
                dmask: true,
            },
        ),
    ];
    for (name, spec) in &combos {
        both_kernels(name, || {
            check_spec(gqa_more_keys, DType::F32, spec, 800, 1e-4, 4e-4)
        });
    }
    // Head chunks that cut a GQA group, with every variant.
    gpu::set_binding_limit_for_this_thread(Some(4 * 37 * 53));
    both_kernels("everything, split", || {
        check_spec(gqa_more_keys, DType::F32, &combos[2].1, 810, 1e-4, 4e-4)
    });
    gpu::set_binding_limit_for_this_thread(None);
}

/// Every variant where the backward's streamed tiles share workgroup memory
/// (dK/dV: dO, then Q over it, then dO again, with one weight array): a 16
/// KiB budget forces it (32-row blocks) and 12 KiB (16-row blocks), both
/// with the register prefetch; d = 128 on lavapipe runs it without.
#[test]
fn variants_with_shared_streamed_tiles() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        causal: true,
        window: Some((20, 3)),
        softcap: Some(0.7),
        mask: MaskArg::Float(vec![2, 1, 37, 53]),
        dmask: true,
        alibi: Some(vec![4]),
        sinks: true,
        dropout_p: 0.2,
    };
    for kib in [16, 12] {
        gpu::set_workgroup_storage_for_this_thread(Some(kib * 1024));
        let errs = check_spec(
            VARIANT_SHAPES[0],
            DType::F32,
            &spec,
            920 + kib as u64,
            1e-4,
            4e-4,
        );
        gpu::set_workgroup_storage_for_this_thread(None);
        eprintln!("shared streamed tiles, {kib} KiB: {errs:?}");
    }
}

#[test]
fn variants_in_float16() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        window: Some((10, 2)),
        softcap: Some(0.5),
        mask: MaskArg::Bool(vec![1, 4, 37, 53]),
        alibi: Some(vec![4]),
        sinks: true,
        dropout_p: 0.1,
        ..Spec::default()
    };
    let errs = check_spec(VARIANT_SHAPES[0], DType::F16, &spec, 900, 1e-2, 1e-2);
    eprintln!("float16 everything: {errs:?}");
    let spec = Spec {
        causal: true,
        mask: MaskArg::Float(vec![2, 1, 37, 53]),
        dmask: true,
        ..Spec::default()
    };
    let errs = check_spec((2, 4, 2, 37, 53, 12, 7), DType::F16, &spec, 910, 1e-2, 1e-2);
    eprintln!("float16 mask+dmask: {errs:?}");
}

/// Kernel times of the variants that cut work (window, a block-sparse
/// mask) and of dropout against their baselines, on whatever adapter runs
/// the tests: `cargo test --release --test gpu variant_work_report --
/// --ignored --nocapture` (FLASHPORT_BENCH_SEQ sets the sequence, 1024 by
/// default; FLASHPORT_GPU_KERNELS=simple for the simple kernels).
#[test]
#[ignore]
fn variant_work_report() {
    if !gpu_present() {
        return;
    }
    let seq: usize = std::env::var("FLASHPORT_BENCH_SEQ")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let heads: usize = std::env::var("FLASHPORT_BENCH_HEADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let reps: usize = std::env::var("FLASHPORT_BENCH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    // 64x64 blocks, ~11% kept (the diagonal always), like
    // benchmarks/gpu_variants_bench.py.
    let nb = seq.div_ceil(64);
    let keep: Vec<bool> = random(nb * nb, 4242)
        .iter()
        .enumerate()
        .map(|(e, x)| e / nb == e % nb || (x + 1.0) / 2.0 < 0.1)
        .collect();
    let block_mask: Vec<bool> = (0..seq * seq)
        .map(|e| keep[(e / seq / 64) * nb + (e % seq) / 64])
        .collect();
    let kept = block_mask.iter().filter(|&&b| b).count() as f64 / (seq * seq) as f64;
    let mask_shape = [seq, seq];
    let rows: Vec<(String, Options, bool)> = vec![
        (
            "causal".into(),
            Options {
                causal: true,
                ..Options::default()
            },
            false,
        ),
        (
            "causal + window (256, 0)".into(),
            Options {
                causal: true,
                window: Some((256, 0)),
                ..Options::default()
            },
            false,
        ),
        ("dense".into(), Options::default(), false),
        (
            format!("block mask {:.0}% kept", 100.0 * kept),
            Options {
                mask: Some(ArrayInfo::new(&mask_shape, "bool")),
                ..Options::default()
            },
            true,
        ),
        (
            "dropout 0.1".into(),
            Options {
                dropout_p: 0.1,
                seed: Some(5),
                ..Options::default()
            },
            false,
        ),
    ];
    eprintln!("variant kernel ms at (1, {heads}, {seq}, 64) float32 (median of {reps})");
    eprintln!(
        "{:<28}{:>9}{:>9}{:>9}{:>9}",
        "variant", "fwd", "dq", "dkdv", "f+b"
    );
    for (name, options, masked) in &rows {
        let p = validate_forward(
            ArrayInfo::new(&[1, heads, seq, 64], "float32"),
            ArrayInfo::new(&[1, heads, seq, 64], "float32"),
            ArrayInfo::new(&[1, heads, seq, 64], "float32"),
            options,
        )
        .unwrap();
        let arrays = VariantArrays {
            mask: masked.then_some(MaskData::Bool(&block_mask)),
            ..VariantArrays::default()
        };
        let q = Inputs::new(random(p.q_len(), 1), DType::F32);
        let k = Inputs::new(random(p.k_len(), 2), DType::F32);
        let v = Inputs::new(random(p.v_len(), 3), DType::F32);
        let kernel = |times: &[(String, f64)], what: &str| -> f64 {
            times
                .iter()
                .filter(|(n, _)| n.contains(what) && !n.starts_with("host:"))
                .map(|(_, t)| t)
                .sum::<f64>()
                * 1e3
        };
        let mut samples: Vec<[f64; 3]> = Vec::new();
        for _ in 0..reps {
            let f = gpu::forward(
                &p,
                q.slice(DType::F32),
                k.slice(DType::F32),
                v.slice(DType::F32),
                &arrays,
            )
            .unwrap();
            let fwd = kernel(&gpu::last_kernel_times(), "forward");
            let Buffer::F32(lse) = &f.lse else { panic!() };
            let o = Inputs::new(as_f64(&f.out), DType::F32);
            gpu::backward(
                &p,
                [
                    o.slice(DType::F32),
                    q.slice(DType::F32),
                    k.slice(DType::F32),
                    v.slice(DType::F32),
                    o.slice(DType::F32),
                    Slice::F32(lse),
                ],
                &arrays,
            )
            .unwrap();
            let t = gpu::last_kernel_times();
            samples.push([fwd, kernel(&t, "dq"), kernel(&t, "dkdv")]);
        }
        let median = |i: usize| {
            let mut x: Vec<f64> = samples.iter().map(|s| s[i]).collect();
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        let (f, dq, dkdv) = (median(0), median(1), median(2));
        eprintln!(
            "{name:<28}{f:>9.2}{dq:>9.2}{dkdv:>9.2}{:>9.2}",
            f + dq + dkdv
        );
    }
}

/// Windows whose rows start far into the keys (more keys than queries) or
/// whose first rows see nothing at all (more queries than keys), over
/// several tiles: the kernels start their loops at the first tile any row
/// of the workgroup sees.
#[test]
fn variant_window_far_from_the_start() {
    if !gpu_present() {
        return;
    }
    let shapes: [Shape; 2] = [(1, 2, 1, 45, 200, 32, 16), (1, 2, 2, 200, 45, 16, 32)];
    for (w, causal) in [((3, 1), false), ((20, 0), true), ((0, 40), false)] {
        let spec = Spec {
            window: Some(w),
            causal,
            dmask: true,
            ..Spec::default()
        };
        for (i, &s) in shapes.iter().enumerate() {
            let spec = Spec {
                mask: MaskArg::Blocks(vec![s.3, s.4], |_, _| true),
                ..spec.clone()
            };
            both_kernels(&format!("window {w:?} causal={causal} {s:?}"), || {
                check_spec(s, DType::F32, &spec, 1000 + i as u64, 1e-4, 4e-4)
            });
            let plain = Spec {
                window: Some(w),
                causal,
                ..Spec::default()
            };
            both_kernels(
                &format!("window {w:?} causal={causal} {s:?}, no mask"),
                || check_spec(s, DType::F32, &plain, 1010 + i as u64, 1e-4, 4e-4),
            );
        }
    }
}

/// Block masks with long hidden runs, so that the tiled kernels skip many
/// tiles in a row: a whole 64-row block hidden (its rows see nothing), a
/// run of hidden key tiles, the last key tile hidden, and everything but
/// the last query tile of the dK/dV kernels' loop.
#[test]
fn variant_mask_long_hidden_runs() {
    if !gpu_present() {
        return;
    }
    fn keep(r: usize, c: usize) -> bool {
        let hidden = (64..128).contains(&r)
            || c >= 160
            || (r < 64 && (16..112).contains(&c))
            || (c < 40 && r < 130)
            || (r + c) % 7 == 3;
        !hidden
    }
    let (sq, sk) = (150, 170);
    for (dmask, causal, dropout_p) in [(true, false, 0.0), (false, true, 0.0), (true, false, 0.2)] {
        let spec = Spec {
            mask: MaskArg::Blocks(vec![sq, sk], keep),
            dmask,
            causal,
            dropout_p,
            ..Spec::default()
        };
        both_kernels(
            &format!("long hidden runs dmask={dmask} causal={causal} dropout={dropout_p}"),
            || {
                check_spec(
                    (1, 2, 1, sq, sk, 32, 16),
                    DType::F32,
                    &spec,
                    1100,
                    1e-4,
                    4e-4,
                )
            },
        );
    }
    // Everything hidden: every row sees nothing.
    let spec = Spec {
        mask: MaskArg::Blocks(vec![sq, sk], |_, _| false),
        dmask: true,
        ..Spec::default()
    };
    both_kernels("everything hidden", || {
        check_spec(
            (1, 2, 1, sq, sk, 32, 16),
            DType::F32,
            &spec,
            1120,
            1e-4,
            4e-4,
        )
    });
}

/// Dropout where the keys of a 4-key Philox call straddle tiles: seq_k no
/// multiple of 4, and windows whose tiles start at keys no multiple of 4.
#[test]
fn variant_dropout_unaligned_keys() {
    if !gpu_present() {
        return;
    }
    for (s, window, causal) in [
        ((1, 2, 1, 66, 71, 16, 8), None, false),
        ((2, 2, 1, 37, 130, 32, 16), Some((30, 3)), false),
        ((1, 1, 1, 90, 47, 16, 16), Some((14, 0)), true),
    ] {
        let spec = Spec {
            dropout_p: 0.3,
            window,
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("dropout {s:?} window {window:?}"), || {
            check_spec(s, DType::F32, &spec, 1200, 1e-4, 4e-4)
        });
    }
}

// ---------------------------------------------------------------------
// The cooperative-matrix float16 forward (tensor cores), where the
// adapter has it; elsewhere the test says so instead of passing.

/// Forward errors (out, lse) of `c` against the float64 CPU, with the
/// cooperative kernel on or off for this thread; also the kernels it ran.
fn forward_errors(c: &Case, coop: bool) -> (f64, f64, Vec<String>) {
    gpu::set_no_coop_for_this_thread(!coop);
    let reference = cpu::forward(
        &f64_problem(&c.p),
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let got = gpu::forward(
        &c.p,
        c.q.slice(DType::F16),
        c.k.slice(DType::F16),
        c.v.slice(DType::F16),
        &VariantArrays::default(),
    )
    .unwrap();
    gpu::set_no_coop_for_this_thread(false);
    let kernels = kernels_run();
    let ref_lse = as_f64(&reference.lse);
    let (out, lse) = (as_f64(&got.out), as_f64(&got.lse));
    let dv = c.p.value_dim;
    for (row, &l) in ref_lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(lse[row], f64::NEG_INFINITY, "{:?} row {row}", c.p);
            assert!(out[row * dv..(row + 1) * dv].iter().all(|&x| x == 0.0));
        }
    }
    (
        rel_err(&out, &as_f64(&reference.out)),
        rel_err(&lse, &ref_lse),
        kernels,
    )
}

/// The one-subgroup diagnostic of the cooperative-matrix builtins
/// (shaders/coop_diagnostic.wgsl), through wgpu's own SPIR-V (Vulkan
/// memory model) and through src/gpu/spirv.rs (GLSL450). Prints what each
/// case computed; fails where the GLSL450 build differs from naga's
/// documentation.
#[test]
fn coop_one_tile_diagnostic() {
    if !gpu_present() || !gpu::coop_available() {
        eprintln!("NOT TESTED: no cooperative matrices here (none on this adapter, or FLASHPORT_GPU_COOP=0)");
        return;
    }
    let mut wrong = Vec::new();
    for (via_spirv, glsl450, name) in [
        (false, false, "wgpu's SPIR-V (Vulkan memory model)"),
        (true, false, "SPIR-V written here, Vulkan memory model"),
        (true, true, "SPIR-V written here, GLSL450 memory model"),
    ] {
        if via_spirv && !gpu::coop_passthrough() {
            eprintln!("diagnostic, {name}: no passthrough shaders here");
            continue;
        }
        match gpu::coop_diagnostic(via_spirv, glsl450) {
            Ok(lines) => {
                for l in lines {
                    eprintln!("diagnostic, {name}: {l}");
                    if glsl450 && !l.contains("as documented") {
                        wrong.push(l);
                    }
                }
            }
            Err(e) => {
                eprintln!("diagnostic, {name}: failed: {e}");
                if glsl450 {
                    wrong.push(e.to_string());
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn coop_forward_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    if !gpu::coop_available() {
        eprintln!(
            "NOT TESTED: this adapter has no 16x16x16 float16 cooperative matrices \
             (or FLASHPORT_GPU_COOP=0 turned it off): \
             the cooperative-matrix forward does not run here"
        );
        return;
    }
    // Head dimensions up to 128, both ways of d != dv, GQA, sizes that are
    // not tile multiples.
    let shapes: [Shape; 8] = [
        (1, 2, 1, 65, 17, 64, 32),
        (1, 1, 1, 130, 130, 128, 128),
        (1, 4, 2, 70, 90, 112, 32),
        (2, 4, 2, 37, 53, 16, 48),
        (1, 3, 1, 40, 9, 16, 16),
        (1, 2, 2, 300, 300, 64, 64),
        (1, 2, 1, 1000, 1000, 64, 64),
        (1, 1, 1, 77, 1030, 32, 96),
    ];
    // Every shape here runs the cooperative forward where the adapter has
    // the matrices (FLASHPORT_GPU_COOP=1 makes a shape that does not a
    // failure rather than a skip). Tiles pinned for a benchmark
    // (FLASHPORT_GPU_COOP_TILES) may not fit every head dimension: those
    // shapes then run other kernels and are skipped.
    let pinned = std::env::var("FLASHPORT_GPU_COOP_TILES").is_ok_and(|v| !v.is_empty());
    let everywhere = std::env::var("FLASHPORT_GPU_COOP").as_deref() == Ok("1") && !pinned;
    let mut worst = [0.0f64; 4];
    let mut tested = 0;
    for (i, &s) in shapes.iter().enumerate() {
        for causal in [false, true] {
            for grow in [false, true] {
                let mut c = case(s, causal, DType::F16, 70 + i as u64);
                if !everywhere && !gpu::coop_runs(&c.p) {
                    eprintln!(
                        "{s:?}: runs other kernels by default or with pinned tiles; not tested"
                    );
                    continue;
                }
                tested += 1;
                if grow {
                    // Keys that grow along the sequence (and large scores)
                    // move the rows' maxima tile after tile: the lazy
                    // rescaling runs.
                    let (sk, d) = (c.p.seq_k, c.p.head_dim);
                    let scaled: Vec<f64> =
                        c.k.f64
                            .iter()
                            .enumerate()
                            .map(|(e, &x)| x * 4.0 * (1.0 + ((e / d) % sk) as f64 / 64.0).min(8.0))
                            .collect();
                    c.k = Inputs::new(scaled, DType::F16);
                    c.q = Inputs::new(c.q.f64.iter().map(|x| x.abs() * 2.0).collect(), DType::F16);
                }
                let (o, l, kernels) = forward_errors(&c, true);
                assert!(
                    kernels.is_empty() || kernels.iter().all(|k| k == "forward_coop"),
                    "expected the cooperative forward, ran {kernels:?}"
                );
                let (so, sl, _) = forward_errors(&c, false);
                eprintln!(
                    "coop {s:?} causal={causal} grow={grow}: out {o:.2e} lse {l:.2e} \
                     (scalar float16: out {so:.2e} lse {sl:.2e})"
                );
                assert!(
                    o <= 1e-2 && l <= 1e-2,
                    "{s:?} causal={causal}: out {o:e}, lse {l:e}"
                );
                worst = [
                    worst[0].max(o),
                    worst[1].max(l),
                    worst[2].max(so),
                    worst[3].max(sl),
                ];
            }
        }
    }
    eprintln!(
        "cooperative forward worst relative error: out {:.2e}, lse {:.2e} \
         (scalar float16 kernels: out {:.2e}, lse {:.2e})",
        worst[0], worst[1], worst[2], worst[3]
    );
    assert!(tested > 0, "no shape ran the cooperative forward");
}

/// Backward errors (dq, dk, dv) of `c` in float16 against the float64 CPU,
/// with the cooperative kernels on or off for this thread; also the
/// kernels the last call ran. Both sides get the reference O and lse.
fn backward_errors(c: &Case, coop: bool) -> ([f64; 3], Vec<String>) {
    let p64 = f64_problem(&c.p);
    let reference = cpu::forward(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let o = Inputs::new(as_f64(&reference.out), DType::F16);
    let lse32: Vec<f32> = as_f64(&reference.lse).iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), 98), DType::F16);
    let want = cpu::backward(
        &p64,
        [
            d_out.slice(DType::F64),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            o.slice(DType::F64),
            Slice::F64(&lse64),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    gpu::set_no_coop_for_this_thread(!coop);
    let got = gpu::backward(
        &c.p,
        [
            d_out.slice(DType::F16),
            c.q.slice(DType::F16),
            c.k.slice(DType::F16),
            c.v.slice(DType::F16),
            o.slice(DType::F16),
            Slice::F32(&lse32),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    gpu::set_no_coop_for_this_thread(false);
    let kernels = kernels_run();
    (
        [
            rel_err(&as_f64(&got.dq), &as_f64(&want.dq)),
            rel_err(&as_f64(&got.dk), &as_f64(&want.dk)),
            rel_err(&as_f64(&got.dv), &as_f64(&want.dv)),
        ],
        kernels,
    )
}

/// The cooperative-matrix float16 backward against float64, at the
/// float16 tolerance of float16_matches_float64_reference: seq_q != seq_k
/// both ways (causal rows with no visible key where seq_q > seq_k), GQA,
/// d != dv, sizes that are not multiples of the tiles, and scores large
/// enough that P is far from uniform.
#[test]
fn coop_backward_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    if !gpu::coop_available() {
        eprintln!(
            "NOT TESTED: this adapter has no 16x16x16 float16 cooperative matrices \
             (or FLASHPORT_GPU_COOP=0 turned it off): \
             the cooperative-matrix backward does not run here"
        );
        return;
    }
    // Head dimensions up to 128, both ways of d != dv, GQA, sizes that are
    // not tile multiples.
    let shapes: [Shape; 8] = [
        (1, 2, 1, 65, 17, 64, 32),
        (1, 1, 1, 130, 130, 128, 128),
        (1, 4, 2, 70, 90, 112, 32),
        (2, 4, 2, 37, 53, 16, 48),
        (1, 3, 1, 40, 9, 16, 16),
        (1, 2, 2, 300, 300, 64, 64),
        (1, 4, 1, 200, 1000, 64, 64),
        (1, 1, 1, 77, 1030, 32, 96),
    ];
    let everywhere = std::env::var("FLASHPORT_GPU_COOP").as_deref() == Ok("1");
    let mut worst = [0.0f64; 2];
    let mut tested = 0;
    for (i, &s) in shapes.iter().enumerate() {
        for causal in [false, true] {
            for sharp in [false, true] {
                let mut c = case(s, causal, DType::F16, 170 + i as u64);
                if !everywhere && !gpu::coop_backward_runs(&c.p) {
                    eprintln!("{s:?}: runs other kernels by default; not tested");
                    continue;
                }
                tested += 1;
                if sharp {
                    // Scores of several units: P far from uniform, dS
                    // spread over magnitudes.
                    c.q = Inputs::new(c.q.f64.iter().map(|x| x * 6.0).collect(), DType::F16);
                }
                let (e, kernels) = backward_errors(&c, true);
                assert!(
                    kernels.is_empty()
                        || kernels[1..] == ["backward_dq_coop", "backward_dkdv_coop"],
                    "expected the cooperative backward, ran {kernels:?}"
                );
                let (se, _) = backward_errors(&c, false);
                let (w, sw) = (
                    e.iter().cloned().fold(0.0, f64::max),
                    se.iter().cloned().fold(0.0, f64::max),
                );
                eprintln!(
                    "coop backward {s:?} causal={causal} sharp={sharp}: dq/dk/dv {:.2e} {:.2e} {:.2e} \
                     (scalar float16: {:.2e} {:.2e} {:.2e})",
                    e[0], e[1], e[2], se[0], se[1], se[2]
                );
                assert!(
                    w <= 1e-2,
                    "{s:?} causal={causal} sharp={sharp}: dq/dk/dv {e:?}"
                );
                worst = [worst[0].max(w), worst[1].max(sw)];
            }
        }
    }
    eprintln!(
        "cooperative backward worst relative error {:.2e} (scalar float16 kernels {:.2e})",
        worst[0], worst[1]
    );
    assert!(tested > 0, "no shape ran the cooperative backward");
}

// ---------------------------------------------------------------------
// Device tensors: inputs that stay on the GPU between calls, outputs kept
// there. They must give the bits of the host path, chunked or not.

use flashport_core::{
    attention_arrays, attention_backward_arrays, Array, Device, DeviceTensor, Input, Placement,
};

/// The bits of a buffer, so that equality also holds for NaN and tells -0
/// from 0.
fn bits(b: &Buffer) -> Vec<u64> {
    match b {
        Buffer::F16(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
        Buffer::F32(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
        Buffer::F64(x) => x.iter().map(|v| v.to_bits()).collect(),
    }
}

fn on_device(a: &Array) -> &DeviceTensor {
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
fn device_tensors_round_trip_exactly() {
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
    // Then every exponent with random mantissas.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..60_000 {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        words.push((state >> 32) as u32);
    }
    let values: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
    let got = gpu::round_to_f16_on_device(&values).unwrap();
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
/// device tensors (inputs uploaded once, forward outputs fed straight into
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
        Device::Gpu,
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
        Device::Gpu,
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
    let f = attention_arrays(Device::Gpu, p, inputs, &none, Placement::of_inputs(&inputs)).unwrap();
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
                gpu::set_binding_limit_for_this_thread(Some(limit as u64));
                let c = case(s, causal, dtype, limit as u64);
                let result = std::panic::catch_unwind(|| check_device_path(&c, 3));
                gpu::set_binding_limit_for_this_thread(None);
                if let Err(e) = result {
                    std::panic::resume_unwind(e);
                }
            }
        }
    }
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
    // A tensor of the wrong size is caught like a slice of the wrong size.
    let small = gpu::to_device("q", Slice::F32(&[1.0; 8]), &[1, 8]).unwrap();
    let err = attention_arrays(
        Device::Gpu,
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
