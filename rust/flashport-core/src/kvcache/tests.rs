//! The cache with its CPU storage: what attention sees after appends,
//! forks, copy-on-write and prefix reuse, and the errors of bad arguments.

use super::*;
use crate::problem::validate_forward;
use crate::{Array, Options, Slice};

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
    let options = KvCacheOptions {
        causal: true,
        ..Default::default()
    };
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
            &Options {
                causal: true,
                ..Options::default()
            },
        )
        .unwrap();
        let want = crate::attention(
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
