//! Tiles of the cooperative-matrix-2 forward (shaders/cm2/forward.comp):
//! one workgroup of 128 invocations per 64 query rows, 64 keys a step, as
//! ggml's kernel for float16 head dimensions below 256, or 128 keys a step
//! where both head dimensions are at most 64.

use super::Tiles;

/// Query rows of a workgroup, and keys of a step.
pub const CM2_ROWS: u32 = 64;
pub const CM2_KEYS: u32 = 64;
/// Invocations of a workgroup (the shader's `local_size_x`).
pub const CM2_WORKGROUP: u32 = 128;

/// Keys a forward step where both head dimensions are at most 64: on the
/// H200 (4, 16, 4096, 64) float16 took 2.42 ms against 2.52 with 64 keys
/// (non-causal; causal 1.35 against 1.39 ms), one process; at d = 128 the
/// wider step lost (6.58 against 3.98 ms), and so did 32 keys and 128
/// query rows at both, and workgroups of 256 invocations in a build that
/// made them a constant (`_testing_set_overrides(cm2_forward=...)`,
/// 2026-11-28).
pub const CM2_KEYS_NARROW: u32 = 128;

/// The forward's tiles for head dimensions `d` and `dv`, where it takes
/// them: multiples of 16 (the matrices' granule) up to 128, so that the
/// output accumulator (64 × dv floats) stays in registers.
pub fn cm2_forward_tiles(d: u32, dv: u32) -> Option<Tiles> {
    let fits = |x: u32| x > 0 && x % 16 == 0 && x <= 128;
    (fits(d) && fits(dv)).then_some(Tiles {
        q_rows: CM2_ROWS,
        k_rows: if d.max(dv) <= 64 {
            CM2_KEYS_NARROW
        } else {
            CM2_KEYS
        },
        workgroup: CM2_WORKGROUP,
        kv_shared: false,
        prefetch: 0,
    })
}

/// The backward's tiles (both kernels: BR query rows, BC keys) for head
/// dimensions `d` and `dv` where it takes them: 64 keys, 32 above d = 64,
/// where dK/dV's two float32 accumulators (BC × d and BC × dv) would
/// otherwise take 128 registers an invocation on their own.
pub fn cm2_backward_tiles(d: u32, dv: u32) -> Option<Tiles> {
    cm2_forward_tiles(d, dv).map(|t| Tiles {
        k_rows: if d.max(dv) > 64 {
            CM2_KEYS / 2
        } else {
            CM2_KEYS
        },
        ..t
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_dimensions_in_sixteens_up_to_128() {
        for (d, dv, fits) in [
            (64, 64, true),
            (128, 128, true),
            (64, 128, true),
            (16, 48, true),
            (80, 64, true),
            (72, 64, false),
            (256, 256, false),
            (144, 64, false),
            (0, 64, false),
            (64, 8, false),
        ] {
            assert_eq!(cm2_forward_tiles(d, dv).is_some(), fits, "d={d} dv={dv}");
            assert_eq!(cm2_backward_tiles(d, dv).is_some(), fits, "d={d} dv={dv}");
        }
        assert_eq!(cm2_backward_tiles(64, 64).unwrap().k_rows, 64);
        assert_eq!(cm2_backward_tiles(64, 128).unwrap().k_rows, 32);
        assert_eq!(cm2_backward_tiles(128, 128).unwrap().q_rows, 64);
        assert_eq!(cm2_forward_tiles(64, 64).unwrap().k_rows, 128);
        assert_eq!(cm2_forward_tiles(48, 64).unwrap().k_rows, 128);
        assert_eq!(cm2_forward_tiles(64, 80).unwrap().k_rows, 64);
        assert_eq!(cm2_forward_tiles(128, 128).unwrap().k_rows, 64);
    }
}
