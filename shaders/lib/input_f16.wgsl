// How the kernels read their inputs when they are float16: the names of
// lib/input_f32.wgsl, which says how the host picks one. Halves are
// packed in pairs into u32 words, low half first, and widened to float32
// as they are loaded, so the arithmetic is the float32 kernels' own.
// unpack2x16float is core WGSL: no shader-f16 feature is needed.
//
// Four halves in two words.
alias In4 = vec2<u32>;

fn widen(x: In4) -> vec4<f32> {
    return vec4(unpack2x16float(x.x), unpack2x16float(x.y));
}

fn in_word(i: u32) -> u32 {
    return i >> 1u;
}

fn in_elem(w: u32, i: u32) -> f32 {
    let h = unpack2x16float(w);
    return select(h.x, h.y, (i & 1u) == 1u);
}

// x with every NaN and infinity (a half whose exponent bits are all ones)
// replaced by +0.
fn clean_in4(x: In4) -> In4 {
    var y = select(x, x & vec2(0xffff0000u), (x & vec2(0x7c00u)) == vec2(0x7c00u));
    y = select(y, y & vec2(0x0000ffffu), (y & vec2(0x7c000000u)) == vec2(0x7c000000u));
    return y;
}

// The element flags of lib/nonfinite.wgsl (NONFINITE_FLAGS), two halves a
// word: exponent fields at bits 10-14 and 26-30.
fn flags_in4(x: In4) -> u32 {
    let f = (x & vec2(0x7c007c00u)) + vec2(0x04000400u);
    return f.x | f.y;
}
