//! Attention of a few query rows against a cache of keys and values
//! (decoding, chunked prefill, speculative verification), contiguous per
//! sequence or paged through a block table, on the CPU or the GPU.
//!
//! # What is computed
//!
//! Sequence `b` holds `len = cache_seqlens[b]` keys; its query row `i` is
//! at position `len - seq_q + i` (the queries are the last `seq_q` tokens
//! of the sequence), so `causal`, the window and ALiBi mean exactly what
//! they mean for [`crate::attention`] with `seq_k = len` and the default,
//! bottom-right positions: [`KvCacheProblem::sequence`] is that problem.
//! Keys at or past `len` are never read.
//!
//! # Split-KV (Flash-Decoding)
//!
//! With few query rows the work per (sequence, key/value head) is one long
//! walk over its keys. The keys a sequence's rows see
//! ([`KvCacheProblem::keys_read`]) are cut into `splits` consecutive
//! ranges ([`split_keys`]); each split's attention state `(o, lse)` is
//! computed on its own (CPU tasks, GPU workgroups) and the states are
//! merged in split order by the arithmetic of [`crate::merge`], with the
//! sink logit (if any) as one more part whose output is 0. The split count
//! depends on the arguments only ([`cpu_splits`], and on the GPU
//! `gpu::decode::select::gpu_splits` of the shape and the adapter), never
//! on the thread count or on timing, so the bits are reproducible.

use std::ops::Range;

use crate::problem::KvCacheProblem;
use crate::{
    check_len, cpu, gpu, resolve, Array, Device, Error, ForwardOutput, Input, Placement, Result,
    VariantArrays,
};

/// Split boundaries fall on multiples of this many keys from the start of
/// the keys read, so that tiles stay whole inside a split.
pub const SPLIT_GRANULE: usize = 16;

/// The keys of split `s` of `splits` of `keys`: consecutive ranges of
/// `ceil(keys.len() / splits)` keys rounded up to [`SPLIT_GRANULE`], the
/// last ones empty when there are more splits than that makes.
pub fn split_keys(keys: Range<usize>, splits: usize, s: usize) -> Range<usize> {
    let per = keys
        .len()
        .div_ceil(splits.max(1))
        .next_multiple_of(SPLIT_GRANULE);
    let start = keys.start + (s * per).min(keys.len());
    start..(start + per).min(keys.end)
}

/// Tasks the CPU's default split count aims for: enough for the threads of
/// a large machine to finish together when sequences differ in length.
pub const CPU_TASKS: usize = 16;

/// The fewest keys a CPU split gets from the default: a split costs a
/// task hand-over and a partial state to merge.
pub const CPU_MIN_SPLIT_KEYS: usize = 256;

/// The CPU's key splits per sequence: the caller's, else enough for about
/// [`CPU_TASKS`] tasks over (sequence, key/value head, split), with no
/// split under [`CPU_MIN_SPLIT_KEYS`] keys of the longest sequence. A
/// function of the shape only (not of the thread count, which must not
/// change the bits).
pub fn cpu_splits(p: &KvCacheProblem) -> usize {
    if let Some(n) = p.num_splits {
        return n;
    }
    let heads = (p.batch() * p.heads_kv()).max(1);
    let longest = (0..p.batch())
        .map(|b| p.keys_read(b).len())
        .max()
        .unwrap_or(0);
    let by_tasks = CPU_TASKS.div_ceil(heads);
    let by_keys = (longest / CPU_MIN_SPLIT_KEYS).max(1);
    by_tasks.min(by_keys).max(1)
}

/// Checks the variant arrays against the problem: no mask (the cache's
/// lengths are the mask), slopes and sinks of the validated sizes.
pub(crate) fn check_variants(p: &KvCacheProblem, variants: &VariantArrays<'_>) -> Result<()> {
    let a = &p.attention;
    let slopes = match a.alibi_per_batch {
        None => None,
        Some(true) => Some(a.batch * a.heads_q),
        Some(false) => Some(a.heads_q),
    };
    let sinks = a.sinks.then_some(a.heads_q);
    if variants.mask.is_some()
        || slopes != variants.alibi_slopes.map(<[f64]>::len)
        || sinks != variants.sinks.map(<[f64]>::len)
    {
        return Err(Error::Shape(
            "the variant arrays do not match the validated problem".to_string(),
        ));
    }
    Ok(())
}

