#[test]
fn window_pairs_equals_counting_every_row() {
    let mut checked = 0;
    for seq_q in [0usize, 1, 2, 5, 13] {
        for seq_k in [0usize, 1, 3, 8, 17] {
            for causal in [false, true] {
                for left in [None, Some(0), Some(1), Some(4), Some(30)] {
                    for right in [None, Some(0), Some(2), Some(30)] {
                        for offset in [-20i64, -3, 0, 2, 25] {
                            let mut p = fwd(&[2, 4], &[3, 4], &[3, 4]).unwrap();
                            (p.seq_q, p.seq_k) = (seq_q, seq_k);
                            p.causal = causal;
                            p.window = Window { left, right };
                            p.q_offset = offset;
                            let rows: usize = (0..seq_q).map(|i| p.visible_keys(i).len()).sum();
                            assert_eq!(p.window_pairs(), rows as f64, "{p:?}");
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 5 * 5 * 2 * 5 * 4 * 5);
}

#[test]
fn window_pairs_of_huge_empty_problems_take_no_time() {
    let mut p = fwd(&[2, 4], &[3, 4], &[3, 4]).unwrap();
    (p.seq_q, p.seq_k) = (usize::MAX / 2, usize::MAX / 4);
    p.batch = 0;
    p.window = Window {
        left: Some(3),
        right: Some(1),
    };
    assert_eq!(p.forward_flops(), 0.0);
    p.batch = 1;
    assert!(p.window_pairs() > 1e18);
}

use super::*;

fn fwd(q: &[usize], k: &[usize], v: &[usize]) -> Result<Problem> {
    validate_forward(
        ArrayInfo::new(q, "float32"),
        ArrayInfo::new(k, "float32"),
        ArrayInfo::new(v, "float32"),
        &Options::default(),
    )
}

#[test]
fn accepts_gqa_and_distinct_value_dim() {
    let p = fwd(&[2, 8, 5, 16], &[2, 2, 7, 16], &[2, 2, 7, 24]).unwrap();
    assert_eq!(
        (p.group_size(), p.seq_q, p.seq_k, p.value_dim),
        (4, 5, 7, 24)
    );
    assert_eq!(p.out_shape(), vec![2, 8, 5, 24]);
    assert!((p.scale - 0.25).abs() < 1e-15);
}

#[test]
fn unbatched_shapes_keep_their_ndim() {
    let p = fwd(&[5, 16], &[7, 16], &[7, 3]).unwrap();
    assert_eq!((p.batch, p.heads_q), (1, 1));
    assert_eq!(p.out_shape(), vec![5, 3]);
    assert_eq!(p.lse_shape(), vec![5]);
}

#[test]
fn rejects_indivisible_heads_naming_both_counts() {
    let err = fwd(&[1, 6, 5, 16], &[1, 4, 5, 16], &[1, 4, 5, 16]).unwrap_err();
    match err {
        Error::Shape(msg) => assert!(msg.contains("(4)") && msg.contains("(6)"), "{msg}"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn bfloat16_is_ml_dtypes_name_and_computes_in_float32() {
    for d in [DType::F16, DType::BF16, DType::F32, DType::F64] {
        assert_eq!(DType::from_numpy_name(d.numpy_name()), Some(d));
    }
    assert_eq!(DType::from_numpy_name("bfloat16"), Some(DType::BF16));
    assert_eq!(DType::BF16.lse_dtype(), DType::F32);
    assert!(DType::BF16.is_half() && !DType::F32.is_half());
    let shape = [1, 2, 4, 8];
    let p = validate_forward(
        ArrayInfo::new(&shape, "bfloat16"),
        ArrayInfo::new(&shape, "bfloat16"),
        ArrayInfo::new(&shape, "bfloat16"),
        &Options::default(),
    )
    .unwrap();
    assert_eq!(p.dtype, DType::BF16);
    let err = validate_forward(
        ArrayInfo::new(&shape, "int8"),
        ArrayInfo::new(&shape, "int8"),
        ArrayInfo::new(&shape, "int8"),
        &Options::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("bfloat16"), "{err}");
    // lse is float32 (or float64), never the inputs' half dtype.
    let lse = [1, 2, 4];
    let a = ArrayInfo::new(&shape, "bfloat16");
    let bad = validate_backward(
        a,
        a,
        a,
        a,
        a,
        ArrayInfo::new(&lse, "bfloat16"),
        &Options::default(),
    );
    assert!(matches!(bad, Err(Error::DType { ref argument, .. }) if argument == "lse"));
}

#[test]
fn rejects_mixed_and_unsupported_dtypes() {
    let q = [1, 1, 4, 8];
    let e = validate_forward(
        ArrayInfo::new(&q, "float32"),
        ArrayInfo::new(&q, "float64"),
        ArrayInfo::new(&q, "float32"),
        &Options::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { ref argument, .. } if argument == "k"));
    let e = validate_forward(
        ArrayInfo::new(&q, "int64"),
        ArrayInfo::new(&q, "int64"),
        ArrayInfo::new(&q, "int64"),
        &Options::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("int64"));
}

#[test]
fn rejects_non_finite_scale() {
    let q = [4, 8];
    let e = validate_forward(
        ArrayInfo::new(&q, "float32"),
        ArrayInfo::new(&q, "float32"),
        ArrayInfo::new(&q, "float32"),
        &Options::from(VariantOptions {
            scale: Some(f64::NAN),
            ..VariantOptions::default()
        }),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Value { .. }));
}

#[test]
fn causal_alignment_is_bottom_right() {
    let p = Problem {
        causal: true,
        ..fwd(&[3, 4], &[5, 4], &[5, 4]).unwrap()
    };
    // seq_q = 3, seq_k = 5: the last query sees every key.
    assert_eq!(
        (0..3).map(|i| p.visible_keys(i).end).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    let p = Problem {
        causal: true,
        ..fwd(&[5, 4], &[2, 4], &[2, 4]).unwrap()
    };
    // seq_q > seq_k: the first rows see nothing.
    assert_eq!(
        (0..5).map(|i| p.visible_keys(i).end).collect::<Vec<_>>(),
        vec![0, 0, 0, 1, 2]
    );
}

#[test]
fn offsets_default_to_bottom_right_and_move_the_diagonal() {
    let p = fwd(&[3, 4], &[5, 4], &[5, 4]).unwrap();
    assert_eq!((p.q_offset, p.k_offset, p.causal_offset()), (2, 0, 2));
    let explicit = |q_offset, k_offset| {
        validate_forward(
            ArrayInfo::new(&[3, 4], "float32"),
            ArrayInfo::new(&[5, 4], "float32"),
            ArrayInfo::new(&[5, 4], "float32"),
            &Options::from(VariantOptions {
                causal: true,
                q_offset,
                k_offset,
                ..VariantOptions::default()
            }),
        )
        .unwrap()
    };
    let ends = |p: Problem| (0..3).map(|i| p.visible_keys(i)).collect::<Vec<_>>();
    // Explicit defaults are the defaults.
    assert_eq!(explicit(Some(2), Some(0)), explicit(None, None));
    // Queries at 10..13 against keys at 10..15: top-left aligned.
    assert_eq!(ends(explicit(Some(10), Some(10))), vec![0..1, 0..2, 0..3]);
    // Keys 0..5 at 100..105 lie after queries 7..10: nothing visible.
    assert_eq!(ends(explicit(Some(7), Some(100))), vec![0..0; 3]);
    // The far past: every key visible, exactly at the range's ends.
    let limit = i128::from(POSITION_LIMIT);
    let p = explicit(Some(limit), Some(-limit));
    assert_eq!(p.causal_offset(), 1i128 << 63);
    assert_eq!(ends(p), vec![0..5; 3]);
}

#[test]
fn offsets_out_of_range_are_refused_by_name() {
    let q = [3, 4];
    let k = [5, 4];
    for (q_offset, k_offset, name) in [
        (Some(1i128 << 62 | 1), None, "q_offset"),
        (None, Some(-(1i128 << 62) - 1), "k_offset"),
        (Some(i128::MAX), None, "q_offset"),
    ] {
        let e = with(
            Options::from(VariantOptions {
                q_offset,
                k_offset,
                ..VariantOptions::default()
            }),
            &q,
            &k,
        )
        .unwrap_err();
        match e {
            Error::Value { ref argument, .. } => assert_eq!(argument, name, "{e}"),
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn with(options: Options<'_>, q: &[usize], k: &[usize]) -> Result<Problem> {
    validate_forward(
        ArrayInfo::new(q, "float32"),
        ArrayInfo::new(k, "float32"),
        ArrayInfo::new(k, "float32"),
        &options,
    )
}

#[test]
fn window_is_aligned_like_causal_and_combines_with_it() {
    // seq_q = 4, seq_k = 6: the diagonal of row i is key i + 2.
    let window = Options::from(VariantOptions {
        window: Some((1, 0)),
        ..VariantOptions::default()
    });
    let p = with(window, &[4, 8], &[6, 8]).unwrap();
    let ranges: Vec<_> = (0..4).map(|i| p.visible_keys(i)).collect();
    assert_eq!(ranges, vec![1..3, 2..4, 3..5, 4..6]);
    let p = with(
        Options::from(VariantOptions {
            window: Some((-1, 1)),
            causal: true,
            ..VariantOptions::default()
        }),
        &[4, 8],
        &[6, 8],
    )
    .unwrap();
    // causal wins over the wider right side.
    assert_eq!(p.visible_keys(0), 0..3);
    let p = with(
        Options::from(VariantOptions {
            window: Some((0, 0)),
            ..VariantOptions::default()
        }),
        &[6, 8],
        &[2, 8],
    )
    .unwrap();
    // Rows whose diagonal lies before key 0 see nothing.
    assert_eq!(p.visible_keys(0), 0..0);
    assert_eq!(p.visible_keys(5), 1..2);
    assert!(p.forward_flops() > 0.0);
}

#[test]
fn variant_arguments_are_checked_by_name() {
    let q = [2, 3, 5, 8];
    let k = [2, 3, 7, 8];
    let err = |options: Options<'_>| with(options, &q, &k).unwrap_err().to_string();
    assert!(err(Options::from(VariantOptions {
        window: Some((-2, 0)),
        ..VariantOptions::default()
    }))
    .contains("window"));
    assert!(err(Options::from(VariantOptions {
        softcap: Some(-1.0),
        ..VariantOptions::default()
    }))
    .contains("softcap"));
    assert!(err(Options::from(VariantOptions {
        dropout_p: 1.0,
        ..VariantOptions::default()
    }))
    .contains("dropout_p"));
    assert!(err(Options::from(VariantOptions {
        dropout_p: 0.1,
        ..VariantOptions::default()
    }))
    .contains("seed"));
    let bad_mask = [5, 6];
    let e = err(Options::from(VariantOptions {
        mask: Some(ArrayInfo::new(&bad_mask, "bool")),
        ..VariantOptions::default()
    }));
    assert!(e.contains("(5, 6)") && e.contains("(2, 3, 5, 7)"), "{e}");
    let e = err(Options::from(VariantOptions {
        mask: Some(ArrayInfo::new(&[5, 7], "int8")),
        ..VariantOptions::default()
    }));
    assert!(e.contains("mask") && e.contains("int8"), "{e}");
    let e = err(Options::from(VariantOptions {
        sinks: Some(ArrayInfo::new(&[2], "float32")),
        ..VariantOptions::default()
    }));
    assert!(e.contains("sinks") && e.contains("(3,)"), "{e}");
    let e = err(Options::from(VariantOptions {
        alibi_slopes: Some(ArrayInfo::new(&[3, 3], "float32")),
        ..VariantOptions::default()
    }));
    assert!(e.contains("alibi_slopes"), "{e}");
}

#[test]
fn masks_broadcast_from_the_right() {
    let q = [2, 3, 5, 8];
    let k = [2, 3, 7, 8];
    for shape in [&[7][..], &[5, 1], &[3, 1, 7], &[2, 1, 5, 7], &[1, 1, 1, 1]] {
        let p = with(
            Options::from(VariantOptions {
                mask: Some(ArrayInfo::new(shape, "float32")),
                ..VariantOptions::default()
            }),
            &q,
            &k,
        )
        .unwrap();
        assert_eq!(p.mask.unwrap().shape(), shape.to_vec());
    }
}

#[test]
fn return_dmask_needs_a_float_mask_and_the_backward() {
    let q = [5, 8];
    let (mask_shape, lse) = ([5, 5], [5]);
    let info = |s| ArrayInfo::new(s, "float32");
    let backward = |mask: &str, dmask: bool| {
        validate_backward(
            info(&q),
            info(&q),
            info(&q),
            info(&q),
            info(&q),
            info(&lse),
            &Options {
                return_dmask: dmask,
                ..Options::from(VariantOptions {
                    mask: Some(ArrayInfo::new(&mask_shape, mask)),
                    ..VariantOptions::default()
                })
            },
        )
    };
    assert!(backward("float32", true).unwrap().return_dmask);
    assert!(backward("bool", true)
        .unwrap_err()
        .to_string()
        .contains("boolean"));
    assert!(!backward("bool", false).unwrap().return_dmask);
}

/// `attention_varlen`'s arguments with `cu_seqlens` given as (dtype,
/// entries); q `(total_q, 4, 8)`, k and v `(total_k, 2, 8)`.
fn varlen(
    cu_q: (&str, &[i128]),
    cu_k: (&str, &[i128]),
    totals: (usize, usize),
    options: Options<'_>,
) -> Result<(Problem, Segments)> {
    let (tq, tk) = totals;
    let (sq, sk) = ([cu_q.1.len()], [cu_k.1.len()]);
    validate_varlen_forward(
        ArrayInfo::new(&[tq, 4, 8], "float32"),
        ArrayInfo::new(&[tk, 2, 8], "float32"),
        ArrayInfo::new(&[tk, 2, 8], "float32"),
        SeqLens {
            info: ArrayInfo::new(&sq, cu_q.0),
            values: cu_q.1,
        },
        SeqLens {
            info: ArrayInfo::new(&sk, cu_k.0),
            values: cu_k.1,
        },
        &options,
    )
}

#[test]
fn varlen_packs_the_batch_head_major() {
    let (p, s) = varlen(
        ("int32", &[0, 3, 3, 10]),
        ("uint64", &[0, 5, 6, 6]),
        (10, 6),
        Options::default(),
    )
    .unwrap();
    assert_eq!(
        (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.ndim),
        (1, 4, 2, 10, 6, 3)
    );
    assert_eq!(p.varlen.map(|v| v.sequences), Some(3));
    assert_eq!(p.varlen.map(|v| v.visible_pairs), Some(3 * 5));
    assert_eq!(s.cu_seqlens_k(), &[0, 5, 6, 6]);
    // A batch of no sequences at all.
    let (p, _) = varlen(("int64", &[0]), ("int64", &[0]), (0, 0), Options::default()).unwrap();
    assert_eq!((p.seq_q, p.seq_k, p.varlen.unwrap().sequences), (0, 0, 0));
}

#[test]
fn varlen_errors_name_the_argument_and_the_entry() {
    let ok: &[i128] = &[0, 4, 10];
    let err = |cu_q: (&str, &[i128]), cu_k: (&str, &[i128]), totals| {
        varlen(cu_q, cu_k, totals, Options::default())
            .unwrap_err()
            .to_string()
    };
    let e = err(("int32", &[0, 12, 10]), ("int32", ok), (10, 10));
    assert!(
        e.contains("cu_seqlens_q[2] = 10 < cu_seqlens_q[1] = 12"),
        "{e}"
    );
    let e = err(("int32", ok), ("int32", &[1, 4, 10]), (10, 10));
    assert!(e.contains("cu_seqlens_k[0] = 1"), "{e}");
    let e = err(("int32", &[0, 4, 11]), ("int32", ok), (10, 10));
    assert!(
        e.contains("cu_seqlens_q[2] = 11") && e.contains("q holds 10 packed rows"),
        "{e}"
    );
    let e = err(("int32", ok), ("int32", &[0, 4, 9]), (10, 10));
    assert!(
        e.contains("cu_seqlens_k[2] = 9") && e.contains("k holds 10"),
        "{e}"
    );
    let e = err(("int32", ok), ("int32", &[0, 10]), (10, 10));
    assert!(
        e.contains("cu_seqlens_q has 3 entries (batch 2)")
            && e.contains("cu_seqlens_k has 2 (batch 1)"),
        "{e}"
    );
    match varlen(("float32", ok), ("int32", ok), (10, 10), Options::default()).unwrap_err() {
        Error::DType {
            argument, dtype, ..
        } => {
            assert_eq!(
                (argument.as_str(), dtype.as_str()),
                ("cu_seqlens_q", "float32")
            )
        }
        other => panic!("unexpected {other:?}"),
    }
    let e = err(("int32", &[]), ("int32", ok), (10, 10));
    assert!(e.contains("cu_seqlens_q has shape (0,)"), "{e}");
    // Packed shapes are reported as given.
    let e = validate_varlen_forward(
        ArrayInfo::new(&[10, 3, 8], "float32"),
        ArrayInfo::new(&[10, 2, 8], "float32"),
        ArrayInfo::new(&[10, 2, 8], "float32"),
        SeqLens {
            info: ArrayInfo::new(&[3], "int64"),
            values: ok,
        },
        SeqLens {
            info: ArrayInfo::new(&[3], "int64"),
            values: ok,
        },
        &Options::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("(2) must divide") && e.contains("q (10, 3, 8)"),
        "{e}"
    );
    let e = validate_varlen_forward(
        ArrayInfo::new(&[2, 10, 3, 8], "float32"),
        ArrayInfo::new(&[10, 2, 8], "float32"),
        ArrayInfo::new(&[10, 2, 8], "float32"),
        SeqLens {
            info: ArrayInfo::new(&[3], "int64"),
            values: ok,
        },
        SeqLens {
            info: ArrayInfo::new(&[3], "int64"),
            values: ok,
        },
        &Options::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("q has shape (2, 10, 3, 8)"), "{e}");
    // Per-sequence ALiBi slopes are (batch, heads_q), batch counting
    // sequences.
    let slopes = |shape: &[usize]| {
        varlen(
            ("int32", ok),
            ("int32", ok),
            (10, 10),
            Options::from(VariantOptions {
                alibi_slopes: Some(ArrayInfo::new(shape, "float32")),
                ..VariantOptions::default()
            }),
        )
    };
    assert_eq!(slopes(&[2, 4]).unwrap().0.alibi_per_batch, Some(true));
    assert_eq!(slopes(&[4]).unwrap().0.alibi_per_batch, Some(false));
    let e = slopes(&[1, 4]).unwrap_err().to_string();
    assert!(
        e.contains("alibi_slopes has shape (1, 4)") && e.contains("(2, 4)"),
        "{e}"
    );
}

#[test]
fn varlen_backward_checks_the_packed_output_and_lse() {
    let ok: &[i128] = &[0, 4, 10];
    let lens = SeqLens {
        info: ArrayInfo::new(&[3], "int32"),
        values: ok,
    };
    let (q, kv) = ([10, 4, 8], [10, 2, 6]);
    let k = [10, 2, 8];
    let backward = |o: &[usize], lse: &[usize], lse_dtype: &str| {
        validate_varlen_backward(
            ArrayInfo::new(o, "float32"),
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&k, "float32"),
            ArrayInfo::new(&kv, "float32"),
            ArrayInfo::new(o, "float32"),
            ArrayInfo::new(lse, lse_dtype),
            lens,
            lens,
            &Options::default(),
        )
    };
    assert!(backward(&[10, 4, 6], &[4, 10], "float32").is_ok());
    let e = backward(&[4, 10, 6], &[4, 10], "float32")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("do has shape (4, 10, 6)") && e.contains("(10, 4, 6)"),
        "{e}"
    );
    let e = backward(&[10, 4, 6], &[10, 4], "float32")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lse has shape (10, 4)") && e.contains("(4, 10)"),
        "{e}"
    );
    assert!(matches!(
        backward(&[10, 4, 6], &[4, 10], "float16").unwrap_err(),
        Error::DType { .. }
    ));
}

fn packed(cu_q: &[i128], cu_k: &[i128], options: Options<'_>) -> (Problem, Segments) {
    let (tq, tk) = (
        *cu_q.last().unwrap() as usize,
        *cu_k.last().unwrap() as usize,
    );
    let shape_q = [cu_q.len()];
    let shape_k = [cu_k.len()];
    validate_varlen_forward(
        ArrayInfo::new(&[tq, 2, 8], "float32"),
        ArrayInfo::new(&[tk, 1, 8], "float32"),
        ArrayInfo::new(&[tk, 1, 4], "float32"),
        SeqLens {
            info: ArrayInfo::new(&shape_q, "int32"),
            values: cu_q,
        },
        SeqLens {
            info: ArrayInfo::new(&shape_k, "int64"),
            values: cu_k,
        },
        &options,
    )
    .unwrap()
}

/// Rows see their own sequence's keys only, causal bottom-right within
/// it, and empty sequences own nothing.
#[test]
fn rows_see_their_sequence() {
    let causal = Options::from(VariantOptions {
        causal: true,
        ..VariantOptions::default()
    });
    // Sequences: (q 2, k 3), (q 0, k 4), (q 3, k 1), (q 1, k 0).
    let (p, s) = packed(&[0, 2, 2, 5, 6], &[0, 3, 7, 8, 8], causal);
    assert_eq!((p.batch, p.seq_q, p.seq_k), (1, 6, 8));
    assert_eq!(
        (0..6).map(|r| s.sequence_of_row(r)).collect::<Vec<_>>(),
        vec![0, 0, 2, 2, 2, 3]
    );
    let rows = s.rows(&p);
    assert_eq!(rows.visible, vec![0..2, 0..3, 7..7, 7..7, 7..8, 8..8]);
    for r in 0..6 {
        assert_eq!(s.visible_keys(&p, r), rows.visible[r]);
    }
    assert_eq!(p.varlen.unwrap().visible_pairs, 2 + 3 + 1);
    assert_eq!(s.diagonal(2), 8 - 5);
    let (p, s) = packed(&[0, 2, 2, 5, 6], &[0, 3, 7, 8, 8], Options::default());
    assert_eq!(s.rows(&p).visible, vec![0..3, 0..3, 7..8, 7..8, 7..8, 8..8]);
    assert_eq!(p.varlen.unwrap().visible_pairs, 2 * 3 + 3);
    assert!((p.forward_flops() - 9.0 * 2.0 * 2.0 * 12.0).abs() < 1e-9);
}

#[test]
fn windows_stay_within_the_sequence() {
    let window = Options::from(VariantOptions {
        window: Some((1, 0)),
        ..VariantOptions::default()
    });
    let (p, s) = packed(&[0, 3, 6], &[0, 3, 8], window);
    // Sequence 1: q 3, k 5: row i's diagonal is key 3 + i + 2.
    assert_eq!(s.rows(&p).visible, vec![0..1, 0..2, 1..3, 4..6, 5..7, 6..8]);
}

fn merge_err(outs: Parts<'_>, lses: Parts<'_>) -> String {
    validate_merge(outs, lses).unwrap_err().to_string()
}

#[test]
fn merge_takes_stacked_or_separate_parts_of_any_leading_shape() {
    let (o, l) = ([2, 3, 5, 8], [2, 3, 5]);
    let outs = [ArrayInfo::new(&o, "float16"); 3];
    let lses = [ArrayInfo::new(&l, "float32"); 3];
    let each = validate_merge(Parts::Each(&outs), Parts::Each(&lses)).unwrap();
    assert_eq!((each.parts, each.rows, each.value_dim), (3, 30, 8));
    assert_eq!(
        (each.out_shape.clone(), each.lse_shape()),
        (o.to_vec(), l.to_vec())
    );
    let stacked = validate_merge(
        Parts::Stacked(ArrayInfo::new(&[3, 2, 3, 5, 8], "float16")),
        Parts::Stacked(ArrayInfo::new(&[3, 2, 3, 5], "float32")),
    )
    .unwrap();
    assert_eq!(stacked, each);
    // Mixed forms, and a part of just (seq_q, d_v).
    let p = validate_merge(
        Parts::Stacked(ArrayInfo::new(&[1, 4, 0], "float64")),
        Parts::Each(&[ArrayInfo::new(&[4], "float64")]),
    )
    .unwrap();
    assert_eq!((p.parts, p.rows, p.value_dim, p.out_len()), (1, 4, 0, 0));
}

#[test]
fn merge_errors_name_the_part() {
    let (o, l) = ([4, 8], [4]);
    let out = ArrayInfo::new(&o, "float32");
    let lse = ArrayInfo::new(&l, "float32");
    let e = merge_err(Parts::Each(&[]), Parts::Each(&[]));
    assert!(e.contains("outs is an empty sequence"), "{e}");
    let e = merge_err(
        Parts::Stacked(ArrayInfo::new(&[0, 4, 8], "float32")),
        Parts::Stacked(ArrayInfo::new(&[0, 4], "float32")),
    );
    assert!(
        e.contains("outs has shape (0, 4, 8)") && e.contains("no parts"),
        "{e}"
    );
    let e = merge_err(Parts::Each(&[out, out]), Parts::Each(&[lse]));
    assert!(e.contains("outs has 2 parts but lses has 1"), "{e}");
    let odd = ArrayInfo::new(&[4, 9], "float32");
    let e = merge_err(Parts::Each(&[out, out, odd]), Parts::Each(&[lse; 3]));
    assert!(
        e.contains("outs[2] has shape (4, 9)") && e.contains("outs[0]"),
        "{e}"
    );
    let wide = ArrayInfo::new(&o, "float64");
    match validate_merge(Parts::Each(&[out, wide]), Parts::Each(&[lse; 2])).unwrap_err() {
        Error::DType { argument, .. } => assert_eq!(argument, "outs[1]"),
        other => panic!("unexpected {other:?}"),
    }
    let lse64 = ArrayInfo::new(&l, "float64");
    match validate_merge(Parts::Each(&[out; 2]), Parts::Each(&[lse, lse64])).unwrap_err() {
        Error::DType {
            argument, reason, ..
        } => {
            assert_eq!(argument, "lses[1]");
            assert!(reason.contains("float32"), "{reason}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let short = ArrayInfo::new(&[3], "float32");
    let e = merge_err(Parts::Each(&[out]), Parts::Each(&[short]));
    assert!(
        e.contains("lses[0] has shape (3,)") && e.contains("(4,)"),
        "{e}"
    );
    let e = merge_err(
        Parts::Stacked(ArrayInfo::new(&[2, 8], "float32")),
        Parts::Stacked(ArrayInfo::new(&[2], "float32")),
    );
    assert!(e.contains("(parts, ..., seq_q, d_v)"), "{e}");
    let e = merge_err(
        Parts::Each(&[ArrayInfo::new(&o, "int32")]),
        Parts::Each(&[lse]),
    );
    assert!(e.contains("outs[0] has dtype int32"), "{e}");
}

#[test]
fn sums_take_parts_of_one_shape_in_dtypes_float32_holds() {
    let (a, b) = ([2, 3], [3, 2]);
    let mixed = [
        ArrayInfo::new(&a, "float16"),
        ArrayInfo::new(&a, "float32"),
        ArrayInfo::new(&a, "bfloat16"),
    ];
    let p = validate_sum(&mixed, "float16").unwrap();
    assert_eq!(
        (p.parts, p.len, p.shape, p.dtype),
        (3, 6, vec![2, 3], DType::F16)
    );
    let err = |parts: &[ArrayInfo<'_>], dtype| validate_sum(parts, dtype).unwrap_err();
    let wrong_shape = [ArrayInfo::new(&a, "float16"), ArrayInfo::new(&b, "float16")];
    assert_eq!(
        err(&wrong_shape, "float16").to_string(),
        "parts[1] has shape (3, 2) but parts[0] has shape (2, 3); every part has the sum's shape"
    );
    let wide = [ArrayInfo::new(&a, "float16"), ArrayInfo::new(&a, "float64")];
    assert!(matches!(
        err(&wide, "float16"),
        Error::DType { argument, dtype, .. } if argument == "parts[1]" && dtype == "float64"
    ));
    assert!(matches!(
        err(&mixed, "int8"),
        Error::DType { argument, .. } if argument == "dtype"
    ));
    assert!(matches!(err(&[], "float32"), Error::Shape(_)));
    let huge = [usize::MAX, 2];
    assert!(matches!(
        err(&[ArrayInfo::new(&huge, "float32")], "float32"),
        Error::TooLarge(_)
    ));
}
