// decode/combine.wgsl's output in float16, rounded as the host rounds
// (lib/to_f16.wgsl, which the host prepends): two elements an invocation,
// one word of halves, low half first. The host picks it for a float16
// output kept on the device, with d_v even (a word's halves in one row)
// and the whole output in one dispatch, so that no rounding pass follows.

@group(0) @binding(4) var<storage, read_write> out: array<u32>;

const OUT_ELEMS: u32 = 2u;

fn store_out(e: u32, o: vec2<f32>) {
    out[e / 2u] = f32_to_f16_bits(bitcast<u32>(o.x)) | (f32_to_f16_bits(bitcast<u32>(o.y)) << 16u);
}
