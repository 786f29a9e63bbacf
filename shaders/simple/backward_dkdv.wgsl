// FlashAttention-2 backward, dK and dV: one workgroup per (key/value head,
// tile of BK keys). It owns its rows of dK and dV, accumulates them in
// workgroup memory over every query row of every query head of its GQA
// group (recomputing P from lse), and writes them once: no atomics, a
// fixed summation order, bitwise reproducible results.

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
override DO_ELEMS: u32 = 1024u;
override K_ELEMS: u32 = 1024u;
override V_ELEMS: u32 = 1024u;
override S_ELEMS: u32 = 256u;
override ROW_ELEMS: u32 = 16u;

// u32 words, float32 bits or float16 pairs, read through lib/input_*.wgsl.
@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<u32>;
@group(0) @binding(3) var<storage, read> k: array<u32>;
@group(0) @binding(4) var<storage, read> v: array<u32>;
// (lse, D) of each query row, in one buffer (the pre-pass writes it) so
// that the kernel binds 8 storage buffers, WebGPU's default limit.
@group(0) @binding(5) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> dk: array<f32>;
@group(0) @binding(7) var<storage, read_write> dv: array<f32>;

var<workgroup> sk: array<f32, K_ELEMS>;
var<workgroup> sv: array<f32, V_ELEMS>;
var<workgroup> sdk: array<f32, K_ELEMS>;
var<workgroup> sdv: array<f32, V_ELEMS>;
var<workgroup> sq: array<f32, Q_ELEMS>;
var<workgroup> sdo: array<f32, DO_ELEMS>;
var<workgroup> sp: array<f32, S_ELEMS>;
var<workgroup> sds: array<f32, S_ELEMS>;
// The lse and delta of the tile's rows, from `stats`.
var<workgroup> lse: array<f32, ROW_ELEMS>;
var<workgroup> delta: array<f32, ROW_ELEMS>;
// How each row enters (lib/common.wgsl, row_status): 0 where it saw no
// key (P = 0), 2 where it is poisoned (P = dS = NaN at every key it
// sees), else 1.
var<workgroup> sok: array<u32, ROW_ELEMS>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // screen.wgsl's flag: the last word of `stats`.
    if screened_out(lid, bitcast<u32>(stats[arrayLength(&stats) - 1u].y)) {
        return;
    }
    let kv = wid.y;
    let k0 = wid.x * BK;
    let nk = min(BK, p.seq_k - k0);
    let k_base = (kv * p.seq_k + k0) * D;
    let v_base = (kv * p.seq_k + k0) * DV;

    for (var e = lid; e < BK * D; e += WG) {
        var x = 0.0;
        if e / D < nk {
            x = in_elem(k[in_word(k_base + e)], k_base + e);
        }
        sk[(e / D) * KS + e % D] = x;
        sdk[e] = 0.0;
    }
    for (var e = lid; e < BK * DV; e += WG) {
        var x = 0.0;
        if e / DVN < nk {
            x = in_elem(v[in_word(v_base + e)], v_base + e);
        }
        sv[(e / DVN) * VS + e % DVN] = x;
        sdv[e] = 0.0;
    }

    // Query rows above `first_row` see none of these keys (causal; with
    // VARLEN, earlier sequences), nor do those from `row_end` on (the left
    // window; with VARLEN, later sequences).
    var first_row = 0u;
    if p.causal != 0u {
        first_row = u32(max(i32(k0) - p.causal_offset, 0));
    }
    if VARLEN {
        first_row = varlen_first_row(k0);
    }
    let row_end = rows_seeing_end(k0 + nk);
    for (var t = 0u; t < p.g_count; t++) {
        let head = kv * p.g_count + t;
        let bh = p.head0 + head;
        for (var r0 = first_row; r0 < row_end; r0 += BQ) {
            let nr = min(BQ, row_end - r0);
            if !mask_tile_visible(bh, r0, r0 + nr, k0, k0 + nk) {
                continue;
            }
            let q_base = (head * p.seq_q + r0) * D;
            let o_base = (head * p.seq_q + r0) * DV;
            let l_base = head * p.seq_q + r0;
            workgroupBarrier();
            for (var e = lid; e < BQ * D; e += WG) {
                var x = 0.0;
                if e / D < nr {
                    x = in_elem(q[in_word(q_base + e)], q_base + e);
                }
                // NaN and infinities as 0 (docs/design.md#non-finite-inputs):
                // a row holding any is poisoned (its pairs NaN whatever its
                // scores), and dK += dS q must not meet 0 * NaN where the
                // row does not see the key.
                sq[e] = select(0.0, x, is_finite(x));
            }
            for (var e = lid; e < BQ * DV; e += WG) {
                var x = 0.0;
                if e / DVN < nr {
                    x = in_elem(d_out[in_word(o_base + e)], o_base + e);
                }
                // As q's (dV += P dO).
                sdo[e] = select(0.0, x, is_finite(x));
            }
            for (var i = lid; i < BQ; i += WG) {
                var lse_i = 0.0;
                var delta_i = 0.0;
                var ok = 0u;
                if i < nr {
                    let st = stats[l_base + i];
                    lse_i = st.x;
                    delta_i = st.y;
                    let status = row_status(lse_i);
                    ok = select(select(0u, 1u, status.x), 2u, status.y);
                }
                lse[i] = select(0.0, lse_i, is_finite(lse_i));
                delta[i] = delta_i;
                sok[i] = ok;
            }
            workgroupBarrier();

            for (var e = lid; e < BQ * BK; e += WG) {
                let i = e / BK;
                let j = e % BK;
                let row = r0 + i;
                let key = k0 + j;
                // P * Z (for dV) and dU = dS * softcap'(u) (for dK).
                var pij = 0.0;
                var ds = 0.0;
                if i < nr && j < nk && sok[i] != 0u && key < visible_end(row) && key >= visible_start(row) {
                    var s = 0.0;
                    for (var c = 0u; c < D; c++) {
                        s += sq[i * D + c] * sk[j * KS + c];
                    }
                    let u = s * p.scale;
                    var sm = u;
                    if MODIFIES {
                        sm = score(u, bh, row, key);
                    }
                    if sok[i] == 2u && (!MASK || shown(sm)) {
                        pij = nan_f32();
                        ds = nan_f32();
                    } else if !MASK || shown(sm) {
                        pij = pair_weight(sm, lse[i]);
                        var dp = 0.0;
                        for (var c = 0u; c < DV; c++) {
                            dp += sdo[i * DV + c] * sv[j * VS + c];
                        }
                        let z = dropout_factor(bh, row, key);
                        ds = softcap_grad(pij * (dp * z - delta[i]), u);
                        pij *= z;
                    }
                }
                sp[e] = pij;
                sds[e] = ds;
            }
            workgroupBarrier();

            for (var e = lid; e < BK * DV; e += WG) {
                let j = e / DVN;
                let c = e % DVN;
                var grad = sdv[e];
                for (var i = 0u; i < nr; i++) {
                    grad += sp[i * BK + j] * sdo[i * DV + c];
                }
                sdv[e] = grad;
            }
            for (var e = lid; e < BK * D; e += WG) {
                let j = e / D;
                let c = e % D;
                var grad = sdk[e];
                for (var i = 0u; i < nr; i++) {
                    grad += sds[i * BK + j] * sq[i * D + c];
                }
                sdk[e] = grad;
            }
        }
    }
    workgroupBarrier();

    for (var e = lid; e < nk * D; e += WG) {
        dk[k_base + e] = sdk[e] * p.scale;
    }
    for (var e = lid; e < nk * DV; e += WG) {
        dv[v_base + e] = sdv[e];
    }
}
