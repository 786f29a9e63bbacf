enable f16;
enable wgpu_cooperative_matrix;

// FlashAttention-2 forward for float16 inputs on cooperative matrices
// (tensor cores): QK^T and PV are 16x16x16 f16 products accumulated in
// f32; the online softmax runs in scalar f32 code on the scores staged in
// workgroup memory. Plain and causal attention only: the host keeps every
// other variant on the other kernels (src/gpu/mod.rs, coop_tiles).
//
// The `enable` lines above must open the module, so the host puts them
// before shaders/common.wgsl (src/gpu/shaders.rs). Needs the device
// features SHADER_F16, SUBGROUP and EXPERIMENTAL_COOPERATIVE_MATRIX with a
// 16x16x16 f16 -> f32 configuration and subgroups of exactly 32 lanes.
//
// Layout: W subgroups per workgroup, each owning 16 query rows (BQ = 16 W
// rows); key tiles of BK rows. In the scalar softmax step a row belongs to
// two lanes of its subgroup (lane = 2 r + h), which take alternate columns.
//
// Every workgroup variable is a multiple of 16 bytes (`rescale` is a
// vec4): cooperative loads and stores need 16-byte aligned pointers
// (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986) and the driver, not
// the declaration order, places the variables. With a lone u32 flag here
// the kernel gave wrong results on the H100 (out error 1.2); with the vec4
// it matches the float64 reference as well as the scalar float16 kernel
// (benchmarks/GPU_NOTES.md). The host still runs it only with
// FLASHPORT_GPU_COOP=1 (it is slower than the float32 tiled kernel).
//
// Rescaling is lazy (as in FlashAttention-3): a row keeps its reference
// maximum m until a tile's maximum exceeds it by more than TAU, so
// exp(s - m) <= e^TAU stays well inside float16 for P, and the O
// accumulators go through workgroup memory for the per-row correction
// only on the tiles where some row moved its m. The result is the same
// softmax (the final division and lse use the same m), only rounded
// differently.

override W: u32 = 4u;
override WG: u32 = 32u * W;
override BQ: u32 = 16u * W;
override BK: u32 = 64u;
override D: u32 = 64u;
override DV: u32 = 64u;
// Row strides, padded by 16 bytes so that the 16 rows a coopLoad reads
// start in different banks.
override QS: u32 = D + 8u;
override KS: u32 = D + 8u;
override VS: u32 = DV + 8u;
override PS: u32 = BK + 8u;
override SS: u32 = BK + 4u;
override OS: u32 = DV + 4u;
// Array sizes (products computed by the host, src/gpu/shaders.rs).
override K_ELEMS: u32 = 4608u;
override V_ELEMS: u32 = 4608u;
// Q is staged once and read into registers before P first needs the room.
override QP_ELEMS: u32 = 4608u;
// f32 scratch: the scores of a tile, or O for a rescale and the output.
override F_ELEMS: u32 = 4352u;

const TAU: f32 = 8.0;
// D / 16 and DV / 16 are at most MAXN (head dimensions up to 128).
const MAXN: u32 = 8u;

alias A16 = coop_mat16x16<f16, A>;
alias B16 = coop_mat16x16<f16, B>;
alias C32 = coop_mat16x16<f32, C>;

// Eight f16 per vec4<u32>: rows are multiples of 16 elements.
@group(0) @binding(1) var<storage, read> q: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> k: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> v: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;

var<workgroup> ks: array<f16, K_ELEMS>;
var<workgroup> vs: array<f16, V_ELEMS>;
var<workgroup> qp: array<f16, QP_ELEMS>;
var<workgroup> sf: array<f32, F_ELEMS>;
var<workgroup> row_l: array<f32, BQ>;
var<workgroup> row_m: array<f32, BQ>;
// A vector, so that every workgroup variable is a multiple of 16 bytes:
// cooperative loads and stores need 16-byte aligned pointers, and the
// driver places the variables (a lone u32 could shift the arrays after it).
var<workgroup> rescale: vec4<u32>;

