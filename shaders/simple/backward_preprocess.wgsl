// Backward pre-pass: D = rowsum(dO ∘ O), the per-row term of
// dS = P ∘ (dP − D), written with the row's lse as (lse, D) into one
// buffer, which the dQ and dK/dV kernels bind in place of two, with the
// lse of a poisoned row replaced by NaN (lib/common.wgsl, row_status). One
// thread per query row; the sum runs in column order, so it is
// reproducible. It also raises screen.wgsl's flag, which sends the call to
// the simple kernels, for a poisoned row and for a dO or o element that
// is not finite or is 2^48 or more in magnitude (dP, summed from such
// products, may overflow).

override WG: u32 = 64u;
override DV: u32 = 64u;

// u32 words, float32 bits or float16 pairs, read through lib/input_*.wgsl.
@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> o: array<u32>;
@group(0) @binding(3) var<storage, read> lse: array<f32>;
// One more entry than rows: the y of the last is screen.wgsl's flag.
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
    var finite = true;
    // Whether to send the call to the simple kernels: also for a row with
    // no key (a fast kernel gives its pairs dS = 0 * (dP - D)).
    var raise = false;
    for (var c = 0u; c < DV; c++) {
        let at = r * DV + c;
        let g = in_elem(d_out[in_word(at)], at);
        let x = in_elem(o[in_word(at)], at);
        finite = finite && is_finite(g) && is_finite(x);
        raise = raise || screened_f32(bitcast<u32>(g)) || screened_f32(bitcast<u32>(x));
        delta += g * x;
    }
    // docs/design.md#non-finite-inputs: a row that saw a key (lse not
    // -inf) whose lse is NaN or +inf, or whose dO or o holds a NaN or an
    // infinity, is poisoned: its lse becomes NaN (row_status).
    var row_lse = lse[r];
    if bitcast<u32>(row_lse) != 0xff800000u && !(finite && is_finite(row_lse) && is_finite(delta)) {
        row_lse = nan_f32();
        raise = true;
    }
    if raise {
        // Every writer stores the same word.
        stats[arrayLength(&stats) - 1u].y = bitcast<f32>(1u);
    }
    stats[r] = vec2(row_lse, delta);
}
