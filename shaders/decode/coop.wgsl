// Decoding over a float16 KV cache on cooperative matrices (tensor cores):
// what decode/subgroup.wgsl computes (one workgroup per (sequence,
// key/value head, key split, block of query rows), the split's o
// normalised and its lse written in float32 for decode/combine.wgsl), with
// the dot products and the P V products as 16x16x16 float16 products
// accumulated in float32. The subgroup kernel does the same work in
// scalar code: every (query row, key) pair costs d multiply-adds a lane
// and float16 decoding ran at half of float32's bytes per second, bound by
// that work (docs/gpu.md, "The subgroup decode kernel"). Here a key costs
// its share of two matrix products and one exponential per query row.
//
// The host prepends lib/coop.wgsl (the `enable` lines and the matrix
// types), lib/input_f16.wgsl, the score fragments and decode/shared.wgsl
// (src/gpu/shaders.rs, decode_coop_source), and picks this kernel for
// float16 caches with d and d_v multiples of 16 up to 128 on adapters with
// cooperative matrices (src/gpu/tiles/decode.rs, coop_decode_tiles).
//
// Layout: W walkers of one subgroup (32 lanes) each. The 16 query rows of
// a row block (a decoding GQA group's heads, padded with zero rows) are
// the A operand of every product; walker w takes the key tiles k0 + 16 (n
// W + w) of the block's keys, with its own online softmax, and the walkers
// merge at the end as the subgroup kernel's do. A tile's K and V rows pass
// through the lanes' registers on their way to workgroup memory: loaded a
// tile ahead (the bytes in flight while the products run), rows past the
// keys as zeros, V cleaned of NaN and infinities as
// docs/design.md#non-finite-inputs says (a NaN times a P of 0 would reach
// every row through the product). K is staged as loaded: a NaN or an
// infinity reaches only its own key's scores, which the scalar step codes
// as the other kernels do.
//
// Per step, each walker on its own tile:
//   stage K_t, V_t from registers; load K_{t+1}, V_{t+1} into registers;
//   S = Q K_t^T (scores, to workgroup memory); the scalar step: scores,
//   variants, visibility, codes, the online softmax (lazy rescale, as the
//   cooperative forward: a row keeps its maximum until a tile's exceeds
//   it by TAU in base 2, so P <= 2^TAU stays well inside float16), P to
//   workgroup memory as float16; O += P V_t.
// Every workgroup variable is a multiple of 16 bytes, which cooperative
// loads and stores need (docs/gpu.md#cooperative-matrices-in-wgpu).

override W: u32 = 4u;
override WG: u32 = 32u * W;
override D: u32 = 128u;
override DV: u32 = 128u;
// Row strides in halves, padded by 16 bytes so that the 16 rows a
// cooperative load reads start in different banks.
override KS: u32 = D + 8u;
override VS: u32 = DV + 8u;
// Array sizes: the queries' 16 rows, W tiles of 16 rows each (the host
// computes the products, src/gpu/tiles/decode.rs).
override Q_ELEMS: u32 = 2176u;
override K_ELEMS: u32 = 8704u;
override V_ELEMS: u32 = 8704u;
override P_ELEMS: u32 = 1536u;
override F_ELEMS: u32 = 1280u;
override STATS: u32 = 64u;

// Keys of a tile, rows of a row block: one matrix each.
const BK: u32 = 16u;
const RB: u32 = 16u;
// P and score rows: strides of 16 bytes' padding as above.
const PS: u32 = 24u;
const FS: u32 = 20u;
const TAU: f32 = 8.0;
const LN2: f32 = 0.6931471805599453;
const LOG2E: f32 = 1.4426950408889634;
// A lane stages D / 16 (DV / 16) vec4<u32> words of a tile's K (V) rows,
// 16 rows of D / 8 words over 32 lanes: at most 8 (D <= 128), held in the
// named registers k0..k7, v0..v7 (docs/gpu.md#named-register-variables).

@group(0) @binding(2) var<storage, read> k_cache: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v_cache: array<vec4<u32>>;

