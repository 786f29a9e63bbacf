// FlashAttention-2 backward for float16 inputs on cooperative matrices
// (tensor cores): dQ = scale * sum_j dS_ij K_j for a block of query rows,
// dS = P o (dO V^T - D). The three products (S = Q K^T, dP = dO V^T,
// dQ += dS K) are 16x16x16 f16 products accumulated in f32; P and dS are
// taken in scalar f32 code on S and dP staged in workgroup memory, dS
// rounded to f16 for the last product. Plain and causal attention only,
// like coop/backward_dkdv.wgsl (which says more).
//
// The host prepends lib/coop.wgsl, lib/common.wgsl and
// lib/coop_backward.wgsl (the overrides, staging and waits both backward
// kernels share).
//
// Layout: W subgroups, each owning 16 query rows (BR = 16 W rows), whose
// Q and dO rows it keeps in registers as A matrices and whose dQ it
// accumulates in registers. Key tiles of BK rows stream through workgroup
// memory. In the scalar step lane r + 16 h takes query row r of its
// subgroup and half h of the tile's keys.

// The rows of a key tile: BS of lib/coop_backward.wgsl.
override BK: u32 = BS;
// Where dS lives in `hs` (halves), after K (at 0) and V (at DV_OFF). Q
// and dO are staged at 0 and BR KS first, before the loop, and read into
// registers.
override DS_OFF: u32 = 64u * (64u + 8u);

// Two f16 per u32: rows are multiples of 16 elements. K and V are the
// streamed inputs (lib/coop_backward.wgsl).
@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<u32>;
@group(0) @binding(3) var<storage, read> streamed_d: array<u32>;
@group(0) @binding(4) var<storage, read> streamed_dv: array<u32>;
@group(0) @binding(5) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> dq: array<f32>;
// The full score gradient (a dummy here: never DMASK on this kernel), in
// the layout every dQ kernel binds.
@group(0) @binding(7) var<storage, read_write> dmask: array<f32>;

override DMASK: bool = false;

