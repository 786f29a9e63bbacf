//! The variants where tiles are cut or skipped: streamed tiles sharing
//! workgroup memory, float16, windows far from the start, masks with long
//! hidden runs, dropout whose keys straddle tiles.

use super::common::*;
use super::variant_cases::*;
use flashport_core::overrides;
use flashport_core::DType;

/// Every variant where the backward's streamed tiles share workgroup memory
/// (dK/dV: dO, then Q over it, then dO again, with one weight array): a 16
/// KiB budget forces it (32-row blocks) and 12 KiB (16-row blocks), both
/// with the register prefetch; d = 128 on lavapipe runs it without.
#[test]
fn variants_with_shared_streamed_tiles() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        causal: true,
        window: Some((20, 3)),
        softcap: Some(0.7),
        mask: MaskArg::Float(vec![2, 1, 37, 53]),
        dmask: true,
        alibi: Some(vec![4]),
        sinks: true,
        dropout_p: 0.2,
    };
    for kib in [16, 12] {
        let errs = overrides::with(workgroup_bytes(kib * 1024), || {
            check_spec(
                VARIANT_SHAPES[0],
                DType::F32,
                &spec,
                920 + kib as u64,
                1e-4,
                4e-4,
            )
        });
        eprintln!("shared streamed tiles, {kib} KiB: {errs:?}");
    }
}

#[test]
fn variants_in_float16() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        window: Some((10, 2)),
        softcap: Some(0.5),
        mask: MaskArg::Bool(vec![1, 4, 37, 53]),
        alibi: Some(vec![4]),
        sinks: true,
        dropout_p: 0.1,
        ..Spec::default()
    };
    let errs = check_spec(VARIANT_SHAPES[0], DType::F16, &spec, 900, 1e-2, 1e-2);
    eprintln!("float16 everything: {errs:?}");
    let spec = Spec {
        causal: true,
        mask: MaskArg::Float(vec![2, 1, 37, 53]),
        dmask: true,
        ..Spec::default()
    };
    let errs = check_spec((2, 4, 2, 37, 53, 12, 7), DType::F16, &spec, 910, 1e-2, 1e-2);
    eprintln!("float16 mask+dmask: {errs:?}");
}

/// Windows whose rows start far into the keys (more keys than queries) or
/// whose first rows see nothing at all (more queries than keys), over
/// several tiles: the kernels start their loops at the first tile any row
/// of the workgroup sees.
#[test]
fn variant_window_far_from_the_start() {
    if !gpu_present() {
        return;
    }
    let shapes: [Shape; 2] = [(1, 2, 1, 45, 200, 32, 16), (1, 2, 2, 200, 45, 16, 32)];
    for (w, causal) in [((3, 1), false), ((20, 0), true), ((0, 40), false)] {
        let spec = Spec {
            window: Some(w),
            causal,
            dmask: true,
            ..Spec::default()
        };
        for (i, &s) in shapes.iter().enumerate() {
            let spec = Spec {
                mask: MaskArg::Blocks(vec![s.3, s.4], |_, _| true),
                ..spec.clone()
            };
            both_kernels(&format!("window {w:?} causal={causal} {s:?}"), || {
                check_spec(s, DType::F32, &spec, 1000 + i as u64, 1e-4, 4e-4)
            });
            let plain = Spec {
                window: Some(w),
                causal,
                ..Spec::default()
            };
            both_kernels(
                &format!("window {w:?} causal={causal} {s:?}, no mask"),
                || check_spec(s, DType::F32, &plain, 1010 + i as u64, 1e-4, 4e-4),
            );
        }
    }
}

/// Block masks with long hidden runs, so that the tiled kernels skip many
/// tiles in a row: a whole 64-row block hidden (its rows see nothing), a
/// run of hidden key tiles, the last key tile hidden, and everything but
/// the last query tile of the dK/dV kernels' loop.
#[test]
fn variant_mask_long_hidden_runs() {
    if !gpu_present() {
        return;
    }
    fn keep(r: usize, c: usize) -> bool {
        let hidden = (64..128).contains(&r)
            || c >= 160
            || (r < 64 && (16..112).contains(&c))
            || (c < 40 && r < 130)
            || (r + c) % 7 == 3;
        !hidden
    }
    let (sq, sk) = (150, 170);
    for (dmask, causal, dropout_p) in [(true, false, 0.0), (false, true, 0.0), (true, false, 0.2)] {
        let spec = Spec {
            mask: MaskArg::Blocks(vec![sq, sk], keep),
            dmask,
            causal,
            dropout_p,
            ..Spec::default()
        };
        both_kernels(
            &format!("long hidden runs dmask={dmask} causal={causal} dropout={dropout_p}"),
            || {
                check_spec(
                    (1, 2, 1, sq, sk, 32, 16),
                    DType::F32,
                    &spec,
                    1100,
                    1e-4,
                    4e-4,
                )
            },
        );
    }
    // Everything hidden: every row sees nothing.
    let spec = Spec {
        mask: MaskArg::Blocks(vec![sq, sk], |_, _| false),
        dmask: true,
        ..Spec::default()
    };
    both_kernels("everything hidden", || {
        check_spec(
            (1, 2, 1, sq, sk, 32, 16),
            DType::F32,
            &spec,
            1120,
            1e-4,
            4e-4,
        )
    });
}

/// Dropout where the keys of a 4-key Philox call straddle tiles: seq_k no
/// multiple of 4, and windows whose tiles start at keys no multiple of 4.
#[test]
fn variant_dropout_unaligned_keys() {
    if !gpu_present() {
        return;
    }
    for (s, window, causal) in [
        ((1, 2, 1, 66, 71, 16, 8), None, false),
        ((2, 2, 1, 37, 130, 32, 16), Some((30, 3)), false),
        ((1, 1, 1, 90, 47, 16, 16), Some((14, 0)), true),
    ] {
        let spec = Spec {
            dropout_p: 0.3,
            window,
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("dropout {s:?} window {window:?}"), || {
            check_spec(s, DType::F32, &spec, 1200, 1e-4, 4e-4)
        });
    }
}
