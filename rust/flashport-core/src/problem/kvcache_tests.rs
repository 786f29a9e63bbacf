use super::*;

const Q: [usize; 4] = [2, 8, 1, 16];

fn ints<'a>(shape: &'a [usize], values: &'a [i64]) -> IntArray<'a> {
    IntArray {
        shape,
        dtype: "int32",
        values,
    }
}

fn paged(cache: &[usize], lens: &[i64], table: IntArray<'_>) -> Result<KvCacheProblem> {
    validate_kvcache(
        ArrayInfo::new(&Q, "float32"),
        ArrayInfo::new(cache, "float32"),
        ArrayInfo::new(cache, "float32"),
        ints(&[2], lens),
        Some(table),
        &KvCacheOptions::default(),
    )
}

fn contiguous(
    cache: &[usize],
    lens: &[i64],
    options: KvCacheOptions<'_>,
) -> Result<KvCacheProblem> {
    validate_kvcache(
        ArrayInfo::new(&Q, "float32"),
        ArrayInfo::new(cache, "float32"),
        ArrayInfo::new(cache, "float32"),
        ints(&[2], lens),
        None,
        &options,
    )
}

fn value_argument(e: Error) -> (String, String) {
    match e {
        Error::Value {
            argument, value, ..
        } => (argument, value),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn paged_rows_follow_the_table_and_unread_entries_may_be_anything() {
    let cache = [10, 2, 3, 16];
    // Sequence 0 has 7 keys (blocks 4, 9, 0); sequence 1 has 2 keys in
    // block 4 (shared) and -1 padding after.
    let table = [4, 9, 0, 5, 4, -1, -1, 77];
    let p = paged(&cache, &[7, 2], ints(&[2, 4], &table)).unwrap();
    assert_eq!(
        (p.block_size(), p.cache_blocks(), p.cache_rows()),
        (3, 10, 60)
    );
    // Key 4 of sequence 0 is in block 9 at offset 1, head 1.
    assert_eq!(p.cache_row(0, 1, 4), (9 * 2 + 1) * 3 + 1);
    assert_eq!(p.cache_row(1, 0, 1), (4 * 2) * 3 + 1);
    assert_eq!(p.keys_read(0), 0..7);
    assert_eq!(p.sequence(1).q_offset, 1);
}

#[test]
fn bad_entries_and_lengths_are_named() {
    let cache = [10, 2, 3, 16];
    let e = paged(&cache, &[7, 2], ints(&[2, 4], &[4, 13, 0, 0, 0, 0, 0, 0])).unwrap_err();
    assert_eq!(value_argument(e), ("block_table[0, 1]".into(), "13".into()));
    let e = paged(&cache, &[7, 2], ints(&[2, 4], &[4, 1, 0, 0, -1, 0, 0, 0])).unwrap_err();
    assert_eq!(value_argument(e), ("block_table[1, 0]".into(), "-1".into()));
    let e = paged(&cache, &[13, 2], ints(&[2, 4], &[0; 8])).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Shape(_)), "{msg}");
    assert!(
        msg.contains("block_table has shape (2, 4)") && msg.contains("cache_seqlens[0] = 13"),
        "{msg}"
    );
    let e = paged(&cache, &[1, -3], ints(&[2, 4], &[0; 8])).unwrap_err();
    assert_eq!(value_argument(e), ("cache_seqlens[1]".into(), "-3".into()));
    let e = contiguous(&[2, 2, 5, 16], &[5, 6], KvCacheOptions::default()).unwrap_err();
    assert_eq!(value_argument(e), ("cache_seqlens[1]".into(), "6".into()));
    let float_table = IntArray {
        shape: &[2, 4],
        dtype: "float32",
        values: &[],
    };
    match paged(&cache, &[1, 1], float_table).unwrap_err() {
        Error::DType { argument, .. } => assert_eq!(argument, "block_table"),
        other => panic!("unexpected {other:?}"),
    }
    let e = paged(&cache, &[1, 1], ints(&[3, 4], &[0; 12])).unwrap_err();
    assert!(
        e.to_string().contains("block_table has shape (3, 4)"),
        "{e}"
    );
}

