//! The adapter at hand and what runs on it: the adapters as listed, and
//! the kernels each call runs, named by the timestamp queries, are the
//! ones `gpu::testing::plans` selects for it, with and without overrides,
//! on every tier the adapter reaches (simple and tiled everywhere,
//! cooperative where the adapter has cooperative matrices).

use super::common::*;
use flashport_core::gpu::kernel::{Kernel, Tier};
use flashport_core::gpu::select::{BackwardPlan, ForwardPlan};
use flashport_core::gpu::testing::{adapter_caps, plans};
use flashport_core::overrides::{self, Overrides};
use flashport_core::{
    gpu, validate_forward, ArrayInfo, DType, Options, Problem, VariantArrays, VariantOptions,
};

#[test]
fn adapters_are_listed_consistently() {
    if !gpu_present() {
        return;
    }
    let adapters = gpu::adapters();
    for a in &adapters {
        assert!(
            ["discrete", "integrated", "virtual", "software", "other"]
                .contains(&a.device_type.as_str()),
            "{a:?}"
        );
        assert!(!a.backend.to_lowercase().contains("gl"), "{a:?}");
        assert!(a
            .limits
            .iter()
            .any(|(n, v)| n == "max_compute_workgroup_storage_size" && *v >= 16 * 1024));
    }
    let hardware = adapters.iter().any(|a| a.device_type != "software");
    assert_eq!(gpu::hardware_adapter_available(), hardware);
}

/// What one call pair planned and ran.
struct Ran {
    forward: ForwardPlan,
    backward: BackwardPlan,
    /// The kernels the forward and the backward ran, by name (empty
    /// without timestamp queries).
    forward_ran: Vec<String>,
    backward_ran: Vec<String>,
}

/// Plans the forward and the backward of `c` with the calling thread's
/// overrides, runs both, and checks that the kernels that ran are the
/// plans' (once per chunk of heads) where timestamp queries name them.
fn run_as_planned(c: &Case, what: &str) -> Ran {
    // Which kernels ran is read from their timestamps.
    gpu::set_kernel_timing(true);
    let (forward, backward) = plans(&c.p).unwrap();
    let dt = c.p.dtype;
    let none = VariantArrays::default();
    let f = gpu::forward(&c.p, c.q.slice(dt), c.k.slice(dt), c.v.slice(dt), &none).unwrap();
    let forward_ran = kernels_run();
    let d_out = Inputs::new(random(c.p.out_len(), 5), dt);
    gpu::backward(
        &c.p,
        [
            d_out.slice(dt),
            c.q.slice(dt),
            c.k.slice(dt),
            c.v.slice(dt),
            f.out.as_slice(),
            f.lse.as_slice(),
        ],
        &none,
    )
    .unwrap();
    let backward_ran = kernels_run();
    eprintln!(
        "{what}: planned {:?} / {:?}, ran {forward_ran:?} / {backward_ran:?}",
        forward.tier, backward.tier
    );
    if !forward_ran.is_empty() {
        assert!(
            forward_ran
                .iter()
                .all(|k| k == forward.forward.kernel.name()),
            "{what}: planned {:?}, ran {forward_ran:?}",
            forward.forward
        );
        let planned = [backward.preprocess, backward.dq, backward.dkdv].map(|k| k.kernel.name());
        assert!(
            backward_ran.len() % 3 == 0 && backward_ran.chunks(3).all(|c| c == planned),
            "{what}: planned {planned:?}, ran {backward_ran:?}"
        );
    }
    Ran {
        forward,
        backward,
        forward_ran,
        backward_ran,
    }
}

fn softcap_case(dtype: DType) -> Case {
    let s: Shape = (1, 4, 2, 70, 90, 64, 64);
    let (b, hq, hkv, sq, sk, d, dv) = s;
    let name = dtype.numpy_name();
    let p: Problem = validate_forward(
        ArrayInfo::new(&[b, hq, sq, d], name),
        ArrayInfo::new(&[b, hkv, sk, d], name),
        ArrayInfo::new(&[b, hkv, sk, dv], name),
        &Options::from(VariantOptions {
            softcap: Some(0.5),
            ..VariantOptions::default()
        }),
    )
    .unwrap();
    Case {
        q: Inputs::new(random(p.q_len(), 1), dtype),
        k: Inputs::new(random(p.k_len(), 2), dtype),
        v: Inputs::new(random(p.v_len(), 3), dtype),
        p,
    }
}

