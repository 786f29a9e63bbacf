#version 460
// dQ of the float16 backward on NVIDIA's cooperative matrices 2: a
// workgroup owns BR query rows of one head and walks the keys they see,
// BC at a time: S = Q K^T, P = exp2((s - lse) LOG2E) with s = S · scale
// (0 past a row's visible keys, and for a row whose lse is not finite: it
// saw none), dP = dO V^T, dS = P (dP - D), dQ += dS K, scaled on the way
// out. As shaders/coop/backward_dq.wgsl computes it (the same rounding of
// the score; dS rounded to float16 for its product), with the whole step
// in the matrices. (lse, D) per row come from the pre-pass
// (simple/backward_preprocess.wgsl). dQ is written in float32.
#extension GL_GOOGLE_include_directive : require
// The variants' arrays after the uniform and bindings 1-7 (common.glsl).
#define VX_BINDING 8
#include "common.glsl"

layout(std430, binding = 1) readonly buffer DO { float16_t d_out[]; };
layout(std430, binding = 2) readonly buffer Q { float16_t q[]; };
layout(std430, binding = 3) readonly buffer K { float16_t k[]; };
layout(std430, binding = 4) readonly buffer V { float16_t v[]; };
layout(std430, binding = 5) readonly buffer Stats { vec2 stats[]; };
layout(std430, binding = 6) writeonly buffer DQ { float dq[]; };

// P at (r, c) of the tile at (row0, col0), the head's rows from `at`.
float prob(const in uint32_t r, const in uint32_t c, const in float dot,
           const in uint32_t row0, const in uint32_t col0, const in uint32_t at,
           const in uint32_t bh) {
    const uint32_t row = row0 + r;
    const uint32_t key = col0 + c;
    if (row >= p.seq_q) {
        return 0.0;
    }
    const float lse = stats[at + row].x;
    if (isinf(lse) || isnan(lse) || !sees(row, key)) {
        return 0.0;
    }
    const float s = score_of(dot * p.scale, bh, row, key);
    return s == NEG_INF ? 0.0 : exp2((s - lse) * LOG2E);
}

// dS at (r, c): P (dP - D).
float dscore(const in uint32_t r, const in uint32_t c, const in float dp, const in float pr,
             const in uint32_t row0, const in uint32_t at) {
    const uint32_t row = row0 + r;
    return row < p.seq_q ? pr * (dp - stats[at + row].y) : 0.0;
}

// dU at (r, c) with the softcap: P (dP - D) (1 - tanh^2), u recomputed
// from the tile's dot products `dot`.
float dscore_capped(const in uint32_t r, const in uint32_t c, const in float dp,
                    const in float pr, const in float dot, const in uint32_t row0,
                    const in uint32_t at) {
    return softcap_grad(dscore(r, c, dp, pr, row0, at), dot * p.scale);
}

void main() {
    const uint32_t head = gl_WorkGroupID.y;
    const uint32_t row0 = gl_WorkGroupID.x * BR;
    const uint32_t kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    const uint32_t keys = visible_end(min(row0 + BR, p.seq_q) - 1u);
    const uint32_t start = min(visible_start(row0), keys) / BC * BC;
    const uint32_t at = head * p.seq_q;
    // The flat query head (batch × heads_q) the variants' arrays index.
    const uint32_t bh = p.head0 + head;
    const uint32_t last_row = min(row0 + BR, p.seq_q);

    ROWS(q_rows, p.seq_q, D);
    ROWS(do_rows, p.seq_q, DV);
    ROWS(k_rows, p.seq_k, D);
    ROWS(v_rows, p.seq_k, DV);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);

    F16(BR, D, gl_MatrixUseA) qm;
    coopMatLoadTensorNV(qm, q, at * D, sliceTensorLayoutNV(q_rows, row0, BR, 0, D));
    F16(BR, DV, gl_MatrixUseA) dom;
    coopMatLoadTensorNV(dom, d_out, at * DV, sliceTensorLayoutNV(do_rows, row0, BR, 0, DV));

    ACC(BR, D) acc = ACC(BR, D)(0.0);
    [[dont_unroll]]
    for (uint32_t col0 = start; col0 < keys; col0 += BC) {
        if (!mask_tile_visible(bh, row0, last_row, col0, min(col0 + BC, keys))) {
            continue;
        }
        F16(D, BC, gl_MatrixUseB) kt;
        coopMatLoadTensorNV(kt, k, kv * p.seq_k * D,
                            sliceTensorLayoutNV(k_rows, col0, BC, 0, D), transposed);
        ACC(BR, BC) dots = coopMatMulAdd(qm, kt, ACC(BR, BC)(0.0));
        ACC(BR, BC) pm;
        coopMatPerElementNV(pm, dots, prob, row0, col0, at, bh);
        F16(DV, BC, gl_MatrixUseB) vt;
        coopMatLoadTensorNV(vt, v, kv * p.seq_k * DV,
                            sliceTensorLayoutNV(v_rows, col0, BC, 0, DV), transposed);
        ACC(BR, BC) ds = coopMatMulAdd(dom, vt, ACC(BR, BC)(0.0));
        if (SOFTCAP != 0u) {
            coopMatPerElementNV(ds, ds, dscore_capped, pm, dots, row0, at);
        } else {
            coopMatPerElementNV(ds, ds, dscore, pm, row0, at);
        }
        F16(BR, BC, gl_MatrixUseA) ds16 = F16(BR, BC, gl_MatrixUseA)(ds);
        F16(BC, D, gl_MatrixUseB) km;
        coopMatLoadTensorNV(km, k, kv * p.seq_k * D, sliceTensorLayoutNV(k_rows, col0, BC, 0, D));
        acc = coopMatMulAdd(ds16, km, acc);
    }
    acc = acc * p.scale;
    ROWS(dq_rows, p.seq_q, D);
    coopMatStoreTensorNV(acc, dq, at * D, sliceTensorLayoutNV(dq_rows, row0, BR, 0, D));
}
