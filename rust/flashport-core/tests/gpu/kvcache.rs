//! `KvCache` with its pools on the GPU against the same operations on the
//! CPU's storage: the pools (poisoned with NaN when made, as outputs are in
//! these debug builds) hold the CPU's bits in every written slot and still
//! the poison everywhere else, block copies included; attention matches
//! the float64 reference; a pool split over several buffers (a lowered
//! binding limit when the cache is made) gives the same; and a write the
//! GPU refuses leaves the cache as it was.

use super::common::*;
use flashport_core::kvcache::{ArrayArg, CacheArgs};
use flashport_core::overrides;
use flashport_core::problem::{KvCacheOptions, VariantOptions};
use flashport_core::{gpu, ArrayInfo, Buffer, DType, Error, KvCache, Placement, VariantArrays};

/// (heads_q, heads_kv, block_size, d, d_v)
type Geometry = (usize, usize, usize, usize, usize);

const GEOMETRIES: [Geometry; 2] = [
    // Float16 blocks of 30 and 42 elements: whole words.
    (4, 2, 3, 5, 7),
    // Float16 blocks of 15 and 9 elements: every other block starts
    // mid-word, so copies and writes share words with their neighbours.
    (2, 1, 3, 5, 3),
];

fn cache(g: Geometry, dtype: DType, device: &str) -> KvCache {
    blocks_cache(g, dtype, device, 9)
}

fn blocks_cache(g: Geometry, dtype: DType, device: &str, num_blocks: i64) -> KvCache {
    let (_, hkv, bs, d, dv) = g;
    KvCache::new(
        &CacheArgs {
            num_blocks,
            block_size: bs as i64,
            heads_kv: hkv as i64,
            head_dim: d as i64,
            head_dim_v: Some(dv as i64),
            layers: 2,
            dtype: dtype.numpy_name(),
            swap_blocks: 0,
        },
        Some(device),
    )
    .unwrap()
}

/// The same appends, forks and frees on every cache: copy-on-write of a
/// partly filled block, blocks freed and taken again. Returns the live
/// sequences.
fn script(caches: &mut [&mut KvCache], g: Geometry, dtype: DType) -> Vec<i64> {
    let (_, hkv, _, d, dv) = g;
    let mut seed = 100;
    let mut append = |caches: &mut [&mut KvCache], sid: i64, n: usize| {
        for layer in 0..2 {
            seed += 2;
            let k = Inputs::new(random(hkv * n * d, seed), dtype);
            let v = Inputs::new(random(hkv * n * dv, seed + 1), dtype);
            for c in caches.iter_mut() {
                let dt = c.dtype();
                let name = dt.numpy_name();
                let (ks, vs) = ([hkv, n, d], [hkv, n, dv]);
                c.append(
                    sid,
                    layer,
                    ArrayArg {
                        info: ArrayInfo::new(&ks, name),
                        data: k.slice(dt).into(),
                    },
                    ArrayArg {
                        info: ArrayInfo::new(&vs, name),
                        data: v.slice(dt).into(),
                    },
                    None,
                )
                .unwrap();
            }
        }
    };
    let all = |caches: &mut [&mut KvCache], f: &dyn Fn(&mut KvCache) -> i64| {
        let ids: Vec<i64> = caches.iter_mut().map(|c| f(c)).collect();
        assert!(ids.windows(2).all(|w| w[0] == w[1]));
        ids[0]
    };
    let a = all(caches, &|c| c.new_sequence() as i64);
    append(caches, a, 4);
    let b = all(caches, &|c| c.fork(a).unwrap() as i64);
    append(caches, b, 2);
    append(caches, a, 1);
    let c = all(caches, &|c| c.new_sequence() as i64);
    append(caches, c, 7);
    all(caches, &|x| x.free(b).map(|()| 0).unwrap());
    let d = all(caches, &|x| x.fork(c).unwrap() as i64);
    append(caches, d, 1);
    append(caches, c, 3);
    vec![a, c, d]
}

