enable f16;
enable wgpu_cooperative_matrix;

// One-subgroup diagnostic of the cooperative-matrix builtins (run by the
// test coop_one_tile_diagnostic in coop_diagnostic.rs beside this file,
// which knows the expected values):
// each case writes one 16x16 f32 result to out[256 case ..]. Not a kernel.
//
// A[i][k] = i + k / 16, I the identity, P[k][n] = 1 where n = (k + 1) % 16.

alias A16 = coop_mat16x16<f16, A>;
alias B16 = coop_mat16x16<f16, B>;
alias C32 = coop_mat16x16<f32, C>;

@group(0) @binding(0) var<storage, read_write> out: array<f32>;
// cin[i * 20 + n] = 1000 i + n (an accumulator with row stride 20).
@group(0) @binding(1) var<storage, read> cin: array<f32>;

var<workgroup> wa: array<f16, 256>;
// A with row stride 24 (rows 16..19 continue the formula), padding 99.
var<workgroup> wa2: array<f16, 480>;
var<workgroup> wi: array<f16, 256>;
var<workgroup> wp: array<f16, 256>;
var<workgroup> wf: array<f32, 256>;

fn a_val(i: u32, k: u32) -> f16 {
    return f16(f32(i) + f32(k) / 16.0);
}

@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) lid: u32) {
    for (var e = lid; e < 256u; e += 32u) {
        let i = e / 16u;
        let k = e % 16u;
        wa[e] = a_val(i, k);
        wi[e] = select(f16(0.0), f16(1.0), i == k);
        wp[e] = select(f16(0.0), f16(1.0), k == (i + 1u) % 16u);
    }
    for (var e = lid; e < 480u; e += 32u) {
        let i = e / 24u;
        let k = e % 24u;
        wa2[e] = select(f16(99.0), a_val(i, k), k < 16u);
    }
    workgroupBarrier();

    let zero = C32();
    let a_t = coopLoadT<A16>(&wa[0], 16u);
    let i_t = coopLoadT<B16>(&wi[0], 16u);
    // 0: A (coopLoadT) x I (coopLoadT), coopStoreT.
    let d0 = coopMultiplyAdd(a_t, i_t, zero);
    coopStoreT(d0, &out[0], 16u);
    // 1: the same product, coopStore.
    coopStore(d0, &out[256], 16u);
    // 2: A read with coopLoad x I.
    let a_c = coopLoad<A16>(&wa[0], 16u);
    coopStoreT(coopMultiplyAdd(a_c, i_t, zero), &out[512], 16u);
    // 3: A x P, P read with coopLoadT.
    coopStoreT(coopMultiplyAdd(a_t, coopLoadT<B16>(&wp[0], 16u), zero), &out[768], 16u);
    // 4: A x P, P read with coopLoad.
    coopStoreT(coopMultiplyAdd(a_t, coopLoad<B16>(&wp[0], 16u), zero), &out[1024], 16u);
    // 5: A (stride 24) x I + C (coopLoadT from storage, stride 20).
    let c_t = coopLoadT<C32>(&cin[0], 20u);
    coopStoreT(coopMultiplyAdd(coopLoadT<A16>(&wa2[0], 24u), i_t, c_t), &out[1280], 16u);
    // 6: function-local arrays of matrices, dynamically indexed:
    // arr[c][i][k] = wa2[24 (i + c) + k] = A[i + c][k] (pointers stay
    // 16-byte aligned, as coop loads require); acc[c] = arr[c] x I; out acc[3].
    var arr: array<A16, 4>;
    var acc: array<C32, 4>;
    for (var c = 0u; c < 4u; c++) {
        arr[c] = coopLoadT<A16>(&wa2[24u * c], 24u);
    }
    for (var c = 0u; c < 4u; c++) {
        acc[c] = coopMultiplyAdd(arr[c], i_t, acc[c]);
    }
    coopStoreT(acc[3], &out[1536], 16u);
    // 7: sum over c of arr[c] x I in one accumulator.
    var total = C32();
    for (var c = 0u; c < 4u; c++) {
        total = coopMultiplyAdd(arr[c], i_t, total);
    }
    coopStoreT(total, &out[1792], 16u);
    // 8: coopStoreT to workgroup memory, barrier, scalar reads (transposed).
    coopStoreT(d0, &wf[0], 16u);
    workgroupBarrier();
    for (var e = lid; e < 256u; e += 32u) {
        out[2048u + e] = wf[(e % 16u) * 16u + e / 16u];
    }
    // 9: the kernel's loop pattern: rewrite wa every step behind barriers,
    // accumulate (A + 100 t) x I over t < 4: 4 A + 600.
    var run = C32();
    for (var t = 0u; t < 4u; t++) {
        workgroupBarrier();
        for (var e = lid; e < 256u; e += 32u) {
            wa[e] = f16(f32(a_val(e / 16u, e % 16u)) + 100.0 * f32(t));
        }
        workgroupBarrier();
        run = coopMultiplyAdd(coopLoadT<A16>(&wa[0], 16u), i_t, run);
    }
    coopStoreT(run, &out[2304], 16u);
    // 10: the same through workgroup f32 and scalar code each step: the
    // scalar half writes wf = 2 (A + t), stores back; sum over t of them.
    var run2 = C32();
    for (var t = 0u; t < 4u; t++) {
        workgroupBarrier();
        coopStoreT(coopMultiplyAdd(a_t, i_t, C32()), &wf[0], 16u);
        workgroupBarrier();
        for (var e = lid; e < 256u; e += 32u) {
            wf[e] = 2.0 * (wf[e] + f32(t));
        }
        workgroupBarrier();
        run2 = run2 + coopLoadT<C32>(&wf[0], 16u);
    }
    coopStoreT(run2, &out[2560], 16u);
}
