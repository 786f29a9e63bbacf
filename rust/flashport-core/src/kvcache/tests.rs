//! The cache with its CPU storage: what attention sees after appends,
//! forks, copy-on-write and prefix reuse, and the errors of bad arguments.

use super::*;
use crate::array::{Array, Slice};
use crate::problem::{validate_forward, Options, VariantOptions};

fn cache(layers: i64, block_size: i64, num_blocks: i64) -> KvCache {
    KvCache::new(
        &CacheArgs {
            num_blocks,
            block_size,
            heads_kv: 2,
            head_dim: 3,
            head_dim_v: Some(2),
            layers,
            dtype: "float64",
            swap_blocks: 0,
        },
        Some("cpu"),
    )
    .unwrap()
}

/// Deterministic values, never zero: `(heads, n, dim)`.
fn values(seed: u64, heads: usize, n: usize, dim: usize) -> Vec<f64> {
    (0..heads * n * dim)
        .map(|i| {
            let x = (seed.wrapping_mul(2654435761) ^ (i as u64 * 40503)) % 1000;
            x as f64 / 250.0 - 1.999
        })
        .collect()
}

fn arg<'a>(shape: &'a [usize], data: &'a [f64]) -> ArrayArg<'a> {
    ArrayArg {
        info: ArrayInfo::new(shape, "float64"),
        data: Input::Host(Slice::F64(data)),
    }
}

/// A sequence's keys and values on one layer, as the test appended them:
/// `(heads_kv, len, d)` and `(heads_kv, len, dv)`.
#[derive(Clone, Default)]
struct Model {
    k: Vec<Vec<[f64; 3]>>,
    v: Vec<Vec<[f64; 2]>>,
}

impl Model {
    fn new() -> Self {
        Model {
            k: vec![Vec::new(); 2],
            v: vec![Vec::new(); 2],
        }
    }
    fn extend(&mut self, n: usize, k: &[f64], v: &[f64]) {
        for h in 0..2 {
            for t in 0..n {
                let kk = &k[(h * n + t) * 3..][..3];
                let vv = &v[(h * n + t) * 2..][..2];
                self.k[h].push([kk[0], kk[1], kk[2]]);
                self.v[h].push([vv[0], vv[1]]);
            }
        }
    }
}

fn append(
    c: &mut KvCache,
    sid: u64,
    layer: i64,
    n: usize,
    seed: u64,
    tokens: Option<&[i64]>,
    model: &mut Model,
) {
    let (k, v) = (values(seed, 2, n, 3), values(seed + 1, 2, n, 2));
    let (ks, vs) = ([2, n, 3], [2, n, 2]);
    let ts = [n];
    let t = tokens.map(|t| IntArray {
        shape: &ts,
        dtype: "int64",
        values: t,
    });
    c.append(sid as i64, layer, arg(&ks, &k), arg(&vs, &v), t)
        .unwrap();
    model.extend(n, &k, &v);
}

/// Attention of one query row per sequence over `layer`, against plain
/// attention over each model's keys.
fn check_attention(c: &KvCache, ids: &[u64], layer: i64, models: &[&Model]) {
    let heads_q = 4;
    let q = values(99, ids.len() * heads_q, 1, 3);
    let q_shape = [ids.len(), heads_q, 1, 3];
    let seq_ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let options = KvCacheOptions::from(VariantOptions {
        causal: true,
        ..VariantOptions::default()
    });
    let (out, problem) = c
        .attention(
            arg(&q_shape, &q),
            &seq_ids,
            layer,
            &options,
            &VariantArrays::default(),
            Placement::Host,
        )
        .unwrap();
    assert_eq!(problem.out_shape(), [ids.len(), heads_q, 1, 2]);
    let Array::Host(Buffer::F64(out)) = out.out else {
        panic!()
    };
    for (b, model) in models.iter().enumerate() {
        let len = model.k[0].len();
        assert_eq!(c.length(ids[b] as i64, Some(layer)).unwrap(), len);
        let k: Vec<f64> = model.k.iter().flatten().flatten().copied().collect();
        let v: Vec<f64> = model.v.iter().flatten().flatten().copied().collect();
        let qb = &q[b * heads_q * 3..][..heads_q * 3];
        let (qs, ks, vs) = ([1, heads_q, 1, 3], [1, 2, len, 3], [1, 2, len, 2]);
        let p = validate_forward(
            ArrayInfo::new(&qs, "float64"),
            ArrayInfo::new(&ks, "float64"),
            ArrayInfo::new(&vs, "float64"),
            &Options::from(VariantOptions {
                causal: true,
                ..VariantOptions::default()
            }),
        )
        .unwrap();
        let want = crate::attention::attention(
            Device::Cpu,
            &p,
            Slice::F64(qb),
            Slice::F64(&k),
            Slice::F64(&v),
            &VariantArrays::default(),
        )
        .unwrap();
        let Buffer::F64(want) = want.out else {
            panic!()
        };
        let got = &out[b * heads_q * 2..][..heads_q * 2];
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-12,
                "sequence {b} layer {layer}: {got:?} vs {want:?}"
            );
        }
    }
}

