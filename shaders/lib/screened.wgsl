// A fragment of the simple forward, dQ and dK/dV kernels (after
// lib/common.wgsl). Behind the screen (screen.wgsl) such a kernel runs only
// where the screen raised its flag, the last word of `screen_flag`
// (forward) or of `stats` (backward); elsewhere the tiled or cooperative
// kernels did the work and each of its workgroups returns at once.
override SCREENED: bool = false;

// The flag as the workgroup sees it: workgroupUniformLoad, which needs a
// workgroup variable, lets the whole workgroup return in uniform control
// flow.
var<workgroup> screen_raised: u32;

fn screened_out(lid: u32, flag: u32) -> bool {
    if !SCREENED {
        return false;
    }
    if lid == 0u {
        screen_raised = flag;
    }
    return workgroupUniformLoad(&screen_raised) == 0u;
}
