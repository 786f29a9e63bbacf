// Invocations per workgroup of the element-wise passes (device-array
// moves, varlen layouts, merges, KV cache writes), one element or row each.
const WG: u32 = 64u;

// The grid is two-dimensional when one dimension cannot hold the count.
fn invocation(wid: vec3<u32>, groups: vec3<u32>, lid: u32) -> u32 {
    return (wid.y * groups.x + wid.x) * WG + lid;
}
