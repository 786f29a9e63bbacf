// How decode/subgroup.wgsl reads the caches when d and d_v are multiples
// of 4, on decode/load_vec4.wgsl's bindings: one In4 per lane and row
// (four float32, or four float16 in two words), consecutive lanes reading
// consecutive quads, kept as loaded until used, so that the registers
// holding the next pass's loads (PREFETCH) take two words a quad of
// halves. Quad o is vec4 column o of a row.

alias Raw4 = In4;

fn raw_zero() -> Raw4 {
    return In4();
}

fn widen4(x: Raw4) -> vec4<f32> {
    return widen(x);
}

// Neither NaN nor an infinity among the four elements (widening keeps
// both).
fn raw_finite(x: Raw4) -> bool {
    return all(finite4(widen(x)));
}

// Its non-finite flags (lib/nonfinite.wgsl, NONFINITE_FLAGS).
fn raw_flags(x: Raw4) -> u32 {
    return flags_in4(x);
}

// The quad with every NaN and infinity replaced by 0.
fn raw_clean(x: Raw4) -> Raw4 {
    return clean_in4(x);
}

// Quad o of a key row, zeros past d (no test where WHOLE_K).
fn load_k_raw(row: u32, o: u32) -> Raw4 {
    if !WHOLE_K && 4u * o >= u.d {
        return raw_zero();
    }
    return k_cache[(row * u.d + u.k_delta) / 4u + o];
}

// Quad o of a value row, zeros past d_v (no test where WHOLE_V).
fn load_v_raw(row: u32, o: u32) -> Raw4 {
    if !WHOLE_V && 4u * o >= u.dv {
        return raw_zero();
    }
    return v_cache[(row * u.dv + u.v_delta) / 4u + o];
}