var<workgroup> qs: array<f16, Q_ELEMS>;
var<workgroup> ks: array<f16, K_ELEMS>;
var<workgroup> vs: array<f16, V_ELEMS>;
var<workgroup> pp: array<f16, P_ELEMS>;
var<workgroup> sf: array<f32, F_ELEMS>;
// Per walker and row: its row_max (then its weight), its row_sum, its
// code; then per row the merged row_sum.
var<workgroup> st_max: array<f32, STATS>;
var<workgroup> st_sum: array<f32, STATS>;
var<workgroup> st_code: array<f32, STATS>;
var<workgroup> merged: array<f32, RB>;
// Whether any walker's row moved its row_max on this step (a vector: every
// workgroup variable a multiple of 16 bytes).
var<workgroup> moved: vec4<u32>;

// Word i of the lane's share of the tile of keys kt .. kt + 15 of
// sequence b, head h, in a cache of rows of `width` halves (D or DV): word
// i * 32 + lane of the tile, in row (i * 32 + lane) / (width / 8); zeros
// past `end`, for a key whose block is not bound here (a pool over several
// buffers) and for i past the row's words. `entry` is run_entry's for the
// tile: one table lookup where the tile lies in one block, else one a row.
fn tile_row(b: u32, h: u32, kt: u32, end: u32, entry: u32, j: u32) -> u32 {
    let key = kt + j;
    if key >= end {
        return NONE;
    }
    if entry != NONE {
        return entry_row(entry, h, kt) + j;
    }
    if !bound(b, key) {
        return NONE;
    }
    return cache_row(b, h, key);
}

fn load_k_word(b: u32, h: u32, kt: u32, end: u32, entry: u32, lane: u32, i: u32) -> vec4<u32> {
    let e = i * 32u + lane;
    let row = tile_row(b, h, kt, end, entry, e / (D / 8u));
    if i >= D / 16u || row == NONE {
        return vec4(0u);
    }
    return k_cache[(row * D + u.k_delta) / 8u + e % (D / 8u)];
}

fn load_v_word(b: u32, h: u32, kt: u32, end: u32, entry: u32, lane: u32, i: u32) -> vec4<u32> {
    let e = i * 32u + lane;
    let row = tile_row(b, h, kt, end, entry, e / (DV / 8u));
    if i >= DV / 16u || row == NONE {
        return vec4(0u);
    }
    return v_cache[(row * DV + u.v_delta) / 8u + e % (DV / 8u)];
}

// Word i of the lane's share of a K (V) tile whose 16 rows are cache rows
// row0 .. row0 + 15, all below the split's end: the common case, without
// a branch. (With a test a word, as load_k_word has, the H200 ran the
// kernel 4.5 times slower: its loads did not overlap.)
fn load_k_run(row0: u32, lane: u32, i: u32) -> vec4<u32> {
    if i >= D / 16u {
        return vec4(0u);
    }
    let e = i * 32u + lane;
    return k_cache[((row0 + e / (D / 8u)) * D + u.k_delta) / 8u + e % (D / 8u)];
}

fn load_v_run(row0: u32, lane: u32, i: u32) -> vec4<u32> {
    if i >= DV / 16u {
        return vec4(0u);
    }
    let e = i * 32u + lane;
    return v_cache[((row0 + e / (DV / 8u)) * DV + u.v_delta) / 8u + e % (DV / 8u)];
}

// The lane's words of a tile, K then V: named members, not arrays
// (docs/gpu.md#named-register-variables).
struct Words {
    k0: vec4<u32>, k1: vec4<u32>, k2: vec4<u32>, k3: vec4<u32>,
    k4: vec4<u32>, k5: vec4<u32>, k6: vec4<u32>, k7: vec4<u32>,
    v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>,
    v4: vec4<u32>, v5: vec4<u32>, v6: vec4<u32>, v7: vec4<u32>,
}

