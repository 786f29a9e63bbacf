//! The geometry of a KV cache, validated from the constructor's
//! arguments: every layer holds a key pool `(num_blocks, heads_kv,
//! block_size, head_dim)` and a value pool `(num_blocks, heads_kv,
//! block_size, head_dim_v)`, the paged layout of `attention_with_kvcache`.

use super::hash::CacheIdentity;
use crate::error::{shape_str, Error, Result};
use crate::problem::DType;

/// What a KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub layers: usize,
    pub dtype: DType,
    /// Host blocks of the swap space (0: none), each one block of every
    /// layer's keys and values.
    pub swap_blocks: usize,
}

/// The constructor's arguments as the caller gave them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheArgs<'a> {
    pub num_blocks: i64,
    pub block_size: i64,
    pub heads_kv: i64,
    pub head_dim: i64,
    /// `None`: `head_dim`.
    pub head_dim_v: Option<i64>,
    pub layers: i64,
    /// The NumPy dtype name.
    pub dtype: &'a str,
    /// Host blocks of the swap space, 0 or more.
    pub swap_blocks: i64,
}

fn at_least_one(argument: &str, value: i64, what: &str) -> Result<usize> {
    match usize::try_from(value) {
        Ok(v) if v >= 1 => Ok(v),
        _ => Err(Error::Value {
            argument: argument.to_string(),
            value: value.to_string(),
            reason: format!("{what} must be at least 1"),
        }),
    }
}

impl CacheShape {
    /// Validates the constructor's arguments: each size at least 1, a
    /// float dtype, and pools whose sizes fit in memory's address range.
    pub fn new(args: &CacheArgs<'_>) -> Result<CacheShape> {
        let shape = CacheShape {
            num_blocks: at_least_one("num_blocks", args.num_blocks, "the number of blocks")?,
            block_size: at_least_one("block_size", args.block_size, "a block's token count")?,
            heads_kv: at_least_one("heads_kv", args.heads_kv, "the number of key/value heads")?,
            head_dim: at_least_one("head_dim", args.head_dim, "the key head dimension")?,
            head_dim_v: at_least_one(
                "head_dim_v",
                args.head_dim_v.unwrap_or(args.head_dim),
                "the value head dimension",
            )?,
            layers: at_least_one("layers", args.layers, "the number of layers")?,
            dtype: DType::from_numpy_name(args.dtype).ok_or_else(|| Error::DType {
                argument: "dtype".to_string(),
                dtype: args.dtype.to_string(),
                reason: "a KV cache holds float16, float32 or float64".to_string(),
            })?,
            swap_blocks: usize::try_from(args.swap_blocks).map_err(|_| Error::Value {
                argument: "swap_blocks".to_string(),
                value: args.swap_blocks.to_string(),
                reason: "the swap space's block count must be 0 or more".to_string(),
            })?,
        };
        shape.nbytes().ok_or_else(|| {
            Error::TooLarge(format!(
                "a KV cache of {} layer(s) of key pools {} and value pools {} is larger than \
                 this machine can address",
                shape.layers,
                shape_str(&shape.k_pool_shape()),
                shape_str(&shape.v_pool_shape())
            ))
        })?;
        shape.swap_nbytes().ok_or_else(|| {
            Error::TooLarge(format!(
                "a swap space of {} block(s) of {} layer(s) is larger than this machine can \
                 address",
                shape.swap_blocks, shape.layers
            ))
        })?;
        Ok(shape)
    }

    /// `(num_blocks, heads_kv, block_size, head_dim)`.
    pub fn k_pool_shape(&self) -> [usize; 4] {
        [
            self.num_blocks,
            self.heads_kv,
            self.block_size,
            self.head_dim,
        ]
    }

    /// `(num_blocks, heads_kv, block_size, head_dim_v)`.
    pub fn v_pool_shape(&self) -> [usize; 4] {
        [
            self.num_blocks,
            self.heads_kv,
            self.block_size,
            self.head_dim_v,
        ]
    }