/// Every slot the CPU wrote (data is never 0) holds its bits on the GPU;
/// every other slot still holds the poison.
fn same_pools(gpu: &KvCache, cpu: &KvCache, what: &str) {
    for layer in 0..2 {
        let (gk, gv) = gpu.read_layer(layer).unwrap();
        let (ck, cv) = cpu.read_layer(layer).unwrap();
        for (g, c, name) in [(&gk, &ck, "k"), (&gv, &cv, "v")] {
            let (gb, cb, cf) = (bits(g), bits(c), as_f64(c));
            assert_eq!(gb.len(), cb.len());
            let written = cf.iter().filter(|&&x| x != 0.0).count();
            assert!(written > 0, "{what}: nothing written");
            for (i, ((&gx, &cx), &x)) in gb.iter().zip(&cb).zip(&cf).enumerate() {
                if x != 0.0 {
                    assert_eq!(gx, cx, "{what} layer {layer} {name}[{i}]");
                } else {
                    assert!(
                        as_f64(g)[i].is_nan(),
                        "{what} layer {layer} {name}[{i}] changed"
                    );
                }
            }
        }
    }
}

/// Attention of queries rounded to `round` (the dtype under test).
fn attend(
    c: &KvCache,
    (g, round): (Geometry, DType),
    ids: &[i64],
    layer: i64,
    seq_q: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (hq, _, _, d, _) = g;
    let shape = [ids.len(), hq, seq_q, d];
    let q = Inputs::new(random(shape.iter().product(), 7 + layer as u64), round);
    let dt = c.dtype();
    let (r, _) = c
        .attention(
            ArrayArg {
                info: ArrayInfo::new(&shape, dt.numpy_name()),
                data: q.slice(dt).into(),
            },
            ids,
            layer,
            &KvCacheOptions::from(VariantOptions {
                causal: true,
                ..VariantOptions::default()
            }),
            &VariantArrays::default(),
            Placement::Host,
        )
        .unwrap();
    (
        as_f64(&r.out.into_host().unwrap()),
        as_f64(&r.lse.into_host().unwrap()),
    )
}

