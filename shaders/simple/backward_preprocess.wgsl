// Backward pre-pass: D = rowsum(dO ∘ O), the per-row term of
// dS = P ∘ (dP − D), written with the row's lse as (lse, D) into one
// buffer, which the dQ and dK/dV kernels bind in place of two. One thread
// per query row; the sum runs in column order, so it is reproducible.

override WG: u32 = 64u;
override DV: u32 = 64u;

// u32 words, float32 bits or float16 pairs, read through lib/input_*.wgsl.
@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> o: array<u32>;
@group(0) @binding(3) var<storage, read> lse: array<f32>;
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>;

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
    var delta = 0.0;
    for (var c = 0u; c < DV; c++) {
        let at = r * DV + c;
        delta += in_elem(d_out[in_word(at)], at) * in_elem(o[in_word(at)], at);
    }
    stats[r] = vec2(lse[r], delta);
}