    fn elements(shape: [usize; 4]) -> Option<usize> {
        shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b))
    }

    /// Elements of one layer's key pool.
    pub fn k_pool_len(&self) -> usize {
        Self::elements(self.k_pool_shape()).expect("validated")
    }

    /// Elements of one layer's value pool.
    pub fn v_pool_len(&self) -> usize {
        Self::elements(self.v_pool_shape()).expect("validated")
    }

    /// Bytes of every layer's pools, if they fit an `isize`.
    pub fn nbytes(&self) -> Option<usize> {
        self.bytes_of(self.num_blocks)
    }

    /// Bytes of the swap space (`swap_blocks` blocks of every layer's keys
    /// and values), if they fit an `isize`.
    pub fn swap_nbytes(&self) -> Option<usize> {
        self.bytes_of(self.swap_blocks)
    }

    /// Elements of one block of one layer's keys and of its values.
    pub fn block_lens(&self) -> (usize, usize) {
        let per_head = self.heads_kv * self.block_size;
        (per_head * self.head_dim, per_head * self.head_dim_v)
    }

    fn bytes_of(&self, blocks: usize) -> Option<usize> {
        let block = [1, self.heads_kv, self.block_size, 1];
        let per_layer = Self::elements([blocks, block[1], block[2], self.head_dim])?.checked_add(
            Self::elements([blocks, block[1], block[2], self.head_dim_v])?,
        )?;
        let element = match self.dtype {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            DType::F64 => 8,
        };
        let total = per_layer.checked_mul(self.layers)?.checked_mul(element)?;
        (total <= isize::MAX as usize).then_some(total)
    }

    /// What a block's contents span, for the prefix hashes.
    pub fn identity(&self) -> CacheIdentity {
        CacheIdentity {
            layers: self.layers,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
            block_size: self.block_size,
            dtype: self.dtype,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> CacheArgs<'static> {
        CacheArgs {
            num_blocks: 8,
            block_size: 3,
            heads_kv: 2,
            head_dim: 5,
            head_dim_v: None,
            layers: 2,
            dtype: "float16",
            swap_blocks: 0,
        }
    }

    #[test]
    fn sizes_and_defaults() {
        let s = CacheShape::new(&args()).unwrap();
        assert_eq!(s.head_dim_v, 5);
        assert_eq!(s.k_pool_shape(), [8, 2, 3, 5]);
        assert_eq!(s.nbytes(), Some(2 * 2 * (8 * 2 * 3 * 5 * 2)));
        let s = CacheShape::new(&CacheArgs {
            head_dim_v: Some(7),
            ..args()
        })
        .unwrap();
        assert_eq!((s.v_pool_shape(), s.v_pool_len()), ([8, 2, 3, 7], 336));
    }

    #[test]
    fn errors_name_the_argument() {
        let cases: [(CacheArgs<'_>, &str); 7] = [
            (
                CacheArgs {
                    num_blocks: 0,
                    ..args()
                },
                "num_blocks=0",
            ),
            (
                CacheArgs {
                    block_size: -2,
                    ..args()
                },
                "block_size=-2",
            ),
            (
                CacheArgs {
                    heads_kv: 0,
                    ..args()
                },
                "heads_kv=0",
            ),
            (
                CacheArgs {
                    head_dim: 0,
                    ..args()
                },
                "head_dim=0",
            ),
            (
                CacheArgs {
                    head_dim_v: Some(0),
                    ..args()
                },
                "head_dim_v=0",
            ),
            (
                CacheArgs {
                    layers: 0,
                    ..args()
                },
                "layers=0",
            ),
            (
                CacheArgs {
                    dtype: "int32",
                    ..args()
                },
                "dtype has dtype int32",
            ),
        ];
        for (a, fragment) in cases {
            let e = CacheShape::new(&a).unwrap_err().to_string();
            assert!(e.contains(fragment), "{e}");
        }
        let huge = CacheArgs {
            num_blocks: i64::MAX,
            ..args()
        };
        assert!(matches!(CacheShape::new(&huge), Err(Error::TooLarge(_))));
    }
}
