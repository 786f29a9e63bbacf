//! Fuzzing the core's validation: random shapes (empty, tiny, and sizes
//! near the limits of `usize`), dtype names, and keyword values (NaN and
//! infinite scales, windows and offsets at their extremes, dropout outside
//! `[0, 1)`) through every `validate_*` entry. Validation must answer every
//! input with `Ok` or a typed error, never a panic (an overflowing product
//! of dimensions is the classic one), and a problem it accepts must be one
//! the CPU can run: small accepted forward problems are run, and their
//! outputs must have the validated lengths and be finite.
//!
//! The default budget keeps this to seconds in `make test`; a long hunt is
//! `PROPTEST_CASES=100000 cargo test -p flashport-core --release --test
//! fuzz_validation`.

use flashport_core::{
    attention, attention_backward, validate_backward, validate_forward, validate_kvcache,
    validate_merge, validate_varlen_backward, validate_varlen_forward, ArrayInfo, Buffer, DType,
    Device, Error, IntArray, KvCacheOptions, Options, Parts, SeqLens, Slice, VariantArrays,
    VariantOptions,
};
use proptest::prelude::*;

/// A dimension: mostly small, sometimes 0, sometimes huge.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..9,
        2 => 9usize..70,
        1 => Just(usize::MAX),
        1 => (1usize..4).prop_map(|k| 1usize << (20 * k).min(63)),
        1 => any::<usize>(),
    ]
}

fn shape(max_ndim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim(), 0..=max_ndim)
}

/// Shapes of q, k, v, o and lse that agree with each other (one batch,
/// heads and head dims, GQA heads), so that validation goes past its
/// shape checks to the sizes, where products of huge dimensions overflow;
/// sometimes one shape is replaced by a random one.
fn attention_shapes() -> impl Strategy<Value = [Vec<usize>; 5]> {
    let d = || prop_oneof![12 => 1usize..24, 1 => Just(0usize), 2 => dim()];
    let dims = (d(), d(), 1usize..4, d(), d(), d(), d());
    (dims, prop::option::weighted(0.3, (0usize..5, shape(5)))).prop_map(
        |((b, hkv, group, sq, sk, d, dv), replace)| {
            let hq = hkv.saturating_mul(group);
            let mut shapes = [
                vec![b, hq, sq, d],
                vec![b, hkv, sk, d],
                vec![b, hkv, sk, dv],
                vec![b, hq, sq, dv],
                vec![b, hq, sq],
            ];
            if let Some((i, other)) = replace {
                shapes[i] = other;
            }
            shapes
        },
    )
}

fn dtype() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        4 => Just("float32"),
        2 => Just("float64"),
        2 => Just("float16"),
        1 => Just("int64"),
        1 => Just("bool"),
        1 => Just("complex64"),
        1 => Just(""),
    ]
}

fn real() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -4.0f64..4.0,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(f64::NEG_INFINITY),
        1 => Just(0.0),
        1 => Just(1e300),
        1 => Just(-1e-300),
    ]
}

fn integer() -> impl Strategy<Value = i128> {
    prop_oneof![
        4 => -3i128..70,
        1 => Just(i128::from(i64::MAX)),
        1 => Just(i128::from(i64::MIN)),
        1 => Just(i128::MAX),
        1 => Just(i128::MIN),
        1 => any::<i64>().prop_map(i128::from),
    ]
}

fn window() -> impl Strategy<Value = Option<(i64, i64)>> {
    let side = prop_oneof![4 => -2i64..40, 1 => Just(i64::MAX), 1 => Just(i64::MIN)];
    prop::option::of((side.clone(), side))
}

/// A variant array (mask, slopes, sinks) as validation sees it.
fn info() -> impl Strategy<Value = (Vec<usize>, &'static str)> {
    (shape(5), prop_oneof![Just("bool"), dtype()])
}

