// How decode/decode.wgsl reads the caches when d and d_v are multiples of
// 4: one In4 (lib/input_*.wgsl: four float32, or four float16 in two
// words) per lane and row, so the lanes of a key group read a row as
// consecutive 16- or 8-byte words. Rows are counted from the binding's
// first block, which starts k_delta (v_delta) elements into the binding.

@group(0) @binding(2) var<storage, read> k_cache: array<In4>;
@group(0) @binding(3) var<storage, read> v_cache: array<In4>;

// Elements 4c..4c+3 of a key row, zeros past d.
fn load_k(row: u32, c: u32) -> vec4<f32> {
    if 4u * c >= u.d {
        return vec4(0.0);
    }
    return widen(k_cache[(row * u.d + u.k_delta) / 4u + c]);
}

// Elements 4c..4c+3 of a value row, zeros past d_v.
fn load_v(row: u32, c: u32) -> vec4<f32> {
    if 4u * c >= u.dv {
        return vec4(0.0);
    }
    return widen(v_cache[(row * u.dv + u.v_delta) / 4u + c]);
}
