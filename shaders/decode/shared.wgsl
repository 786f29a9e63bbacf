// What decoding's two kernels share, decode/decode.wgsl and
// decode/subgroup.wgsl (the host assembles each with this fragment): the
// uniform, the bindings other than the caches (decode/load_*.wgsl), where
// a key's cache row is, and which keys a split and a query row see.

// A paged cache: keys are found through the block table in `seq_data`.
override PAGED: bool = false;

// The variants the decode kernels compute are lib/variants.wgsl's
// SOFTCAP and ALIBI (the window is a uniform; sinks join in the combine
// pass).

// A KV cache's pool split over several buffers (src/gpu/decode/mod.rs):
// the dispatch binds one, and table entries NONE are blocks of the
// others, neither loaded nor seen here (another run of the dispatch sees
// them).
override SKIPS: bool = false;

// Mirrors `Uniform` in src/gpu/decode/mod.rs, word for word.
struct Decode {
    heads_q: u32,
    heads_kv: u32,
    group: u32,
    seq_q: u32,
    // group * seq_q: the rows of one (sequence, key/value head).
    rows: u32,
    row_blocks: u32,
    d: u32,
    dv: u32,
    // Keys per block (a contiguous cache: its capacity, one block per
    // sequence).
    block_size: u32,
    max_blocks: u32,
    splits: u32,
    causal: u32,
    // Window sides, NONE where unbounded; the host caps them at 2^30,
    // beyond every position.
    left: u32,
    right: u32,
    scale: f32,
    softcap: f32,
    // Word offsets in `seq_data`: the lengths of this dispatch's sequences,
    // their block-table rows (blocks counted from the first block bound),
    // the ALiBi slopes per (sequence, query head).
    seqlens_off: u32,
    table_off: u32,
    slopes_off: u32,
    // The first slot of this run's splits in part_o / part_lse (a pool
    // split over buffers runs once per buffer).
    split_base: u32,
    // Elements from the start of a cache binding to its first block.
    k_delta: u32,
    v_delta: u32,
    // Rows of this dispatch's output: sequences * heads_q * seq_q.
    out_rows: u32,
    pad1: u32,
}

const NONE: u32 = 0xffffffffu;
// The finite stand-in for a running maximum of -inf (lib/common.wgsl).
const NEG_BIG: f32 = -3.0e38;
const NEG_INF: u32 = 0xff800000u;

@group(0) @binding(0) var<uniform> u: Decode;
@group(0) @binding(1) var<storage, read> q: array<u32>;
@group(0) @binding(4) var<storage, read> seq_data: array<u32>;
@group(0) @binding(5) var<storage, read_write> part_o: array<f32>;
@group(0) @binding(6) var<storage, read_write> part_lse: array<u32>;

// The cache row (counted from the binding's first block) of key `key` of
// the dispatch's sequence `b`, key/value head `h`.
fn cache_row(b: u32, h: u32, key: u32) -> u32 {
    var block = b;
    var offset = key;
    if PAGED {
        block = seq_data[u.table_off + b * u.max_blocks + key / u.block_size];
        offset = key % u.block_size;
    }
    return (block * u.heads_kv + h) * u.block_size + offset;
}

// The cache row of key `key` when keys key .. key + count - 1 are all in
// one block and key < end, so that a pass finds its keys' rows with one
// table lookup (rows key - key0 further on); NONE otherwise, where the
// pass looks each key up (a pass that starts near a block's end, or one
// past the split's keys, whose table entry may not exist).
fn run_row(b: u32, h: u32, key: u32, end: u32, count: u32) -> u32 {
    return entry_row(run_entry(b, key, end, count), h, key);
}

// run_row's table lookup alone: the block holding keys key .. key +
// count - 1 (the sequence, for a contiguous cache), or NONE where run_row
// is NONE. Apart so that a pass can read it a pass before it needs it.
fn run_entry(b: u32, key: u32, end: u32, count: u32) -> u32 {
    if key >= end || (PAGED && key % u.block_size + count > u.block_size) {
        return NONE;
    }
    if PAGED {
        return seq_data[u.table_off + b * u.max_blocks + key / u.block_size];
    }
    return b;
}

// The cache row of key `key` in block `entry` (run_entry's; NONE gives
// NONE: a block of another binding, whose keys `bound` turns away).
fn entry_row(entry: u32, h: u32, key: u32) -> u32 {
    if entry == NONE {
        return NONE;
    }
    var offset = key;
    if PAGED {
        offset = key % u.block_size;
    }
    return (entry * u.heads_kv + h) * u.block_size + offset;
}

// Whether key `key` of the dispatch's sequence `b` is in a block bound
// here.
fn bound(b: u32, key: u32) -> bool {
    if SKIPS {
        return seq_data[u.table_off + b * u.max_blocks + key / u.block_size] != NONE;
    }
    return true;
}

// The keys row `i` (of seq_q) of a sequence of `len` keys sees: query i is
// at position len - seq_q + i. Lengths and seq_q are below 2^30 (checked
// by the host), so positions fit i32.
fn visible(len: u32, i: u32) -> vec2<u32> {
    let pos = i32(len) - i32(u.seq_q) + i32(i);
    var end = i32(len);
    if u.causal != 0u {
        end = min(end, pos + 1);
    }
    if u.right != NONE {
        end = min(end, pos + i32(u.right) + 1);
    }
    end = clamp(end, 0, i32(len));
    var start = 0;
    if u.left != NONE {
        start = max(0, pos - i32(u.left));
    }
    return vec2(u32(min(start, end)), u32(end));
}

// The keys any row of the sequence sees (src/problem/kvcache.rs, keys_read): the
// range the splits cut.
fn keys_read(len: u32) -> vec2<u32> {
    if len == 0u || u.seq_q == 0u {
        return vec2(0u);
    }
    let first = visible(len, 0u);
    let last = visible(len, u.seq_q - 1u);
    let start = min(first.x, last.y);
    return vec2(start, max(last.y, start));
}

// Split s of `keys` (src/decode.rs, split_keys).
fn split_keys(keys: vec2<u32>, s: u32) -> vec2<u32> {
    let n = keys.y - keys.x;
    let per = ((n + u.splits - 1u) / u.splits + 15u) / 16u * 16u;
    let start = keys.x + min(s * per, n);
    return vec2(start, min(start + per, keys.y));
}

// The keys the rows row0 .. row0 + rows_per_block - 1 of the group (of
// split `split` of a sequence of `len` keys) see: the first and the last
// query index among them bound both ends (all of them when the block
// wraps from one head of the group to the next).
fn block_keys(len: u32, split: vec2<u32>, row0: u32, rows_per_block: u32) -> vec2<u32> {
    var i_lo = row0 % u.seq_q;
    var i_hi = min(row0 + rows_per_block, u.rows) - 1u;
    i_hi = i_hi % u.seq_q;
    if i_hi < i_lo || min(rows_per_block, u.rows - row0) > u.seq_q {
        i_lo = 0u;
        i_hi = u.seq_q - 1u;
    }
    return vec2(max(split.x, visible(len, i_lo).x), min(split.y, visible(len, i_hi).y));
}

// Elements 4c..4c+3 of row `row` of q (the dispatch's own rows), scaled,
// zeros past d.
fn load_q(row: u32, c: u32) -> vec4<f32> {
    var x = vec4(0.0);
    let base = row * u.d;
    for (var e = 0u; e < 4u; e++) {
        let col = 4u * c + e;
        if col < u.d {
            x[e] = in_elem(q[in_word(base + col)], base + col);
        }
    }
    return x * u.scale;
}