#[derive(Debug, Clone)]
struct Keywords {
    causal: bool,
    scale: Option<f64>,
    window: Option<(i64, i64)>,
    q_offset: Option<i128>,
    k_offset: Option<i128>,
    softcap: Option<f64>,
    dropout_p: f64,
    seed: Option<i128>,
    mask: Option<(Vec<usize>, &'static str)>,
    alibi: Option<(Vec<usize>, &'static str)>,
    sinks: Option<(Vec<usize>, &'static str)>,
    return_dmask: bool,
    num_splits: Option<i128>,
}

/// Hostile keywords half the time, plausible ones otherwise (so that
/// problems get past them to the shape and size checks and the kernels).
fn keywords() -> impl Strategy<Value = Keywords> {
    prop_oneof![hostile_keywords(), plausible_keywords()]
}

fn plausible_keywords() -> impl Strategy<Value = Keywords> {
    let side = prop_oneof![Just(-1i64), 0i64..30];
    (
        any::<bool>(),
        prop::option::of(0.01f64..2.0),
        prop::option::of((side.clone(), side)),
        prop::option::of((0i128..50, 0i128..50)),
        prop::option::of(1.0f64..50.0),
        prop::option::weighted(0.2, (0.0f64..0.9, 0i128..1000)),
    )
        .prop_map(
            |(causal, scale, window, offsets, softcap, dropout)| Keywords {
                causal,
                scale,
                window,
                q_offset: offsets.map(|o| o.0),
                k_offset: offsets.map(|o| o.1),
                softcap,
                dropout_p: dropout.map_or(0.0, |d| d.0),
                seed: dropout.map(|d| d.1),
                mask: None,
                alibi: None,
                sinks: None,
                return_dmask: false,
                num_splits: None,
            },
        )
}

fn hostile_keywords() -> impl Strategy<Value = Keywords> {
    (
        (
            any::<bool>(),
            prop::option::of(real()),
            window(),
            prop::option::weighted(0.3, integer()),
            prop::option::weighted(0.3, integer()),
            prop::option::weighted(0.3, real()),
        ),
        (
            prop_oneof![4 => Just(0.0), 1 => real()],
            prop::option::weighted(0.3, integer()),
            prop::option::weighted(0.2, info()),
            prop::option::weighted(0.2, info()),
            prop::option::weighted(0.2, info()),
            any::<bool>(),
            prop::option::weighted(0.3, integer()),
        ),
    )
        .prop_map(
            |(
                (causal, scale, window, q_offset, k_offset, softcap),
                (dropout_p, seed, mask, alibi, sinks, return_dmask, num_splits),
            )| Keywords {
                causal,
                scale,
                window,
                q_offset,
                k_offset,
                softcap,
                dropout_p,
                seed,
                mask,
                alibi,
                sinks,
                return_dmask,
                num_splits,
            },
        )
}

fn as_info<'a>((shape, dtype): &'a (Vec<usize>, &'static str)) -> ArrayInfo<'a> {
    ArrayInfo::new(shape, dtype)
}

impl Keywords {
    fn options(&self) -> Options<'_> {
        Options {
            variants: self.variants(),
            return_dmask: self.return_dmask,
        }
    }
    fn variants(&self) -> VariantOptions<'_> {
        VariantOptions {
            causal: self.causal,
            scale: self.scale,
            window: self.window,
            q_offset: self.q_offset,
            k_offset: self.k_offset,
            softcap: self.softcap,
            dropout_p: self.dropout_p,
            seed: self.seed,
            mask: self.mask.as_ref().map(as_info),
            alibi_slopes: self.alibi.as_ref().map(as_info),
            sinks: self.sinks.as_ref().map(as_info),
        }
    }
    /// The KV cache takes no mask, dropout or positions.
    fn kvcache_options(&self) -> KvCacheOptions<'_> {
        KvCacheOptions {
            variants: VariantOptions {
                mask: None,
                dropout_p: 0.0,
                seed: None,
                q_offset: None,
                k_offset: None,
                ..self.variants()
            },
            num_splits: self.num_splits,
        }
    }
}

/// Validation answers with a typed error; every kind carries a message.
fn assert_typed(error: &Error) {
    assert!(
        !error.to_string().is_empty(),
        "an error without a message: {error:?}"
    );
}

/// A deterministic, non-zero fill for running accepted problems.
fn data(len: usize, salt: u64) -> Vec<f32> {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// `PROPTEST_CASES` for a long hunt; a budget of seconds by default.
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000)
}

/// Elements up to which an accepted float32 problem without variant
/// arrays is run on the CPU.
const RUN_LIMIT: usize = 1 << 14;

