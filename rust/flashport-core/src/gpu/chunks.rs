//! Splitting a problem into dispatches whose every binding fits the
//! adapter's `max_storage_buffer_binding_size` (and `max_buffer_size`),
//! and whose grid fits `max_compute_workgroups_per_dimension`.

use super::context::Context;
use crate::error::{Error, Result};
use crate::overrides::Overrides;
use crate::problem::Problem;

/// The largest binding a chunk may use: the adapter's (and its largest
/// buffer's), or less where the overrides say, a multiple of 4 bytes.
pub(crate) fn binding_limit(ctx: &Context, overrides: &Overrides) -> u64 {
    let adapter = ctx
        .limits
        .max_storage_buffer_binding_size
        .min(ctx.limits.max_buffer_size);
    overrides
        .binding_limit
        .map_or(adapter, |cap| cap.min(adapter))
        & !3
}

/// A slice of the heads that one set of bindings covers: key/value heads
/// `kv0..kv0 + kv_count` (flat over batch) and, of each one's GQA group,
/// query heads `g0..g0 + g_count`. A group is cut (`g_count < group`) only
/// when a single key/value head with its whole group is too large; then
/// `kv_count == 1` and dK/dV of that head are summed over the cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub kv0: usize,
    pub kv_count: usize,
    pub g0: usize,
    pub g_count: usize,
}

impl Chunk {
    /// The first query head (flat over batch); the chunk's query heads are
    /// contiguous from there.
    pub fn q0(&self, group: usize) -> usize {
        self.kv0 * group + self.g0
    }
    pub fn q_count(&self) -> usize {
        self.kv_count * self.g_count
    }
}

fn too_large(p: &Problem, what: &str, limit: u64) -> Error {
    Error::TooLarge(format!(
        "{what} needs a GPU binding larger than this adapter allows ({limit} bytes) \
         even when split by heads (batch={}, heads={}/{}, seq_q={}, seq_k={}, d={}, d_v={}); \
         use device=\"cpu\"",
        p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim, p.value_dim
    ))
}

/// Plans the chunks of `p` for bindings of at most `limit` bytes and grids
/// of at most `max_dim` workgroups along y. Sizes are those of the widest
/// binding, an f32 one: inputs are never wider than outputs.
pub(crate) fn plan(p: &Problem, limit: u64, max_dim: u32) -> Result<Vec<Chunk>> {
    let kv_heads = p.batch * p.heads_kv;
    let group = p.group_size();
    let width = p.head_dim.max(p.value_dim).max(1) as u64;
    // The backward's full score gradient (for the mask's) is bound per
    // query head too.
    let scores = if p.return_dmask { p.seq_k as u64 } else { 0 };
    let per_q_head = 4 * p.seq_q as u64 * width.max(scores);
    let per_kv_head = 4 * p.seq_k as u64 * width;
    let max_dim = max_dim.max(1) as usize;
    if kv_heads == 0 {
        return Ok(Vec::new());
    }
    if per_kv_head > limit {
        return Err(too_large(p, "one key/value head", limit));
    }
    if per_q_head > limit {
        return Err(too_large(p, "one query head", limit));
    }

    let per_group = (group as u64 * per_q_head).max(per_kv_head).max(1);
    let whole = ((limit / per_group) as usize)
        .min(kv_heads)
        .min(max_dim / group);
    let mut chunks = Vec::new();
    if whole >= 1 {
        let mut kv0 = 0;
        while kv0 < kv_heads {
            let kv_count = whole.min(kv_heads - kv0);
            chunks.push(Chunk {
                kv0,
                kv_count,
                g0: 0,
                g_count: group,
            });
            kv0 += kv_count;
        }
    } else {
        let cut = ((limit / per_q_head.max(1)) as usize)
            .min(group)
            .min(max_dim);
        debug_assert!(cut >= 1);
        for kv0 in 0..kv_heads {
            let mut g0 = 0;
            while g0 < group {
                let g_count = cut.min(group - g0);
                chunks.push(Chunk {
                    kv0,
                    kv_count: 1,
                    g0,
                    g_count,
                });
                g0 += g_count;
            }
        }
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_forward, ArrayInfo, Options};

    fn problem(q: &[usize], k: &[usize]) -> Problem {
        validate_forward(
            ArrayInfo::new(q, "float32"),
            ArrayInfo::new(k, "float32"),
            ArrayInfo::new(k, "float32"),
            &Options::default(),
        )
        .unwrap()
    }

    fn covers(p: &Problem, chunks: &[Chunk]) {
        let g = p.group_size();
        let mut next_q = 0;
        for c in chunks {
            assert_eq!(c.q0(g), next_q, "{chunks:?}");
            next_q += c.q_count();
        }
        assert_eq!(next_q, p.batch * p.heads_q);
    }

    #[test]
    fn one_chunk_when_everything_fits() {
        let p = problem(&[2, 8, 100, 64], &[2, 2, 50, 64]);
        let c = plan(&p, 1 << 27, 65535).unwrap();
        assert_eq!(c.len(), 1);
        covers(&p, &c);
    }

    #[test]
    fn splits_by_whole_groups_then_within_a_group() {
        let p = problem(&[2, 8, 100, 64], &[2, 2, 50, 64]);
        // One group: 4 query heads × 100 rows × 64 × 4 B = 102400 B.
        let c = plan(&p, 102_400, 65535).unwrap();
        assert_eq!(c.len(), 4);
        assert!(c.iter().all(|c| c.kv_count == 1 && c.g_count == 4));
        covers(&p, &c);
        let c = plan(&p, 60_000, 65535).unwrap();
        assert!(c.iter().all(|c| c.kv_count == 1 && c.g_count <= 2));
        covers(&p, &c);
        assert!(matches!(plan(&p, 1000, 65535), Err(Error::TooLarge(_))));
    }

    #[test]
    fn respects_the_grid_limit() {
        let p = problem(&[1, 40, 3, 8], &[1, 10, 3, 8]);
        let c = plan(&p, 1 << 27, 8).unwrap();
        assert!(c.iter().all(|c| c.q_count() <= 8 && c.kv_count <= 8));
        covers(&p, &c);
    }
}
