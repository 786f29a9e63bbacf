#version 460
// The float16 forward on NVIDIA's cooperative matrices 2
// (VK_NV_cooperative_matrix2): the whole online softmax of a tile of BR
// query rows stays in the matrices (row reductions and per-element
// functions), where the portable kernels (shaders/coop/) must pass each
// score tile through workgroup memory. The structure follows ggml's
// flash_attn_cm2.comp (docs/gpu.md#cooperative-matrices-2); the arithmetic
// follows flashport's other kernels:
// - s = (q . k) * scale in float32 (the q rows are not scaled in float16),
//   and the softmax in base 2 after subtracting: exp2((s - m) * LOG2E),
//   exactly 1 at a row's maximum, as the backward recomputes it
//   (docs/gpu.md#forward-and-backward-round-the-score-the-same-way);
// - the row sums add the float32 probabilities; P V takes them rounded to
//   float16, as the other float16 kernels do;
// - keys past a row's visible end (causal) are -inf, and a row that sees
//   no key gets o = 0 and lse = -inf;
// - o and lse are written in float32 (the call rounds o to float16 where
//   it is kept as float16, as it does for every kernel).
// Float16 inputs without variants, as the cooperative tier; the uniform is
// lib/common.wgsl's Params, member for member (gpu/params.rs checks the
// Rust side; gpu/cm2.rs the offsets read here).
//
// Compiled by scripts/cm2.sh (a pinned glslang) into forward.spv; the
// specialisation constants D, DV, BR, BC and CLAMP are set in the SPIR-V
// by gpu/cm2.rs (wgpu passes none to a passthrough module).
#extension GL_GOOGLE_include_directive : require
// The variants' arrays after the uniform and bindings 1-5 (common.glsl).
#define VX_BINDING 6
#include "common.glsl"

layout(std430, binding = 1) readonly buffer Q { float16_t q[]; };
layout(std430, binding = 2) readonly buffer K { float16_t k[]; };
layout(std430, binding = 3) readonly buffer V { float16_t v[]; };
layout(std430, binding = 4) writeonly buffer O { float o[]; };
layout(std430, binding = 5) writeonly buffer LSE { float lse[]; };

// The score of element (r, c) of the tile at (row0, col0): scaled and
// softcapped, or -inf where the key is not visible to the row (or past the
// keys).
float scored(const in uint32_t r, const in uint32_t c, const in float dot,
             const in uint32_t row0, const in uint32_t col0, const in uint32_t bh) {
    const uint32_t row = row0 + r;
    const uint32_t key = col0 + c;
    return sees(row, key) ? score_of(dot * p.scale, bh, row, key) : NEG_INF;
}

// The score of a key every row of the tile sees.
float unmasked(const in uint32_t r, const in uint32_t c, const in float dot,
               const in uint32_t row0, const in uint32_t col0, const in uint32_t bh) {
    return score_of(dot * p.scale, bh, row0 + r, col0 + c);
}

float maximum(const in float a, const in float b) { return max(a, b); }
float add(const in float a, const in float b) { return a + b; }
float first(const in float a, const in float b) { return a; }

float max2(const in uint32_t r, const in uint32_t c, const in float a, const in float b) {
    return max(a, b);
}

// exp2((s - m) * LOG2E), 0 for a key not seen (s = -inf).
float prob(const in uint32_t r, const in uint32_t c, const in float s, const in float m) {
    return s == NEG_INF ? 0.0 : exp2((s - m) * LOG2E);
}

// The factor of the state so far when the maximum moves from `was` to
// `now`: 1 where it stays (-inf included: nothing seen yet).
float rescale(const in uint32_t r, const in uint32_t c, const in float was, const in float now) {
    return was == now ? 1.0 : exp2((was - now) * LOG2E);
}

// The factor of a row's accumulator, and its lse, from its maximum m and
// sum l: lib/common.wgsl's finish_row. A finite sink joins the sum (a row
// that saw no key gets o = 0 and lse = the sink); a sink of -inf is none
// (the host sends NaN and +inf sinks to the simple kernels).
vec2 finish_row(const in float m, const in float l, const in uint32_t bh) {
    if (SINKS != 0u) {
        const float sink = sink_of(bh);
        if (!isinf(sink) && !isnan(sink)) {
            const float now = max(m, sink);
            const float rescaled = m == NEG_INF ? 0.0 : exp2((m - now) * LOG2E);
            const float sum = l * rescaled + exp2((sink - now) * LOG2E);
            return vec2(rescaled / sum, now + log(sum));
        }
    }
    return l == 0.0 ? vec2(0.0, NEG_INF) : vec2(1.0 / l, m + log(l));
}

float reciprocal(const in uint32_t r, const in uint32_t c, const in float l, const in float m,
                 const in uint32_t bh) {
    return finish_row(m, l, bh).x;
}

float log_sum_exp(const in uint32_t r, const in uint32_t c, const in float m, const in float l,
                  const in uint32_t bh) {
    return finish_row(m, l, bh).y;
}

