// How decode/subgroup.wgsl reads caches whose d or d_v is not a multiple
// of 4: quads read element by element by decode/load_elements.wgsl's
// load_k / load_v, widened as they load. Quad o is vec4 column o of a row.

alias Raw4 = vec4<f32>;

fn raw_zero() -> Raw4 {
    return vec4(0.0);
}

fn widen4(x: Raw4) -> vec4<f32> {
    return x;
}

fn raw_finite(x: Raw4) -> bool {
    return all(finite4(x));
}

// Its non-finite flags (lib/nonfinite.wgsl, NONFINITE_FLAGS).
fn raw_flags(x: Raw4) -> u32 {
    return flags_f32(x);
}

fn raw_clean(x: Raw4) -> Raw4 {
    return clean4(x);
}

// Quad o of a key row, zeros past d.
fn load_k_raw(row: u32, o: u32) -> Raw4 {
    return load_k(row, o);
}

// Quad o of a value row, zeros past d_v.
fn load_v_raw(row: u32, o: u32) -> Raw4 {
    return load_v(row, o);
}
