enable f16;
enable wgpu_cooperative_matrix;

// FlashAttention-2 backward for float16 inputs on cooperative matrices
// (tensor cores): dQ = scale * sum_j dS_ij K_j for a block of query rows,
// dS = P o (dO V^T - D). The three products (S = Q K^T, dP = dO V^T,
// dQ += dS K) are 16x16x16 f16 products accumulated in f32; P and dS are
// taken in scalar f32 code on S and dP staged in workgroup memory, dS
// rounded to f16 for the last product. Plain and causal attention only,
// like backward_dkdv_coop.wgsl (which says more).
//
// Layout: W subgroups, each owning 16 query rows (BR = 16 W rows), whose
// Q and dO rows it keeps in registers as A matrices and whose dQ it
// accumulates in registers. Key tiles of BK rows stream through workgroup
// memory. In the scalar step lane r + 16 h takes query row r of its
// subgroup and half h of the tile's keys.

override W: u32 = 4u;
override WG: u32 = 32u * W;
override BR: u32 = 16u * W;
override BK: u32 = 32u;
override D: u32 = 64u;
override DV: u32 = 64u;
// Row strides in halves, padded by 16 bytes (see backward_dkdv_coop.wgsl).
override KS: u32 = D + 8u;
override VS: u32 = DV + 8u;
override TS: u32 = BK + 8u;
override FS: u32 = BK + 4u;
// Where the tiles live in `hs` (halves): K at 0, V at V_OFF, dS at DS_OFF.
// Q and dO are staged at 0 and BR KS first, before the loop, and read into
// registers.
override V_OFF: u32 = 32u * (64u + 8u);
override DS_OFF: u32 = 64u * (64u + 8u);
override H_ELEMS: u32 = 9216u;
override F_ELEMS: u32 = 2304u;
// Words of a K (V) tile each invocation loads: ceil(BK D / 2 / WG).
override KW: u32 = 8u;
override VW: u32 = 8u;

// See backward_dkdv_coop.wgsl.
override SUBGROUP_SCRATCH: bool = true;

const LOG2E: f32 = 1.4426950408889634;
const MAXN: u32 = 8u;
// Streamed blocks of 16 keys per tile: BK / 16 is at most this.
const MAXSB: u32 = 4u;
const MAXW: u32 = 32u;

alias A16 = coop_mat16x16<f16, A>;
alias B16 = coop_mat16x16<f16, B>;
alias C32 = coop_mat16x16<f32, C>;

@group(0) @binding(1) var<storage, read> d_out: array<u32>;
@group(0) @binding(2) var<storage, read> q: array<u32>;
@group(0) @binding(3) var<storage, read> k: array<u32>;
@group(0) @binding(4) var<storage, read> v: array<u32>;
@group(0) @binding(5) var<storage, read> stats: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> dq: array<f32>;
// The full score gradient (a dummy here: never DMASK on this kernel), in
// the layout every dQ kernel binds.
@group(0) @binding(7) var<storage, read_write> dmask: array<f32>;

override DMASK: bool = false;

var<workgroup> hs: array<f16, H_ELEMS>;
var<workgroup> s_f: array<f32, F_ELEMS>;
var<workgroup> dp_f: array<f32, F_ELEMS>;

// Waits until this subgroup's writes to its own scratch and dS rows are
// visible to the whole subgroup (see SUBGROUP_SCRATCH).
fn scratch_barrier() {
    if SUBGROUP_SCRATCH {
        subgroupBarrier();
    } else {
        workgroupBarrier();
    }
}

fn put2(at: u32, w: u32) {
    let x = unpack2x16float(w);
    hs[at] = f16(x.x);
    hs[at + 1u] = f16(x.y);
}

// The words of `nk` rows of K from row `row` this invocation stages, a
// tile ahead (as backward_dkdv_coop.wgsl's load_q).
fn load_k(row: u32, nk: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = D / 2u;
    for (var i = 0u; i < KW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BK * d2 && e / d2 < nk {
            w[i] = k[row * d2 + e];
        }
    }
    return w;
}

