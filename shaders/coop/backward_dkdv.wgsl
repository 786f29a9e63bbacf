// FlashAttention-2 backward for float16 inputs on cooperative matrices
// (tensor cores): dV = sum_i P_ij dO_i and dK = scale * sum_i dS_ij Q_i
// over the query rows i, for a block of key rows. The four products
// (S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q) are 16x16x16
// f16 products accumulated in f32; P = exp(S - lse) and dS = P (dP - D)
// are taken in scalar f32 code on S^T and dP^T staged in workgroup memory,
// then rounded to f16 for the last two products (as FlashAttention-2 does
// on tensor cores). Plain and causal attention only; the host keeps every
// other variant on the tiled kernels (src/gpu/mod.rs, coop_backward).
//
// The host prepends lib/coop.wgsl (the `enable` lines, the matrix types,
// what the device must have), lib/common.wgsl and lib/coop_backward.wgsl
// (the overrides, staging and waits both backward kernels share).
//
// Layout: W subgroups, each owning 16 key rows (BR = 16 W keys per
// workgroup), whose K and V rows it keeps in registers as A matrices, and
// whose dK and dV it accumulates in registers. Query tiles of BQ rows
// stream through workgroup memory. In the scalar step lane r + 16 h takes
// key row r of its subgroup and half h of the tile's queries.

// The rows of a query tile: BS of lib/coop_backward.wgsl.
override BQ: u32 = BS;
// Where P^T and dS^T live in `hs` (halves), after Q (at 0) and dO (at
// DV_OFF). K and V are staged at 0 and BR KS first, before the loop, and
// read into registers.
override PT_OFF: u32 = 64u * (64u + 8u);
override DT_OFF: u32 = 64u * (64u + 8u) + 64u * 40u;

// Two f16 per u32: rows are multiples of 16 elements. dO (binding 1) and
// Q (binding 2) are the streamed inputs (lib/coop_backward.wgsl).
@group(0) @binding(1) var<storage, read> streamed_dv: array<u32>;
@group(0) @binding(2) var<storage, read> streamed_d: array<u32>;
@group(0) @binding(3) var<storage, read> k: array<u32>;
@group(0) @binding(4) var<storage, read> v: array<u32>;
// (lse, D) of each query row, from the pre-pass.
@group(0) @binding(5) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> dk: array<f32>;
@group(0) @binding(7) var<storage, read_write> dv: array<f32>;

