// Merging attention states (flashport.merge_states): the output and
// log-sum-exp over the union of several parts' keys. src/merge.rs defines
// the arithmetic and its rules; the host (src/gpu/merge.rs) prepends
// lib/merge.wgsl (the row state, the weights, the bit tests) and runs, per
// chunk of rows, with one part's lse (and output) bound at a time:
//
// - merge_max, per part in order, one invocation per row: the largest
//   finite lse m, whether the row saw one, and whether any lse is NaN or
//   +inf;
// - merge_sum, per part in order: s += exp(lse_i - m);
// - merge_accumulate, per part in order, one invocation per output
//   element: acc = (0 for the first part, else acc) + w_i · out_i with
//   w_i = exp(lse_i - m) / s;
// - merge_finish, one invocation per row: lse = m + log(s).
//
// An empty part's output is not read (every other part's is), a row whose
// every part is empty keeps acc = 0, and a row with a NaN lse gets NaN in
// both, else one with a +inf lse gets +inf and an output of NaN.

struct Merge {
    // Rows of this chunk.
    rows: u32,
    dv: u32,
    // The part bound as `lse` (and `src`).
    part: u32,
    // 1 when `src` holds float16 pairs (low half first), else float32.
    f16: u32,
}

@group(0) @binding(0) var<uniform> m: Merge;
// The part's lse of each row, float32 bits.
@group(0) @binding(1) var<storage, read> lse: array<u32>;
@group(0) @binding(2) var<storage, read_write> state: array<RowState>;
@group(0) @binding(3) var<storage, read_write> lse_out: array<u32>;
@group(0) @binding(4) var<storage, read> src: array<u32>;
@group(0) @binding(5) var<storage, read_write> acc: array<u32>;

@compute @workgroup_size(WG)
fn merge_max(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = invocation(wid, groups, lid);
    if row >= m.rows {
        return;
    }
    var st = RowState(0.0, 0.0, 0u, 0u);
    if m.part > 0u {
        st = state[row];
    }
    state[row] = fold_max(st, lse[row]);
}

@compute @workgroup_size(WG)
fn merge_sum(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = invocation(wid, groups, lid);
    if row >= m.rows {
        return;
    }
    var st = state[row];
    if m.part == 0u {
        st.sum = 0.0;
    }
    if st.invalid == 0u {
        st.sum += part_weight(lse[row], st);
    }
    state[row] = st;
}

@compute @workgroup_size(WG)
fn merge_finish(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = invocation(wid, groups, lid);
    if row >= m.rows {
        return;
    }
    lse_out[row] = merged_lse(state[row]);
}

// A float16 value widened exactly (what unpack2x16float gives, without
// needing it).
fn half_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let biased = (h >> 10u) & 0x1fu;
    let man = h & 0x3ffu;
    if biased == 0x1fu {
        return bitcast<f32>(sign | 0x7f800000u | (man << 13u));
    }
    if biased == 0u {
        // Zero or subnormal: man · 2^-24, exact in f32.
        let x = f32(man) * 5.9604644775390625e-8;
        return select(x, -x, sign != 0u);
    }
    return bitcast<f32>(sign | ((biased + 112u) << 23u) | (man << 13u));
}

fn src_value(i: u32) -> f32 {
    if m.f16 != 0u {
        return half_to_f32((src[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu);
    }
    return bitcast<f32>(src[i]);
}

@compute @workgroup_size(WG)
fn merge_accumulate(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = invocation(wid, groups, lid);
    if e >= m.rows * m.dv {
        return;
    }
    let row = e / m.dv;
    let st = state[row];
    if st.invalid != 0u {
        acc[e] = NAN;
        return;
    }
    var sum = 0.0;
    if m.part > 0u {
        sum = bitcast<f32>(acc[e]);
    }
    // A row that saw a key has sum >= 1 (its largest part adds exp(0)).
    // An empty part is not read: its output may be anything, NaN
    // included. Every other part is, even where its weight underflows to 0
    // (a NaN in its output reaches the row's).
    if is_finite(lse[row]) {
        let w = part_weight(lse[row], st) / st.sum;
        sum += w * src_value(e);
    }
    acc[e] = bitcast<u32>(sum);
}
