// FlashAttention-2 forward: one workgroup per (query head, tile of BQ
// query rows). K/V tiles are staged in workgroup memory and folded into
// the rows with the online softmax, so the score matrix never exists in
// full. Every sum runs in a fixed order: results are bitwise reproducible.
//
// Tile sizes and head dimensions are pipeline overrides chosen by the
// host (src/gpu/tiles.rs); the *_ELEMS overrides are the products the host
// computed, because an array size must be a plain override identifier.
// The inputs are u32 words, float32 bits or float16 pairs, read through
// lib/input_*.wgsl.

override WG: u32 = 64u;
override BQ: u32 = 16u;
override BK: u32 = 16u;
override D: u32 = 64u;
override DV: u32 = 64u;
// DV may be 0 (an empty value dimension); divisions use this instead.
override DVN: u32 = max(DV, 1u);
// Row strides of the staged K and V tiles. One word of padding puts
// consecutive rows in different memory banks, so threads that read one
// column of different rows (the score loops) do not conflict.
override KS: u32 = D + 1u;
override VS: u32 = DV + 1u;
override Q_ELEMS: u32 = 1024u;
override K_ELEMS: u32 = 1024u;
override V_ELEMS: u32 = 1024u;
override S_ELEMS: u32 = 256u;
override O_ELEMS: u32 = 1024u;
override ROW_ELEMS: u32 = 16u;

@group(0) @binding(1) var<storage, read> q: array<u32>;
@group(0) @binding(2) var<storage, read> k: array<u32>;
@group(0) @binding(3) var<storage, read> v: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;
// screen.wgsl's flag (SCREENED in lib/common.wgsl).
@group(0) @binding(6) var<storage, read> screen_flag: array<u32>;

