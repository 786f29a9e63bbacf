//! Where a KV cache's keys and values live, behind the small interface
//! the bookkeeping needs: write new tokens into their slots, copy whole
//! blocks (copy-on-write), run paged attention over one layer's pools, and
//! read a layer back.
//!
//! The CPU keeps the pools in host memory
//! ([`crate::kvcache::cpu_storage`]). The GPU's storage (`gpu/kv_pool.rs`)
//! implements the same calls on device buffers: the writes as a
//! scatter shader over the plan's [`WriteRun`]s, the copies as buffer
//! copies between block ranges, and the attention as the GPU's
//! `attention_with_kvcache` on the layer's pools with the block table the
//! cache builds; nothing above this trait changes.

use super::plan::{BlockCopy, WriteRun};
use crate::array::{Array, Buffer, Input, Placement};
use crate::error::Result;
use crate::output::ForwardOutput;
use crate::problem::KvCacheProblem;
use crate::variants::VariantArrays;

/// The pools of every layer: per layer a key pool `(num_blocks, heads_kv,
/// block_size, head_dim)` and a value pool `(..., head_dim_v)`, row-major.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Where the pools live: `"cpu"` or `"gpu:N"`.
    fn device(&self) -> String;

    /// Copies each `src` block's keys and values, on every layer, into its
    /// `dst` block, in order.
    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<()>;

    /// Writes `n` new tokens per row of `layer`, for `rows.len()` rows
    /// (sequences): `k` is `(rows.len(), heads_kv, n, head_dim)` and `v`
    /// `(rows.len(), heads_kv, n, head_dim_v)`, row-major in the cache's
    /// dtype (validated; one row is a single append's `(heads_kv, n, ...)`).
    /// The runs of `rows[r]` take their tokens from row `r`; each run's
    /// tokens go to consecutive slots of a block, and no two runs write the
    /// same slot. Costs O(the tokens written).
    fn write(
        &mut self,
        layer: usize,
        n: usize,
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()>;

    /// An append's (or a batch's) storage work: `copies` (see
    /// [`Self::copy_blocks`]), then the writes (see [`Self::write`]). A
    /// storage that records both before running either (the GPU, in one
    /// submission) runs none of it when recording fails.
    fn append(
        &mut self,
        layer: usize,
        n: usize,
        copies: &[BlockCopy],
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        self.copy_blocks(copies)?;
        self.write(layer, n, rows, k, v)
    }

    /// `attention_with_kvcache` of `q` over `layer`'s pools, as the
    /// validated `problem` (paged, with the sequences' block table and
    /// lengths) says; the outputs stay where `outputs` says.
    fn attention(
        &self,
        layer: usize,
        problem: &KvCacheProblem,
        q: Input<'_>,
        variants: &VariantArrays<'_>,
        outputs: Placement,
    ) -> Result<ForwardOutput<Array>>;

    /// Copies of `layer`'s key and value pools, in host memory.
    fn read(&self, layer: usize) -> Result<(Buffer, Buffer)>;

    /// Host copies of `blocks` on every layer (swapping out): per layer the
    /// keys and the values of the blocks in order, each block `(heads_kv,
    /// block_size, dim)` row-major. The GPU reads them in one submission.
    fn read_blocks(&self, blocks: &[usize]) -> Result<Vec<(Buffer, Buffer)>>;

    /// Writes `data`, laid out as [`Self::read_blocks`] gives it, into
    /// `blocks` on every layer (swapping in). The GPU records it in one
    /// submission, queued without waiting; when recording fails nothing is
    /// written.
    fn write_blocks(&mut self, blocks: &[usize], data: &[(Buffer, Buffer)]) -> Result<()>;
}
