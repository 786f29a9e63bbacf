//! Decoding over a KV cache (`attention_with_kvcache`) on the GPU against
//! the float64 reference (the CPU's decode in float64 on the same rounded
//! inputs): paged caches of odd block sizes through a permuted table with
//! blocks shared between sequences, empty sequences, GQA with seq_q > 1,
//! d != d_v; every split count the same function and the same bits on a
//! second run; and, where the driver limits a subgroup's loop passes, a
//! split count that would pass the limit refused rather than cut short.
//! Each case runs on every decode kernel the adapter has: the subgroup
//! kernel (where subgroups have a known size) in its layouts, and the
//! workgroup kernel.

use super::common::*;
use flashport_core::gpu::decode::select::DecodeKernel;
use flashport_core::gpu::Gpu;
use flashport_core::overrides::{self, Overrides};
use flashport_core::problem::{validate_kvcache, IntArray, KvCacheOptions, VariantOptions};
use flashport_core::{
    attention_with_kvcache_arrays, cpu, gpu, ArrayInfo, Buffer, DType, Device, Error, Input,
    KvCacheProblem, Placement, VariantArrays,
};

/// A paged cache: `lens` keys per sequence in blocks of `block_size`, the
/// blocks in a scrambled order, sequence 1 starting with sequence 0's
/// first block (shared), and two spare blocks no table names.
struct Paged {
    p: KvCacheProblem,
    q: Inputs,
    k: Inputs,
    v: Inputs,
}

/// (heads_q, heads_kv, seq_q, d, d_v)
type Heads = (usize, usize, usize, usize, usize);

fn paged(
    (hq, hkv, sq, d, dv): Heads,
    lens: &[i64],
    block_size: usize,
    dtype: DType,
    num_splits: Option<i128>,
    seed: u64,
) -> Paged {
    let batch = lens.len();
    let per_seq = lens
        .iter()
        .map(|&n| (n as usize).div_ceil(block_size))
        .max()
        .unwrap()
        .max(1);
    let num_blocks = batch * per_seq + 2;
    // Block i of sequence b is m·(b·per_seq + i) + 3 mod num_blocks, a
    // permutation for m coprime with num_blocks.
    let m = [7, 11, 13]
        .into_iter()
        .find(|m| num_blocks % m != 0)
        .unwrap();
    let mut table: Vec<i64> = (0..batch * per_seq)
        .map(|i| ((m * i + 3) % num_blocks) as i64)
        .collect();
    if batch > 1 && lens[1] > 0 {
        table[per_seq] = table[0];
    }
    let name = dtype.numpy_name();
    let q_shape = [batch, hq, sq, d];
    let (k_shape, v_shape) = (
        [num_blocks, hkv, block_size, d],
        [num_blocks, hkv, block_size, dv],
    );
    let p = validate_kvcache(
        ArrayInfo::new(&q_shape, name),
        ArrayInfo::new(&k_shape, name),
        ArrayInfo::new(&v_shape, name),
        IntArray {
            shape: &[batch],
            dtype: "int64",
            values: lens,
        },
        Some(IntArray {
            shape: &[batch, per_seq],
            dtype: "int32",
            values: &table,
        }),
        &KvCacheOptions {
            num_splits,
            ..KvCacheOptions::from(VariantOptions {
                causal: true,
                ..VariantOptions::default()
            })
        },
    )
    .unwrap();
    Paged {
        q: Inputs::new(random(p.q_len(), seed), dtype),
        k: Inputs::new(random(p.k_cache_len(), seed + 1), dtype),
        v: Inputs::new(random(p.v_cache_len(), seed + 2), dtype),
        p,
    }
}

fn on_gpu(c: &Paged) -> flashport_core::Result<(Buffer, Buffer)> {
    let dt = c.p.dtype();
    let inputs = [c.q.slice(dt), c.k.slice(dt), c.v.slice(dt)].map(Input::Host);
    let r = attention_with_kvcache_arrays(
        Device::Gpu(Gpu::Best),
        &c.p,
        inputs,
        &VariantArrays::default(),
        Placement::Host,
    )?;
    Ok((r.out.into_host()?, r.lse.into_host()?))
}