var<workgroup> sq: array<f32, Q_ELEMS>;
var<workgroup> sk: array<f32, K_ELEMS>;
var<workgroup> sv: array<f32, V_ELEMS>;
var<workgroup> ss: array<f32, S_ELEMS>;
// The online-softmax state of the tile's rows (the names of
// lib/common.wgsl).
var<workgroup> acc: array<f32, O_ELEMS>;
var<workgroup> row_max: array<f32, ROW_ELEMS>;
var<workgroup> row_sum: array<f32, ROW_ELEMS>;
var<workgroup> rescale: array<f32, ROW_ELEMS>;
// docs/design.md#non-finite-inputs (lib/nonfinite.wgsl): each row's code
// (2 after a NaN score, 1 after +inf), and for each key of the tile
// whether its value held a NaN or an infinity (k0 + 1 then: no reset
// between tiles), staged as 0.
var<workgroup> row_code: array<f32, ROW_ELEMS>;
var<workgroup> vbad: array<u32, BK>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    if screened_out(lid, screen_flag[arrayLength(&screen_flag) - 1u]) {
        return;
    }
    let head = wid.y;
    let row0 = wid.x * BQ;
    let rows = min(BQ, p.seq_q - row0);
    let kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    let q_base = (head * p.seq_q + row0) * D;
    let kv_row0 = kv * p.seq_k;
    let bh = p.head0 + head;

    for (var e = lid; e < BQ * D; e += WG) {
        var x = 0.0;
        if e / D < rows {
            x = in_elem(q[in_word(q_base + e)], q_base + e);
        }
        sq[e] = x;
    }
    for (var e = lid; e < BQ * DV; e += WG) {
        acc[e] = 0.0;
    }
    for (var i = lid; i < BQ; i += WG) {
        row_max[i] = NEG_BIG;
        row_sum[i] = 0.0;
        row_code[i] = 0.0;
    }
    for (var j = lid; j < BK; j += WG) {
        vbad[j] = 0u;
    }

    // Rows grow downwards, so the last row of the tile sees the most keys.
    let key_end = visible_end(row0 + rows - 1u);
    // The first row starts first (the window's start grows with the row).
    for (var k0 = visible_start(row0); k0 < key_end; k0 += BK) {
        let nk = min(BK, key_end - k0);
        if !mask_tile_visible(bh, row0, row0 + rows, k0, k0 + nk) {
            // The mask hides the whole tile.
            continue;
        }
        // Also orders the previous tile's reads of sk/sv/ss before these writes.
        workgroupBarrier();
        for (var e = lid; e < BK * D; e += WG) {
            var x = 0.0;
            if e / D < nk {
                let at = (kv_row0 + k0) * D + e;
                x = in_elem(k[in_word(at)], at);
            }
            sk[(e / D) * KS + e % D] = x;
        }
        for (var e = lid; e < BK * DV; e += WG) {
            var x = 0.0;
            if e / DVN < nk {
                let at = (kv_row0 + k0) * DV + e;
                x = in_elem(v[in_word(at)], at);
                if !is_finite(x) {
                    x = 0.0;
                    vbad[e / DVN] = k0 + 1u;
                }
            }
            sv[(e / DVN) * VS + e % DVN] = x;
        }
        workgroupBarrier();

        for (var e = lid; e < BQ * BK; e += WG) {
            let i = e / BK;
            let j = e % BK;
            var s = 0.0;
            if i < rows && j < nk {
                var dot = 0.0;
                for (var c = 0u; c < D; c++) {
                    dot += sq[i * D + c] * sk[j * KS + c];
                }
                s = dot * p.scale;
                if MODIFIES || WINDOW {
                    s = score(s, bh, row0 + i, k0 + j);
                    if k0 + j < visible_start(row0 + i) {
                        s = NEG_BIG;
                    }
                }
            }
            ss[e] = s;
        }
        workgroupBarrier();

        // The online-softmax step, one thread per row; keys past the row's
        // end are the tail of the row (causal masks cut rows at
        // `visible_end`), keys the window's start or the mask hide are
        // NEG_BIG.
        for (var i = lid; i < BQ; i += WG) {
            var n = 0u;
            if i < rows {
                let end = visible_end(row0 + i);
                if end > k0 {
                    n = min(nk, end - k0);
                }
            }
            // NaN and infinite scores weigh 0 here; the row's code keeps them.
            var row_max_new = row_max[i];
            var code = row_code[i];
            for (var j = 0u; j < n; j++) {
                let s = ss[i * BK + j];
                if is_finite(s) {
                    row_max_new = max(row_max_new, s);
                } else {
                    code = max(code, nonfinite_code(s));
                }
            }

            // exp(NEG_BIG - finite) underflows to 0 and discards the empty
            // accumulator, which is what a first visible key needs.
            rescale[i] = exp(row_max[i] - row_max_new);
            var tile_sum = 0.0;
            // Keep bits of keys 4g..4g+4, one Philox call for the four.
            var kept = 0u;
            for (var j = 0u; j < BK; j++) {
                var pj = 0.0;
                let s = ss[i * BK + j];
                let seen = j < n && (!(MASK || WINDOW) || shown(s));
                if seen && is_finite(s) {
                    pj = exp(s - row_max_new);
                }
                tile_sum += pj;
                // The sum is of the undropped probabilities; only the
                // output drops some.
                if DROPOUT {
                    let key = k0 + j;
                    if j == 0u || (key & 3u) == 0u {
                        kept = keep_bits4(bh, row0 + i, key >> 2u);
                    }
                    if ((kept >> (key & 3u)) & 1u) == 0u {
                        pj = 0.0;
                    }
                }
                // A key the row sees whose value is not finite: o = NaN.
                if seen && vbad[j] == k0 + 1u {
                    code = max(code, CODE_VALUE);
                }
                ss[i * BK + j] = pj;
            }
            row_sum[i] = row_sum[i] * rescale[i] + tile_sum;
            row_code[i] = code;
            row_max[i] = row_max_new;
        }
        workgroupBarrier();

        for (var e = lid; e < BQ * DV; e += WG) {
            let i = e / DVN;
            let c = e % DVN;
            var x = acc[e] * rescale[i];
            for (var j = 0u; j < nk; j++) {
                x += ss[i * BK + j] * sv[j * VS + c];
            }
            acc[e] = x;
        }
    }
    workgroupBarrier();

    let o_base = (head * p.seq_q + row0) * DV;
    let l_base = head * p.seq_q + row0;
    // Rows with a code (lib/nonfinite.wgsl): a NaN or +inf score or sink,
    // or a value that is not finite.
    let sink = sink_code(bh);
    if SINKS || DROPOUT {
        for (var e = lid; e < rows * DV; e += WG) {
            let i = e / DVN;
            let fin = finish_row(bh, row_max[i], row_sum[i]);
            let code = max(row_code[i], sink);
            let x = select(0.0, acc[e] / fin.x, fin.x > 0.0);
            out[o_base + e] = code_out(code, x, code_lse(code, fin.y));
        }
        for (var i = lid; i < rows; i += WG) {
            let code = max(row_code[i], sink);
            lse[l_base + i] = code_lse(code, finish_row(bh, row_max[i], row_sum[i]).y);
        }
        return;
    }
    for (var i = lid; i < rows; i += WG) {
        let sum = row_sum[i];
        // A row that saw no key: lse = -inf, written as bits.
        var x = bitcast<f32>(0xff800000u);
        if sum > 0.0 {
            x = row_max[i] + log(sum);
        }
        // Kept for the outputs below (the last reads of row_max were above).
        row_max[i] = code_lse(row_code[i], x);
        lse[l_base + i] = row_max[i];
    }
    workgroupBarrier();
    for (var e = lid; e < rows * DV; e += WG) {
        let sum = row_sum[e / DVN];
        var x = 0.0;
        if sum > 0.0 {
            x = acc[e] / sum;
        }
        out[o_base + e] = code_out(row_code[e / DVN], x, row_max[e / DVN]);
    }
}
