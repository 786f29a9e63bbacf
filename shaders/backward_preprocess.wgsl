// Backward pre-pass: D = rowsum(dO ∘ O), the per-row term of
// dS = P ∘ (dP − D), written with the row's lse as (lse, D) into one
// buffer, which the dQ and dK/dV kernels bind in place of two. One thread
// per query row; the sum runs in column order, so it is reproducible.

override WG: u32 = 64u;
override DV: u32 = 64u;
// Inputs hold IEEE binary16 pairs packed in u32 words instead of f32.
override IN_F16: bool = false;


@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> o: array<u32>;
@group(0) @binding(3) var<storage, read> lse: array<f32>;
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>;

fn half_of(w: u32, i: u32) -> f32 {
    let h = unpack2x16float(w);
    return select(h.x, h.y, (i & 1u) == 1u);
}

fn ld_do(i: u32) -> f32 {
    if IN_F16 {
        return half_of(d_out[i >> 1u], i);
    }
    return bitcast<f32>(d_out[i]);
}

fn ld_o(i: u32) -> f32 {
    if IN_F16 {
        return half_of(o[i >> 1u], i);
    }
    return bitcast<f32>(o[i]);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x * WG + lid;
    if row >= p.seq_q {
        return;
    }
    let r = wid.y * p.seq_q + row;
    var acc = 0.0;
    for (var c = 0u; c < DV; c++) {
        acc += ld_do(r * DV + c) * ld_o(r * DV + c);
    }
    stats[r] = vec2(lse[r], acc);
}
