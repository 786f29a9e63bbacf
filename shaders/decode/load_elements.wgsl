// How decode/decode.wgsl reads the caches for any d and d_v (those that
// are not multiples of 4): element by element from u32 words
// (lib/input_*.wgsl's in_word / in_elem), four per lane and row. Rows are
// counted from the binding's first block, which starts k_delta (v_delta)
// elements into the binding.

@group(0) @binding(2) var<storage, read> k_cache: array<u32>;
@group(0) @binding(3) var<storage, read> v_cache: array<u32>;

// Elements 4c..4c+3 of a key row, zeros past d.
fn load_k(row: u32, c: u32) -> vec4<f32> {
    var x = vec4(0.0);
    let base = row * u.d + u.k_delta;
    for (var e = 0u; e < 4u; e++) {
        let col = 4u * c + e;
        if col < u.d {
            x[e] = in_elem(k_cache[in_word(base + col)], base + col);
        }
    }
    return x;
}

// Elements 4c..4c+3 of a value row, zeros past d_v.
fn load_v(row: u32, c: u32) -> vec4<f32> {
    var x = vec4(0.0);
    let base = row * u.dv + u.v_delta;
    for (var e = 0u; e < 4u; e++) {
        let col = 4u * c + e;
        if col < u.dv {
            x[e] = in_elem(v_cache[in_word(base + col)], base + col);
        }
    }
    return x;
}