var<workgroup> s_f: array<f32, F_ELEMS>;
var<workgroup> dp_f: array<f32, F_ELEMS>;

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let head = wid.y;
    let row0 = wid.x * BR;
    let rows = min(BR, p.seq_q - row0);
    let kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    let kv_row0 = kv * p.seq_k;
    let d2 = D / 2u;
    let dv2 = DV / 2u;
    let q_row0 = head * p.seq_q + row0;

    // Rows past seq_q are zeros: finite scores, never visible, never
    // written out.
    for (var e = lid; e < BR * d2; e += WG) {
        var w = 0u;
        if e / d2 < rows {
            w = q[q_row0 * d2 + e];
        }
        put2((e / d2) * KS + 2u * (e % d2), w);
    }
    for (var e = lid; e < BR * dv2; e += WG) {
        var w = 0u;
        if e / dv2 < rows {
            w = d_out[q_row0 * dv2 + e];
        }
        put2(BR * KS + (e / dv2) * VS + 2u * (e % dv2), w);
    }
    workgroupBarrier();
    let srow = 16u * sg;
    var qa: array<A16, MAXN>;
    var oa: array<A16, MAXN>;
    for (var c = 0u; c < D / 16u; c++) {
        qa[c] = coopLoadT<A16>(&hs[srow * KS + 16u * c], KS);
    }
    for (var c = 0u; c < DV / 16u; c++) {
        oa[c] = coopLoadT<A16>(&hs[BR * KS + srow * VS + 16u * c], VS);
    }
    var gq: array<C32, MAXN>;

    // This lane's query row and half of each key tile; its lse, D and
    // visible keys (none where the row is past seq_q or its lse is not
    // finite).
    let r = lane & 15u;
    let h = lane >> 4u;
    let hk = BK / 2u;
    var lse_r = 0.0;
    var delta_r = 0.0;
    var end_r = 0u;
    // VARLEN: the row's first key (keys before it are another sequence's).
    var start_r = 0u;
    if srow + r < rows {
        let st = stats[q_row0 + srow + r];
        lse_r = st.x;
        delta_r = st.y;
        if is_finite(st.x) {
            end_r = visible_end(row0 + srow + r);
        }
        if VARLEN {
            start_r = varlen_row(row0 + srow + r, 0u);
        }
    }
    if DMASK {
        // Never on this kernel's pipelines; keeps binding 7 in the layout.
        dmask[0] = 0.0;
    }

    let key_end = visible_end(row0 + rows - 1u);
    // Rows start at key 0, a packed batch's at their sequence's keys (the
    // first row starts first).
    var key_start = 0u;
    if VARLEN {
        key_start = min(varlen_row(row0, 0u), key_end);
    }
    var kw = load_d(kv_row0 + key_start, min(BK, key_end - key_start), lid);
    var vw = load_dv(kv_row0 + key_start, min(BK, key_end - key_start), lid);
    for (var k0 = key_start; k0 < key_end; k0 += BK) {
        // The last tile's products are done with hs (or the Q/dO staging,
        // on the first).
        workgroupBarrier();
        store_d(kw, lid);
        store_dv(vw, lid);
        workgroupBarrier();
        // The next tile's words, in flight during this tile's products.
        let k1 = k0 + BK;
        if k1 < key_end {
            kw = load_d(kv_row0 + k1, min(BK, key_end - k1), lid);
            vw = load_dv(kv_row0 + k1, min(BK, key_end - k1), lid);
        }

        // S = Q K^T and dP = dO V^T for this subgroup's 16 rows; K^T and
        // V^T are K and V read column-major.
        for (var jb = 0u; jb < BK / 16u; jb++) {
            var prod = C32();
            for (var c = 0u; c < D / 16u; c++) {
                let kb = coopLoad<B16>(&hs[16u * jb * KS + 16u * c], KS);
                prod = coopMultiplyAdd(qa[c], kb, prod);
            }
            coopStoreT(prod, &s_f[srow * FS + 16u * jb], FS);
            var prod2 = C32();
            for (var c = 0u; c < DV / 16u; c++) {
                let vb = coopLoad<B16>(&hs[DV_OFF + 16u * jb * VS + 16u * c], VS);
                prod2 = coopMultiplyAdd(oa[c], vb, prod2);
            }
            coopStoreT(prod2, &dp_f[srow * FS + 16u * jb], FS);
        }
        scratch_barrier();

        // dS of this lane's row against its half of the keys; invisible
        // pairs (causal, keys past the tile) get exactly 0.
        for (var i = 0u; i < hk; i++) {
            let j = h * hk + i;
            let at = (srow + r) * FS + j;
            var s = s_f[at] * p.scale;
            if MODIFIES {
                // Never on this kernel's pipelines; keeps binding 15 in the
                // automatic layout, which every backward binds.
                s = score(s, p.head0 + head, row0 + srow + r, k0 + j);
            }
            var seen = k0 + j < end_r;
            if VARLEN {
                seen = seen && k0 + j >= start_r;
            }
            let pj = select(0.0, exp2((s - lse_r) * LOG2E), seen);
            hs[DS_OFF + (srow + r) * TS + j] = f16(pj * (dp_f[at] - delta_r));
        }
        scratch_barrier();

        // dQ += dS K (scaled on the way out), each column block's product
        // accumulated from zero and then added: dQ as the accumulator
        // operand, carried across tiles, measured slower (the forward's
        // acc, coop/forward.wgsl).
        var da: array<A16, MAXSB>;
        for (var jb = 0u; jb < BK / 16u; jb++) {
            da[jb] = coopLoadT<A16>(&hs[DS_OFF + srow * TS + 16u * jb], TS);
        }
        for (var c = 0u; c < D / 16u; c++) {
            var prod = C32();
            for (var jb = 0u; jb < BK / 16u; jb++) {
                let kb = coopLoadT<B16>(&hs[16u * jb * KS + 16u * c], KS);
                prod = coopMultiplyAdd(da[jb], kb, prod);
            }
            gq[c] = gq[c] + prod;
        }
    }

    // Out through the scratch, BK columns at a time, rows past seq_q
    // skipped.
    for (var c0 = 0u; c0 < D; c0 += BK) {
        let width = min(BK, D - c0);
        for (var c = c0 / 16u; c < (c0 + width) / 16u; c++) {
            coopStoreT(gq[c], &s_f[srow * FS + 16u * c - c0], FS);
        }
        workgroupBarrier();
        for (var e = lane; e < 16u * width; e += 32u) {
            let i = e / width;
            if srow + i < rows {
                dq[(q_row0 + srow + i) * D + c0 + e % width] = s_f[(srow + i) * FS + e % width] * p.scale;
            }
        }
        workgroupBarrier();
    }
}
