// What every kernel of NVIDIA's cooperative matrices 2 shares
// (shaders/cm2/*.comp include it; scripts/cm2.sh compiles them): the
// extensions, the workgroup, the specialisation constants gpu/cm2.rs sets,
// the uniform (lib/common.wgsl's Params, member for member) and the
// visible keys of a row.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_explicit_arithmetic_types_int32 : require
#extension GL_KHR_memory_scope_semantics : enable
#extension GL_KHR_cooperative_matrix : enable
#extension GL_NV_cooperative_matrix2 : enable

layout(local_size_x = 128, local_size_y = 1, local_size_z = 1) in;

layout(constant_id = 0) const uint32_t D = 64;
layout(constant_id = 1) const uint32_t DV = 64;
// The rows a workgroup owns and the rows (keys, or queries in the dK/dV
// kernel) it streams a step: the forward's and dQ's BR query rows, BC keys;
// dK/dV's BC keys, BR query rows.
layout(constant_id = 2) const uint32_t BR = 64;
layout(constant_id = 3) const uint32_t BC = 64;
// How tensor loads and stores treat elements past the arrays' edges:
// gl_CooperativeMatrixClampModeConstantNV (1, zeros in, nothing out), or
// 0 (undefined) where seq_q and seq_k are multiples of the tiles (the
// kernels' tiles then never reach past the arrays).
#ifndef CLAMP_DEFAULT
#define CLAMP_DEFAULT 1
#endif
layout(constant_id = 4) const uint32_t CLAMP = CLAMP_DEFAULT;
// The score variants the kernels compute, 0 or 1 (set by gpu/cm2.rs from
// the pipeline key): SOFTCAP and ALIBI, lib/variants.wgsl's (s = cap ·
// tanh(u / cap); s -= slope · |i - j|), WINDOW, the left window of
// lib/common.wgsl (the right one is causal's offset), and MASK, an
// additive mask (-inf hides a key; a bool mask comes as 0 and -inf) with
// its map of 16 × 16 blocks that hide everything; and SINKS, a logit per
// query head that joins each row's softmax without a value (the forward's
// last step; the backward reads it in the lse). Off by default, so that a
// plain call's kernel has none of them.
layout(constant_id = 5) const uint32_t SOFTCAP = 0;
layout(constant_id = 6) const uint32_t WINDOW = 0;
layout(constant_id = 7) const uint32_t ALIBI = 0;
layout(constant_id = 8) const uint32_t MASK = 0;
layout(constant_id = 9) const uint32_t SINKS = 0;

layout(std140, binding = 0) uniform Params {
    uint32_t seq_q;
    uint32_t seq_k;
    uint32_t group;
    uint32_t q_head0;
    uint32_t causal;
    int32_t causal_offset;
    float scale;
    uint32_t g_count;
    uint32_t head0;
    uint32_t heads_q;
    int32_t diag_offset;
    int32_t left_offset;
    float softcap;
    float keep_scale;
    uint32_t drop_threshold;
    uint32_t seed_lo;
    uint32_t seed_hi;
    uint32_t mask_sb;
    uint32_t mask_sh;
    uint32_t mask_sr;
    uint32_t mask_sk;
    uint32_t mask_db;
    uint32_t mask_dh;
    uint32_t mask_dr;
    uint32_t mask_dk;
    uint32_t mask_bcr;
    uint32_t mask_bck;
    uint32_t blocks_off;
    uint32_t slopes_off;
    uint32_t sinks_off;
    uint32_t rows_off;
    uint32_t pad1;
} p;

// The variants' arrays, one buffer, as lib/common.wgsl's `vx`: the mask
// (float32 bits) from 0, its block map from blocks_off, the ALiBi slopes
// per flat query head from slopes_off, the sinks per query head from
// sinks_off. The host binds it where the WGSL
// kernels have it (wgpu binding 15), but wgpu-hal numbers a layout's
// Vulkan bindings in the order of its entries (wgpu-hal 30,
// vulkan/device.rs, create_bind_group_layout), which a passthrough module
// must use: right after the kernel's other bindings, VX_BINDING, which
// each kernel defines before it includes this file.
layout(std430, binding = VX_BINDING) readonly buffer VX { uint32_t vx[]; };

const float LOG2E = 1.4426950408889634;
const uint32_t MASK_BLOCK = 16u;
const uint32_t NEG_INF_BITS = 0xff800000u;
#define NEG_INF uintBitsToFloat(0xff800000u)

#define ACC(R, C) coopmat<float, gl_ScopeWorkgroup, R, C, gl_MatrixUseAccumulator>

// The keys query row `row` sees: [0, visible_end(row)) (lib/common.wgsl).
uint32_t visible_end(uint32_t row) {
    if (p.causal == 0u) {
        return p.seq_k;
    }
    return uint32_t(clamp(int32_t(row) + p.causal_offset + 1, 0, int32_t(p.seq_k)));
}

// The left window: query `row` sees keys from visible_start(row) (the
// range may be empty).
uint32_t visible_start(uint32_t row) {
    if (WINDOW == 0u) {
        return 0u;
    }
    return uint32_t(clamp(int32_t(row) + p.left_offset, 0, int32_t(p.seq_k)));
}

