#version 460
// dK and dV of the float16 backward on NVIDIA's cooperative matrices 2: a
// workgroup owns BC keys (and their values) of one key/value head and
// walks the query rows of every query head of its group that see them, BR
// at a time: S^T = K Q^T, P^T as dQ's kernel takes P (backward_dq.comp),
// dP^T = V dO^T, dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q, dK
// scaled on the way out. As shaders/coop/backward_dkdv.wgsl computes it
// (P and dS rounded to float16 for their products), with the whole step in
// the matrices. dK and dV are written in float32.
#extension GL_GOOGLE_include_directive : require
// The variants' arrays after the uniform and bindings 1-7 (common.glsl).
#define VX_BINDING 8
#include "common.glsl"

layout(std430, binding = 1) readonly buffer DO { float16_t d_out[]; };
layout(std430, binding = 2) readonly buffer Q { float16_t q[]; };
layout(std430, binding = 3) readonly buffer K { float16_t k[]; };
layout(std430, binding = 4) readonly buffer V { float16_t v[]; };
layout(std430, binding = 5) readonly buffer Stats { vec2 stats[]; };
layout(std430, binding = 6) writeonly buffer DK { float dk[]; };
layout(std430, binding = 7) writeonly buffer DV_ { float dv[]; };

// P^T at (r, c): key key0 + r, query row row0 + c of the head's rows from
// `at`.
float prob_t(const in uint32_t r, const in uint32_t c, const in float dot,
             const in uint32_t key0, const in uint32_t row0, const in uint32_t at,
             const in uint32_t bh) {
    const uint32_t row = row0 + c;
    const uint32_t key = key0 + r;
    if (row >= p.seq_q || key >= p.seq_k) {
        return 0.0;
    }
    const float lse = stats[at + row].x;
    if (isinf(lse) || isnan(lse) || !sees(row, key)) {
        return 0.0;
    }
    const float s = score_of(dot * p.scale, bh, row, key);
    return s == NEG_INF ? 0.0 : exp2((s - lse) * LOG2E);
}

// dS^T at (r, c): P^T (dP^T - D) of query row row0 + c.
float dscore_t(const in uint32_t r, const in uint32_t c, const in float dp, const in float pr,
               const in uint32_t row0, const in uint32_t at) {
    const uint32_t row = row0 + c;
    return row < p.seq_q ? pr * (dp - stats[at + row].y) : 0.0;
}

// dU^T at (r, c) with the softcap: P^T (dP^T - D) (1 - tanh^2), u
// recomputed from the tile's dot products `dot`.
float dscore_t_capped(const in uint32_t r, const in uint32_t c, const in float dp,
                      const in float pr, const in float dot, const in uint32_t row0,
                      const in uint32_t at) {
    return softcap_grad(dscore_t(r, c, dp, pr, row0, at), dot * p.scale);
}

void main() {
    const uint32_t kvh = gl_WorkGroupID.y;
    const uint32_t key0 = gl_WorkGroupID.x * BC;
    // Rows before the first that sees these keys (causal) are skipped,
    // from a multiple of BR on (whole tiles where seq_q is one).
    uint32_t first_row = 0u;
    if (p.causal != 0u) {
        first_row = uint32_t(max(int32_t(key0) - p.causal_offset, 0));
    }
    first_row = min(first_row, p.seq_q) / BR * BR;
    // Rows past the last whose left window reaches these keys are skipped.
    const uint32_t end_row = max(rows_seeing_end(min(key0 + BC, p.seq_k)), first_row);
    const uint32_t tiles = (end_row - first_row + BR - 1u) / BR;
    const uint32_t total = p.g_count * tiles;

    ROWS(q_rows, p.seq_q, D);
    ROWS(do_rows, p.seq_q, DV);
    ROWS(k_rows, p.seq_k, D);
    ROWS(v_rows, p.seq_k, DV);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);

    F16(BC, D, gl_MatrixUseA) km;
    coopMatLoadTensorNV(km, k, kvh * p.seq_k * D, sliceTensorLayoutNV(k_rows, key0, BC, 0, D));
    F16(BC, DV, gl_MatrixUseA) vm;
    coopMatLoadTensorNV(vm, v, kvh * p.seq_k * DV, sliceTensorLayoutNV(v_rows, key0, BC, 0, DV));

    ACC(BC, D) dk_acc = ACC(BC, D)(0.0);
    ACC(BC, DV) dv_acc = ACC(BC, DV)(0.0);
    [[dont_unroll]]
    for (uint32_t it = 0; it < total; it++) {
        const uint32_t head = kvh * p.g_count + it / tiles;
        const uint32_t row0 = first_row + (it % tiles) * BR;
        const uint32_t at = head * p.seq_q;
        // The flat query head (batch × heads_q) the variants' arrays index.
        const uint32_t bh = p.head0 + head;
        if (!mask_tile_visible(bh, row0, min(row0 + BR, end_row), key0, min(key0 + BC, p.seq_k))) {
            continue;
        }
        F16(D, BR, gl_MatrixUseB) qt;
        coopMatLoadTensorNV(qt, q, at * D, sliceTensorLayoutNV(q_rows, row0, BR, 0, D), transposed);
        ACC(BC, BR) dots = coopMatMulAdd(km, qt, ACC(BC, BR)(0.0));
        ACC(BC, BR) pt;
        coopMatPerElementNV(pt, dots, prob_t, key0, row0, at, bh);
        F16(DV, BR, gl_MatrixUseB) dot_t;
        coopMatLoadTensorNV(dot_t, d_out, at * DV,
                            sliceTensorLayoutNV(do_rows, row0, BR, 0, DV), transposed);
        ACC(BC, BR) dst = coopMatMulAdd(vm, dot_t, ACC(BC, BR)(0.0));
        if (SOFTCAP != 0u) {
            coopMatPerElementNV(dst, dst, dscore_t_capped, pt, dots, row0, at);
        } else {
            coopMatPerElementNV(dst, dst, dscore_t, pt, row0, at);
        }

        F16(BC, BR, gl_MatrixUseA) pt16 = F16(BC, BR, gl_MatrixUseA)(pt);
        F16(BR, DV, gl_MatrixUseB) dom;
        coopMatLoadTensorNV(dom, d_out, at * DV, sliceTensorLayoutNV(do_rows, row0, BR, 0, DV));
        dv_acc = coopMatMulAdd(pt16, dom, dv_acc);
        F16(BC, BR, gl_MatrixUseA) ds16 = F16(BC, BR, gl_MatrixUseA)(dst);
        F16(BR, D, gl_MatrixUseB) qm;
        coopMatLoadTensorNV(qm, q, at * D, sliceTensorLayoutNV(q_rows, row0, BR, 0, D));
        dk_acc = coopMatMulAdd(ds16, qm, dk_acc);
    }
    dk_acc = dk_acc * p.scale;
    ROWS(dk_rows, p.seq_k, D);
    coopMatStoreTensorNV(dk_acc, dk, kvh * p.seq_k * D, sliceTensorLayoutNV(dk_rows, key0, BC, 0, D));
    ROWS(dv_rows, p.seq_k, DV);
    coopMatStoreTensorNV(dv_acc, dv, kvh * p.seq_k * DV, sliceTensorLayoutNV(dv_rows, key0, BC, 0, DV));
}
