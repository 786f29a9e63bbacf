// The element of the tiled kernels' input bindings (q, k, v, dO) for
// float16 inputs: four halves packed in two u32, widened to float32 as they
// are loaded, so the arithmetic is the float32 kernels' own.
// unpack2x16float is core WGSL: no shader-f16 feature is needed.
alias In4 = vec2<u32>;

fn widen(x: In4) -> vec4<f32> {
    return vec4(unpack2x16float(x.x), unpack2x16float(x.y));
}