// The lane's words of the tile of keys kt .. kt + 15 of sequence b, head
// h, rows at or past `end` as zeros.
fn load_tile(b: u32, h: u32, kt: u32, end: u32, lane: u32) -> Words {
    var t: Words;
    let entry = run_entry(b, kt, end, BK);
    if entry != NONE && kt + BK <= end {
        let row0 = entry_row(entry, h, kt);
        t.k0 = load_k_run(row0, lane, 0u);
        t.k1 = load_k_run(row0, lane, 1u);
        t.k2 = load_k_run(row0, lane, 2u);
        t.k3 = load_k_run(row0, lane, 3u);
        t.k4 = load_k_run(row0, lane, 4u);
        t.k5 = load_k_run(row0, lane, 5u);
        t.k6 = load_k_run(row0, lane, 6u);
        t.k7 = load_k_run(row0, lane, 7u);
        t.v0 = load_v_run(row0, lane, 0u);
        t.v1 = load_v_run(row0, lane, 1u);
        t.v2 = load_v_run(row0, lane, 2u);
        t.v3 = load_v_run(row0, lane, 3u);
        t.v4 = load_v_run(row0, lane, 4u);
        t.v5 = load_v_run(row0, lane, 5u);
        t.v6 = load_v_run(row0, lane, 6u);
        t.v7 = load_v_run(row0, lane, 7u);
    } else {
        t.k0 = load_k_word(b, h, kt, end, entry, lane, 0u);
        t.k1 = load_k_word(b, h, kt, end, entry, lane, 1u);
        t.k2 = load_k_word(b, h, kt, end, entry, lane, 2u);
        t.k3 = load_k_word(b, h, kt, end, entry, lane, 3u);
        t.k4 = load_k_word(b, h, kt, end, entry, lane, 4u);
        t.k5 = load_k_word(b, h, kt, end, entry, lane, 5u);
        t.k6 = load_k_word(b, h, kt, end, entry, lane, 6u);
        t.k7 = load_k_word(b, h, kt, end, entry, lane, 7u);
        t.v0 = load_v_word(b, h, kt, end, entry, lane, 0u);
        t.v1 = load_v_word(b, h, kt, end, entry, lane, 1u);
        t.v2 = load_v_word(b, h, kt, end, entry, lane, 2u);
        t.v3 = load_v_word(b, h, kt, end, entry, lane, 3u);
        t.v4 = load_v_word(b, h, kt, end, entry, lane, 4u);
        t.v5 = load_v_word(b, h, kt, end, entry, lane, 5u);
        t.v6 = load_v_word(b, h, kt, end, entry, lane, 6u);
        t.v7 = load_v_word(b, h, kt, end, entry, lane, 7u);
    }
    return t;
}

// Writes word i of the lane's K share into the walker's rows of ks (from
// `kb`), as loaded.
fn stage_k(w: vec4<u32>, kb: u32, lane: u32, i: u32) {
    if i >= D / 16u {
        return;
    }
    let e = i * 32u + lane;
    let at = kb + (e / (D / 8u)) * KS + 8u * (e % (D / 8u));
    for (var c = 0u; c < 4u; c++) {
        let x = unpack2x16float(w[c]);
        ks[at + 2u * c] = f16(x.x);
        ks[at + 2u * c + 1u] = f16(x.y);
    }
}

// Eight halves, each NaN or infinity replaced by +0.
fn clean8(x: vec4<u32>) -> vec4<u32> {
    var y = select(x, x & vec4(0xffff0000u), (x & vec4(0x7c00u)) == vec4(0x7c00u));
    y = select(y, y & vec4(0x0000ffffu), (y & vec4(0x7c000000u)) == vec4(0x7c000000u));
    return y;
}

// The non-finite flags of eight halves (lib/nonfinite.wgsl,
// NONFINITE_FLAGS).
fn flags8(x: vec4<u32>) -> u32 {
    let f = (x & vec4(0x7c007c00u)) + vec4(0x04000400u);
    return f.x | f.y | f.z | f.w;
}

// Writes word i of the lane's V share into the walker's rows of vs (from
// `vb`), cleaned where `clean` (some value of the tile is not finite);
// returns bit j for its row j where it held a NaN or an infinity.
fn stage_v(w: vec4<u32>, vb: u32, lane: u32, i: u32, clean: bool) -> u32 {
    if i >= DV / 16u {
        return 0u;
    }
    let e = i * 32u + lane;
    let at = vb + (e / (DV / 8u)) * VS + 8u * (e % (DV / 8u));
    var x = w;
    var bad = 0u;
    if clean {
        bad = select(0u, 1u << (e / (DV / 8u)), (flags8(w) & NONFINITE_FLAGS) != 0u);
        x = clean8(w);
    }
    for (var c = 0u; c < 4u; c++) {
        let y = unpack2x16float(x[c]);
        vs[at + 2u * c] = f16(y.x);
        vs[at + 2u * c + 1u] = f16(y.y);
    }
    return bad;
}

// m with each row scaled by its lane's `rescale`, through the walker's
// score rows (from `at`; the lane's 8 columns from `mine`).
fn rescaled(m: C32, mine: u32, at: u32, rescale: f32) -> C32 {
    coopStoreT(m, &sf[at], FS);
    scratch_barrier();
    for (var i = 0u; i < 8u; i++) {
        sf[mine + i] *= rescale;
    }
    scratch_barrier();
    let out = coopLoadT<C32>(&sf[at], FS);
    scratch_barrier();
    return out;
}

