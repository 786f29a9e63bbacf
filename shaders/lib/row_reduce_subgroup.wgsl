// Row reductions for tiled/forward.wgsl on adapters with subgroups of at
// least CG = 8 lanes: the 8 invocations of a row group are consecutive
// lanes, so three butterfly shuffles reduce a row. Every lane ends with the
// same bits (each step adds the same two values), and the order is fixed.
// (naga 30 takes subgroup built-ins without `enable subgroups;` and rejects
// the directive; the device must have the SUBGROUP feature.)

fn reduce_max4(x: vec4<f32>, rg: u32, cg: u32) -> vec4<f32> {
    var y = max(x, subgroupShuffleXor(x, 1u));
    y = max(y, subgroupShuffleXor(y, 2u));
    return max(y, subgroupShuffleXor(y, 4u));
}

fn reduce_sum4(x: vec4<f32>, rg: u32, cg: u32) -> vec4<f32> {
    var y = x + subgroupShuffleXor(x, 1u);
    y = y + subgroupShuffleXor(y, 2u);
    return y + subgroupShuffleXor(y, 4u);
}
