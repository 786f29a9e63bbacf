//! Each attention variant, and combinations of them, on the GPU against
//! the float64 CPU reference, on the simple and the tiled kernels.

use super::common::*;
use super::variant_cases::*;
use flashport_core::gpu::kernel::Tier;
use flashport_core::overrides;
use flashport_core::variants::DropoutMask;
use flashport_core::{
    gpu, validate_forward, ArrayInfo, DType, Options, Slice, VariantArrays, VariantOptions,
};

#[test]
fn variant_window() {
    if !gpu_present() {
        return;
    }
    for (w, causal) in [
        ((5, 3), false),
        ((7, -1), false),
        ((-1, 2), false),
        ((4, 0), true),
    ] {
        let spec = Spec {
            window: Some(w),
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("window {w:?} causal={causal}"), || {
            each_shape(&spec, 100)
        });
    }
}

#[test]
fn variant_softcap() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        softcap: Some(0.3),
        ..Spec::default()
    };
    both_kernels("softcap", || each_shape(&spec, 200));
}

#[test]
fn variant_alibi() {
    if !gpu_present() {
        return;
    }
    for (name, shape) in [("per head", vec![4]), ("per batch", vec![2, 4])] {
        let spec = Spec {
            alibi: Some(shape),
            causal: true,
            ..Spec::default()
        };
        both_kernels(&format!("alibi {name}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 300, 1e-4, 4e-4)
        });
    }
}

#[test]
fn variant_masks() {
    if !gpu_present() {
        return;
    }
    let (b, hq, sq, sk) = (2, 4, 37, 53);
    for (name, mask) in [
        ("float (sk,)", MaskArg::Float(vec![sk])),
        ("float (b,1,sq,sk)", MaskArg::Float(vec![b, 1, sq, sk])),
        ("bool (b,h,sq,sk)", MaskArg::Bool(vec![b, hq, sq, sk])),
        ("bool (sq,sk)", MaskArg::Bool(vec![sq, sk])),
    ] {
        let spec = Spec {
            mask,
            ..Spec::default()
        };
        both_kernels(&format!("mask {name}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 400, 1e-4, 4e-4)
        });
    }
}

#[test]
fn variant_dmask() {
    if !gpu_present() {
        return;
    }
    let (b, sq, sk) = (2, 37, 53);
    for causal in [false, true] {
        let spec = Spec {
            mask: MaskArg::Float(vec![b, 1, sq, sk]),
            dmask: true,
            causal,
            window: causal.then_some((9, -1)),
            ..Spec::default()
        };
        both_kernels(&format!("dmask causal={causal}"), || {
            check_spec(VARIANT_SHAPES[0], DType::F32, &spec, 500, 1e-4, 4e-4)
        });
    }
    // Split into chunks: the score gradient is assembled from the pieces.
    let spec = Spec {
        mask: MaskArg::Float(vec![45, 30]),
        dmask: true,
        ..Spec::default()
    };
    overrides::with(binding_limit(4 * 45 * 32), || {
        both_kernels("dmask split", || {
            check_spec(VARIANT_SHAPES[1], DType::F32, &spec, 510, 1e-4, 4e-4)
        })
    });
}

#[test]
fn variant_sinks() {
    if !gpu_present() {
        return;
    }
    for causal in [false, true] {
        // The second shape, causal: rows that see no key (output 0, lse =
        // sink).
        let spec = Spec {
            sinks: true,
            causal,
            ..Spec::default()
        };
        both_kernels(&format!("sinks causal={causal}"), || each_shape(&spec, 600));
    }
}

#[test]
fn variant_dropout() {
    if !gpu_present() {
        return;
    }
    let spec = Spec {
        dropout_p: 0.3,
        causal: true,
        ..Spec::default()
    };
    both_kernels("dropout", || each_shape(&spec, 700));
}

/// The GPU's dropout mask is the CPU's, bit for bit: with every score
/// equal and v the identity, out[i, j] = keep(i, j) / ((1 - p) seq_k).
#[test]
fn dropout_mask_matches_the_cpu_exactly() {
    if !gpu_present() {
        return;
    }
    let (b, h, sq, sk) = (2, 3, 21, 40);
    let options = Options::from(VariantOptions {
        dropout_p: 0.4,
        seed: Some(0xdead_beef_1234_5678),
        ..VariantOptions::default()
    });
    let p = validate_forward(
        ArrayInfo::new(&[b, h, sq, 4], "float32"),
        ArrayInfo::new(&[b, h, sk, 4], "float32"),
        ArrayInfo::new(&[b, h, sk, sk], "float32"),
        &options,
    )
    .unwrap();
    let q = vec![0.0f32; p.q_len()];
    let k = vec![0.5f32; p.k_len()];
    let v: Vec<f32> = (0..p.v_len())
        .map(|e| ((e / sk) % sk == e % sk) as u32 as f32)
        .collect();
    let mask = DropoutMask::new(p.dropout.unwrap());
    for simple in [true, false] {
        let tier = if simple { Tier::Simple } else { Tier::Tiled };
        let got = overrides::with(max_tier(tier), || {
            gpu::forward(
                &p,
                Slice::F32(&q),
                Slice::F32(&k),
                Slice::F32(&v),
                &VariantArrays::default(),
            )
        })
        .unwrap();
        let out = as_f64(&got.out);
        let mut kept = 0;
        for bh in 0..b * h {
            for i in 0..sq {
                for j in 0..sk {
                    let x = out[(bh * sq + i) * sk + j];
                    let want = mask.keeps(bh, i, j);
                    assert_eq!(x > 0.0, want, "simple={simple} bh={bh} i={i} j={j}: {x}");
                    kept += want as usize;
                }
            }
        }
        assert!(kept > 0 && kept < b * h * sq * sk);
    }
}

#[test]
fn variant_combinations() {
    if !gpu_present() {
        return;
    }
    let gqa_more_keys = VARIANT_SHAPES[0];
    let combos = [
        (
            "window+causal+GQA+alibi+sinks",
            Spec {
                window: Some((6, -1)),
                causal: true,
                alibi: Some(vec![2, 4]),
                sinks: true,
                ..Spec::default()
            },
        ),
        (
            "softcap+mask+dropout+dmask",
            Spec {
                softcap: Some(0.5),
                mask: MaskArg::Float(vec![2, 4, 37, 53]),
                dropout_p: 0.2,
                dmask: true,
                ..Spec::default()
            },
        ),
        (
            "everything",
            Spec {
                window: Some((8, 3)),
                causal: false,
                softcap: Some(0.4),
                dropout_p: 0.25,
                mask: MaskArg::Float(vec![53]),
                alibi: Some(vec![4]),
                sinks: true,
                dmask: true,
            },
        ),
    ];
    for (name, spec) in &combos {
        both_kernels(name, || {
            check_spec(gqa_more_keys, DType::F32, spec, 800, 1e-4, 4e-4)
        });
    }
    // Head chunks that cut a GQA group, with every variant.
    overrides::with(binding_limit(4 * 37 * 53), || {
        both_kernels("everything, split", || {
            check_spec(gqa_more_keys, DType::F32, &combos[2].1, 810, 1e-4, 4e-4)
        })
    });
}
