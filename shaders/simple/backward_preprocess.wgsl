// Backward pre-pass: D = rowsum(dO ∘ O), the per-row term of
// dS = P ∘ (dP − D), written with the row's lse as (lse, D) into one
// buffer, which the dQ and dK/dV kernels bind in place of two, with the
// lse of a poisoned row replaced by NaN (lib/common.wgsl, row_status).
//
// One invocation per row sums it in column order, the order in which the
// simple and register-tiled dQ kernels sum dP = dO · v, so that there a
// row whose o is one key's v gets dP − D = 0 exactly. The workgroup's
// rows reach it through workgroup memory, CW columns at a time, loaded so
// that a warp's loads cover consecutive columns and each invocation has
// eight in flight: walking its row from global memory, one load at a time
// with a warp's loads 32 rows apart, ran at about 355 GB/s on the H100.
//
// It also raises screen.wgsl's flag, which sends the call to the simple
// kernels, for a poisoned row and for a dO or o element that is not finite
// or is 2^48 or more in magnitude (dP, summed from such products, may
// overflow).

// Rows per workgroup, one per invocation.
override WG: u32 = 64u;
override DV: u32 = 64u;
// Columns staged per pass, and the padded row stride of the staged tiles
// (odd, so that the invocations' rows start in different banks). Mirrored
// by src/gpu/tiles/simple.rs (PREPROCESS_COLUMNS).
const CW: u32 = 16u;
const GS: u32 = CW + 1u;
override STAGED: u32 = WG * GS;

// u32 words, float32 bits or float16 pairs, read through lib/input_*.wgsl.
@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> o: array<u32>;
@group(0) @binding(3) var<storage, read> lse: array<f32>;
// One more entry than rows: the y of the last is screen.wgsl's flag.
@group(0) @binding(4) var<storage, read_write> stats: array<vec2<f32>>;

var<workgroup> gs: array<f32, STAGED>;
var<workgroup> xs: array<f32, STAGED>;

// Loads element `e` (row-major over the workgroup's rows and this pass's
// columns) of dO and o: 0 past the rows or columns.
fn load(e: u32, first: u32, rows: u32, c0: u32, cw: u32) -> vec2<f32> {
    let i = e / CW;
    let c = e % CW;
    if i < rows && c < cw {
        let at = first + i * DV + c0 + c;
        return vec2(in_elem(d_out[in_word(at)], at), in_elem(o[in_word(at)], at));
    }
    return vec2(0.0);
}

fn stage(e: u32, gx: vec2<f32>) {
    let at = (e / CW) * GS + e % CW;
    gs[at] = gx.x;
    xs[at] = gx.y;
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row0 = wid.x * WG;
    let rows = min(WG, p.seq_q - row0);
    let first = (wid.y * p.seq_q + row0) * DV;
    var delta = 0.0;
    var finite = true;
    // Whether to send the call to the simple kernels.
    var raise = false;
    for (var c0 = 0u; c0 < DV; c0 += CW) {
        let cw = min(CW, DV - c0);
        // Also orders the previous pass's reads before these writes.
        workgroupBarrier();
        // Four elements of each input per step, loaded before any is
        // stored. WG * CW is a multiple of 4 * WG.
        for (var e = lid; e < WG * CW; e += 4u * WG) {
            let a = load(e, first, rows, c0, cw);
            let b = load(e + WG, first, rows, c0, cw);
            let c = load(e + 2u * WG, first, rows, c0, cw);
            let d = load(e + 3u * WG, first, rows, c0, cw);
            stage(e, a);
            stage(e + WG, b);
            stage(e + 2u * WG, c);
            stage(e + 3u * WG, d);
        }
        workgroupBarrier();
        if lid < rows {
            for (var c = 0u; c < cw; c++) {
                let g = gs[lid * GS + c];
                let x = xs[lid * GS + c];
                finite = finite && is_finite(g) && is_finite(x);
                raise = raise || screened_f32(bitcast<u32>(g)) || screened_f32(bitcast<u32>(x));
                delta += g * x;
            }
        }
    }
    if lid >= rows {
        return;
    }
    let r = wid.y * p.seq_q + row0 + lid;
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
