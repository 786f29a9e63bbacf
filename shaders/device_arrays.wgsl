// Moves between device-resident arrays (flashport.DeviceArray) and the
// attention kernels' per-chunk buffers, without a trip through the host:
//
// - copy_f16: the float16 elements of a chunk of heads into a buffer of
//   its own. copy_buffer_to_buffer needs 4-byte offsets, which a float16
//   head of odd size does not start at.
// - add_f32: a dK/dV piece of a GQA group cut across chunks, summed into
//   the whole output in chunk order (as the host sums the pieces).
// - to_f16: float32 results rounded to float16 exactly as the host rounds
//   them (half::f16::from_f32, round to nearest even), so an output kept
//   on the device has the bits a NumPy output has (lib/to_f16.wgsl).
//
// Each binding is a window of a buffer bound at an aligned offset; `span`
// locates the elements inside the windows. Float16 elements are packed in
// pairs into u32 words, the low half first, as the attention kernels read
// them.

struct Span {
    // Offsets, in elements of each window's own type (float16 or float32).
    // A float16 destination offset is even: each invocation owns one word.
    src_offset: u32,
    dst_offset: u32,
    count: u32,
}

@group(0) @binding(0) var<uniform> span: Span;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

fn src_half(i: u32) -> u32 {
    return (src[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
}

@compute @workgroup_size(WG)
fn copy_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let first = 2u * invocation(wid, groups, lid);
    if first >= span.count {
        return;
    }
    let lo = src_half(span.src_offset + first);
    var hi = 0u;
    if first + 1u < span.count {
        hi = src_half(span.src_offset + first + 1u);
    }
    dst[(span.dst_offset + first) >> 1u] = lo | (hi << 16u);
}

@compute @workgroup_size(WG)
fn add_f32(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = invocation(wid, groups, lid);
    if i >= span.count {
        return;
    }
    let sum = bitcast<f32>(dst[span.dst_offset + i]) + bitcast<f32>(src[span.src_offset + i]);
    dst[span.dst_offset + i] = bitcast<u32>(sum);
}

// A grid-stride loop over the destination's words (the host caps the
// grid, src/gpu/device_array.rs): fewer, longer-lived invocations, as the
// screen streams its inputs.
@compute @workgroup_size(WG)
fn to_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let stride = groups.x * groups.y * WG;
    for (var word = invocation(wid, groups, lid); 2u * word < span.count; word += stride) {
        let first = 2u * word;
        let lo = f32_to_f16_bits(src[span.src_offset + first]);
        var hi = 0u;
        if first + 1u < span.count {
            hi = f32_to_f16_bits(src[span.src_offset + first + 1u]);
        }
        dst[(span.dst_offset + first) >> 1u] = lo | (hi << 16u);
    }
}
