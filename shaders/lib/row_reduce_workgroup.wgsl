// Row reductions for tiled/forward.wgsl without subgroups: through
// workgroup memory, folded in lane order. The caller's next barrier orders
// these reads before `red` is written again.
override RED_ELEMS: u32 = 128u;
var<workgroup> red: array<vec4<f32>, RED_ELEMS>;

fn reduce_max4(x: vec4<f32>, rg: u32, cg: u32) -> vec4<f32> {
    red[rg * CG + cg] = x;
    workgroupBarrier();
    var y = red[rg * CG];
    for (var i = 1u; i < CG; i++) {
        y = max(y, red[rg * CG + i]);
    }
    return y;
}

fn reduce_sum4(x: vec4<f32>, rg: u32, cg: u32) -> vec4<f32> {
    red[rg * CG + cg] = x;
    workgroupBarrier();
    var y = red[rg * CG];
    for (var i = 1u; i < CG; i++) {
        y += red[rg * CG + i];
    }
    return y;
}