// Columns 16 c .. 16 c + 15 of o: each walker's accumulator `m` through
// its score rows (from `at`), merged at the walkers' weights.
fn write_o(m: C32, c: u32, at: u32, lid: u32, s: u32, seq_head: u32, row0: u32) {
    coopStoreT(m, &sf[at], FS);
    workgroupBarrier();
    for (var e = lid; e < RB * 16u; e += WG) {
        let i = e / 16u;
        let col = 16u * c + e % 16u;
        if row0 + i < u.rows && col < u.dv {
            var x = 0.0;
            for (var w = 0u; w < W; w++) {
                x += st_max[w * RB + i] * sf[w * RB * FS + i * FS + e % 16u];
            }
            let sum = merged[i];
            // A row that saw no key keeps o = 0; one with a code gets NaN
            // (unless its lse is -inf: no code above 0.5, and no key).
            var o = select(0.0, x / sum, sum > 0.0);
            let code_i = st_code[i];
            if code_i > 0.75 || (code_i > 0.0 && sum > 0.0) {
                o = nan_f32();
            }
            part_o[((u.split_base + s) * u.out_rows + seq_head * u.rows + row0 + i) * u.dv + col] = o;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) walker: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let s = wid.x;
    let rb = wid.y % u.row_blocks;
    let seq_head = wid.y / u.row_blocks;
    let b = seq_head / u.heads_kv;
    let h = seq_head % u.heads_kv;
    let row0 = rb * RB;
    let len = seq_data[u.seqlens_off + b];
    let split = split_keys(keys_read(len), s);
    let block = block_keys(len, split, row0, RB);
    let key_end = block.y;
    // Tiles start on multiples of 16 keys (a paged block's tiles then lie
    // in one block); the keys before the block's first are hidden below.
    let tiles_start = block.x / BK * BK;
    var steps = 0u;
    if key_end > block.x {
        steps = (key_end - tiles_start + BK * W - 1u) / (BK * W);
    }

    // The rows' queries as float16, zero rows past the group, staged once
    // in qs, where every step reads them: held in registers they took 32
    // a lane, and the kernel spilled at the driver's 255 (measured with
    // rust/tools/kernel-stats on the H200).
    let q_first = seq_head * u.rows;
    let d2 = D / 2u;
    for (var e = lid; e < RB * d2; e += WG) {
        let r = e / d2;
        var w = 0u;
        if row0 + r < u.rows {
            w = q[(q_first + row0 + r) * d2 + e % d2];
        }
        let x = unpack2x16float(w);
        qs[r * KS + 2u * (e % d2)] = f16(x.x);
        qs[r * KS + 2u * (e % d2) + 1u] = f16(x.y);
    }
    if lid == 0u {
        moved = vec4(0u);
    }
    // Every walker reads every row of qs.
    workgroupBarrier();
    // O's 16 rows, 16 columns each: named, not an array (an array of
    // matrices indexed in loops lived in local memory, 256 bytes a lane:
    // kernel-stats on the H200).
    var acc0 = C32();
    var acc1 = C32();
    var acc2 = C32();
    var acc3 = C32();
    var acc4 = C32();
    var acc5 = C32();
    var acc6 = C32();
    var acc7 = C32();

    // The scalar step's row and half of the tile: lanes 2r and 2r + 1
    // share row r, 8 keys each.
    let r = lane >> 1u;
    let half = lane & 1u;
    let gr = row0 + r;
    var lo = 0u;
    var hi = 0u;
    var slope = 0.0;
    var pos = 0;
    if gr < u.rows {
        let i = gr % u.seq_q;
        let seen = visible(len, i);
        lo = max(seen.x, block.x);
        hi = min(seen.y, key_end);
        pos = i32(len) - i32(u.seq_q) + i32(i);
        if ALIBI {
            slope = bitcast<f32>(seq_data[u.slopes_off + b * u.heads_q + h * u.group + gr / u.seq_q]);
        }
    }
    // The row's online-softmax state in base 2 (row_sum over this lane's
    // keys), and its code (lib/nonfinite.wgsl).
    var row_max = NEG_BIG;
    var row_sum = 0.0;
    var code = 0.0;

    let kb = walker * RB * KS;
    let vb = walker * RB * VS;
    let pb = walker * RB * PS;
    let fb = walker * RB * FS;
    // The lane's words of the walker's next tile.
    var t = load_tile(b, h, tiles_start + walker * BK, key_end, lane);
    for (var n = 0u; n < steps; n++) {
        let kt = tiles_start + (n * W + walker) * BK;
        stage_k(t.k0, kb, lane, 0u);
        stage_k(t.k1, kb, lane, 1u);
        stage_k(t.k2, kb, lane, 2u);
        stage_k(t.k3, kb, lane, 3u);
        stage_k(t.k4, kb, lane, 4u);
        stage_k(t.k5, kb, lane, 5u);
        stage_k(t.k6, kb, lane, 6u);
        stage_k(t.k7, kb, lane, 7u);
        // V is cleaned only where some value of the tile is not finite.
        let clean = subgroupAny(((flags8(t.v0) | flags8(t.v1) | flags8(t.v2) | flags8(t.v3) | flags8(t.v4) | flags8(t.v5) | flags8(t.v6) | flags8(t.v7)) & NONFINITE_FLAGS) != 0u);
        var vbad = 0u;
        vbad |= stage_v(t.v0, vb, lane, 0u, clean);
        vbad |= stage_v(t.v1, vb, lane, 1u, clean);
        vbad |= stage_v(t.v2, vb, lane, 2u, clean);
        vbad |= stage_v(t.v3, vb, lane, 3u, clean);
        vbad |= stage_v(t.v4, vb, lane, 4u, clean);
        vbad |= stage_v(t.v5, vb, lane, 5u, clean);
        vbad |= stage_v(t.v6, vb, lane, 6u, clean);
        vbad |= stage_v(t.v7, vb, lane, 7u, clean);
        if clean {
            vbad = subgroupOr(vbad);
        }
        // The next tile's loads, in flight while this one is multiplied.
        if n + 1u < steps {
            t = load_tile(b, h, kt + BK * W, key_end, lane);
        }
        scratch_barrier();

        // S = Q K^T: K^T is the staged K read column-major.
        var prod = C32();
        for (var c = 0u; c < D / 16u; c++) {
            let qa = coopLoadT<A16>(&qs[16u * c], KS);
            let kt_c = coopLoad<B16>(&ks[kb + 16u * c], KS);
            prod = coopMultiplyAdd(qa, kt_c, prod);
        }
        coopStoreT(prod, &sf[fb], FS);
        scratch_barrier();

        // The scalar step over the lane's 8 keys, in key order.
        var sv: array<f32, 8>;
        var tile_max = NEG_BIG;
        for (var i = 0u; i < 8u; i++) {
            let j = 8u * half + i;
            let key = kt + j;
            var sc = NEG_BIG;
            // Keys of blocks bound by another run of the dispatch are not
            // seen here (their rows were staged as zeros).
            if key >= lo && key < hi && (!SKIPS || bound(b, key)) {
                let y = variant_score(sf[fb + r * FS + j] * u.scale, u.softcap, slope, abs(pos - i32(key)));
                if finite_f32(y) {
                    sc = y * LOG2E;
                } else {
                    code = max(code, nonfinite_code(y));
                }
                // A key the row sees whose value was not finite: o = NaN.
                if ((vbad >> j) & 1u) != 0u {
                    code = max(code, CODE_VALUE);
                }
            }
            sv[i] = sc;
            tile_max = max(tile_max, sc);
        }
        tile_max = max(tile_max, subgroupShuffleXor(tile_max, 1u));
        var rescale = 1.0;
        if tile_max > row_max + TAU {
            // exp2(NEG_BIG - finite) is 0: the first visible key discards
            // the (empty) accumulators.
            rescale = exp2(row_max - tile_max);
            row_max = tile_max;
        }
        row_sum *= rescale;
        for (var i = 0u; i < 8u; i++) {
            let pj = select(0.0, exp2(sv[i] - row_max), sv[i] > NEG_BIG);
            row_sum += pj;
            pp[pb + r * PS + 8u * half + i] = f16(pj);
        }
        // Whether a row of the walker (of any walker, where the waits are
        // workgroup-wide) moved its maximum: the accumulators then go
        // through workgroup memory to be rescaled (rarely after the first
        // tile: the maximum moves by more than TAU).
        var any_moved = false;
        if SUBGROUP_SCRATCH {
            any_moved = subgroupAny(rescale != 1.0);
        } else {
            if rescale != 1.0 {
                moved.x = 1u;
            }
            any_moved = workgroupUniformLoad(&moved).x != 0u;
        }
        // The walker's P is visible to its lanes.
        scratch_barrier();
        if any_moved {
            if DV / 16u > 0u {
                acc0 = rescaled(acc0, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 1u {
                acc1 = rescaled(acc1, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 2u {
                acc2 = rescaled(acc2, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 3u {
                acc3 = rescaled(acc3, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 4u {
                acc4 = rescaled(acc4, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 5u {
                acc5 = rescaled(acc5, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 6u {
                acc6 = rescaled(acc6, fb + r * FS + 8u * half, fb, rescale);
            }
            if DV / 16u > 7u {
                acc7 = rescaled(acc7, fb + r * FS + 8u * half, fb, rescale);
            }
            if !SUBGROUP_SCRATCH && lid == 0u {
                moved.x = 0u;
            }
        }

        // O += P V into the accumulators themselves (the cooperative
        // forward adds each product made from zero, faster there, but its
        // temporaries are 64 registers a lane more).
        let pa = coopLoadT<A16>(&pp[pb], PS);
        if DV / 16u > 0u {
            acc0 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 0u], VS), acc0);
        }
        if DV / 16u > 1u {
            acc1 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 16u], VS), acc1);
        }
        if DV / 16u > 2u {
            acc2 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 32u], VS), acc2);
        }
        if DV / 16u > 3u {
            acc3 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 48u], VS), acc3);
        }
        if DV / 16u > 4u {
            acc4 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 64u], VS), acc4);
        }
        if DV / 16u > 5u {
            acc5 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 80u], VS), acc5);
        }
        if DV / 16u > 6u {
            acc6 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 96u], VS), acc6);
        }
        if DV / 16u > 7u {
            acc7 = coopMultiplyAdd(pa, coopLoadT<B16>(&vs[vb + 112u], VS), acc7);
        }
        // The walker's products are done: its ks, vs, pp and sf are free.
        scratch_barrier();
    }

    // The row's sum and code over its two lanes; the walkers' states.
    row_sum += subgroupShuffleXor(row_sum, 1u);
    code = max(code, subgroupShuffleXor(code, 1u));
    if half == 0u {
        st_max[walker * RB + r] = row_max;
        st_sum[walker * RB + r] = row_sum;
        st_code[walker * RB + r] = code;
    }
    workgroupBarrier();
    // Per row: the largest row_max, the walkers' weights (in place of
    // their row_max) and the merged row_sum, in walker order.
    if lid < RB {
        var top = NEG_BIG;
        var c = 0.0;
        for (var w = 0u; w < W; w++) {
            top = max(top, st_max[w * RB + lid]);
            c = max(c, st_code[w * RB + lid]);
        }
        var sum = 0.0;
        for (var w = 0u; w < W; w++) {
            let sum_w = st_sum[w * RB + lid];
            // A walker that saw no key of the row weighs 0.
            let weight = select(0.0, exp2(st_max[w * RB + lid] - top), sum_w > 0.0);
            st_max[w * RB + lid] = weight;
            sum += weight * sum_w;
        }
        merged[lid] = sum;
        st_code[lid] = c;
        let row = row0 + lid;
        if row < u.rows {
            // lse = (row_max + log2(row_sum)) ln 2; -inf (as bits) for a
            // row that saw no key in this split; NaN or +inf for a code.
            var lse = bitcast<f32>(NEG_INF);
            if sum > 0.0 {
                lse = (top + log2(sum)) * LN2;
            }
            part_lse[(u.split_base + s) * u.out_rows + seq_head * u.rows + row] = bitcast<u32>(code_lse(c, lse));
        }
    }
    workgroupBarrier();
    // o, 16 columns at a time.
    if DV / 16u > 0u {
        write_o(acc0, 0u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 1u {
        write_o(acc1, 1u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 2u {
        write_o(acc2, 2u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 3u {
        write_o(acc3, 3u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 4u {
        write_o(acc4, 4u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 5u {
        write_o(acc5, 5u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 6u {
        write_o(acc6, 6u, fb, lid, s, seq_head, row0);
    }
    if DV / 16u > 7u {
        write_o(acc7, 7u, fb, lid, s, seq_head, row0);
    }
}
