// How the kernels read their inputs (q, k, v, dO, and O in the backward
// pre-pass) when they are float32. The host prepends this or
// lib/input_f16.wgsl (src/gpu/shaders.rs): a binding's type cannot be an
// override, so the element type is chosen by the fragment, not by a
// constant. Both define the same names.
//
// The register-tiled kernels read four elements at a time: `In4`, widened
// to vec4<f32> as it is loaded.
alias In4 = vec4<f32>;

fn widen(x: In4) -> vec4<f32> {
    return x;
}

// The simple kernels take any head dimension, so they read one element at
// a time from inputs bound as u32 words: element i is in word in_word(i).
fn in_word(i: u32) -> u32 {
    return i;
}

fn in_elem(w: u32, i: u32) -> f32 {
    return bitcast<f32>(w);
}

// x with every NaN and infinity replaced by 0, tested on the bits as
// lib/nonfinite.wgsl's clean4 does (which not every kernel includes).
fn clean_in4(x: In4) -> In4 {
    return select(vec4(0.0), x, (bitcast<vec4<u32>>(x) & vec4(0x7f800000u)) != vec4(0x7f800000u));
}

// The element flags of lib/nonfinite.wgsl (NONFINITE_FLAGS).
fn flags_in4(x: In4) -> u32 {
    let f = (bitcast<vec4<u32>>(x) & vec4(0x7f800000u)) + vec4(0x00800000u);
    return f.x | f.y | f.z | f.w;
}
