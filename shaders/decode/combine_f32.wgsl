// decode/combine.wgsl's output in float32: one element an invocation.

@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const OUT_ELEMS: u32 = 1u;

fn store_out(e: u32, o: vec2<f32>) {
    out[e] = o.x;
}