#[test]
fn shapes_dtypes_and_options_are_checked_by_name() {
    let e = contiguous(&[3, 2, 5, 16], &[1, 1], KvCacheOptions::default()).unwrap_err();
    assert!(
        e.to_string()
            .contains("k_cache has 3 sequences but q has 2"),
        "{e}"
    );
    let e = contiguous(&[2, 3, 5, 16], &[1, 1], KvCacheOptions::default()).unwrap_err();
    assert!(e.to_string().contains("(3) must divide"), "{e}");
    let e = contiguous(&[2, 2, 5, 8], &[1, 1], KvCacheOptions::default()).unwrap_err();
    assert!(e.to_string().contains("k_cache: 8"), "{e}");
    let e = validate_kvcache(
        ArrayInfo::new(&Q, "float32"),
        ArrayInfo::new(&[2, 2, 5, 16], "float16"),
        ArrayInfo::new(&[2, 2, 5, 16], "float16"),
        ints(&[2], &[1, 1]),
        None,
        &KvCacheOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { ref argument, .. } if argument == "k_cache"));
    for n in [0, -1, MAX_SPLITS as i128 + 1] {
        let options = KvCacheOptions {
            num_splits: Some(n),
            ..KvCacheOptions::default()
        };
        let e = contiguous(&[2, 2, 5, 16], &[1, 1], options).unwrap_err();
        assert_eq!(value_argument(e).0, "num_splits");
    }
    let options = KvCacheOptions::from(VariantOptions {
        window: Some((-3, 0)),
        ..VariantOptions::default()
    });
    let e = contiguous(&[2, 2, 5, 16], &[1, 1], options).unwrap_err();
    assert_eq!(value_argument(e).0, "window");
}

#[test]
fn the_variants_the_cache_does_not_take_are_refused() {
    let mask = [1usize, 1];
    let refused = [
        (
            "mask",
            VariantOptions {
                mask: Some(ArrayInfo::new(&mask, "bool")),
                ..VariantOptions::default()
            },
        ),
        (
            "dropout_p",
            VariantOptions {
                dropout_p: 0.5,
                seed: Some(1),
                ..VariantOptions::default()
            },
        ),
        (
            "seed",
            VariantOptions {
                seed: Some(1),
                ..VariantOptions::default()
            },
        ),
        (
            "q_offset",
            VariantOptions {
                q_offset: Some(0),
                ..VariantOptions::default()
            },
        ),
        (
            "k_offset",
            VariantOptions {
                k_offset: Some(0),
                ..VariantOptions::default()
            },
        ),
    ];
    for (name, variants) in refused {
        let e = contiguous(&[2, 2, 5, 16], &[1, 1], variants.into()).unwrap_err();
        assert!(
            e.to_string()
                .contains("takes no mask, dropout or positions"),
            "{e}"
        );
        assert_eq!(value_argument(e), (name.to_string(), "given".to_string()));
    }
}

#[test]
fn positions_are_bottom_right_against_each_length() {
    let q = [2, 2, 3, 4];
    let options = KvCacheOptions::from(VariantOptions {
        causal: true,
        window: Some((1, -1)),
        ..VariantOptions::default()
    });
    let p = validate_kvcache(
        ArrayInfo::new(&q, "float64"),
        ArrayInfo::new(&[2, 1, 8, 4], "float64"),
        ArrayInfo::new(&[2, 1, 8, 4], "float64"),
        ints(&[2], &[8, 2]),
        None,
        &options,
    )
    .unwrap();
    // Rows at 5, 6, 7 of 8 keys: each sees itself and one before.
    let s = p.sequence(0);
    assert_eq!(
        (0..3).map(|i| s.visible_keys(i)).collect::<Vec<_>>(),
        vec![4..6, 5..7, 6..8]
    );
    assert_eq!(p.keys_read(0), 4..8);
    // Rows at -1, 0, 1 of 2 keys: the first sees nothing.
    let s = p.sequence(1);
    assert_eq!(
        (0..3).map(|i| s.visible_keys(i)).collect::<Vec<_>>(),
        vec![0..0, 0..1, 0..2]
    );
    assert_eq!(p.keys_read(1), 0..2);
}