// The eight halves of a word quadruple, in memory order. (naga 30 types
// bitcast<vec2<f16>>(u32) as f32; the round trip through f32 is exact.)
fn halves(w: vec4<u32>) -> array<f16, 8> {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    return array<f16, 8>(h0.x, h0.y, h1.x, h1.y, h2.x, h2.y, h3.x, h3.y);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let head = wid.y;
    let row0 = wid.x * BQ;
    let rows = min(BQ, p.seq_q - row0);
    let kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    let kv_row0 = kv * p.seq_k;
    let bh = p.head0 + head;
    let d8 = D / 8u;
    let dv8 = DV / 8u;

    // Q rows past seq_q are zeros: finite scores, never written out.
    for (var e = lid; e < BQ * d8; e += WG) {
        let r = e / d8;
        let c = e % d8;
        var w = vec4<u32>(0u);
        if r < rows {
            w = q[(head * p.seq_q + row0 + r) * d8 + c];
        }
        let at = r * QS + 8u * c;
        let x = halves(w);
        for (var i = 0u; i < 8u; i++) {
            qp[at + i] = x[i];
        }
    }
    workgroupBarrier();
    let srow = 16u * sg;
    var qa: array<A16, MAXN>;
    for (var c = 0u; c < D / 16u; c++) {
        qa[c] = coopLoadT<A16>(&qp[srow * QS + 16u * c], QS);
    }
    var o: array<C32, MAXN>;

    // This lane's row in the softmax step, and its half of the columns.
    let r = lane >> 1u;
    let h = lane & 1u;
    let grow = row0 + srow + r;
    var row_end = 0u;
    if grow < p.seq_q {
        row_end = visible_end(grow);
    }
    var m = NEG_BIG;
    // This lane's half of the row sum.
    var l = 0.0;

    let key_end = visible_end(row0 + rows - 1u);
    for (var k0 = 0u; k0 < key_end; k0 += BK) {
        let nk = min(BK, key_end - k0);
        // The previous tile's reads of ks, vs, qp, sf and `rescale` are done.
        workgroupBarrier();
        if lid == 0u {
            rescale.x = 0u;
        }
        // Keys past the tile's end are zeros: P is 0 there and 0 * V must
        // not be NaN.
        for (var e = lid; e < BK * d8; e += WG) {
            let j = e / d8;
            var w = vec4<u32>(0u);
            if j < nk {
                w = k[(kv_row0 + k0 + j) * d8 + e % d8];
            }
            let at = j * KS + 8u * (e % d8);
            let x = halves(w);
            for (var i = 0u; i < 8u; i++) {
                ks[at + i] = x[i];
            }
        }
        for (var e = lid; e < BK * dv8; e += WG) {
            let j = e / dv8;
            var w = vec4<u32>(0u);
            if j < nk {
                w = v[(kv_row0 + k0 + j) * dv8 + e % dv8];
            }
            let at = j * VS + 8u * (e % dv8);
            let x = halves(w);
            for (var i = 0u; i < 8u; i++) {
                vs[at + i] = x[i];
            }
        }
        workgroupBarrier();

        // S = Q K^T for this subgroup's 16 rows; K^T is K read column-major.
        let nb = (nk + 15u) / 16u;
        for (var jb = 0u; jb < nb; jb++) {
            var acc = C32();
            for (var c = 0u; c < D / 16u; c++) {
                let kb = coopLoad<B16>(&ks[16u * jb * KS + 16u * c], KS);
                acc = coopMultiplyAdd(qa[c], kb, acc);
            }
            coopStoreT(acc, &sf[srow * SS + 16u * jb], SS);
        }
        workgroupBarrier();

        // The online-softmax step. Keys past the row's end (causal) or the
        // tile's are skipped; their P is 0.
        var n = 0u;
        if row_end > k0 {
            n = min(nk, row_end - k0);
        }
        let srow_at = (srow + r) * SS;
        var tmax = NEG_BIG;
        for (var j = h; j < n; j += 2u) {
            var s = sf[srow_at + j] * p.scale;
            if MODIFIES {
                // Never on this kernel's pipelines; keeps binding 15 in the
                // automatic layout, which every forward binds.
                s = score(s, bh, grow, k0 + j);
            }
            tmax = max(tmax, s);
        }
        tmax = max(tmax, subgroupShuffleXor(tmax, 1u));
        var corr = 1.0;
        if tmax > m + TAU {
            // exp(NEG_BIG - finite) is 0: the first visible key discards
            // the empty accumulators.
            corr = exp(m - tmax);
            m = tmax;
            rescale.x = 1u;
        }
        l *= corr;
        let prow_at = (srow + r) * PS;
        for (var j = h; j < nb * 16u; j += 2u) {
            var pj = 0.0;
            if j < n {
                pj = exp(sf[srow_at + j] * p.scale - m);
            }
            l += pj;
            qp[prow_at + j] = f16(pj);
        }
        // Also orders the P writes before the coopLoads below.
        let any_rescale = workgroupUniformLoad(&rescale).x;
        if any_rescale != 0u {
            for (var c = 0u; c < DV / 16u; c++) {
                coopStoreT(o[c], &sf[srow * OS + 16u * c], OS);
            }
            workgroupBarrier();
            let orow_at = (srow + r) * OS;
            for (var c = h; c < DV; c += 2u) {
                sf[orow_at + c] *= corr;
            }
            workgroupBarrier();
            for (var c = 0u; c < DV / 16u; c++) {
                o[c] = coopLoadT<C32>(&sf[srow * OS + 16u * c], OS);
            }
        }

        // O += P V.
        for (var jb = 0u; jb < nb; jb++) {
            let pa = coopLoadT<A16>(&qp[srow * PS + 16u * jb], PS);
            for (var c = 0u; c < DV / 16u; c++) {
                let vb = coopLoadT<B16>(&vs[16u * jb * VS + 16u * c], VS);
                o[c] = coopMultiplyAdd(pa, vb, o[c]);
            }
        }
    }

    let l_row = l + subgroupShuffleXor(l, 1u);
    workgroupBarrier();
    for (var c = 0u; c < DV / 16u; c++) {
        coopStoreT(o[c], &sf[srow * OS + 16u * c], OS);
    }
    if h == 0u {
        row_l[srow + r] = l_row;
        row_m[srow + r] = m;
    }
    workgroupBarrier();

    // Rows that saw no key: o = 0, lse = -inf.
    let o_base = (head * p.seq_q + row0) * DV;
    for (var e = lid; e < rows * DV; e += WG) {
        let i = e / DV;
        let lr = row_l[i];
        var x = 0.0;
        if lr > 0.0 {
            x = sf[i * OS + e % DV] / lr;
        }
        out[o_base + e] = x;
    }
    let l_base = head * p.seq_q + row0;
    for (var i = lid; i < rows; i += WG) {
        let lr = row_l[i];
        var x = bitcast<f32>(0xff800000u);
        if lr > 0.0 {
            x = row_m[i] + log(lr);
        }
        lse[l_base + i] = x;
    }
}
