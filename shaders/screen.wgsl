// After lib/nonfinite.wgsl. The screen in front of the tiled and
// cooperative attention kernels (docs/design.md#non-finite-inputs). Those
// kernels are fast because IEEE arithmetic runs over whole tiles, hidden
// pairs included; only the simple kernels follow the rules for NaN and
// infinities. A call records both (src/gpu/screen.rs), and this pass
// raises `flag` (its last word) where q, k or v hold a NaN or an infinity
// or, as float32, a magnitude of 2^48 or more (a score or dP summed from
// such products may overflow to an infinity, which the fast kernels would
// meet as NaN in a hidden pair): the simple kernels then do the work
// again, and otherwise return at once (lib/screened.wgsl). The backward
// pre-pass raises the same flag for do, o and lse.

// Inputs as float16 pairs (else float32 words).
override F16: bool = false;

const SCREEN_WG: u32 = 256u;

@group(0) @binding(0) var<storage, read> a: array<u32>;
@group(0) @binding(1) var<storage, read> b: array<u32>;
@group(0) @binding(2) var<storage, read> c: array<u32>;
@group(0) @binding(3) var<storage, read_write> flag: array<atomic<u32>>;

// A non-finite float16 in either half (whose products cannot overflow),
// or a float32 lib/nonfinite.wgsl screens out.
fn screened_word(w: u32) -> bool {
    if F16 {
        return (w & 0x7c00u) == 0x7c00u || (w & 0x7c000000u) == 0x7c000000u;
    }
    return screened_f32(w);
}

@compute @workgroup_size(SCREEN_WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let stride = groups.x * SCREEN_WG;
    var raised = false;
    for (var i = gid.x; i < arrayLength(&a); i += stride) {
        raised = raised | screened_word(a[i]);
    }
    for (var i = gid.x; i < arrayLength(&b); i += stride) {
        raised = raised | screened_word(b[i]);
    }
    for (var i = gid.x; i < arrayLength(&c); i += stride) {
        raised = raised | screened_word(c[i]);
    }
    if raised {
        atomicOr(&flag[arrayLength(&flag) - 1u], 1u);
    }
}