fn run_forward(problem: &flashport_core::Problem) {
    let lens = [problem.q_len(), problem.k_len(), problem.v_len()];
    if problem.dtype != DType::F32
        || lens.iter().any(|&n| n > RUN_LIMIT)
        || problem.out_len() > RUN_LIMIT
        || problem.forward_flops() > 1e7
        || problem.mask.is_some()
    {
        return;
    }
    let [q, k, v] = [0, 1, 2].map(|i| data(lens[i], i as u64 + 1));
    let result = attention(
        Device::Cpu,
        problem,
        Slice::F32(&q),
        Slice::F32(&k),
        Slice::F32(&v),
        &VariantArrays::default(),
    );
    // Slopes and sinks were validated by shape only; without their data
    // the call must refuse, not read past anything.
    let Ok(result) = result else {
        return;
    };
    let (Buffer::F32(out), Buffer::F32(lse)) = (&result.out, &result.lse) else {
        panic!(
            "float32 problem returned {:?} / {:?}",
            result.out, result.lse
        );
    };
    assert_eq!(out.len(), problem.out_len());
    assert_eq!(lse.len(), problem.lse_len());
    assert!(
        out.iter().all(|x| x.is_finite()),
        "non-finite output for {problem:?}"
    );
    if problem.dropout.is_some() || problem.sinks || problem.alibi_per_batch.is_some() {
        return;
    }
    let d_out = data(out.len(), 4);
    let grads = attention_backward(
        Device::Cpu,
        problem,
        Slice::F32(&d_out),
        Slice::F32(&q),
        Slice::F32(&k),
        Slice::F32(&v),
        Slice::F32(out),
        Slice::F32(lse),
        &VariantArrays::default(),
    )
    .unwrap_or_else(|e| panic!("backward of an accepted forward failed: {e}"));
    for (name, grad, len) in [
        ("dq", &grads.dq, problem.q_len()),
        ("dk", &grads.dk, problem.k_len()),
        ("dv", &grads.dv, problem.v_len()),
    ] {
        let Buffer::F32(grad) = grad else {
            panic!("{name} is not float32");
        };
        assert_eq!(grad.len(), len, "{name}");
        assert!(
            grad.iter().all(|x| x.is_finite()),
            "non-finite {name} for {problem:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(cases())
    })]

    #[test]
    fn forward_and_backward(
        [q, k, v, o, lse] in attention_shapes(),
        dtypes in (dtype(), dtype(), dtype(), dtype()),
        kw in keywords(),
    ) {
        let (dq, dk, dv, dl) = dtypes;
        // Mostly one dtype for q, k and v, so that validation goes deeper;
        // mixed ones when k's draw is the empty name.
        let (dk, dv) = if dk.is_empty() { (dk, dv) } else { (dq, dq) };
        let options = kw.options();
        match validate_forward(
            ArrayInfo::new(&q, dq), ArrayInfo::new(&k, dk), ArrayInfo::new(&v, dv), &options,
        ) {
            Ok(problem) => {
                let _ = problem.forward_flops();
                let _ = (problem.q_len(), problem.k_len(), problem.v_len());
                let _ = (problem.out_len(), problem.lse_len());
                run_forward(&problem);
            }
            Err(e) => assert_typed(&e),
        }
        match validate_backward(
            ArrayInfo::new(&o, dq), ArrayInfo::new(&q, dq), ArrayInfo::new(&k, dk),
            ArrayInfo::new(&v, dv), ArrayInfo::new(&o, dq), ArrayInfo::new(&lse, dl), &options,
        ) {
            Ok(problem) => {
                let _ = (problem.q_len(), problem.k_len(), problem.v_len());
                let _ = (problem.out_len(), problem.lse_len());
            }
            Err(e) => assert_typed(&e),
        }
    }

    #[test]
    fn varlen(
        q in shape(4), k in shape(4), v in shape(4), o in shape(4), lse in shape(3),
        dt in dtype(),
        cu_q in prop::collection::vec(integer(), 0..5),
        cu_k in prop::collection::vec(integer(), 0..5),
        cu_dtype in prop_oneof![Just("int32"), Just("int64"), Just("uint64"), Just("float32")],
        kw in keywords(),
    ) {
        let (cu_q_shape, cu_k_shape) = ([cu_q.len()], [cu_k.len()]);
        let sq = SeqLens { info: ArrayInfo::new(&cu_q_shape, cu_dtype), values: &cu_q };
        let sk = SeqLens { info: ArrayInfo::new(&cu_k_shape, cu_dtype), values: &cu_k };
        // attention_varlen has no mask or position keywords.
        let variants = VariantOptions { mask: None, q_offset: None, k_offset: None, ..kw.variants() };
        let options = Options { variants, ..kw.options() };
        if let Err(e) = validate_varlen_forward(
            ArrayInfo::new(&q, dt), ArrayInfo::new(&k, dt), ArrayInfo::new(&v, dt), sq, sk,
            &options,
        ) {
            assert_typed(&e);
        }
        if let Err(e) = validate_varlen_backward(
            ArrayInfo::new(&o, dt), ArrayInfo::new(&q, dt), ArrayInfo::new(&k, dt),
            ArrayInfo::new(&v, dt), ArrayInfo::new(&o, dt), ArrayInfo::new(&lse, "float32"),
            sq, sk, &options,
        ) {
            assert_typed(&e);
        }
    }

    #[test]
    fn kvcache(
        q in shape(5), kc in shape(5), vc in shape(5),
        dt in dtype(),
        lens in prop::collection::vec(any::<i64>().prop_map(|x| x % 100), 0..5),
        table in prop::option::of((shape(3), prop::collection::vec(-2i64..40, 0..40))),
        kw in keywords(),
    ) {
        let lens_shape = [lens.len()];
        let seqlens = IntArray { shape: &lens_shape, dtype: "int32", values: &lens };
        let table = table.as_ref().map(|(shape, values)| IntArray {
            shape,
            dtype: "int64",
            values,
        });
        match validate_kvcache(
            ArrayInfo::new(&q, dt), ArrayInfo::new(&kc, dt), ArrayInfo::new(&vc, dt),
            seqlens, table, &kw.kvcache_options(),
        ) {
            Ok(problem) => {
                let _ = (problem.q_len(), problem.k_cache_len(), problem.v_cache_len());
            }
            Err(e) => assert_typed(&e),
        }
    }

    #[test]
    fn merge(
        outs in prop::collection::vec((shape(4), dtype()), 0..4),
        lses in prop::collection::vec((shape(3), dtype()), 0..4),
        stacked in any::<bool>(),
    ) {
        let out_infos: Vec<ArrayInfo<'_>> = outs.iter().map(as_info).collect();
        let lse_infos: Vec<ArrayInfo<'_>> = lses.iter().map(as_info).collect();
        let result = if stacked && !outs.is_empty() && !lses.is_empty() {
            validate_merge(Parts::Stacked(out_infos[0]), Parts::Stacked(lse_infos[0]))
        } else {
            validate_merge(Parts::Each(&out_infos), Parts::Each(&lse_infos))
        };
        match result {
            Ok(problem) => {
                let _ = problem.out_len();
            }
            Err(e) => assert_typed(&e),
        }
    }
}

/// The fuzzer is only as good as the share of its inputs that get past
/// the first checks: most forward problems it draws must be accepted, and
/// some run, or it tests only the front door.
#[test]
fn forward_inputs_reach_the_kernels() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = (attention_shapes(), keywords());
    let (mut accepted, mut small, draws) = (0, 0, 2000);
    for _ in 0..draws {
        let ([q, k, v, ..], kw) = strategy.new_tree(&mut runner).unwrap().current();
        let options = Options {
            variants: VariantOptions {
                mask: None,
                alibi_slopes: None,
                sinks: None,
                ..kw.variants()
            },
            ..kw.options()
        };
        let infos = [&q, &k, &v].map(|s| ArrayInfo::new(s, "float32"));
        match validate_forward(infos[0], infos[1], infos[2], &options) {
            Ok(problem) => {
                accepted += 1;
                small += usize::from(problem.q_len() <= RUN_LIMIT && problem.out_len() > 0);
            }
            Err(e) => assert_typed(&e),
        }
    }
    assert!(accepted * 5 >= draws, "{accepted} of {draws} accepted");
    assert!(
        small * 20 >= draws,
        "{small} of {draws} small enough to run"
    );
}
