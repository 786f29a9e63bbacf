//! Attention of a few query rows against a cache of keys and values
//! (decoding, chunked prefill, speculative verification), contiguous per
//! sequence or paged through a block table, on the CPU or the GPU.
//!
//! # What is computed
//!
//! Sequence `b` holds `len = cache_seqlens[b]` keys; its query row `i` is
//! at position `len - seq_q + i` (the queries are the last `seq_q` tokens
//! of the sequence), so `causal`, the window and ALiBi mean exactly what
//! they mean for [`crate::attention()`] with `seq_k = len` and the default,
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

use crate::array::{check_len, Array, Input, Placement};
use crate::device::{resolve, Device};
use crate::error::Result;
use crate::output::ForwardOutput;
use crate::problem::KvCacheProblem;
use crate::variants::VariantArrays;
use crate::{cpu, gpu};

// The split policy lives below the backends (`crate::splits`), which
// both use; this module dispatches.
pub use crate::splits::{cpu_splits, split_keys, CPU_MIN_SPLIT_KEYS, CPU_TASKS, SPLIT_GRANULE};

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
    variants.check_kvcache(problem)?;
    let named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)];
    let on_host = || {
        Ok(match device {
            Device::Auto => Device::Cpu,
            concrete => concrete,
        })
    };
    match resolve(device, on_host, &named, outputs)? {
        Device::Gpu(g) => gpu::decode::attention_with_kvcache(
            g,
            problem,
            [q, k_cache, v_cache],
            variants,
            outputs,
        ),
        _ => {
            let [q, k, v] = named.map(|(name, input)| crate::device::on_host(name, input));
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
    use crate::problem::{validate_kvcache, ArrayInfo, IntArray, KvCacheOptions};

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