fn load_v(row: u32, nk: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = DV / 2u;
    for (var i = 0u; i < VW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BK * d2 && e / d2 < nk {
            w[i] = v[row * d2 + e];
        }
    }
    return w;
}

fn store_k(w: array<u32, MAXW>, lid: u32) {
    let d2 = D / 2u;
    for (var i = 0u; i < KW; i++) {
        let e = i * WG + lid;
        if e < BK * d2 {
            put2((e / d2) * KS + 2u * (e % d2), w[i]);
        }
    }
}

fn store_v(w: array<u32, MAXW>, lid: u32) {
    let d2 = DV / 2u;
    for (var i = 0u; i < VW; i++) {
        let e = i * WG + lid;
        if e < BK * d2 {
            put2(V_OFF + (e / d2) * VS + 2u * (e % d2), w[i]);
        }
    }
}

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
    if srow + r < rows {
        let st = stats[q_row0 + srow + r];
        lse_r = st.x;
        delta_r = st.y;
        if is_finite(st.x) {
            end_r = visible_end(row0 + srow + r);
        }
    }
    if DMASK {
        // Never on this kernel's pipelines; keeps binding 7 in the layout.
        dmask[0] = 0.0;
    }

    let key_end = visible_end(row0 + rows - 1u);
    var kw = load_k(kv_row0, min(BK, key_end), lid);
    var vw = load_v(kv_row0, min(BK, key_end), lid);
    for (var k0 = 0u; k0 < key_end; k0 += BK) {
        // The last tile's products are done with hs (or the Q/dO staging,
        // on the first).
        workgroupBarrier();
        store_k(kw, lid);
        store_v(vw, lid);
        workgroupBarrier();
        // The next tile's words, in flight during this tile's products.
        let k1 = k0 + BK;
        if k1 < key_end {
            kw = load_k(kv_row0 + k1, min(BK, key_end - k1), lid);
            vw = load_v(kv_row0 + k1, min(BK, key_end - k1), lid);
        }

        // S = Q K^T and dP = dO V^T for this subgroup's 16 rows; K^T and
        // V^T are K and V read column-major.
        for (var jb = 0u; jb < BK / 16u; jb++) {
            var acc = C32();
            for (var c = 0u; c < D / 16u; c++) {
                let kb = coopLoad<B16>(&hs[16u * jb * KS + 16u * c], KS);
                acc = coopMultiplyAdd(qa[c], kb, acc);
            }
            coopStoreT(acc, &s_f[srow * FS + 16u * jb], FS);
            var acc2 = C32();
            for (var c = 0u; c < DV / 16u; c++) {
                let vb = coopLoad<B16>(&hs[V_OFF + 16u * jb * VS + 16u * c], VS);
                acc2 = coopMultiplyAdd(oa[c], vb, acc2);
            }
            coopStoreT(acc2, &dp_f[srow * FS + 16u * jb], FS);
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
            let pj = select(0.0, exp2((s - lse_r) * LOG2E), k0 + j < end_r);
            hs[DS_OFF + (srow + r) * TS + j] = f16(pj * (dp_f[at] - delta_r));
        }
        scratch_barrier();

        // dQ += dS K (scaled on the way out), each column block's product
        // accumulated from zero and then added: dQ as the accumulator
        // operand, carried across tiles, measured slower (the forward's
        // O, shaders/forward_coop.wgsl).
        var da: array<A16, MAXSB>;
        for (var jb = 0u; jb < BK / 16u; jb++) {
            da[jb] = coopLoadT<A16>(&hs[DS_OFF + srow * TS + 16u * jb], TS);
        }
        for (var c = 0u; c < D / 16u; c++) {
            var acc = C32();
            for (var jb = 0u; jb < BK / 16u; jb++) {
                let kb = coopLoadT<B16>(&hs[16u * jb * KS + 16u * c], KS);
                acc = coopMultiplyAdd(da[jb], kb, acc);
            }
            gq[c] = gq[c] + acc;
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