/// The GPU cache against the CPU cache (same dtype, for the pools) and a
/// float64 CPU cache (for attention), with the GPU's pools made under
/// `limit` bytes per binding where given.
fn check(per_buffer: Option<u64>) {
    for g in GEOMETRIES {
        for (dtype, tol) in [(DType::F32, 2e-5), (DType::F16, 2e-3)] {
            let (_, hkv, bs, d, dv) = g;
            let eb = if dtype == DType::F16 { 2 } else { 4 };
            let widest = (hkv * bs * d.max(dv) * eb) as u64;
            let limit = per_buffer.map(|n| gpu::testing::kv_pool_binding_limit(widest, n).unwrap());
            let mut gpu = match limit {
                Some(bytes) => {
                    overrides::with(binding_limit(bytes as usize), || cache(g, dtype, "gpu"))
                }
                None => cache(g, dtype, "gpu"),
            };
            assert_eq!(gpu.device(), "gpu:0");
            let mut cpu = cache(g, dtype, "cpu");
            let mut f64 = cache(g, DType::F64, "cpu");
            let ids = script(&mut [&mut gpu, &mut cpu, &mut f64], g, dtype);
            let what = format!("{g:?} {dtype:?} {per_buffer:?} blocks per buffer");
            same_pools(&gpu, &cpu, &what);
            for layer in 0..2 {
                for seq_q in [1, 2] {
                    let (out, lse) = attend(&gpu, (g, dtype), &ids, layer, seq_q);
                    let (want_out, want_lse) = attend(&f64, (g, dtype), &ids, layer, seq_q);
                    let (eo, el) = (rel_err(&out, &want_out), rel_err(&lse, &want_lse));
                    assert!(
                        eo <= tol && el <= tol,
                        "{what} layer {layer} seq_q {seq_q}: out {eo:e}, lse {el:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_pools_hold_the_cpus_bits_and_attend_as_the_reference() {
    if !gpu_present() {
        return;
    }
    check(None);
}

#[test]
fn pools_split_over_buffers_attend_as_one() {
    if !gpu_present() {
        return;
    }
    // 9 blocks in buffers of 1, 2 and 4 blocks, sequences across them.
    // The limit holds only while the cache is made; attention then binds
    // the buffers as they are.
    for blocks in [1, 2, 4] {
        check(Some(blocks));
    }
}

#[test]
fn a_write_the_gpu_refuses_changes_nothing() {
    if !gpu_present() {
        return;
    }
    let g = GEOMETRIES[0];
    let (_, hkv, _, d, dv) = g;
    let mut gpu = cache(g, DType::F32, "gpu");
    let mut cpu = cache(g, DType::F32, "cpu");
    let ids = script(&mut [&mut gpu, &mut cpu], g, DType::F32);
    let before = attend(&gpu, (g, DType::F32), &ids, 0, 1);
    let usage = |c: &KvCache| {
        let m = c.manager();
        (
            ids.iter()
                .map(|&s| (c.length(s, Some(0)).unwrap(), c.block_table(&[s]).unwrap()))
                .collect::<Vec<_>>(),
            (
                m.pool().ref_counts().to_vec(),
                m.pool().free_order().collect::<Vec<_>>(),
            ),
        )
    };
    let was = usage(&gpu);
    // An append of 2 positions (copy-on-write of the fork's shared last
    // block first) whose keys exceed the binding limit in force.
    let n = 2;
    let k = vec![1.5f32; hkv * n * d];
    let v = vec![-0.5f32; hkv * n * dv];
    let e = overrides::with(binding_limit(16), || {
        gpu.append(
            ids[2],
            0,
            ArrayArg {
                info: ArrayInfo::new(&[hkv, n, d], "float32"),
                data: flashport_core::Slice::F32(&k).into(),
            },
            ArrayArg {
                info: ArrayInfo::new(&[hkv, n, dv], "float32"),
                data: flashport_core::Slice::F32(&v).into(),
            },
            None,
        )
        .unwrap_err()
    });
    assert!(
        matches!(e, Error::TooLarge(_)) && e.to_string().starts_with("k ("),
        "{e}"
    );
    assert_eq!(usage(&gpu), was);
    assert_eq!(attend(&gpu, (g, DType::F32), &ids, 0, 1), before);
    let _: Buffer = gpu.read_layer(1).unwrap().0;
}

/// A batch of appends, `n` positions on `layer` for each of `ids`, on
/// `batched` in one call and on `single` one sequence at a time, from the
/// same keys and values.
fn step(
    (batched, single): (&mut KvCache, &mut KvCache),
    g: Geometry,
    ids: &[i64],
    layer: i64,
    n: usize,
    seed: u64,
) -> flashport_core::Result<()> {
    let (_, hkv, _, d, dv) = g;
    let dt = batched.dtype();
    let rows = ids.len();
    let k = Inputs::new(random(rows * hkv * n * d, seed), dt);
    let v = Inputs::new(random(rows * hkv * n * dv, seed + 1), dt);
    let (ks, vs) = ([rows, hkv, n, d], [rows, hkv, n, dv]);
    let name = dt.numpy_name();
    batched.append_batch(
        ids,
        layer,
        ArrayArg {
            info: ArrayInfo::new(&ks, name),
            data: k.slice(dt).into(),
        },
        ArrayArg {
            info: ArrayInfo::new(&vs, name),
            data: v.slice(dt).into(),
        },
        None,
    )?;
    // The same rows' elements, row by row (Inputs rounds each value alone,
    // so row r of the batch's arrays is the same bits as these).
    for (r, &sid) in ids.iter().enumerate() {
        let (kn, vn) = (hkv * n * d, hkv * n * dv);
        let kr = Inputs::new(k.f64[r * kn..(r + 1) * kn].to_vec(), dt);
        let vr = Inputs::new(v.f64[r * vn..(r + 1) * vn].to_vec(), dt);
        single
            .append(
                sid,
                layer,
                ArrayArg {
                    info: ArrayInfo::new(&ks[1..], name),
                    data: kr.slice(dt).into(),
                },
                ArrayArg {
                    info: ArrayInfo::new(&vs[1..], name),
                    data: vr.slice(dt).into(),
                },
                None,
            )
            .unwrap();
    }
    Ok(())
}

/// Both layers' pools, as bits (the poison included).
fn pool_bits(c: &KvCache) -> Vec<Vec<u64>> {
    (0..2)
        .flat_map(|l| {
            let (k, v) = c.read_layer(l).unwrap();
            [bits(&k), bits(&v)]
        })
        .collect()
}

#[test]
fn a_batch_on_the_gpu_is_the_appends_in_order_bit_for_bit() {
    if !gpu_present() {
        return;
    }
    for g in GEOMETRIES {
        for dtype in [DType::F32, DType::F16] {
            let what = format!("{g:?} {dtype:?}");
            let (mut batched, mut single) = (
                blocks_cache(g, dtype, "gpu", 24),
                blocks_cache(g, dtype, "gpu", 24),
            );
            let ids = script(&mut [&mut batched, &mut single], g, dtype);
            let (a, c, d) = (ids[0], ids[1], ids[2]);
            let both = (&mut batched, &mut single);
            // A decode step of the batch, layer by layer, in another order.
            for layer in 0..2 {
                step(
                    (both.0, both.1),
                    g,
                    &[d, a, c],
                    layer,
                    1,
                    300 + layer as u64,
                )
                .unwrap();
            }
            // A fork and its parent in one batch: the first row copies the
            // shared last block, the second writes the original in place.
            let f = both.0.fork(c).unwrap() as i64;
            assert_eq!(both.1.fork(c).unwrap() as i64, f);
            for layer in 0..2 {
                step((both.0, both.1), g, &[f, c], layer, 2, 310 + layer as u64).unwrap();
            }
            // Several positions per row, across blocks, rows of all four.
            for layer in 0..2 {
                step(
                    (both.0, both.1),
                    g,
                    &[a, f, d, c],
                    layer,
                    4,
                    320 + layer as u64,
                )
                .unwrap();
            }
            assert!(batched.manager() == single.manager(), "{what}");
            assert_eq!(pool_bits(&batched), pool_bits(&single), "{what}");
            let live = [a, c, d, f];
            for layer in 0..2 {
                let got = attend(&batched, (g, dtype), &live, layer, 2);
                let want = attend(&single, (g, dtype), &live, layer, 2);
                let same =
                    |x: &[f64], y: &[f64]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same(&got.0, &want.0) && same(&got.1, &want.1), "{what}");
            }
        }
    }
}

#[test]
fn a_batch_the_gpu_refuses_changes_nothing() {
    if !gpu_present() {
        return;
    }
    let g = GEOMETRIES[1];
    let (mut gpu, mut other) = (cache(g, DType::F16, "gpu"), cache(g, DType::F16, "gpu"));
    let ids = script(&mut [&mut gpu, &mut other], g, DType::F16);
    let f = gpu.fork(ids[1]).unwrap() as i64;
    let (manager, pools) = (gpu.manager().clone(), pool_bits(&gpu));
    // Rows that copy a shared block and take new ones are committed, then
    // the upload exceeds the binding limit in force: all rolled back.
    let e = overrides::with(binding_limit(16), || {
        step((&mut gpu, &mut other), g, &[f, ids[0], ids[1]], 0, 2, 400).unwrap_err()
    });
    assert!(
        matches!(e, Error::TooLarge(_)) && e.to_string().starts_with("k ("),
        "{e}"
    );
    assert!(*gpu.manager() == manager);
    assert_eq!(pool_bits(&gpu), pools);
    // The same batch within the limit goes through.
    let mut third = cache(g, DType::F16, "gpu");
    script(&mut [&mut third], g, DType::F16);
    third.fork(ids[1]).unwrap();
    step((&mut gpu, &mut third), g, &[f, ids[0], ids[1]], 0, 2, 400).unwrap();
    assert!(gpu.manager() == third.manager());
    assert_eq!(pool_bits(&gpu), pool_bits(&third));
}