#[test]
fn attention_sees_each_sequence_and_layer_through_forks_and_copies() {
    let mut c = cache(2, 3, 12);
    let a = c.new_sequence();
    let mut ma = [Model::new(), Model::new()];
    for (layer, m) in ma.iter_mut().enumerate() {
        append(&mut c, a, layer as i64, 7, 10 + layer as u64, None, m);
    }
    let b = c.fork(a as i64).unwrap();
    let mut mb = ma.clone();
    // Diverge inside the shared, partly filled block 2, one layer at a time.
    append(&mut c, a, 0, 1, 20, None, &mut ma[0]);
    check_attention(&c, &[a, b], 0, &[&ma[0], &mb[0]]);
    append(&mut c, b, 0, 4, 30, None, &mut mb[0]);
    append(&mut c, b, 1, 4, 31, None, &mut mb[1]);
    append(&mut c, a, 1, 1, 21, None, &mut ma[1]);
    for layer in 0..2 {
        check_attention(
            &c,
            &[a, b, a],
            layer,
            &[
                &ma[layer as usize],
                &mb[layer as usize],
                &ma[layer as usize],
            ],
        );
    }
    assert_eq!(c.length(a as i64, None).unwrap(), 8);
    assert_eq!(c.length(b as i64, None).unwrap(), 11);
    c.free(a as i64).unwrap();
    check_attention(&c, &[b], 1, &[&mb[1]]);
    c.manager().check_invariants().unwrap();
}

#[test]
fn an_adopted_prefix_is_read_not_rewritten() {
    let mut c = cache(2, 2, 8);
    let prompt = [4, 5, 6, 7, 8];
    let a = c.new_sequence();
    let mut ma = [Model::new(), Model::new()];
    for (layer, m) in ma.iter_mut().enumerate() {
        append(
            &mut c,
            a,
            layer as i64,
            5,
            40 + layer as u64,
            Some(&prompt),
            m,
        );
    }
    let used = c.manager().pool().num_used();
    // b gives other values for the same tokens: its first two blocks are
    // a's (the trust the docs state), its last position its own.
    let b = c.new_sequence();
    let mut mb = [Model::new(), Model::new()];
    for (layer, m) in mb.iter_mut().enumerate() {
        append(
            &mut c,
            b,
            layer as i64,
            5,
            50 + layer as u64,
            Some(&prompt),
            m,
        );
        let mut shared = ma[layer].clone();
        for h in 0..2 {
            shared.k[h][4] = m.k[h][4];
            shared.v[h][4] = m.v[h][4];
        }
        *m = shared;
    }
    assert_eq!(c.manager().pool().num_used(), used + 1);
    let (table, width) = c.block_table(&[a as i64, b as i64]).unwrap();
    assert_eq!(width, 3);
    assert_eq!(table[..2], table[3..5]);
    assert_ne!(table[2], table[5]);
    for layer in 0..2 {
        check_attention(
            &c,
            &[a, b],
            layer,
            &[&ma[layer as usize], &mb[layer as usize]],
        );
    }
}

