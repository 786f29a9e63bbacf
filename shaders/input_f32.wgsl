// The element of the tiled kernels' input bindings (q, k, v, dO) for
// float32 inputs: a vec4 read as it is. The host prepends this or
// shaders/input_f16.wgsl: a binding's type cannot be an override.
alias In4 = vec4<f32>;

fn widen(x: In4) -> vec4<f32> {
    return x;
}
