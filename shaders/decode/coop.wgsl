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
// merge at the end as the subgroup kernel's do.
//
// A tile whose 16 keys lie in one block, below the split's end, and which
// every row sees (decoding's common case) is multiplied straight from the
// caches: no staging, no registers held for loads. A NaN or an infinity
// in such a tile's K reaches only its own key's scores, which the scalar
// step codes as the other kernels do; one in its V reaches the rows'
// accumulators (every row sees every key of the tile, and the code of
// docs/design.md#non-finite-inputs is then 0.5, o = NaN): a row whose
// accumulators end not finite gets that code (float16 products summed in
// float32 do not overflow). Any other tile (a split's last, a block
// boundary inside it, rows that see part of it, a pool over several
// buffers) is staged through workgroup memory by the lanes, rows past the
// keys as zeros, V cleaned and its non-finite rows flagged as the
// subgroup kernel does.
//
// Per step, each walker on its own tile: S = Q K^T (scores to workgroup
// memory); the scalar step: scores, variants, visibility, codes, the
// online softmax (lazy rescale, as the cooperative forward: a row keeps
// its maximum until a tile's exceeds it by TAU in base 2, so P <= 2^TAU
// stays well inside float16), P to workgroup memory as float16; O += P V.
// Every workgroup variable is a multiple of 16 bytes, and every
// cooperative load starts on 16 bytes (d and d_v multiples of 16, the
// caches' deltas multiples of 8 halves), which cooperative loads and
// stores need (docs/gpu.md#cooperative-matrices-in-wgpu).

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

@group(0) @binding(2) var<storage, read> k_cache: array<f16>;
@group(0) @binding(3) var<storage, read> v_cache: array<f16>;

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
// Whether a step multiplies its tiles straight from the caches (main).
var<workgroup> direct_step: array<u32, 4>;

// The cache row of key kt + j of a tile of sequence b, head h: NONE past
// `end` and for a key whose block is not bound here (a pool over several
// buffers).
fn tile_row(b: u32, h: u32, kt: u32, end: u32, j: u32) -> u32 {
    let key = kt + j;
    if key >= end || !bound(b, key) {
        return NONE;
    }
    return cache_row(b, h, key);
}

// Stages the walker's tile of keys kt .. kt + 15 into its rows of ks and
// vs (from `kb`, `vb`): lane l copies halves 8 e .. 8 e + 7 of the tile,
// e = i * 32 + l, rows past the keys as zeros, V's NaN and infinities as
// zeros. Returns bit j where value row j held one.
fn stage_tile(b: u32, h: u32, kt: u32, end: u32, kb: u32, vb: u32, lane: u32) -> u32 {
    for (var e = lane; e < BK * D / 8u; e += 32u) {
        let j = e / (D / 8u);
        let row = tile_row(b, h, kt, end, j);
        let at = kb + j * KS + 8u * (e % (D / 8u));
        let src = row * D + u.k_delta + 8u * (e % (D / 8u));
        for (var c = 0u; c < 8u; c++) {
            var x = f16(0.0);
            if row != NONE {
                x = k_cache[src + c];
            }
            ks[at + c] = x;
        }
    }
    var bad = 0u;
    for (var e = lane; e < BK * DV / 8u; e += 32u) {
        let j = e / (DV / 8u);
        let row = tile_row(b, h, kt, end, j);
        let at = vb + j * VS + 8u * (e % (DV / 8u));
        let src = row * DV + u.v_delta + 8u * (e % (DV / 8u));
        for (var c = 0u; c < 8u; c++) {
            var x = f16(0.0);
            if row != NONE {
                x = v_cache[src + c];
            }
            // Widening keeps NaN and the infinities, tested on the bits
            // (naga has no bitcast of halves).
            if !finite_f32(f32(x)) {
                bad |= 1u << j;
                x = f16(0.0);
            }
            vs[at + c] = x;
        }
    }
    return subgroupOr(bad);
}