var<workgroup> s_t: array<f32, F_ELEMS>;
var<workgroup> dp_t: array<f32, F_ELEMS>;
// Per query row of the tile: lse, delta, and the end of its visible keys (0
// for rows past the tile or whose lse is not finite: they saw no key).
var<workgroup> lse: array<f32, BQ>;
var<workgroup> delta: array<f32, BQ>;
var<workgroup> row_end: array<u32, BQ>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let kvh = wid.y;
    let k0 = wid.x * BR;
    let nk = min(BR, p.seq_k - k0);
    let d2 = D / 2u;
    let dv2 = DV / 2u;

    // Key rows past seq_k are zeros: finite scores, never visible, never
    // written out.
    for (var e = lid; e < BR * d2; e += WG) {
        var w = 0u;
        if e / d2 < nk {
            w = k[(kvh * p.seq_k + k0) * d2 + e];
        }
        put2((e / d2) * KS + 2u * (e % d2), w);
    }
    for (var e = lid; e < BR * dv2; e += WG) {
        var w = 0u;
        if e / dv2 < nk {
            w = v[(kvh * p.seq_k + k0) * dv2 + e];
        }
        put2(BR * KS + (e / dv2) * VS + 2u * (e % dv2), w);
    }
    workgroupBarrier();
    let srow = 16u * sg;
    var ka: array<A16, MAXN>;
    var va: array<A16, MAXN>;
    for (var c = 0u; c < D / 16u; c++) {
        ka[c] = coopLoadT<A16>(&hs[srow * KS + 16u * c], KS);
    }
    for (var c = 0u; c < DV / 16u; c++) {
        va[c] = coopLoadT<A16>(&hs[BR * KS + srow * VS + 16u * c], VS);
    }
    var gk: array<C32, MAXN>;
    var gv: array<C32, MAXN>;

    let r = lane & 15u;
    let h = lane >> 4u;
    let krow = k0 + srow + r;
    let hq = BQ / 2u;
    // VARLEN: rows from `seen_by` on start after this lane's key (they
    // belong to a later sequence, or their window has moved past it).
    var seen_by = p.seq_q;
    if VARLEN {
        seen_by = varlen_key(krow + 1u, 1u);
    }

    // Query rows above `first_row` see none of these keys (causal; with
    // VARLEN, earlier sequences), nor do those from `rows_end` on (VARLEN:
    // later sequences).
    var first_row = 0u;
    if p.causal != 0u {
        first_row = u32(max(i32(k0) - p.causal_offset, 0));
    }
    var rows_end = p.seq_q;
    if VARLEN {
        first_row = varlen_first_row(k0);
        rows_end = varlen_key(k0 + nk, 1u);
    }
    first_row = min(first_row, rows_end);
    let n_tiles = (rows_end - first_row + BQ - 1u) / BQ;
    // One flat loop over (query head of the group, query tile), so that
    // the prefetch crosses head boundaries.
    let total = p.g_count * n_tiles;
    var qw: array<u32, MAXW>;
    var ow: array<u32, MAXW>;
    if total > 0u {
        let nr = min(BQ, rows_end - first_row);
        qw = load_d(kvh * p.g_count * p.seq_q + first_row, nr, lid);
        ow = load_dv(kvh * p.g_count * p.seq_q + first_row, nr, lid);
    }
    for (var it = 0u; it < total; it++) {
        let head = kvh * p.g_count + it / n_tiles;
        let r0 = first_row + (it % n_tiles) * BQ;
        let nr = min(BQ, rows_end - r0);
        let q_row = head * p.seq_q + r0;
        // The K/V staging (first pass) or the last tile's products are
        // done with hs.
        workgroupBarrier();
        store_d(qw, lid);
        store_dv(ow, lid);
        for (var j = lid; j < BQ; j += WG) {
            var end = 0u;
            var st = vec2(0.0);
            if j < nr {
                st = stats[q_row + j];
                if is_finite(st.x) {
                    end = visible_end(r0 + j);
                }
            }
            lse[j] = st.x;
            delta[j] = st.y;
            row_end[j] = end;
        }
        workgroupBarrier();
        // The next tile's words, in flight during this tile's products.
        let it1 = it + 1u;
        if it1 < total {
            let next_row = (kvh * p.g_count + it1 / n_tiles) * p.seq_q + first_row + (it1 % n_tiles) * BQ;
            let nr1 = min(BQ, rows_end - first_row - (it1 % n_tiles) * BQ);
            qw = load_d(next_row, nr1, lid);
            ow = load_dv(next_row, nr1, lid);
        }

        // S^T = K Q^T and dP^T = V dO^T for this subgroup's 16 keys; Q^T
        // is Q read column-major.
        for (var jb = 0u; jb < BQ / 16u; jb++) {
            var prod = C32();
            for (var c = 0u; c < D / 16u; c++) {
                let qb = coopLoad<B16>(&hs[16u * jb * KS + 16u * c], KS);
                prod = coopMultiplyAdd(ka[c], qb, prod);
            }
            coopStoreT(prod, &s_t[srow * FS + 16u * jb], FS);
            var prod2 = C32();
            for (var c = 0u; c < DV / 16u; c++) {
                let ob = coopLoad<B16>(&hs[DV_OFF + 16u * jb * VS + 16u * c], VS);
                prod2 = coopMultiplyAdd(va[c], ob, prod2);
            }
            coopStoreT(prod2, &dp_t[srow * FS + 16u * jb], FS);
        }
        scratch_barrier();

        // P and dS of this lane's key against its half of the queries.
        // Invisible pairs (causal, rows past the tile, keys past seq_k:
        // visible_end never exceeds seq_k) get exactly 0.
        for (var i = 0u; i < hq; i++) {
            let j = h * hq + i;
            let at = (srow + r) * FS + j;
            var s = s_t[at] * p.scale;
            if MODIFIES {
                // Never on this kernel's pipelines; keeps binding 15 in the
                // automatic layout, which every backward binds.
                s = score(s, p.head0 + head, r0 + j, krow);
            }
            var seen = krow < row_end[j];
            if VARLEN {
                seen = seen && r0 + j < seen_by;
            }
            let pj = select(0.0, exp2((s - lse[j]) * LOG2E), seen);
            let dsj = pj * (dp_t[at] - delta[j]);
            hs[PT_OFF + (srow + r) * TS + j] = f16(pj);
            hs[DT_OFF + (srow + r) * TS + j] = f16(dsj);
        }
        scratch_barrier();

        // dV += P^T dO and dK += dS^T Q (scaled on the way out), each
        // column block's product accumulated from zero and then added:
        // the gradients as the accumulator operand, carried across tiles,
        // measured slower (the forward's acc, coop/forward.wgsl).
        var pa: array<A16, MAXSB>;
        var da: array<A16, MAXSB>;
        for (var jb = 0u; jb < BQ / 16u; jb++) {
            pa[jb] = coopLoadT<A16>(&hs[PT_OFF + srow * TS + 16u * jb], TS);
            da[jb] = coopLoadT<A16>(&hs[DT_OFF + srow * TS + 16u * jb], TS);
        }
        for (var c = 0u; c < DV / 16u; c++) {
            var prod = C32();
            for (var jb = 0u; jb < BQ / 16u; jb++) {
                let ob = coopLoadT<B16>(&hs[DV_OFF + 16u * jb * VS + 16u * c], VS);
                prod = coopMultiplyAdd(pa[jb], ob, prod);
            }
            gv[c] = gv[c] + prod;
        }
        for (var c = 0u; c < D / 16u; c++) {
            var prod = C32();
            for (var jb = 0u; jb < BQ / 16u; jb++) {
                let qb = coopLoadT<B16>(&hs[16u * jb * KS + 16u * c], KS);
                prod = coopMultiplyAdd(da[jb], qb, prod);
            }
            gk[c] = gk[c] + prod;
        }
    }

    // Out through the scratch, BQ columns at a time, rows past seq_k
    // skipped.
    let base = kvh * p.seq_k + k0 + srow;
    for (var c0 = 0u; c0 < DV; c0 += BQ) {
        let width = min(BQ, DV - c0);
        for (var c = c0 / 16u; c < (c0 + width) / 16u; c++) {
            coopStoreT(gv[c], &s_t[srow * FS + 16u * c - c0], FS);
        }
        workgroupBarrier();
        for (var e = lane; e < 16u * width; e += 32u) {
            let i = e / width;
            if srow + i < nk {
                dv[(base + i) * DV + c0 + e % width] = s_t[(srow + i) * FS + e % width];
            }
        }
        workgroupBarrier();
    }
    for (var c0 = 0u; c0 < D; c0 += BQ) {
        let width = min(BQ, D - c0);
        for (var c = c0 / 16u; c < (c0 + width) / 16u; c++) {
            coopStoreT(gk[c], &s_t[srow * FS + 16u * c - c0], FS);
        }
        workgroupBarrier();
        for (var e = lane; e < 16u * width; e += 32u) {
            let i = e / width;
            if srow + i < nk {
                dk[(base + i) * D + c0 + e % width] = s_t[(srow + i) * FS + e % width] * p.scale;
            }
        }
        workgroupBarrier();
    }
}
