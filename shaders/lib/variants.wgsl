// The score variants every attention and decode kernel computes, one
// declaration for all (the host prepends it with lib/nonfinite.wgsl and
// lib/tanh.wgsl): softcap (s = cap · tanh(s / cap), the cap in the
// kernel's uniform) and ALiBi (s -= slope · |i - j|, the slopes in its
// data). Off by default, so that a plain call's pipeline specialises them
// away; gpu/shaders.rs (`variant_overrides`) sets them from the call.

override SOFTCAP: bool = false;
override ALIBI: bool = false;

// The score of u = scale · q · k under the variants that change it, as
// crate::variants defines it, for every kernel (the attention kernels'
// `score`, decoding's): the softcap `cap`, then ALiBi with the row's
// `slope` and the `distance` |row's position − key's|. Hidden keys and
// the mask are each kernel's own.
fn variant_score(u: f32, cap: f32, slope: f32, distance: i32) -> f32 {
    var s = u;
    if SOFTCAP {
        s = cap * tanh_f32(u / cap);
    }
    if ALIBI {
        s -= slope * f32(distance);
    }
    return s;
}