void main() {
    const uint32_t head = gl_WorkGroupID.y;
    const uint32_t row0 = gl_WorkGroupID.x * BR;
    const uint32_t kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    // The flat query head (batch × heads_q) the variants' arrays index.
    const uint32_t bh = p.head0 + head;
    const uint32_t last_row = min(row0 + BR, p.seq_q) - 1u;
    // Every key a row of the tile sees is before the last row's end and
    // from the first row's start on; every row sees the keys from the last
    // row's start to the first row's end.
    const uint32_t keys = visible_end(last_row);
    const uint32_t first_end = visible_end(row0);
    const uint32_t last_start = visible_start(last_row);
    const uint32_t start = min(visible_start(row0), keys) / BC * BC;

    tensorLayoutNV<2, CLAMP> q_rows = createTensorLayoutNV(2, CLAMP);
    q_rows = setTensorLayoutDimensionNV(q_rows, p.seq_q, D);
    tensorLayoutNV<2, CLAMP> k_rows = createTensorLayoutNV(2, CLAMP);
    k_rows = setTensorLayoutDimensionNV(k_rows, p.seq_k, D);
    tensorLayoutNV<2, CLAMP> v_rows = createTensorLayoutNV(2, CLAMP);
    v_rows = setTensorLayoutDimensionNV(v_rows, p.seq_k, DV);
    tensorLayoutNV<2, CLAMP> o_rows = createTensorLayoutNV(2, CLAMP);
    o_rows = setTensorLayoutDimensionNV(o_rows, p.seq_q, DV);
    // lse as a matrix of one column: the other columns are clamped away.
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lse_rows =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    lse_rows = setTensorLayoutDimensionNV(lse_rows, p.seq_q, 1);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);

    const uint32_t q_at = head * p.seq_q * D;
    const uint32_t k_at = kv * p.seq_k * D;
    const uint32_t v_at = kv * p.seq_k * DV;

    // Rows past seq_q load as zeros: finite scores, never written.
    coopmat<float16_t, gl_ScopeWorkgroup, BR, D, gl_MatrixUseA> qm;
    coopMatLoadTensorNV(qm, q, q_at, sliceTensorLayoutNV(q_rows, row0, BR, 0, D));

    ACC(BR, DV) acc = ACC(BR, DV)(0.0);
    ACC(BR, BC) m = ACC(BR, BC)(NEG_INF);
    ACC(BR, BC) l = ACC(BR, BC)(0.0);

    [[dont_unroll]]
    for (uint32_t col0 = start; col0 < keys; col0 += BC) {
        if (!mask_tile_visible(bh, row0, last_row + 1u, col0, min(col0 + BC, keys))) {
            // The mask hides the whole tile: it adds nothing.
            continue;
        }
        coopmat<float16_t, gl_ScopeWorkgroup, D, BC, gl_MatrixUseB> kt;
        coopMatLoadTensorNV(kt, k, k_at, sliceTensorLayoutNV(k_rows, col0, BC, 0, D), transposed);
        ACC(BR, BC) s = coopMatMulAdd(qm, kt, ACC(BR, BC)(0.0));
        if (col0 + BC <= first_end && col0 >= last_start) {
            // Every row of the tile sees every key of it (visible_end and
            // visible_start grow with the row, and stay within seq_k): no
            // window test.
            if (SOFTCAP != 0u || ALIBI != 0u || MASK != 0u) {
                coopMatPerElementNV(s, s, unmasked, row0, col0, bh);
            } else {
                s = s * p.scale;
            }
        } else {
            coopMatPerElementNV(s, s, scored, row0, col0, bh);
        }

        ACC(BR, BC) tile_max;
        coopMatReduceNV(tile_max, s, gl_CooperativeMatrixReduceRowNV, maximum);
        ACC(BR, BC) was = m;
        coopMatPerElementNV(m, tile_max, max2, was);
        ACC(BR, BC) pm;
        coopMatPerElementNV(pm, s, prob, m);
        ACC(BR, BC) alpha;
        coopMatPerElementNV(alpha, was, rescale, m);

        ACC(BR, BC) tile_sum;
        coopMatReduceNV(tile_sum, pm, gl_CooperativeMatrixReduceRowNV, add);
        l = alpha * l + tile_sum;

        coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA> ph =
            coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA>(pm);
        coopmat<float16_t, gl_ScopeWorkgroup, BC, DV, gl_MatrixUseB> vm;
        coopMatLoadTensorNV(vm, v, v_at, sliceTensorLayoutNV(v_rows, col0, BC, 0, DV));
        ACC(BR, DV) alpha_rows;
        coopMatReduceNV(alpha_rows, alpha, gl_CooperativeMatrixReduceRowNV, first);
        acc = coopMatMulAdd(ph, vm, alpha_rows * acc);
    }

    ACC(BR, BC) inv;
    coopMatPerElementNV(inv, l, reciprocal, m, bh);
    ACC(BR, DV) inv_rows;
    coopMatReduceNV(inv_rows, inv, gl_CooperativeMatrixReduceRowNV, first);
    acc = inv_rows * acc;
    coopMatStoreTensorNV(acc, o, head * p.seq_q * DV, sliceTensorLayoutNV(o_rows, row0, BR, 0, DV));

    ACC(BR, BC) row_lse;
    coopMatPerElementNV(row_lse, m, log_sum_exp, l, bh);
    coopMatStoreTensorNV(row_lse, lse, head * p.seq_q, sliceTensorLayoutNV(lse_rows, row0, BR, 0, BC));
}
