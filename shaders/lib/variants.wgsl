// The score variants every attention and decode kernel computes, one
// declaration for all (the host prepends it with lib/nonfinite.wgsl and
// lib/tanh.wgsl): softcap (s = cap · tanh(s / cap), the cap in the
// kernel's uniform) and ALiBi (s -= slope · |i - j|, the slopes in its
// data). Off by default, so that a plain call's pipeline specialises them
// away; gpu/shaders.rs (`variant_overrides`) sets them from the call.

override SOFTCAP: bool = false;
override ALIBI: bool = false;