// Whether any of the 8 values of `m` the lane looks at (row r, columns
// 8 half ..) is NaN or an infinity, through the walker's score rows (from
// `at`; the lane's from `mine`).
fn nonfinite8(m: C32, mine: u32, at: u32) -> bool {
    coopStoreT(m, &sf[at], FS);
    scratch_barrier();
    var bad = false;
    for (var i = 0u; i < 8u; i++) {
        bad = bad || !finite_f32(sf[mine + i]);
    }
    scratch_barrier();
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
    // The keys every row of the block sees: those of its last query
    // index from the start, of its first to the end (visible() moves both
    // ends with the index; every index where the block wraps).
    var i_lo = row0 % u.seq_q;
    var i_hi = (min(row0 + RB, u.rows) - 1u) % u.seq_q;
    if i_hi < i_lo || min(RB, u.rows - row0) > u.seq_q {
        i_lo = 0u;
        i_hi = u.seq_q - 1u;
    }
    let shared_keys = vec2(max(block.x, visible(len, i_hi).x), min(key_end, visible(len, i_lo).y));
    // A tile of 16 keys from a multiple of 16 lies in one block.
    let whole_blocks = !SKIPS && (!PAGED || u.block_size % BK == 0u);
    for (var n = 0u; n < steps; n++) {
        let kt = tiles_start + (n * W + walker) * BK;
        // Multiplied from the caches where every walker's tile is whole,
        // in one block, and seen by every row; staged otherwise (above).
        // Decided for the whole workgroup and passed through workgroup
        // memory, which makes it uniform where naga can see it (it wants
        // cooperative operations in uniform control flow, and takes the
        // loop's counter and the lengths for values that may differ);
        // two slots, so that the next step's cannot overwrite this one's
        // before every invocation has read it.
        let k0 = tiles_start + n * W * BK;
        if lid == 0u {
            direct_step[n & 1u] = u32(whole_blocks && k0 >= shared_keys.x && k0 + W * BK <= shared_keys.y);
        }
        let direct = workgroupUniformLoad(&direct_step[n & 1u]) != 0u;
        let entry = run_entry(b, kt, key_end, BK);
        var k_at = 0u;
        var v_at = 0u;
        var vbad = 0u;
        var prod = C32();
        if direct {
            let row = entry_row(entry, h, kt);
            k_at = row * D + u.k_delta;
            v_at = row * DV + u.v_delta;
            // S = Q K^T: K^T is K's rows read column-major.
            for (var c = 0u; c < D / 16u; c++) {
                let qa = coopLoadT<A16>(&qs[16u * c], KS);
                prod = coopMultiplyAdd(qa, coopLoad<B16>(&k_cache[k_at + 16u * c], D), prod);
            }
        } else {
            vbad = stage_tile(b, h, kt, key_end, kb, vb, lane);
            scratch_barrier();
            for (var c = 0u; c < D / 16u; c++) {
                let qa = coopLoadT<A16>(&qs[16u * c], KS);
                prod = coopMultiplyAdd(qa, coopLoad<B16>(&ks[kb + 16u * c], KS), prod);
            }
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
        if direct {
            if DV / 16u > 0u {
                acc0 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 0u], DV), acc0);
            }
            if DV / 16u > 1u {
                acc1 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 16u], DV), acc1);
            }
            if DV / 16u > 2u {
                acc2 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 32u], DV), acc2);
            }
            if DV / 16u > 3u {
                acc3 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 48u], DV), acc3);
            }
            if DV / 16u > 4u {
                acc4 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 64u], DV), acc4);
            }
            if DV / 16u > 5u {
                acc5 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 80u], DV), acc5);
            }
            if DV / 16u > 6u {
                acc6 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 96u], DV), acc6);
            }
            if DV / 16u > 7u {
                acc7 = coopMultiplyAdd(pa, coopLoadT<B16>(&v_cache[v_at + 112u], DV), acc7);
            }
        } else {
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
        }
        // The walker's products are done: its ks, vs, pp and sf are free.
        scratch_barrier();
    }

    // A row whose accumulators are not finite met a NaN or an infinity in
    // a value of a tile multiplied from the cache (above): code 0.5.
    var acc_bad = false;
    let mine = fb + r * FS + 8u * half;
    if DV / 16u > 0u {
        acc_bad = nonfinite8(acc0, mine, fb) || acc_bad;
    }
    if DV / 16u > 1u {
        acc_bad = nonfinite8(acc1, mine, fb) || acc_bad;
    }
    if DV / 16u > 2u {
        acc_bad = nonfinite8(acc2, mine, fb) || acc_bad;
    }
    if DV / 16u > 3u {
        acc_bad = nonfinite8(acc3, mine, fb) || acc_bad;
    }
    if DV / 16u > 4u {
        acc_bad = nonfinite8(acc4, mine, fb) || acc_bad;
    }
    if DV / 16u > 5u {
        acc_bad = nonfinite8(acc5, mine, fb) || acc_bad;
    }
    if DV / 16u > 6u {
        acc_bad = nonfinite8(acc6, mine, fb) || acc_bad;
    }
    if DV / 16u > 7u {
        acc_bad = nonfinite8(acc7, mine, fb) || acc_bad;
    }
    if acc_bad && gr < u.rows {
        code = max(code, CODE_VALUE);
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
