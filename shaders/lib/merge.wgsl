// Merging attention states, shared by merge_states.wgsl (parts bound one
// at a time) and decode/combine.wgsl (the splits of a decode): the
// arithmetic of src/merge.rs, relative to a row's largest lse, with the
// parts in order. A row's state holds that largest finite lse, whether
// any part saw a key, whether any lse is NaN (2) or +inf (1), and the sum
// of the parts' exp(lse_i - top); part i weighs exp(lse_i - top) / sum.
//
// WGSL does not promise IEEE infinities or NaN in arithmetic, so they are
// tested and written as bits: an lse of -inf (an empty part) never enters
// an exponential and gets weight 0 (its output is not read), a row whose
// every part is empty gets lse -inf, and a row with a NaN lse gets NaN,
// else one with a +inf lse gets +inf (docs/design.md#non-finite-inputs);
// its output is NaN either way. Every part with a finite lse is read, even
// where its weight underflows to 0.

const NEG_INF: u32 = 0xff800000u;
const POS_INF: u32 = 0x7f800000u;
const NAN: u32 = 0x7fc00000u;

// Per row, across the parts seen so far.
struct RowState {
    top: f32,
    sum: f32,
    seen: u32,
    invalid: u32,
}

fn is_finite(bits: u32) -> bool {
    return (bits & 0x7f800000u) != 0x7f800000u;
}

// `st` with one more part's lse (bits) among the largest.
fn fold_max(st: RowState, bits: u32) -> RowState {
    var next = st;
    if is_finite(bits) {
        let x = bitcast<f32>(bits);
        next.top = select(x, max(st.top, x), st.seen != 0u);
        next.seen = 1u;
    } else if bits == POS_INF {
        next.invalid = max(st.invalid, 1u);
    } else if bits != NEG_INF {
        next.invalid = 2u;
    }
    return next;
}

// exp(lse_i - top), 0 for an empty part: no -inf enters the exponential.
fn part_weight(bits: u32, st: RowState) -> f32 {
    if !is_finite(bits) {
        return 0.0;
    }
    return exp(bitcast<f32>(bits) - st.top);
}

// The merged lse of a row whose parts are all folded and summed.
fn merged_lse(st: RowState) -> u32 {
    if st.invalid != 0u {
        return select(POS_INF, NAN, st.invalid == 2u);
    }
    if st.seen == 0u {
        return NEG_INF;
    }
    return bitcast<u32>(st.top + log(st.sum));
}
