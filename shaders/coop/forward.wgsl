// FlashAttention-2 forward for float16 inputs on cooperative matrices
// (tensor cores): QK^T and PV are 16x16x16 f16 products accumulated in
// f32; the online softmax runs in scalar f32 code on the scores staged in
// workgroup memory. Plain and causal attention only: the host keeps every
// other variant on the other kernels (src/gpu/mod.rs, coop_tiles).
//
// The host prepends lib/coop.wgsl (the `enable` lines, the matrix types,
// what the device must have) and lib/common.wgsl (src/gpu/shaders.rs).
//
// Layout: W subgroups per workgroup, each owning 16 query rows (BQ = 16 W
// rows); key tiles of BK rows. In the scalar softmax step a row belongs to
// two lanes of its subgroup (lane = r + 16 h), each taking half the keys.
// The score scratch (`sf`) and the P tile (`qp`) are private to each
// subgroup; only the K and V tiles are shared.
//
// Staging, and why it is shaped so: K and V arrive as pairs of halves
// (u32). Each invocation loads whole u32s, consecutive lanes consecutive
// words, and writes the two halves to consecutive f16 slots, so a warp's
// store covers 128 contiguous bytes (one shared-memory wavefront). The
// first version unpacked vec4s into eight scalar f16 stores 16 bytes apart
// per lane, four wavefronts each, and the staging alone took about as long
// as the products. The next tile's words are loaded into registers while
// the current one is multiplied, and written to workgroup memory once the
// last reader of the old tile has passed a barrier:
//   iteration t:  V_t regs -> vs          (PV_{t-1} done: barrier B(t-1))
//                 load K_{t+1}, V_{t+1} -> regs
//                 S = Q K_t^T -> sf; barrier; softmax -> P; flag
//                 A(t): workgroupUniformLoad(flag)  (QK_t done everywhere)
//                 K_{t+1} regs -> ks
//                 [rescale acc if any row moved its maximum]
//                 O += P V_t
//                 B(t): barrier
//
// Every workgroup variable is a multiple of 16 bytes (`moved` is a
// vec4): cooperative loads and stores need 16-byte aligned pointers
// (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986) and the driver, not
// the declaration order, places the variables. With a lone u32 flag here
// the first version gave wrong results on the H100 (out error 1.2)
// (docs/gpu.md#cooperative-matrices-in-wgpu).
//
// Rescaling is lazy (as in FlashAttention-3): a row keeps its row_max
// (in base 2 here: scores are scaled by LOG2E) until a tile's maximum
// exceeds it by more than TAU, so exp2(s - row_max) <= 2^TAU stays well
// inside float16 for P, and the accumulators `acc` go through workgroup
// memory for the rescale only on the tiles where some row moved its
// row_max. The result is the same softmax (the final division and lse use
// the same row_max), only rounded differently.

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
// f32 scratch rows: a tile's scores, or OC columns of O at a time for a
// rescale and the output (OC < DV where the scratch would otherwise bound
// the rows a workgroup can hold).
override OC: u32 = 64u;
override FS: u32 = max(BK, OC) + 4u;
// Array sizes (products computed by the host, src/gpu/shaders.rs).
override K_ELEMS: u32 = 4608u;
override V_ELEMS: u32 = 4608u;
// Q is staged once and read into registers before P first needs the room.
override QP_ELEMS: u32 = 4608u;
override F_ELEMS: u32 = 4352u;
// Words of a K (V) tile each invocation stages: ceil(BK D / 2 / WG).
override KW: u32 = 16u;
override VW: u32 = 16u;

const TAU: f32 = 8.0;
const LN2: f32 = 0.6931471805599453;
// Key blocks of 16 per tile: BK / 16 is at most this (key tiles up to 64).
const MAXKB: u32 = 4u;
// Scores per lane in the softmax step: BK / 2 is at most this.
const MAXHALF: u32 = 64u;
// Words per staged register array: KW and VW are at most this
// (tiles::coop_tiles keeps to it).
const MAXW: u32 = 64u;

// Two f16 per u32: rows are multiples of 16 elements.
@group(0) @binding(1) var<storage, read> q: array<u32>;
@group(0) @binding(2) var<storage, read> k: array<u32>;
@group(0) @binding(3) var<storage, read> v: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> lse: array<f32>;