/// The plan is what runs: plain problems of each dtype on head dims on and
/// off the tiled kernels' grid, a variant, under each override.
#[test]
fn the_planned_kernels_are_the_ones_that_run() {
    if !gpu_present() {
        return;
    }
    let cases = [
        (
            "float32 d=64",
            case((1, 4, 2, 70, 90, 64, 64), true, DType::F32, 1),
        ),
        (
            "float16 d=64",
            case((1, 4, 2, 70, 90, 64, 64), false, DType::F16, 2),
        ),
        (
            "float16 d=128",
            case((1, 2, 1, 65, 40, 128, 128), true, DType::F16, 3),
        ),
        (
            "float16 d=62",
            case((1, 2, 1, 33, 40, 62, 40), false, DType::F16, 4),
        ),
        (
            "float32 d=256",
            case((1, 2, 2, 20, 33, 256, 8), false, DType::F32, 5),
        ),
        ("float16 softcap", softcap_case(DType::F16)),
    ];
    let none = Overrides::NONE;
    let settings = [
        ("defaults", none),
        (
            "simple",
            Overrides {
                max_tier: Some(Tier::Simple),
                ..none
            },
        ),
        (
            "tiled",
            Overrides {
                max_tier: Some(Tier::Tiled),
                ..none
            },
        ),
        (
            "16 KiB",
            Overrides {
                workgroup_bytes: Some(16 * 1024),
                ..none
            },
        ),
        (
            "no subgroups",
            Overrides {
                no_subgroups: true,
                ..none
            },
        ),
        (
            "naga SPIR-V",
            Overrides {
                naga_spirv: true,
                ..none
            },
        ),
        (
            "split bindings",
            Overrides {
                binding_limit: Some(4 * 70 * 64 * 2),
                ..none
            },
        ),
    ];
    let mut timed = false;
    for (name, ov) in settings {
        for (what, c) in &cases {
            let ran = overrides::with(ov, || run_as_planned(c, &format!("{what}, {name}")));
            timed |= !ran.forward_ran.is_empty();
            let (f, b) = (ran.forward, ran.backward);
            // The overrides hold in the plan, and a variant never takes the
            // portable cooperative kernels; those of cooperative matrices 2
            // all but dropout and a mask's gradient.
            if let Some(max) = ov.max_tier {
                assert!(f.tier <= max && b.tier <= max, "{what}, {name}");
            }
            if ov.no_subgroups {
                assert!(!f.forward.subgroups, "{what}, {name}");
            }
            if ov.naga_spirv {
                assert!(!f.forward.passthrough && !b.dq.passthrough && !b.dkdv.passthrough);
            }
            if c.p.has_variants() || c.p.dtype == DType::F32 {
                let cm2_variants = c.p.dtype == DType::F16
                    && !c.p.return_dmask
                    && c.p.dropout.is_none()
                    && c.p.varlen.is_none();
                for tier in [f.tier, b.tier] {
                    assert!(
                        tier < Tier::Coop || (tier == Tier::Cm2 && cm2_variants),
                        "{what}, {name}: {tier:?}"
                    );
                }
            }
            // float32 d = 64: two query heads a binding, so two chunks.
            if ov.binding_limit.is_some() && *what == "float32 d=64" && !ran.backward_ran.is_empty()
            {
                assert!(
                    ran.backward_ran.len() > 3,
                    "{what}, {name}: one chunk, ran {:?}",
                    ran.backward_ran
                );
            }
        }
    }
    if !timed {
        eprintln!(
            "NOT TESTED: this adapter has no timestamp queries, so which kernels ran \
             is unknown; only the plans were checked"
        );
    }
}

/// Each tier is reached on this adapter: the tiled kernels on every
/// adapter for float32 at d = 64 (their tiles fit WebGPU's 16 KiB), the
/// simple ones where asked or off the tiled grid, the cooperative ones for
/// float16 without variants where the adapter has cooperative matrices.
#[test]
fn every_tier_the_adapter_has_is_reached() {
    if !gpu_present() {
        return;
    }
    let caps = adapter_caps().unwrap();
    let tiers = |c: &Case, what: &str| {
        let ran = run_as_planned(c, what);
        (ran.forward.tier, ran.backward.tier)
    };
    let f32_64 = case((1, 4, 2, 70, 90, 64, 64), true, DType::F32, 11);
    let f16_64 = case((1, 4, 2, 70, 90, 64, 64), false, DType::F16, 12);
    let f16_62 = case((1, 2, 1, 33, 40, 62, 40), false, DType::F16, 13);
    assert_eq!(tiers(&f32_64, "float32 d=64"), (Tier::Tiled, Tier::Tiled));
    assert_eq!(tiers(&f16_62, "float16 d=62"), (Tier::Simple, Tier::Simple));
    let simple = overrides::with(max_tier(Tier::Simple), || {
        tiers(&f32_64, "float32 d=64, simple")
    });
    assert_eq!(simple, (Tier::Simple, Tier::Simple));
    let tiled = overrides::with(max_tier(Tier::Tiled), || {
        tiers(&f16_64, "float16 d=64, tiled")
    });
    assert_eq!(tiled, (Tier::Tiled, Tier::Tiled));
    let default = tiers(&f16_64, "float16 d=64");
    if caps.cm2 {
        // NVIDIA's cooperative matrices 2: their forward and backward;
        // capped at Coop, the cooperative kernels.
        assert_eq!(default, (Tier::Cm2, Tier::Cm2));
        let (f, _) = plans(&f16_64.p).unwrap();
        assert_eq!(f.forward.kernel, Kernel::forward(Tier::Cm2));
        let coop = overrides::with(max_tier(Tier::Coop), || {
            tiers(&f16_64, "float16 d=64, coop")
        });
        assert_eq!(coop, (Tier::Coop, Tier::Coop));
    } else if caps.coop {
        assert_eq!(default, (Tier::Coop, Tier::Coop));
        let (f, _) = plans(&f16_64.p).unwrap();
        assert_eq!(f.forward.kernel, Kernel::forward(Tier::Coop));
        assert_eq!(f.forward.passthrough, caps.passthrough);
        eprintln!("NOT TESTED: no cooperative matrices 2 on this adapter: their forward");
    } else {
        assert_eq!(default, (Tier::Tiled, Tier::Tiled));
        eprintln!("NOT TESTED: no cooperative matrices on this adapter: the cooperative tier");
    }
    // The shared context's caps are what `plans` selects from.
    assert_eq!(
        plans(&f16_64.p).unwrap().0.forward.subgroups,
        caps.subgroups
    );
}