#[test]
fn bad_arguments_are_named_and_change_nothing() {
    let mut c = cache(2, 4, 2);
    let a = c.new_sequence();
    let k = values(1, 2, 3, 3);
    let v = values(2, 2, 3, 2);
    let err = |c: &mut KvCache, sid, layer, ks: &[usize], vs: &[usize], t: Option<IntArray<'_>>| {
        let n: usize = ks.iter().product();
        let m: usize = vs.iter().product();
        c.append(
            sid,
            layer,
            arg(ks, &k[..n.min(18)]),
            arg(vs, &v[..m.min(12)]),
            t,
        )
        .unwrap_err()
        .to_string()
    };
    let e = err(&mut c, 7, 0, &[2, 3, 3], &[2, 3, 2], None);
    assert!(e.starts_with("sid=7: no such sequence"), "{e}");
    let e = err(&mut c, 0, 2, &[2, 3, 3], &[2, 3, 2], None);
    assert!(e.starts_with("layer=2"), "{e}");
    let e = err(&mut c, 0, 0, &[3, 2, 3], &[2, 3, 2], None);
    assert_eq!(
        e,
        "k has shape (3, 2, 3); expected (heads_kv, n, head_dim) = (2, n, 3)"
    );
    let e = err(&mut c, 0, 0, &[2, 3, 3], &[2, 3, 3], None);
    assert_eq!(
        e,
        "v has shape (2, 3, 3); expected (heads_kv, n, head_dim_v) = (2, n, 2)"
    );
    let e = err(&mut c, 0, 0, &[2, 3, 3], &[2, 2, 2], None);
    assert!(e.starts_with("k holds 3 positions but v holds 2"), "{e}");
    let ts = [2];
    let t = IntArray {
        shape: &ts,
        dtype: "int64",
        values: &[1, 2],
    };
    let e = err(&mut c, 0, 0, &[2, 3, 3], &[2, 3, 2], Some(t));
    assert!(
        e.starts_with("tokens has shape (2,); expected one token id per appended position, (3,)"),
        "{e}"
    );
    let ts = [3];
    let t = IntArray {
        shape: &ts,
        dtype: "float32",
        values: &[],
    };
    let e = err(&mut c, 0, 0, &[2, 3, 3], &[2, 3, 2], Some(t));
    assert!(e.starts_with("tokens has dtype float32"), "{e}");
    let k32 = [1.0f32; 18];
    let e = c
        .append(
            0,
            0,
            ArrayArg {
                info: ArrayInfo::new(&[2, 3, 3], "float32"),
                data: Input::Host(Slice::F32(&k32)),
            },
            arg(&[2, 3, 2], &v),
            None,
        )
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "k has dtype float32: the cache holds float64"
    );
    // 2 blocks of 4: 9 positions do not fit.
    let (k9, v9) = (values(3, 2, 9, 3), values(4, 2, 9, 2));
    let e = c
        .append(0, 1, arg(&[2, 9, 3], &k9), arg(&[2, 9, 2], &v9), None)
        .unwrap_err();
    assert!(matches!(e, Error::CacheFull(_)), "{e}");
    assert_eq!(
        (
            c.length(a as i64, Some(1)).unwrap(),
            c.manager().pool().num_free()
        ),
        (0, 2)
    );
    // Attention: ids, layer, q.
    let q = values(5, 4, 1, 3);
    let attend = |ids: &[i64], layer, shape: &[usize]| {
        c.attention(
            arg(shape, &q[..shape.iter().product::<usize>()]),
            ids,
            layer,
            &Default::default(),
            &VariantArrays::default(),
            Placement::Host,
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    assert!(attend(&[0, 5], 0, &[2, 2, 1, 3]).starts_with("seq_ids[1]=5: no such sequence"));
    assert!(attend(&[0], 3, &[1, 4, 1, 3]).starts_with("layer=3"));
    assert_eq!(
        attend(&[0, 0], 0, &[1, 4, 1, 3]),
        "q has shape (1, 4, 1, 3); expected (len(seq_ids), heads_q, seq_q, head_dim) = (2, heads_q, seq_q, 3)"
    );
    assert!(attend(&[0], 0, &[1, 3, 1, 3]).contains("must divide"));
}

#[test]
fn the_device_is_chosen_by_name_and_float64_stays_on_the_cpu() {
    let args = CacheArgs {
        num_blocks: 1,
        block_size: 1,
        heads_kv: 1,
        head_dim: 1,
        head_dim_v: None,
        layers: 1,
        dtype: "float64",
        swap_blocks: 0,
    };
    // Refused before any adapter is looked for, as the GPU refuses float64.
    let e = KvCache::new(&args, Some("gpu")).unwrap_err();
    assert!(
        e.to_string().starts_with("dtype has dtype float64") && e.to_string().contains("GPU"),
        "{e}"
    );
    assert_eq!(KvCache::new(&args, Some("auto")).unwrap().device(), "cpu");
    assert!(KvCache::new(&args, Some("tpu")).is_err());
}

// ---------------------------------------------------------------------------
// Batches: append_batch against the same appends one sequence at a time.

/// A small deterministic generator for the random scripts below.
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

fn bits(b: &Buffer) -> Vec<u64> {
    match b {
        Buffer::F64(x) => x.iter().map(|v| v.to_bits()).collect(),
        other => panic!("a float64 cache read back as {other:?}"),
    }
}

/// Each layer's key and value pools, as bits.
type PoolBits = Vec<(Vec<u64>, Vec<u64>)>;

/// Everything about a cache: its bookkeeping (counts, free queue order,
/// cached prefixes, every sequence) and every layer's pools, as bits.
fn state(c: &KvCache) -> (BlockManager, PoolBits) {
    let layers = c.shape().layers as i64;
    let pools = (0..layers)
        .map(|l| {
            let (k, v) = c.read_layer(l).unwrap();
            (bits(&k), bits(&v))
        })
        .collect();
    (c.manager().clone(), pools)
}

/// `append_batch` with `(rows, 2, n, 3)` keys, `(rows, 2, n, 2)` values.
fn append_batch(
    c: &mut KvCache,
    ids: &[i64],
    layer: i64,
    n: usize,
    k: &[f64],
    v: &[f64],
    tokens: Option<&[i64]>,
) -> Result<()> {
    let (ks, vs, ts) = ([ids.len(), 2, n, 3], [ids.len(), 2, n, 2], [ids.len(), n]);
    let t = tokens.map(|t| IntArray {
        shape: &ts,
        dtype: "int64",
        values: t,
    });
    c.append_batch(ids, layer, arg(&ks, k), arg(&vs, v), t)
}

#[test]
fn a_batch_is_the_appends_in_order_bit_for_bit() {
    let mut kinds = [0usize; 4];
    for seed in 0..60 {
        let mut rng = Lcg(seed);
        let (layers, bs) = (1 + rng.below(2), 1 + rng.below(4));
        let num_blocks = 6 + rng.below(10) as i64;
        let mut batched = cache(layers as i64, bs as i64, num_blocks);
        let mut single = cache(layers as i64, bs as i64, num_blocks);
        let mut live: Vec<i64> = Vec::new();
        for step in 0..120 {
            match rng.below(8) {
                0 => {
                    let id = batched.new_sequence();
                    assert_eq!(single.new_sequence(), id);
                    live.push(id as i64);
                }
                1 if !live.is_empty() => {
                    let id = live[rng.below(live.len())];
                    let child = batched.fork(id).unwrap();
                    assert_eq!(single.fork(id).unwrap(), child);
                    live.push(child as i64);
                }
                2 if live.len() > 2 => {
                    let id = live.swap_remove(rng.below(live.len()));
                    batched.free(id).unwrap();
                    single.free(id).unwrap();
                }
                _ if !live.is_empty() => {
                    // A batch of distinct live sequences in any order.
                    let mut pool = live.clone();
                    let rows = 1 + rng.below(pool.len());
                    let ids: Vec<i64> = (0..rows)
                        .map(|_| pool.swap_remove(rng.below(pool.len())))
                        .collect();
                    let layer = rng.below(layers);
                    let n = rng.below(2 * bs + 2);
                    // Tokens that depend on the position only, so that
                    // sequences share prefixes and a block one row fills
                    // can be adopted by a later row; mostly only where
                    // every row may give them (else the batch is refused).
                    let known = |id: i64| {
                        let s = batched.manager().sequence("sid", id).unwrap();
                        (s.lengths[layer], s.tokens.len())
                    };
                    let all_may = ids.iter().all(|&id| {
                        let (start, known) = known(id);
                        start <= known
                    });
                    let give = rng.below(3) > 0 && (all_may || rng.below(6) == 0);
                    let tokens: Vec<i64> = ids
                        .iter()
                        .flat_map(|&id| {
                            let start = known(id).0;
                            (start..start + n).map(|p| (p % 3) as i64)
                        })
                        .collect();
                    let k = values(1000 * seed + step, rows * 2, n, 3);
                    let v = values(1000 * seed + step + 500, rows * 2, n, 2);
                    let before = state(&batched);
                    let got = append_batch(
                        &mut batched,
                        &ids,
                        layer as i64,
                        n,
                        &k,
                        &v,
                        give.then_some(&tokens[..]),
                    );
                    // The reference: one append per row, in order.
                    let mut reference = single.manager().clone();
                    let mut failed = None;
                    for (r, &id) in ids.iter().enumerate() {
                        let t = give.then(|| &tokens[r * n..(r + 1) * n]);
                        match reference.plan_append(id, layer, n, t) {
                            Ok(plan) => {
                                reference.commit(&plan);
                            }
                            Err(e) => {
                                failed = Some((r, e));
                                break;
                            }
                        }
                    }
                    match (got, failed) {
                        (Ok(()), None) => {
                            kinds[0] += 1;
                            for (r, &id) in ids.iter().enumerate() {
                                let (kr, vr) = (&k[r * 2 * n * 3..], &v[r * 2 * n * 2..]);
                                let (ks, vs, ts) = ([2, n, 3], [2, n, 2], [n]);
                                let t = give.then(|| IntArray {
                                    shape: &ts,
                                    dtype: "int64",
                                    values: &tokens[r * n..(r + 1) * n],
                                });
                                single
                                    .append(
                                        id,
                                        layer as i64,
                                        arg(&ks, &kr[..2 * n * 3]),
                                        arg(&vs, &vr[..2 * n * 2]),
                                        t,
                                    )
                                    .unwrap();
                            }
                            assert_eq!(*single.manager(), reference);
                        }
                        (Err(e), Some((r, want))) => {
                            // The row that fails alone fails the batch,
                            // named as that row; nothing changed.
                            kinds[match e {
                                Error::CacheFull(_) => 1,
                                _ => 2,
                            }] += 1;
                            assert_eq!(
                                std::mem::discriminant(&e),
                                std::mem::discriminant(&want),
                                "{e} / {want}"
                            );
                            let row = format!("[{r}");
                            assert!(e.to_string().contains(&row), "{e} (row {r})");
                            assert!(state(&batched) == before, "seed {seed} step {step}: {e}");
                        }
                        (got, failed) => panic!("seed {seed} step {step}: {got:?} vs {failed:?}"),
                    }
                    if rows > 1 && n > 0 {
                        kinds[3] += 1;
                    }
                }
                _ => {}
            }
            let (bm, bp) = state(&batched);
            let (sm, sp) = state(&single);
            assert!(bm == sm, "seed {seed} step {step}: bookkeeping differs");
            assert!(bp == sp, "seed {seed} step {step}: pools differ");
            bm.check_invariants().unwrap();
        }
        // Attention over every live sequence and layer: the same bits.
        for layer in 0..layers as i64 {
            if live.is_empty() {
                break;
            }
            let q = values(7, live.len() * 4, 1, 3);
            let qs = [live.len(), 4, 1, 3];
            let attend = |c: &KvCache| {
                let (out, _) = c
                    .attention(
                        arg(&qs, &q),
                        &live,
                        layer,
                        &KvCacheOptions::default(),
                        &VariantArrays::default(),
                        Placement::Host,
                    )
                    .unwrap();
                let Array::Host(out) = out.out else { panic!() };
                bits(&out)
            };
            assert_eq!(attend(&batched), attend(&single));
        }
    }
    // The scripts reach every case: batches that succeed, that are full,
    // whose tokens are refused, of several rows.
    assert!(kinds.iter().all(|&k| k > 5), "{kinds:?}");
}

/// A cache of 1 layer, blocks of 2, with sequence 0 holding token 3 at
/// position 0, its fork 1 sharing that block, and an empty sequence 2.
fn forked() -> KvCache {
    let mut c = cache(1, 2, 8);
    let a = c.new_sequence();
    append(&mut c, a, 0, 1, 1, Some(&[3]), &mut Model::new());
    c.fork(a as i64).unwrap();
    c.new_sequence();
    c
}

#[test]
fn a_batch_shares_and_copies_as_the_appends_in_order_do() {
    let (a, f, b) = (0i64, 1i64, 2i64);
    let (k, v) = (values(2, 3 * 2, 2, 3), values(3, 3 * 2, 2, 2));
    // a: tokens 4, 5 at positions 1, 2: block 0 is shared with f, so a
    // copies it (block 1) before writing, and takes block 2; block 1 is
    // then full, [3, 4], and cached. f: tokens 4, 9 at 1, 2: block 0 is
    // its own now, written in place (after a's copy read it); block 3 for
    // position 2; its full block 0 duplicates the prefix a's block 1
    // cached, so stays uncached. b: tokens 3, 4 at 0, 1: the prefix a's
    // row cached, adopted in the same call, not written.
    let tokens = [4, 5, 4, 9, 3, 4];
    let mut batched = forked();
    append_batch(&mut batched, &[a, f, b], 0, 2, &k, &v, Some(&tokens)).unwrap();
    let mut single = forked();
    for (r, id) in [a, f, b].into_iter().enumerate() {
        let (ks, vs, ts) = ([2, 2, 3], [2, 2, 2], [2]);
        let t = IntArray {
            shape: &ts,
            dtype: "int64",
            values: &tokens[2 * r..2 * r + 2],
        };
        let (kr, vr) = (&k[r * 12..(r + 1) * 12], &v[r * 8..(r + 1) * 8]);
        single
            .append(id, 0, arg(&ks, kr), arg(&vs, vr), Some(t))
            .unwrap();
    }
    let (table, width) = batched.block_table(&[a, f, b]).unwrap();
    assert_eq!((table, width), (vec![1, 2, 0, 3, 1, -1], 2));
    let m = batched.manager();
    assert_eq!(m.pool().ref_counts(), [1, 2, 1, 1, 0, 0, 0, 0]);
    assert_eq!(m.pool().free_order().collect::<Vec<_>>(), [4, 5, 6, 7]);
    assert!(m.pool().hash_of(1).is_some() && m.pool().hash_of(0).is_none());
    assert!(state(&batched) == state(&single));
    // b reads a's keys for its adopted positions: a's old position 0 (the
    // copy of block 0) and a's row's first token.
    let (Buffer::F64(pool), _) = batched.read_layer(0).unwrap() else {
        panic!()
    };
    let slot = |b: usize, h: usize, s: usize| &pool[((b * 2 + h) * 2 + s) * 3..][..3];
    for h in 0..2 {
        assert_eq!(slot(1, h, 0), slot(0, h, 0), "the copy");
        assert_eq!(slot(1, h, 1), &k[h * 2 * 3..][..3], "a's row, token 0");
        assert_eq!(
            slot(0, h, 1),
            &k[(2 + h) * 2 * 3..][..3],
            "f's row, token 0"
        );
    }
}

#[test]
fn a_failed_batch_changes_nothing_and_names_the_argument() {
    let (a, f, b) = (0i64, 1i64, 2i64);
    let mut c = forked();
    // b holds 1 position appended without tokens (block 1).
    append(&mut c, b as u64, 0, 1, 5, None, &mut Model::new());
    let gone = c.new_sequence() as i64;
    c.free(gone).unwrap();
    let before = state(&c);
    let (k, v) = (values(2, 3 * 2, 4, 3), values(3, 3 * 2, 4, 2));
    let mut fails = |ids: &[i64],
                     layer: i64,
                     (ks, vs): (&[usize], &[usize]),
                     tokens: Option<(&[usize], &str, &[i64])>| {
        let t = tokens.map(|(shape, dtype, values)| IntArray {
            shape,
            dtype,
            values,
        });
        let (nk, nv) = (ks.iter().product::<usize>(), vs.iter().product::<usize>());
        let e = c
            .append_batch(ids, layer, arg(ks, &k[..nk]), arg(vs, &v[..nv]), t)
            .unwrap_err();
        assert!(state(&c) == before, "{e}");
        e
    };
    let (ks, vs): (&[usize], &[usize]) = (&[3, 2, 2, 3], &[3, 2, 2, 2]);
    let e = fails(&[a, f, a], 0, (ks, vs), None);
    assert_eq!(
        e.to_string(),
        "seq_ids[2]=0: sequence 0 is also seq_ids[0]; a batch appends to each sequence once \
         (append all its positions in one row)"
    );
    assert!(matches!(e, Error::Value { .. }));
    let e = fails(&[a, 9, b], 0, (ks, vs), None);
    assert!(
        e.to_string().starts_with("seq_ids[1]=9: no such sequence"),
        "{e}"
    );
    let e = fails(&[a, gone, b], 0, (ks, vs), None);
    assert_eq!(e.to_string(), "seq_ids[1]=3: that sequence was freed");
    assert!(matches!(e, Error::UnknownSequence { .. }));
    let e = fails(&[a, f, b], 1, (ks, vs), None);
    assert!(
        e.to_string()
            .starts_with("layer=1: the cache has 1 layer(s)"),
        "{e}"
    );
    let e = fails(&[a, f, b], 0, (&[2, 2, 3], vs), None);
    assert_eq!(
        e.to_string(),
        "k has shape (2, 2, 3); expected (len(seq_ids), heads_kv, n, head_dim) = (3, 2, n, 3)"
    );
    let e = fails(&[a, f], 0, (&[2, 2, 2, 3], vs), None);
    assert_eq!(
        e.to_string(),
        "v has shape (3, 2, 2, 2); expected (len(seq_ids), heads_kv, n, head_dim_v) = (2, 2, n, 2)"
    );
    let e = fails(&[a, f, b], 0, (ks, &[3, 2, 1, 2]), None);
    assert!(
        e.to_string()
            .starts_with("k holds 2 positions but v holds 1"),
        "{e}"
    );
    let e = fails(&[a, f, b], 0, (ks, vs), Some((&[6], "int64", &[4; 6])));
    assert_eq!(
        e.to_string(),
        "tokens has shape (6,); expected one token id per appended position, (3, 2)"
    );
    assert!(matches!(e, Error::Shape(_)));
    let e = fails(&[a, f, b], 0, (ks, vs), Some((&[3, 2], "float64", &[])));
    assert!(e.to_string().starts_with("tokens has dtype float64"), "{e}");
    // Rows that copy and take blocks, then a row whose tokens are refused
    // (b's position 0 was appended without tokens), or whose blocks no
    // longer fit: 6 free blocks, a takes 3 (a copy and 2 new), f 2, b 2.
    let e = fails(
        &[a, f, b],
        0,
        (ks, vs),
        Some((&[3, 2], "int64", &[4, 5, 4, 9, 1, 2])),
    );
    assert!(
        e.to_string()
            .starts_with("tokens[2]=<2 tokens from position 1>: positions 0 to 0 of sequence 2"),
        "{e}"
    );
    let e = fails(&[a, f, b], 0, (&[3, 2, 4, 3], &[3, 2, 4, 2]), None);
    assert!(matches!(e, Error::CacheFull(_)), "{e}");
    assert!(
        e.to_string().contains(
            "appending 4 position(s) to layer 0 of sequence 2 (seq_ids[2], after the blocks \
             the batch's sequences before it took) needs 2 free block(s)"
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("but 1 of 8 are free; nothing was changed"),
        "{e}"
    );
    // Without the last row it fits, and takes those 5 blocks.
    let (k2, v2) = (&k[..48], &v[..32]);
    let (ks2, vs2) = ([2, 2, 4, 3], [2, 2, 4, 2]);
    c.append_batch(&[a, f], 0, arg(&ks2, k2), arg(&vs2, v2), None)
        .unwrap();
    assert_eq!(c.manager().pool().num_free(), 1);
}
