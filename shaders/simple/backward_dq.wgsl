// FlashAttention-2 backward, dQ: one workgroup per (query head, tile of BQ
// query rows), looping over the key tiles the rows can see and
// recomputing P and dS (the dK/dV kernel recomputes them too: that is the
// price of owning every output row and needing no atomics).

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
@group(0) @binding(6) var<storage, read_write> dq: array<f32>;
// The full score gradient dS, (heads, seq_q, seq_k), for the float mask's
// gradient (with DMASK; a dummy otherwise). Every element is written.
@group(0) @binding(7) var<storage, read_write> dmask: array<f32>;

override DMASK: bool = false;

var<workgroup> sq: array<f32, Q_ELEMS>;
var<workgroup> sdq: array<f32, Q_ELEMS>;
var<workgroup> sdo: array<f32, DO_ELEMS>;
var<workgroup> sk: array<f32, K_ELEMS>;
var<workgroup> sv: array<f32, V_ELEMS>;
var<workgroup> sds: array<f32, S_ELEMS>;
// The lse and delta of the tile's rows, from `stats`.
var<workgroup> lse: array<f32, ROW_ELEMS>;
var<workgroup> delta: array<f32, ROW_ELEMS>;
// How each row enters (lib/common.wgsl, row_status): 0 where it saw no
// key (P = 0), 2 where it is poisoned (dS = NaN at every key it sees),
// else 1.
var<workgroup> sok: array<u32, ROW_ELEMS>;
// docs/design.md#non-finite-inputs: k0 + 1 for each key of the tile whose
// k held a NaN or an infinity (staged as 0: dQ += dS K must not meet
// 0 * NaN where a row does not see the key).
var<workgroup> kbad: array<u32, BK>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // screen.wgsl's flag: the last word of `stats`.
    if screened_out(lid, bitcast<u32>(stats[arrayLength(&stats) - 1u].y)) {
        return;
    }
    let head = wid.y;
    let row0 = wid.x * BQ;
    let rows = min(BQ, p.seq_q - row0);
    let kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    let q_base = (head * p.seq_q + row0) * D;
    let o_base = (head * p.seq_q + row0) * DV;
    let l_base = head * p.seq_q + row0;
    let bh = p.head0 + head;

    for (var e = lid; e < BQ * D; e += WG) {
        var x = 0.0;
        if e / D < rows {
            x = in_elem(q[in_word(q_base + e)], q_base + e);
        }
        sq[e] = x;
        sdq[e] = 0.0;
    }
    for (var e = lid; e < BQ * DV; e += WG) {
        var x = 0.0;
        if e / DVN < rows {
            x = in_elem(d_out[in_word(o_base + e)], o_base + e);
        }
        sdo[e] = x;
    }
    for (var i = lid; i < BQ; i += WG) {
        var lse_i = 0.0;
        var delta_i = 0.0;
        var ok = 0u;
        if i < rows {
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
    for (var j = lid; j < BK; j += WG) {
        kbad[j] = 0u;
    }

    let key_end = visible_end(row0 + rows - 1u);
    let key_start = min(visible_start(row0), key_end);
    for (var k0 = key_start; k0 < key_end; k0 += BK) {
        let nk = min(BK, key_end - k0);
        if !mask_tile_visible(bh, row0, row0 + rows, k0, k0 + nk) {
            // The mask hides the whole tile: dS is 0 there.
            if DMASK {
                for (var e = lid; e < rows * nk; e += WG) {
                    dmask[(l_base + e / nk) * p.seq_k + k0 + e % nk] = 0.0;
                }
            }
            continue;
        }
        let k_base = (kv * p.seq_k + k0) * D;
        let v_base = (kv * p.seq_k + k0) * DV;
        // Also orders the previous tile's reads of sk/sds before these writes.
        workgroupBarrier();
        for (var e = lid; e < BK * D; e += WG) {
            var x = 0.0;
            if e / D < nk {
                x = in_elem(k[in_word(k_base + e)], k_base + e);
                if !is_finite(x) {
                    x = 0.0;
                    kbad[e / D] = k0 + 1u;
                }
            }
            sk[(e / D) * KS + e % D] = x;
        }
        for (var e = lid; e < BK * DV; e += WG) {
            var x = 0.0;
            if e / DVN < nk {
                x = in_elem(v[in_word(v_base + e)], v_base + e);
            }
            sv[(e / DVN) * VS + e % DVN] = x;
        }
        workgroupBarrier();

        for (var e = lid; e < BQ * BK; e += WG) {
            let i = e / BK;
            let j = e % BK;
            let row = row0 + i;
            let key = k0 + j;
            // dS, and dU = dS * softcap'(u).
            var ds = 0.0;
            var du = 0.0;
            if i < rows && j < nk && sok[i] != 0u && key < visible_end(row) && key >= visible_start(row) {
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
                    ds = nan_f32();
                    du = ds;
                } else if !MASK || shown(sm) {
                    let pij = pair_weight(sm, lse[i]);
                    var dp = 0.0;
                    for (var c = 0u; c < DV; c++) {
                        dp += sdo[i * DV + c] * sv[j * VS + c];
                    }
                    ds = pij * (dp * dropout_factor(bh, row, key) - delta[i]);
                    du = softcap_grad(ds, u);
                    // A key whose k held a NaN or an infinity: dQ and the
                    // score's gradient NaN.
                    if kbad[j] == k0 + 1u {
                        ds = nan_f32();
                        du = ds;
                    }
                }
            }
            if DMASK && i < rows && j < nk {
                dmask[(l_base + i) * p.seq_k + key] = ds;
            }
            sds[e] = du;
        }
        workgroupBarrier();

        for (var e = lid; e < BQ * D; e += WG) {
            let i = e / D;
            let c = e % D;
            var grad = sdq[e];
            for (var j = 0u; j < nk; j++) {
                grad += sds[i * BK + j] * sk[j * KS + c];
            }
            sdq[e] = grad;
        }
    }
    workgroupBarrier();

    if DMASK {
        // Keys outside the tiles' range: dS is 0.
        let outside = p.seq_k - (key_end - key_start);
        for (var e = lid; e < rows * outside; e += WG) {
            var key = e % outside;
            if key >= key_start {
                key += key_end - key_start;
            }
            dmask[(l_base + e / outside) * p.seq_k + key] = 0.0;
        }
    }
    for (var e = lid; e < rows * D; e += WG) {
        dq[q_base + e] = sdq[e] * p.scale;
    }
}