/// Runs a validated `attention_with_kvcache` on `[q, k_cache, v_cache]`,
/// host or device arrays, leaving the outputs where `outputs` says.
/// Device inputs or outputs run on the GPU; `Device::Auto` computes host
/// arrays on the CPU (decoding reads each cached value once, so copying
/// the cache to a GPU costs more than the CPU's walk over it).
pub fn attention_with_kvcache_arrays(
    device: Device,
    problem: &KvCacheProblem,
    [q, k_cache, v_cache]: [Input<'_>; 3],
    variants: &VariantArrays<'_>,
    outputs: Placement,
) -> Result<ForwardOutput<Array>> {
    let dtype = problem.dtype();
    check_len("q", &q, problem.q_len(), dtype)?;
    check_len("k_cache", &k_cache, problem.k_cache_len(), dtype)?;
    check_len("v_cache", &v_cache, problem.v_cache_len(), dtype)?;
    check_variants(problem, variants)?;
    let named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)];
    let on_host = || {
        Ok(match device {
            Device::Auto => Device::Cpu,
            concrete => concrete,
        })
    };
    match resolve(device, on_host, &named, outputs)? {
        Device::Gpu => {
            gpu::decode::attention_with_kvcache(problem, [q, k_cache, v_cache], variants, outputs)
        }
        _ => {
            let [q, k, v] = named.map(|(name, input)| crate::on_host(name, input));
            let r = cpu::decode::attention_with_kvcache(problem, q?, k?, v?, variants)?;
            Ok(ForwardOutput {
                out: Array::Host(r.out),
                lse: Array::Host(r.lse),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_kvcache, IntArray, KvCacheOptions};
    use crate::ArrayInfo;

    #[test]
    fn splits_cover_the_keys_in_order_on_the_granule() {
        for (keys, splits) in [
            (0..0, 3),
            (0..1, 1),
            (0..100, 1),
            (0..100, 3),
            (5..1000, 7),
            (40..41, 64),
            (0..4096, 128),
        ] {
            let ranges: Vec<_> = (0..splits)
                .map(|s| split_keys(keys.clone(), splits, s))
                .collect();
            let mut next = keys.start;
            for r in &ranges {
                assert!(
                    r.start == next || r.is_empty(),
                    "{keys:?} / {splits}: {ranges:?}"
                );
                assert!(r.start <= r.end && r.end <= keys.end.max(keys.start));
                if !r.is_empty() {
                    assert_eq!((r.start - keys.start) % SPLIT_GRANULE, 0);
                    next = r.end;
                }
            }
            assert_eq!(next, keys.end, "{keys:?} / {splits}: {ranges:?}");
        }
    }

    fn problem(
        batch: usize,
        heads_kv: usize,
        lens: &[i64],
        num_splits: Option<i128>,
    ) -> KvCacheProblem {
        let q = [batch, 4 * heads_kv, 1, 64];
        let cache = [batch, heads_kv, 1 << 20, 64];
        validate_kvcache(
            ArrayInfo::new(&q, "float32"),
            ArrayInfo::new(&cache, "float32"),
            ArrayInfo::new(&cache, "float32"),
            IntArray {
                shape: &[batch],
                dtype: "int32",
                values: lens,
            },
            None,
            &KvCacheOptions {
                num_splits,
                ..KvCacheOptions::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn cpu_splits_follow_the_shape_only() {
        // One sequence of 8 key/value heads and a long cache: 2 splits make
        // 16 tasks.
        assert_eq!(cpu_splits(&problem(1, 8, &[32768], None)), 2);
        // One head: 16 splits, unless the keys are few.
        assert_eq!(cpu_splits(&problem(1, 1, &[32768], None)), 16);
        assert_eq!(cpu_splits(&problem(1, 1, &[1000], None)), 3);
        assert_eq!(cpu_splits(&problem(1, 1, &[10], None)), 1);
        // Many sequences: no split.
        assert_eq!(cpu_splits(&problem(8, 8, &[4096; 8], None)), 1);
        // The caller's count, whatever the shape.
        assert_eq!(cpu_splits(&problem(8, 8, &[4096; 8], Some(5))), 5);
        assert_eq!(cpu_splits(&problem(1, 1, &[0], Some(300))), 300);
    }
}