var<workgroup> ks: array<f16, K_ELEMS>;
var<workgroup> vs: array<f16, V_ELEMS>;
var<workgroup> qp: array<f16, QP_ELEMS>;
var<workgroup> sf: array<f32, F_ELEMS>;
// The rows' final row_sum and row_max, for the invocations that write
// them out.
var<workgroup> row_sum_wg: array<f32, BQ>;
var<workgroup> row_max_wg: array<f32, BQ>;
// Whether any row moved its row_max on this tile (the accumulators then
// need a rescale). A vector, so that every workgroup variable is a
// multiple of 16 bytes.
var<workgroup> moved: vec4<u32>;

// Words of rows [k0, k0 + nk) of a (rows x width/2)-word key/value head
// starting at word `base`, in the staging order: word e = i WG + lid is
// row e / (width / 2), pair e % (width / 2). Rows past nk are zeros: P is 0
// there and 0 * V must not be NaN.
fn load_k(base: u32, nk: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = D / 2u;
    for (var i = 0u; i < KW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BK * d2 && e / d2 < nk {
            w[i] = k[base + e];
        }
    }
    return w;
}

fn load_v(base: u32, nk: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = DV / 2u;
    for (var i = 0u; i < VW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BK * d2 && e / d2 < nk {
            w[i] = v[base + e];
        }
    }
    return w;
}

fn store_k(w: array<u32, MAXW>, lid: u32) {
    let d2 = D / 2u;
    for (var i = 0u; i < KW; i++) {
        let e = i * WG + lid;
        if e < BK * d2 {
            let x = unpack2x16float(w[i]);
            let at = (e / d2) * KS + 2u * (e % d2);
            ks[at] = f16(x.x);
            ks[at + 1u] = f16(x.y);
        }
    }
}

