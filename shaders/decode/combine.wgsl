// The combine pass of decoding over a KV cache: each output row's split
// states (o normalised, lse; written by decode/decode.wgsl) merged in split
// order with merge_states' arithmetic (lib/merge.wgsl, which the host
// prepends), the sink logit (if any) joining last as a part whose output
// is 0. One invocation per element of the output (float32,
// decode/combine_f32.wgsl), or per two (float16, rounded here:
// decode/combine_f16.wgsl); the one of column 0 also writes the row's lse. The splits are few (at most 1024), so each
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
@group(0) @binding(5) var<storage, read_write> lse: array<u32>;

// Part p of a row's merge: split p, or the sink after the splits.
fn part_lse_bits(row: u32, p: u32) -> u32 {
    if p < c.splits {
        return part_lse[p * c.rows + row];
    }
    return seq_data[c.sinks_off + (row / c.seq_q) % c.heads_q];
}

// Split p's o at (row, col), and at col + 1 where an invocation has two
// elements (0 otherwise).
fn part_o_at(p: u32, row: u32, col: u32) -> vec2<f32> {
    let at = (p * c.rows + row) * c.dv + col;
    var x = vec2(part_o[at], 0.0);
    if OUT_ELEMS == 2u {
        x.y = part_o[at + 1u];
    }
    return x;
}

// o with a part of lse `bits` and output x added at its weight (none for
// an empty part).
fn add_part(o: vec2<f32>, bits: u32, x: vec2<f32>, st: RowState) -> vec2<f32> {
    if !is_finite(bits) {
        return o;
    }
    let w = part_weight(bits, st) / st.sum;
    return o + w * x;
}

@compute @workgroup_size(WG)
fn decode_combine(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let width = max(c.dv, 1u);
    let e = OUT_ELEMS * invocation(wid, groups, lid);
    if e >= c.rows * width {
        return;
    }
    let row = e / width;
    let col = e % width;
    let parts = c.splits + c.sinks;
    // The loops take eight parts at a time, their loads first and then the
    // folds in order (named values, not an array, so that they stay in
    // registers): the parts' loads are independent, and a loop that
    // waited for each in turn spent its time on their latency (24 us of a
    // batch-1 decode over 32 splits on an H200).
    var st = RowState(0.0, 0.0, 0u, 0u);
    var p = 0u;
    for (; p + 8u <= parts; p += 8u) {
        let b0 = part_lse_bits(row, p);
        let b1 = part_lse_bits(row, p + 1u);
        let b2 = part_lse_bits(row, p + 2u);
        let b3 = part_lse_bits(row, p + 3u);
        let b4 = part_lse_bits(row, p + 4u);
        let b5 = part_lse_bits(row, p + 5u);
        let b6 = part_lse_bits(row, p + 6u);
        let b7 = part_lse_bits(row, p + 7u);
        st = fold_max(fold_max(fold_max(fold_max(fold_max(fold_max(fold_max(fold_max(st, b0), b1), b2), b3), b4), b5), b6), b7);
    }
    for (; p < parts; p++) {
        st = fold_max(st, part_lse_bits(row, p));
    }
    let merges = st.invalid == 0u && st.seen != 0u;
    if merges {
        p = 0u;
        for (; p + 8u <= parts; p += 8u) {
            let b0 = part_lse_bits(row, p);
            let b1 = part_lse_bits(row, p + 1u);
            let b2 = part_lse_bits(row, p + 2u);
            let b3 = part_lse_bits(row, p + 3u);
            let b4 = part_lse_bits(row, p + 4u);
            let b5 = part_lse_bits(row, p + 5u);
            let b6 = part_lse_bits(row, p + 6u);
            let b7 = part_lse_bits(row, p + 7u);
            st.sum += part_weight(b0, st);
            st.sum += part_weight(b1, st);
            st.sum += part_weight(b2, st);
            st.sum += part_weight(b3, st);
            st.sum += part_weight(b4, st);
            st.sum += part_weight(b5, st);
            st.sum += part_weight(b6, st);
            st.sum += part_weight(b7, st);
        }
        for (; p < parts; p++) {
            st.sum += part_weight(part_lse_bits(row, p), st);
        }
    }
    if col < c.dv {
        // A row that saw no key keeps 0; an empty part is not read, every
        // other part is (a NaN it holds reaches the row). Columns col and,
        // with two elements an invocation, col + 1 (d_v is even then).
        var o = vec2(0.0);
        if st.invalid != 0u {
            o = vec2(bitcast<f32>(NAN));
        } else if merges {
            p = 0u;
            for (; p + 8u <= c.splits; p += 8u) {
                let b0 = part_lse[p * c.rows + row];
                let b1 = part_lse[(p + 1u) * c.rows + row];
                let b2 = part_lse[(p + 2u) * c.rows + row];
                let b3 = part_lse[(p + 3u) * c.rows + row];
                let b4 = part_lse[(p + 4u) * c.rows + row];
                let b5 = part_lse[(p + 5u) * c.rows + row];
                let b6 = part_lse[(p + 6u) * c.rows + row];
                let b7 = part_lse[(p + 7u) * c.rows + row];
                let x0 = part_o_at(p, row, col);
                let x1 = part_o_at(p + 1u, row, col);
                let x2 = part_o_at(p + 2u, row, col);
                let x3 = part_o_at(p + 3u, row, col);
                let x4 = part_o_at(p + 4u, row, col);
                let x5 = part_o_at(p + 5u, row, col);
                let x6 = part_o_at(p + 6u, row, col);
                let x7 = part_o_at(p + 7u, row, col);
                o = add_part(o, b0, x0, st);
                o = add_part(o, b1, x1, st);
                o = add_part(o, b2, x2, st);
                o = add_part(o, b3, x3, st);
                o = add_part(o, b4, x4, st);
                o = add_part(o, b5, x5, st);
                o = add_part(o, b6, x6, st);
                o = add_part(o, b7, x7, st);
            }
            for (; p < c.splits; p++) {
                o = add_part(o, part_lse[p * c.rows + row], part_o_at(p, row, col), st);
            }
        }
        store_out(e, o);
    }
    if col == 0u {
        lse[row] = merged_lse(st);
    }
}
