//! The identity of a full block's contents for prefix reuse: a hash
//! chained over the prefix (vLLM's `hash_block_tokens`).
//!
//! Block `i` of a sequence whose tokens are `t` has the hash
//! `h_i = H(h_{i-1}, t[i·bs .. (i+1)·bs])`, with `h_{-1}` the root: the
//! hash of the cache's identity (its layer count, heads, head dimensions,
//! block size and dtype, the "layer set" a block's data spans). Two blocks
//! at the same position after the same tokens have the same hash; the
//! chain makes a block's hash depend on every token before it, so equal
//! hashes mean equal whole prefixes, not just equal blocks.
//!
//! `H` is 128 bits: two `DefaultHasher` states (SipHash-1-3 today; fixed
//! keys) fed the same words under different domain tags. Hashes never leave
//! the process, so the algorithm need only be stable within one build; a
//! false match of two different prefixes needs a 128-bit collision (about
//! `n² / 2¹²⁹` for `n` distinct prefixes).

use std::hash::{DefaultHasher, Hasher};

use crate::problem::DType;

/// The hash of a block's whole prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// What a block's data spans, hashed into the root of every chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheIdentity {
    pub layers: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub block_size: usize,
    pub dtype: DType,
}

fn hash128(words: impl Iterator<Item = u64> + Clone) -> BlockHash {
    let half = |tag: u64| {
        let mut h = DefaultHasher::new();
        h.write_u64(tag);
        for w in words.clone() {
            h.write_u64(w);
        }
        h.finish()
    };
    BlockHash(
        (u128::from(half(0x6b76_6361_6368_6531)) << 64) | u128::from(half(0x6b76_6361_6368_6532)),
    )
}

impl CacheIdentity {
    /// The parent hash of every sequence's block 0.
    pub fn root(&self) -> BlockHash {
        let dtype = match self.dtype {
            DType::F16 => 16,
            // Not 16: a bfloat16 cache's blocks are not a float16 one's.
            DType::BF16 => 17,
            DType::F32 => 32,
            DType::F64 => 64,
        };
        let words = [
            self.layers,
            self.heads_kv,
            self.head_dim,
            self.head_dim_v,
            self.block_size,
            dtype,
        ];
        hash128(words.into_iter().map(|w| w as u64))
    }
}

/// The hash of a full block holding `tokens` after the prefix whose last
/// block hashed to `parent` (the root for block 0).
pub fn chain(parent: BlockHash, tokens: &[i64]) -> BlockHash {
    let words = [
        (parent.0 >> 64) as u64,
        parent.0 as u64,
        tokens.len() as u64,
    ];
    hash128(words.into_iter().chain(tokens.iter().map(|&t| t as u64)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(layers: usize) -> CacheIdentity {
        CacheIdentity {
            layers,
            heads_kv: 2,
            head_dim: 8,
            head_dim_v: 8,
            block_size: 4,
            dtype: DType::F32,
        }
    }

    #[test]
    fn the_chain_depends_on_every_earlier_token_and_the_identity() {
        let root = identity(2).root();
        let a = chain(root, &[1, 2, 3, 4]);
        let b = chain(a, &[5, 6, 7, 8]);
        // Deterministic.
        assert_eq!(a, chain(identity(2).root(), &[1, 2, 3, 4]));
        assert_eq!(b, chain(a, &[5, 6, 7, 8]));
        // The same block after a different prefix differs.
        let a2 = chain(root, &[1, 2, 3, 9]);
        assert_ne!(chain(a2, &[5, 6, 7, 8]), b);
        // Order matters; so does the cache's layer set.
        assert_ne!(chain(root, &[2, 1, 3, 4]), a);
        assert_ne!(chain(identity(3).root(), &[1, 2, 3, 4]), a);
        // A block is not its parent: no chain is a fixed point.
        assert_ne!(a, root);
        assert_ne!(chain(root, &[]), root);
    }

    #[test]
    fn negative_and_large_token_ids_are_distinct() {
        let root = identity(1).root();
        let ids = [0, 1, -1, i64::MAX, i64::MIN, 1 << 32];
        let hashes: Vec<_> = ids.iter().map(|&t| chain(root, &[t])).collect();
        for i in 0..hashes.len() {
            for j in 0..i {
                assert_ne!(hashes[i], hashes[j], "{} vs {}", ids[i], ids[j]);
            }
        }
    }
}