fn store_v(w: array<u32, MAXW>, lid: u32) {
    let d2 = DV / 2u;
    for (var i = 0u; i < VW; i++) {
        let e = i * WG + lid;
        if e < BK * d2 {
            let x = unpack2x16float(w[i]);
            let at = (e / d2) * VS + 2u * (e % d2);
            vs[at] = f16(x.x);
            vs[at + 1u] = f16(x.y);
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
    let row0 = wid.x * BQ;
    let rows = min(BQ, p.seq_q - row0);
    let kv = (p.q_head0 + head) / p.group - p.q_head0 / p.group;
    let kv_row0 = kv * p.seq_k;
    let bh = p.head0 + head;
    let d2 = D / 2u;
    let dv2 = DV / 2u;

    // Q rows past seq_q are zeros: finite scores, never written out.
    for (var e = lid; e < BQ * d2; e += WG) {
        let r = e / d2;
        let c = e % d2;
        var w = 0u;
        if r < rows {
            w = q[(head * p.seq_q + row0 + r) * d2 + c];
        }
        let x = unpack2x16float(w);
        let at = r * QS + 2u * c;
        qp[at] = f16(x.x);
        qp[at + 1u] = f16(x.y);
    }
    workgroupBarrier();
    let srow = 16u * sg;
    var qa: array<A16, MAXN>;
    for (var c = 0u; c < D / 16u; c++) {
        qa[c] = coopLoadT<A16>(&qp[srow * QS + 16u * c], QS);
    }
    var acc: array<C32, MAXN>;

    // This lane's row in the softmax step, and its half of the columns:
    // lanes r and r + 16 share row r. Each lane walks its half row in
    // order, so that the driver may merge four consecutive scores into one
    // 16-byte load and consecutive P values into wider stores (inferred
    // from the timing below; the driver's code is not visible). Score rows
    // are BK + 4 floats apart, which puts the 8 rows a quarter warp reads
    // in 8 different bank quadruples (BK = 16, 32 or 64). Walking each
    // group of 4 in a per-lane permuted order instead (so that scalar
    // loads of "the same" column spread over all banks) measured 3% slower
    // for the whole kernel at (4,16,4096,64) and 2% at d = 128.
    let r = lane & 15u;
    let h = lane >> 4u;
    let grow = row0 + srow + r;
    var row_end = 0u;
    // VARLEN: the row's first key (keys before it are another sequence's).
    var row_start = 0u;
    if grow < p.seq_q {
        row_end = visible_end(grow);
        if VARLEN {
            row_start = varlen_row(grow, 0u);
        }
    }
    // The online-softmax state of this lane's row (the names of
    // lib/common.wgsl; row_max in base 2), row_sum over its half of the
    // keys.
    var row_max = NEG_BIG;
    var row_sum = 0.0;
    let scale_log2 = p.scale * LOG2E;

    let key_end = visible_end(row0 + rows - 1u);
    // Rows start at key 0, a packed batch's at their sequence's keys (the
    // first row starts first).
    var key_start = 0u;
    if VARLEN {
        key_start = min(varlen_row(row0, 0u), key_end);
    }
    var kw = load_k((kv_row0 + key_start) * d2, min(BK, key_end - key_start), lid);
    var vw = load_v((kv_row0 + key_start) * dv2, min(BK, key_end - key_start), lid);
    store_k(kw, lid);
    if lid == 0u {
        moved.x = 0u;
    }
    // Q is in registers everywhere (qp becomes P), K_0 is staged.
    workgroupBarrier();
    for (var k0 = key_start; k0 < key_end; k0 += BK) {
        let nk = min(BK, key_end - k0);
        store_v(vw, lid);
        let k1 = k0 + BK;
        let nk1 = min(BK, max(key_end, k1) - k1);
        // Both next tiles are loaded here, a whole tile ahead of their
        // stores. Loading V only after K was stored (to hold fewer
        // registers) left the V load one PV product to hide in, and cost
        // 11% at (4,16,4096,64); the registers did not bound occupancy.
        if k1 < key_end {
            kw = load_k((kv_row0 + k1) * d2, nk1, lid);
            vw = load_v((kv_row0 + k1) * dv2, nk1, lid);
        }

        // S = Q K^T for this subgroup's 16 rows; K^T is K read column-major.
        // Whole tiles even where fewer keys are left (their K and V rows
        // are staged as zeros, their P is 0): a constant trip count lets
        // the driver unroll and interleave the independent products.
        for (var jb = 0u; jb < BK / 16u; jb++) {
            var prod = C32();
            for (var c = 0u; c < D / 16u; c++) {
                let kb = coopLoad<B16>(&ks[16u * jb * KS + 16u * c], KS);
                prod = coopMultiplyAdd(qa[c], kb, prod);
            }
            coopStoreT(prod, &sf[srow * FS + 16u * jb], FS);
        }
        workgroupBarrier();

        // The online-softmax step, in base 2. Keys past the row's end
        // (causal) or the tile's get P = 0. Constant trip counts over the
        // lane's contiguous half row: the driver unrolls them, so the
        // loads are issued back to back instead of one latency per key
        // (with a key-count bound this step took most of the kernel).
        var n = 0u;
        if row_end > k0 {
            n = min(nk, row_end - k0);
        }
        // VARLEN: keys below n0 belong to an earlier sequence.
        var n0 = 0u;
        if VARLEN && row_start > k0 {
            n0 = min(row_start - k0, BK);
        }
        let half_at = (srow + r) * FS + h * (BK / 2u);
        var sv: array<f32, MAXHALF>;
        var tile_max = NEG_BIG;
        for (var i = 0u; i < BK / 2u; i++) {
            let j = h * (BK / 2u) + i;
            var s = sf[half_at + i] * scale_log2;
            if MODIFIES {
                // Never on this kernel's pipelines; keeps binding 15 in the
                // automatic layout, which every forward binds.
                s = score(sf[half_at + i] * p.scale, bh, grow, k0 + j) * LOG2E;
            }
            var seen = j < n;
            if VARLEN {
                seen = seen && j >= n0;
            }
            s = select(NEG_BIG, s, seen);
            sv[i] = s;
            tile_max = max(tile_max, s);
        }
        tile_max = max(tile_max, subgroupShuffleXor(tile_max, 16u));
        var rescale = 1.0;
        if tile_max > row_max + TAU {
            // exp2(NEG_BIG - finite) is 0: the first visible key discards
            // the empty accumulators.
            rescale = exp2(row_max - tile_max);
            row_max = tile_max;
            // On the first tile acc is still zero: nothing to rescale. (The
            // test is here, not on the uniform branch below: naga treats a
            // loaded `var` such as k0 as non-uniform.)
            if k0 > key_start {
                moved.x = 1u;
            }
        }
        row_sum *= rescale;
        let p_at = (srow + r) * PS + h * (BK / 2u);
        for (var i = 0u; i < BK / 2u; i++) {
            let j = h * (BK / 2u) + i;
            var seen = j < n;
            if VARLEN {
                seen = seen && j >= n0;
            }
            let pj = select(0.0, exp2(sv[i] - row_max), seen);
            row_sum += pj;
            qp[p_at + i] = f16(pj);
        }
        // Every subgroup's QK^T is done (ks is free), V_t and P are
        // visible.
        let any_moved = workgroupUniformLoad(&moved).x;
        if lid == 0u {
            moved.x = 0u;
        }
        if k1 < key_end {
            store_k(kw, lid);
        }
        if any_moved != 0u {
            for (var c0 = 0u; c0 < DV; c0 += OC) {
                let c1 = min(c0 + OC, DV);
                for (var c = c0 / 16u; c < c1 / 16u; c++) {
                    coopStoreT(acc[c], &sf[srow * FS + 16u * c - c0], FS);
                }
                workgroupBarrier();
                let orow_at = (srow + r) * FS;
                for (var c = h; c < c1 - c0; c += 2u) {
                    sf[orow_at + c] *= rescale;
                }
                workgroupBarrier();
                for (var c = c0 / 16u; c < c1 / 16u; c++) {
                    acc[c] = coopLoadT<C32>(&sf[srow * FS + 16u * c - c0], FS);
                }
            }
        }

        // O += P V, each column block's product accumulated from zero and
        // then added to O. Multiplying into O directly (O as the
        // accumulator operand, carried across key tiles) measured 30%
        // slower for the whole kernel at (4,16,4096,64): the driver's code
        // for a loop-carried accumulator, not the arithmetic.
        var pa: array<A16, MAXKB>;
        for (var jb = 0u; jb < BK / 16u; jb++) {
            pa[jb] = coopLoadT<A16>(&qp[srow * PS + 16u * jb], PS);
        }
        for (var c = 0u; c < DV / 16u; c++) {
            var prod = C32();
            for (var jb = 0u; jb < BK / 16u; jb++) {
                let vb = coopLoadT<B16>(&vs[16u * jb * VS + 16u * c], VS);
                prod = coopMultiplyAdd(pa[jb], vb, prod);
            }
            acc[c] = acc[c] + prod;
        }
        // Every subgroup's PV is done (vs is free); K_{t+1} is visible.
        workgroupBarrier();
    }

    let row_sum_full = row_sum + subgroupShuffleXor(row_sum, 16u);
    if h == 0u {
        row_sum_wg[srow + r] = row_sum_full;
        row_max_wg[srow + r] = row_max;
    }
    // Rows that saw no key: out = 0, lse = -inf.
    let o_base = (head * p.seq_q + row0) * DV;
    for (var c0 = 0u; c0 < DV; c0 += OC) {
        let c1 = min(c0 + OC, DV);
        let width = c1 - c0;
        for (var c = c0 / 16u; c < c1 / 16u; c++) {
            coopStoreT(acc[c], &sf[srow * FS + 16u * c - c0], FS);
        }
        workgroupBarrier();
        for (var e = lid; e < rows * width; e += WG) {
            let i = e / width;
            let sum = row_sum_wg[i];
            var x = 0.0;
            if sum > 0.0 {
                x = sf[i * FS + e % width] / sum;
            }
            out[o_base + i * DV + c0 + e % width] = x;
        }
        // The next chunk overwrites sf.
        workgroupBarrier();
    }
    let l_base = head * p.seq_q + row0;
    for (var i = lid; i < rows; i += WG) {
        let sum = row_sum_wg[i];
        var x = bitcast<f32>(0xff800000u);
        if sum > 0.0 {
            x = (row_max_wg[i] + log2(sum)) * LN2;
        }
        lse[l_base + i] = x;
    }
}
