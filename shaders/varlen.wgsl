// attention_varlen's device arrays between flash-attn's packed layout and
// the attention kernels' head-major one: an array of shape (a, b, w) is
// written as (b, a, w), (total, heads, dim) -> (heads, total, dim) on the
// way in and back on the way out (src/gpu/varlen.rs). A module of its own,
// so that the attention kernels do not change.
//
// One invocation per output word: a float32 element, or two float16
// elements (packed in pairs, the low half first, as the kernels read
// them), each fetched from wherever it lies in the source.

struct Dims {
    a: u32,
    b: u32,
    w: u32,
    // a * b * w elements.
    count: u32,
}

@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// Element `e` of the output, (j, i, c) of (b, a, w), is (i, j, c) of the
// source.
fn source_of(e: u32) -> u32 {
    let c = e % dims.w;
    let rest = e / dims.w;
    let i = rest % dims.a;
    let j = rest / dims.a;
    return (i * dims.b + j) * dims.w + c;
}

fn src_half(i: u32) -> u32 {
    return (src[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
}

@compute @workgroup_size(WG)
fn varlen_swap_f32(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = invocation(wid, groups, lid);
    if e >= dims.count {
        return;
    }
    dst[e] = src[source_of(e)];
}

@compute @workgroup_size(WG)
fn varlen_swap_f16(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let first = 2u * invocation(wid, groups, lid);
    if first >= dims.count {
        return;
    }
    let lo = src_half(source_of(first));
    var hi = 0u;
    if first + 1u < dims.count {
        hi = src_half(source_of(first + 1u));
    }
    dst[first >> 1u] = lo | (hi << 16u);
}
