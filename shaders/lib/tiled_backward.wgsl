// What the two register-tiled backward kernels (shaders/tiled/
// backward_dq.wgsl and backward_dkdv.wgsl) share, prepended by the host
// after lib/tiled.wgsl. A workgroup owns BR = 4*RG rows (query rows for
// dQ, key rows for dK/dV) and streams tiles of BC = 32 rows of the other
// side; invocation (rg, cg) owns rows rg + i*RG, streamed rows cg + 8*j of
// its two 4x4 tiles (S and dP), and columns 4*(cg + 8*n) of its
// accumulators (named variables: private arrays indexed in loops were
// spilled on NVIDIA). Each accumulator sums in a fixed order, with no
// atomics: bitwise reproducible. Sizes are overrides the host computes
// (src/gpu/tiles.rs, backward_kernels). A row whose lse is -inf saw no
// key: its probabilities are all 0.

override RG: u32 = 8u;
override D: u32 = 64u;
override DV: u32 = 64u;
// ceil(D / 32), ceil(DV / 32): vec4 columns per invocation of a width-D /
// width-DV accumulator.
override ND: u32 = 2u;
override NV: u32 = 2u;
override A0_ELEMS: u32 = 1u;
override A1_ELEMS: u32 = 1u;
override W_ELEMS: u32 = 1u;
override W2_ELEMS: u32 = 1u;
// vec4s of each streamed tile every invocation prefetches into named
// registers during the previous tile's arithmetic (0: no prefetch; <= 8).
override PF_N: u32 = 0u;
// The two streamed tiles share one region of `bs` (B1_OFF = 0), for head
// dimensions whose tiles would not fit side by side: the second is loaded
// over the first once the products that read the first are done.
override SHARED: bool = false;
override B1_OFF: u32 = 1u;
override B_ELEMS: u32 = 1u;
override BR: u32 = 4u * RG;
override D4: u32 = D / 4u;
override DV4: u32 = DV / 4u;

const BC: u32 = 32u;