// The first query row past those whose left window reaches below
// `key_end` (rows' starts grow with their index).
uint32_t rows_seeing_end(uint32_t key_end) {
    if (WINDOW == 0u) {
        return p.seq_q;
    }
    return uint32_t(clamp(int32_t(key_end) - p.left_offset, 0, int32_t(p.seq_q)));
}

// lib/tanh.wgsl's tanh_f32, line for line: float32 precision on every
// driver (GLSL's builtin may be a hardware approximation).
float tanh_f32(const in float x) {
    if (isnan(x)) {
        return x;
    }
    const float a = min(abs(x), 10.0);
    if (a < 0.5) {
        const float t = x * x;
        float s = -929569.0 / 638512875.0;
        s = s * t + 21844.0 / 6081075.0;
        s = s * t - 1382.0 / 155925.0;
        s = s * t + 62.0 / 2835.0;
        s = s * t - 17.0 / 315.0;
        s = s * t + 2.0 / 15.0;
        s = s * t - 1.0 / 3.0;
        return x + x * (t * s);
    }
    return sign(x) * (1.0 - 2.0 / (exp(2.0 * a) + 1.0));
}

// The score s of (flat query head bh, row, key) from u = scale * q . k,
// as lib/common.wgsl's `score` computes it for the variants these kernels
// take: softcap, ALiBi, then the mask; -inf where the mask hides the key.
float score_of(const in float u, const in uint32_t bh, const in uint32_t row,
               const in uint32_t key) {
    float s = u;
    if (SOFTCAP != 0u) {
        s = p.softcap * tanh_f32(u / p.softcap);
    }
    if (ALIBI != 0u) {
        const float slope = uintBitsToFloat(vx[p.slopes_off + bh]);
        s -= slope * float(abs(int32_t(row) + p.diag_offset - int32_t(key)));
    }
    if (MASK != 0u) {
        if (row >= p.seq_q || key >= p.seq_k) {
            return NEG_INF;
        }
        const uint32_t b = bh / p.heads_q;
        const uint32_t h = bh % p.heads_q;
        const uint32_t bits = vx[b * p.mask_sb + h * p.mask_sh + row * p.mask_sr + key * p.mask_sk];
        if (bits == NEG_INF_BITS) {
            return NEG_INF;
        }
        s += uintBitsToFloat(bits);
    }
    return s;
}

// The sink of flat query head bh (SINKS).
float sink_of(const in uint32_t bh) {
    return uintBitsToFloat(vx[p.sinks_off + bh % p.heads_q]);
}

// Whether the mask leaves any score of rows [r0, r1) x keys [c0, c1) of
// head bh (lib/common.wgsl's mask_tile_visible): false lets a workgroup
// skip the tile. Uniform indices: a uniform answer.
bool mask_tile_visible(const in uint32_t bh, const in uint32_t r0, const in uint32_t r1,
                       const in uint32_t c0, const in uint32_t c1) {
    if (MASK == 0u || r0 >= r1 || c0 >= c1) {
        return true;
    }
    const uint32_t b = min(bh / p.heads_q, p.mask_db - 1u);
    const uint32_t h = min(bh % p.heads_q, p.mask_dh - 1u);
    const uint32_t plane = p.blocks_off + (b * p.mask_dh + h) * p.mask_bcr * p.mask_bck;
    uint32_t rb0 = 0u;
    uint32_t rb1 = 1u;
    if (p.mask_dr != 1u) {
        rb0 = r0 / MASK_BLOCK;
        rb1 = (r1 - 1u) / MASK_BLOCK + 1u;
    }
    uint32_t kb0 = 0u;
    uint32_t kb1 = 1u;
    if (p.mask_dk != 1u) {
        kb0 = c0 / MASK_BLOCK;
        kb1 = (c1 - 1u) / MASK_BLOCK + 1u;
    }
    bool any = false;
    for (uint32_t rb = rb0; rb < rb1; rb++) {
        for (uint32_t kb = kb0; kb < kb1; kb++) {
            any = any || vx[plane + rb * p.mask_bck + kb] != 0u;
        }
    }
    return any;
}

// dS -> dU: the softcap's derivative 1 - tanh^2, tanh recomputed from u
// (lib/common.wgsl's softcap_grad).
float softcap_grad(const in float ds, const in float u) {
    if (SOFTCAP == 0u) {
        return ds;
    }
    const float t = tanh_f32(u / p.softcap);
    return ds * (1.0 - t * t);
}

// Whether query `row` sees key `key`: within its window and causal end.
bool sees(const in uint32_t row, const in uint32_t key) {
    return key < visible_end(row) && key >= visible_start(row);
}


#define F16(R, C, USE) coopmat<float16_t, gl_ScopeWorkgroup, R, C, USE>

// A 2-D tensor layout of `rows` × `cols` with the kernel's clamp mode.
#define ROWS(name, rows, cols) \
    tensorLayoutNV<2, CLAMP> name = createTensorLayoutNV(2, CLAMP); \
    name = setTensorLayoutDimensionNV(name, rows, cols)
