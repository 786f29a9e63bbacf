//! A KV cache's swap space: host memory for the blocks of sequences
//! swapped out of its pools, `swap_blocks` blocks of every layer's keys
//! and values, in the pools' layout and dtype. The bookkeeping (which host
//! block holds what, and their counts) is the block manager's
//! ([`crate::blocks::swap_pool`]); this holds the values.
//!
//! It is zeroed memory that is committed as blocks are written (as the
//! CPU's pools are), checked at construction against what the machine
//! gives a process: a separate budget from the pools, as vLLM's CPU swap
//! space is, on the CPU too.

use super::cpu_storage::{gather_layers, pool, scatter_layers};
use crate::array::Buffer;
use crate::blocks::CacheShape;
use crate::error::{Error, Result};

#[derive(Debug)]
pub struct SwapSpace {
    shape: CacheShape,
    /// Per layer, `(swap_blocks, heads_kv, block_size, dim)`.
    keys: Vec<Buffer>,
    values: Vec<Buffer>,
}

impl SwapSpace {
    pub fn new(shape: CacheShape) -> Result<SwapSpace> {
        let total = shape.swap_nbytes().expect("validated") as u128;
        if total > 0 && !crate::host_memory::admits(total) {
            return Err(Error::TooLarge(format!(
                "a swap space of {} block(s) takes {total} bytes of host memory, more than \
                 this machine has{}; use fewer swap_blocks",
                shape.swap_blocks,
                crate::host_memory::why()
            )));
        }
        let (ks, vs) = shape.block_lens();
        let layers = if shape.swap_blocks == 0 {
            0
        } else {
            shape.layers
        };
        let mut keys = Vec::with_capacity(layers);
        let mut values = Vec::with_capacity(layers);
        for _ in 0..layers {
            keys.push(pool(shape.dtype, ks * shape.swap_blocks)?);
            values.push(pool(shape.dtype, vs * shape.swap_blocks)?);
        }
        Ok(SwapSpace {
            shape,
            keys,
            values,
        })
    }

    /// Keeps `data` (per layer the keys and values of the blocks, as
    /// [`crate::blocks::Storage::read_blocks`] gives them) in host blocks
    /// `blocks`.
    pub fn store(&mut self, blocks: &[usize], data: &[(Buffer, Buffer)]) {
        let lens = self.shape.block_lens();
        scatter_layers(&mut self.keys, &mut self.values, lens, blocks, data);
    }

    /// Host blocks `blocks`, laid out as [`Self::store`] takes them.
    pub fn load(&self, blocks: &[usize]) -> Result<Vec<(Buffer, Buffer)>> {
        let lens = self.shape.block_lens();
        gather_layers(&self.keys, &self.values, self.shape.dtype, lens, blocks)
    }
}
