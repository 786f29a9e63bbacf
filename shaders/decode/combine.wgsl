// The combine pass of decoding over a KV cache: each output row's split
// states (o normalised, lse; written by decode/decode.wgsl) merged in split
// order with merge_states' arithmetic (lib/merge.wgsl, which the host
// prepends), the sink logit (if any) joining last as a part whose output
// is 0. One invocation per output element; the one of column 0 also
// writes the row's lse. The splits are few (at most 1024), so each
// invocation folds them itself rather than in passes over bound parts.

struct Combine {
    // Output rows of this dispatch: sequences * heads_q * seq_q.
    rows: u32,
    dv: u32,
    splits: u32,
    heads_q: u32,
    seq_q: u32,
    // 1 with sinks, at `sinks_off` in `seq_data`, one per query head.
    sinks: u32,
    sinks_off: u32,
    pad0: u32,
}

@group(0) @binding(0) var<uniform> c: Combine;
@group(0) @binding(1) var<storage, read> part_o: array<f32>;
@group(0) @binding(2) var<storage, read> part_lse: array<u32>;
@group(0) @binding(3) var<storage, read> seq_data: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read_write> lse: array<u32>;

// Part p of a row's merge: split p, or the sink after the splits.
fn part_lse_bits(row: u32, p: u32) -> u32 {
    if p < c.splits {
        return part_lse[p * c.rows + row];
    }
    return seq_data[c.sinks_off + (row / c.seq_q) % c.heads_q];
}

@compute @workgroup_size(WG)
fn decode_combine(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let width = max(c.dv, 1u);
    let e = invocation(wid, groups, lid);
    if e >= c.rows * width {
        return;
    }
    let row = e / width;
    let col = e % width;
    let parts = c.splits + c.sinks;
    var st = RowState(0.0, 0.0, 0u, 0u);
    for (var p = 0u; p < parts; p++) {
        st = fold_max(st, part_lse_bits(row, p));
    }
    let merges = st.invalid == 0u && st.seen != 0u;
    if merges {
        for (var p = 0u; p < parts; p++) {
            st.sum += part_weight(part_lse_bits(row, p), st);
        }
    }
    if col < c.dv {
        // A row that saw no key keeps 0; an empty part is not read, every
        // other part is (a NaN it holds reaches the row).
        var o = 0.0;
        if st.invalid != 0u {
            o = bitcast<f32>(NAN);
        } else if merges {
            for (var p = 0u; p < c.splits; p++) {
                let bits = part_lse[p * c.rows + row];
                if is_finite(bits) {
                    let w = part_weight(bits, st) / st.sum;
                    o += w * part_o[(p * c.rows + row) * c.dv + col];
                }
            }
        }
        out[row * c.dv + col] = o;
    }
    if col == 0u {
        lse[row] = merged_lse(st);
    }
}
