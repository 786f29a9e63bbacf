// Tokens into the blocks of a KV cache's pool (src/gpu/kv_pool.rs): an
// append's new keys or values, `src` (heads, n, dim) row-major, into their
// slots of the paged layout (blocks, heads, block_size, dim). A block
// copied for copy-on-write is the same move, its own (heads, block_size,
// dim) elements being the source. One invocation per element written; the
// host prepends lib/grid.wgsl.
//
// Elements move as bits, float32 or float16. Float16 elements are packed
// in pairs into u32 words (low half first, as the attention kernels read
// them), and the other half of a written word may be another invocation's
// element or another slot's (which must survive): the pool is bound as
// atomics, so each invocation replaces only its own half and no
// read-modify-write of a neighbour can undo it.

struct Scatter {
    // Tokens per head in `src`.
    n: u32,
    // Slots written: entries of `slots`.
    count: u32,
    heads: u32,
    dim: u32,
    block_size: u32,
    // Elements of `src` before its first token (a source bound from an
    // aligned offset).
    src_delta: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> u: Scatter;
@group(0) @binding(1) var<storage, read> src: array<u32>;
// Per slot written, three words: the source token, the block (counted
// from the first block of the bound pool buffer) and the slot in it.
@group(0) @binding(2) var<storage, read> slots: array<u32>;
@group(0) @binding(3) var<storage, read_write> pool: array<atomic<u32>>;

// Element `e` of the move (head-major, then slot, then column) as its
// source and pool element indices; none when past the move.
fn element(e: u32) -> vec2<u32> {
    let c = e % u.dim;
    let i = (e / u.dim) % u.count;
    let h = e / (u.dim * u.count);
    let token = slots[3u * i];
    let block = slots[3u * i + 1u];
    let slot = slots[3u * i + 2u];
    let src_at = u.src_delta + (h * u.n + token) * u.dim + c;
    let dst_at = ((block * u.heads + h) * u.block_size + slot) * u.dim + c;
    return vec2(src_at, dst_at);
}

@compute @workgroup_size(WG)
fn scatter_f32(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = invocation(wid, groups, lid);
    if e >= u.heads * u.count * u.dim {
        return;
    }
    let m = element(e);
    atomicStore(&pool[m.y], src[m.x]);
}

@compute @workgroup_size(WG)
fn scatter_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = invocation(wid, groups, lid);
    if e >= u.heads * u.count * u.dim {
        return;
    }
    let m = element(e);
    let bits = (src[m.x >> 1u] >> ((m.x & 1u) * 16u)) & 0xffffu;
    let shift = (m.y & 1u) * 16u;
    atomicAnd(&pool[m.y >> 1u], ~(0xffffu << shift));
    atomicOr(&pool[m.y >> 1u], bits << shift);
}