/// The relative errors of the GPU's out and lse against the reference.
fn errors(c: &Paged) -> (f64, f64) {
    let mut p64 = c.p.clone();
    p64.attention.dtype = DType::F64;
    let want = cpu::decode::attention_with_kvcache(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let (out, lse) = on_gpu(c).unwrap();
    (
        rel_err(&as_f64(&out), &as_f64(&want.out)),
        rel_err(&as_f64(&lse), &as_f64(&want.lse)),
    )
}

/// The decode kernels this adapter runs, as the overrides that pick each:
/// the default (the subgroup kernel where the adapter's subgroups have a
/// known size), the subgroup kernel with 8 keys per pass in a workgroup of
/// one subgroup, with walkers of half a subgroup, with and without the
/// next pass's loads prefetched, and the workgroup kernel (no subgroups).
fn kernels() -> Vec<(&'static str, Overrides)> {
    let base = overrides::current();
    let mut all = vec![("default", base)];
    if let Some(size) = gpu::testing::subgroup_size().unwrap() {
        all.push((
            "subgroup, 8 keys, one subgroup",
            Overrides {
                decode_keys: Some(8),
                decode_workgroup: Some(size),
                ..base
            },
        ));
        all.push((
            "subgroup, walkers of half a subgroup",
            Overrides {
                decode_lanes: Some(size / 2),
                ..base
            },
        ));
        for (name, prefetch) in [
            ("subgroup, prefetching", true),
            ("subgroup, no prefetch", false),
        ] {
            all.push((
                name,
                Overrides {
                    decode_prefetch: Some(prefetch),
                    ..base
                },
            ));
        }
    }
    all.push((
        "workgroup",
        Overrides {
            no_subgroups: true,
            ..base
        },
    ));
    all
}

/// Runs `f` once per decode kernel, with its name.
fn on_every_kernel(mut f: impl FnMut(&str)) {
    for (name, o) in kernels() {
        overrides::with(o, || f(name));
    }
}

#[test]
fn the_subgroup_kernel_runs_where_subgroups_have_a_known_size() {
    if !gpu_present() {
        return;
    }
    let c = paged((4, 1, 1, 128, 128), &[200, 77], 16, DType::F32, None, 3);
    let (kernel, _) = gpu::testing::decode_plan(&c.p).unwrap();
    eprintln!("{kernel:?}");
    if gpu::testing::subgroup_size().unwrap().is_some() {
        assert!(matches!(kernel, DecodeKernel::Subgroup(_)), "{kernel:?}");
    } else {
        assert!(matches!(kernel, DecodeKernel::Workgroup(_)), "{kernel:?}");
    }
    let none = Overrides {
        no_subgroups: true,
        ..overrides::current()
    };
    let (kernel, _) = overrides::with(none, || gpu::testing::decode_plan(&c.p)).unwrap();
    assert!(matches!(kernel, DecodeKernel::Workgroup(_)), "{kernel:?}");
}

#[test]
fn paged_decode_matches_the_reference() {
    if !gpu_present() {
        return;
    }
    // GQA 4:1 with two query rows (chunked prefill), blocks of 5 keys,
    // one empty sequence; then plain decode of d = 128 in blocks of 16;
    // then 8 rows of d = 20 (element by element) over 83 keys, and the
    // head dimensions that give a lane of 8-lane walkers 2 and 3 vec4s.
    let shapes: [(Heads, &[i64], usize); 5] = [
        ((8, 2, 2, 32, 24), &[37, 0, 48], 5),
        ((4, 1, 1, 128, 128), &[200, 77], 16),
        ((16, 2, 1, 20, 20), &[83], 7),
        ((2, 1, 1, 64, 64), &[130], 16),
        ((4, 2, 1, 96, 72), &[50, 33], 8),
    ];
    on_every_kernel(|kernel| {
        for (heads, lens, block_size) in shapes {
            for (dtype, tol) in [(DType::F32, 2e-5), (DType::F16, 2e-3)] {
                for splits in [None, Some(1), Some(3), Some(40)] {
                    let c = paged(heads, lens, block_size, dtype, splits, 31);
                    let (out, lse) = errors(&c);
                    assert!(
                        out <= tol && lse <= tol,
                        "{kernel}: {heads:?} {lens:?} {dtype:?} splits {splits:?}: out {out:e}, \
                         lse {lse:e}"
                    );
                }
            }
        }
    });
}

#[test]
fn decode_is_bitwise_reproducible() {
    if !gpu_present() {
        return;
    }
    let c = paged((8, 2, 3, 40, 16), &[61, 30, 9], 3, DType::F32, None, 41);
    on_every_kernel(|kernel| {
        let (a, b) = (on_gpu(&c).unwrap(), on_gpu(&c).unwrap());
        assert_eq!(bits(&a.0), bits(&b.0), "{kernel}");
        assert_eq!(bits(&a.1), bits(&b.1), "{kernel}");
    });
}

#[test]
fn decode_past_the_loop_limit_is_split_or_refused() {
    if !gpu_present() {
        return;
    }
    // One sequence of 40000 keys over 8 key/value heads: the default
    // splits keep every workgroup within the driver's loop limit. (The
    // subgroup kernel makes a pass per walker's keys, far fewer: it takes
    // the sequence in one split, checked below.)
    let heads = (8, 8, 1, 16, 16);
    let c = paged(heads, &[40000], 512, DType::F32, None, 51);
    let one = paged(heads, &[40000], 512, DType::F32, Some(1), 51);
    on_every_kernel(|kernel| {
        let (out, lse) = errors(&c);
        assert!(
            out <= 2e-5 && lse <= 2e-5,
            "{kernel}: out {out:e}, lse {lse:e}"
        );
        // (The workgroup kernel refuses one split where the limit is.)
        if let Ok((DecodeKernel::Subgroup(_), _)) = gpu::testing::decode_plan(&one.p) {
            let (out, lse) = errors(&one);
            assert!(
                out <= 2e-5 && lse <= 2e-5,
                "{kernel}: out {out:e}, lse {lse:e}"
            );
        }
    });
    // The workgroup kernel in one split passes the limit: refused.
    let workgroup = Overrides {
        no_subgroups: true,
        ..overrides::current()
    };
    overrides::with(workgroup, || {
        if gpu::testing::adapter_caps().unwrap().loop_limit.is_none() {
            eprintln!("NOT TESTED: this adapter's driver has no loop limit");
            let (out, lse) = errors(&one);
            assert!(out <= 2e-5 && lse <= 2e-5, "out {out:e}, lse {lse:e}");
            return;
        }
        match on_gpu(&one) {
            Err(Error::TooLarge(m)) => assert!(m.contains("num_splits=2 or more"), "{m}"),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    });
}
