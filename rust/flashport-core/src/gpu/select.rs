//! Which kernels a call runs, with which tiles: one pure function per pass
//! of what the problem needs and what the adapter offers, written once for
//! the forward and the backward, and tested below on a table of adapters
//! without a GPU. Nothing here reads the environment.

use super::kernel::{Kernel, Tier};
use super::shaders::Variants;
use super::tiles::{self, Tiles};
pub use crate::overrides::Overrides;
use crate::{DType, Problem};

/// What the choice depends on from the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterCaps {
    pub workgroup_storage_bytes: u32,
    pub max_invocations: u32,
    pub max_workgroup_size_x: u32,
    /// Subgroup operations with subgroups of at least 8 lanes (a row group
    /// of the tiled forward reduces within one subgroup).
    pub subgroups: bool,
    /// 16x16x16 float16 → float32 cooperative matrices, shader-f16, and
    /// subgroups of exactly 32 lanes (the cooperative kernels' subgroups
    /// own 16 rows each, two lanes per row).
    pub coop: bool,
    /// The driver takes SPIR-V written here (wgpu's passthrough), so the
    /// cooperative kernels can be built with the GLSL450 memory model and
    /// subgroup barriers that order workgroup memory (src/gpu/spirv.rs).
    pub passthrough: bool,
    /// wgpu validates `subgroupBarrier()`, which the cooperative backward
    /// needs where wgpu writes the SPIR-V itself.
    pub subgroup_barrier: bool,
}

impl AdapterCaps {
    /// The limits every WebGPU adapter guarantees, and no optional feature.
    pub const WEBGPU_DEFAULT: AdapterCaps = AdapterCaps {
        workgroup_storage_bytes: 16 * 1024,
        max_invocations: 256,
        max_workgroup_size_x: 256,
        subgroups: false,
        coop: false,
        passthrough: false,
        subgroup_barrier: false,
    };
}

/// Which compiled pipeline a dispatch needs; everything that is a WGSL
/// override or a choice of how to build it is part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PipelineKey {
    pub kernel: Kernel,
    pub f16_inputs: bool,
    pub d: u32,
    pub dv: u32,
    pub tiles: Tiles,
    /// Which row-reduction fragment the tiled forward is built with.
    pub subgroups: bool,
    pub variants: Variants,
    /// A cooperative kernel built from the SPIR-V of src/gpu/spirv.rs and
    /// handed to the driver as it is (false: wgpu compiles the WGSL).
    pub passthrough: bool,
}

/// The forward's kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardPlan {
    pub tier: Tier,
    pub forward: PipelineKey,
}

/// The backward's kernels: the pre-pass (D = rowsum(dO∘O)), then dQ over
/// query tiles and dK/dV over key tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardPlan {
    pub tier: Tier,
    pub preprocess: PipelineKey,
    pub dq: PipelineKey,
    pub dkdv: PipelineKey,
}

/// The variant overrides a problem's pipelines are specialised for.
pub fn variants_of(p: &Problem) -> Variants {
    Variants {
        softcap: p.softcap.is_some(),
        alibi: p.alibi_per_batch.is_some(),
        mask: p.mask.is_some(),
        sinks: p.sinks,
        dropout: p.dropout.is_some(),
        // A packed batch's rows start at their sequence's keys.
        window: p.window.left.is_some() || p.varlen.is_some(),
        dmask: p.return_dmask,
        varlen: p.varlen.is_some(),
    }
}

/// What a pass needs to know to key its pipelines.
struct Keys {
    f16: bool,
    d: u32,
    dv: u32,
    caps: AdapterCaps,
    variants: Variants,
    passthrough: bool,
}

impl Keys {
    fn new(p: &Problem, caps: AdapterCaps, ov: &Overrides, variants: Variants) -> Keys {
        Keys {
            f16: p.dtype == DType::F16,
            d: p.head_dim as u32,
            dv: p.value_dim as u32,
            caps,
            variants,
            passthrough: caps.passthrough && !ov.naga_spirv,
        }
    }

    fn key(&self, kernel: Kernel, tiles: Tiles) -> PipelineKey {
        PipelineKey {
            kernel,
            f16_inputs: self.f16,
            d: self.d,
            dv: self.dv,
            tiles,
            subgroups: self.caps.subgroups,
            variants: self.variants,
            passthrough: kernel.is_coop() && self.passthrough,
        }
    }

    fn simple(&self, kernel: Kernel) -> PipelineKey {
        self.key(
            kernel,
            tiles::simple_tiles(kernel, self.d, self.dv, self.caps),
        )
    }

    /// Whether the cooperative kernels may run: float16 without variants
    /// (the other tiers implement them), on an adapter with cooperative
    /// matrices and a way to build the backward's subgroup barriers.
    fn coop(&self, p: &Problem, ov: &Overrides) -> bool {
        self.f16
            && !p.has_variants()
            && self.caps.coop
            && (self.passthrough || self.caps.subgroup_barrier)
            && ov.allows(Tier::Coop)
    }
}

/// The forward's kernel for `p` on an adapter with `caps`: the fastest
/// tier whose tiles fit.
pub fn select_forward(p: &Problem, caps: AdapterCaps, ov: &Overrides) -> ForwardPlan {
    let caps = ov.apply(caps);
    let variants = Variants {
        dmask: false,
        ..variants_of(p)
    };
    let keys = Keys::new(p, caps, ov, variants);
    let (d, dv) = (keys.d, keys.dv);
    let coop = keys
        .coop(p, ov)
        .then(|| tiles::coop_forward_tiles(d, dv, caps))
        .flatten()
        .map(|t| (Tier::Coop, keys.key(Kernel::ForwardCoop, t)));
    let tiled = || {
        ov.allows(Tier::Tiled)
            .then(|| tiles::tiled_forward_tiles(d, dv, caps))
            .flatten()
            .map(|t| (Tier::Tiled, keys.key(Kernel::ForwardTiled, t)))
    };
    let (tier, forward) = coop
        .or_else(tiled)
        .unwrap_or_else(|| (Tier::Simple, keys.simple(Kernel::Forward)));
    ForwardPlan { tier, forward }
}

/// The backward's kernels for `p` on an adapter with `caps`: the fastest
/// tier whose dQ and dK/dV tiles both fit.
pub fn select_backward(p: &Problem, caps: AdapterCaps, ov: &Overrides) -> BackwardPlan {
    let caps = ov.apply(caps);
    let keys = Keys::new(p, caps, ov, variants_of(p));
    let (d, dv) = (keys.d, keys.dv);
    let pair = |tier, dq, dkdv, (tq, tkv)| (tier, keys.key(dq, tq), keys.key(dkdv, tkv));
    let coop = keys
        .coop(p, ov)
        .then(|| tiles::coop_backward_tiles(d, dv, caps))
        .flatten()
        .map(|t| {
            pair(
                Tier::Coop,
                Kernel::BackwardDqCoop,
                Kernel::BackwardDkDvCoop,
                t,
            )
        });
    let tiled = || {
        ov.allows(Tier::Tiled)
            .then(|| tiles::tiled_backward_tiles(d, dv, caps))
            .flatten()
            .map(|t| {
                pair(
                    Tier::Tiled,
                    Kernel::BackwardDqTiled,
                    Kernel::BackwardDkDvTiled,
                    t,
                )
            })
    };
    let (tier, dq, dkdv) = coop.or_else(tiled).unwrap_or_else(|| {
        (
            Tier::Simple,
            keys.simple(Kernel::BackwardDq),
            keys.simple(Kernel::BackwardDkDv),
        )
    });
    BackwardPlan {
        tier,
        preprocess: keys.simple(Kernel::BackwardPreprocess),
        dq,
        dkdv,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{validate_backward, ArrayInfo, Options};

    /// An NVIDIA H100 through Vulkan (driver 580).
    const H100: AdapterCaps = AdapterCaps {
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        coop: true,
        passthrough: true,
        subgroup_barrier: true,
    };
    /// Mesa's lavapipe (CI): subgroups of 8 lanes, no cooperative matrices.
    const LAVAPIPE: AdapterCaps = AdapterCaps {
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        coop: false,
        passthrough: true,
        subgroup_barrier: false,
    };
    /// An adapter with lavapipe's limits but no subgroup operations.
    const NO_SUBGROUPS: AdapterCaps = AdapterCaps {
        subgroups: false,
        passthrough: false,
        ..LAVAPIPE
    };
    const ADAPTERS: [(&str, AdapterCaps); 4] = [
        ("h100", H100),
        ("lavapipe", LAVAPIPE),
        ("webgpu-16k", AdapterCaps::WEBGPU_DEFAULT),
        ("no-subgroups", NO_SUBGROUPS),
    ];

    /// A GQA problem (8 query heads over 2) with seq_q != seq_k, as the
    /// backward validates it (which the forward's checks include).
    fn problem(dtype: &str, d: usize, dv: usize, options: Options<'_>) -> Problem {
        let (q, k, v, o, lse) = (
            [2, 8, 100, d],
            [2, 2, 70, d],
            [2, 2, 70, dv],
            [2, 8, 100, dv],
            [2, 8, 100],
        );
        let (q, k, v, o) = (
            ArrayInfo::new(&q, dtype),
            ArrayInfo::new(&k, dtype),
            ArrayInfo::new(&v, dtype),
            ArrayInfo::new(&o, dtype),
        );
        validate_backward(o, q, k, v, o, ArrayInfo::new(&lse, "float32"), &options).unwrap()
    }

    fn plain(dtype: &str, d: usize, dv: usize) -> Problem {
        problem(dtype, d, dv, Options::default())
    }

    /// Every key of a plan fits its adapter (after the overrides), and the
    /// tier names the kernels it holds.
    fn consistent(caps: AdapterCaps, tier: Tier, keys: &[PipelineKey]) {
        for key in keys {
            let bytes = tiles::workgroup_bytes(key.kernel, key.d, key.dv, key.tiles);
            assert!(
                bytes <= caps.workgroup_storage_bytes as u64,
                "{key:?}: {bytes} B"
            );
            assert!(key.tiles.workgroup <= caps.max_invocations, "{key:?}");
            assert_eq!(key.subgroups, caps.subgroups, "{key:?}");
            assert_eq!(key.passthrough, key.kernel.is_coop() && caps.passthrough);
        }
        assert_eq!(keys[0].kernel.tier(), tier);
    }

    fn tiers(p: &Problem, caps: AdapterCaps, ov: &Overrides) -> (Tier, Tier) {
        let f = select_forward(p, caps, ov);
        let b = select_backward(p, caps, ov);
        consistent(ov.apply(caps), f.tier, &[f.forward]);
        consistent(ov.apply(caps), b.tier, &[b.dq, b.dkdv]);
        assert_eq!(b.dq.kernel.tier(), b.dkdv.kernel.tier());
        assert_eq!(b.preprocess.kernel, Kernel::BackwardPreprocess);
        (f.tier, b.tier)
    }

    #[test]
    fn each_adapter_gets_the_fastest_tier_that_fits() {
        use Tier::*;
        let no = Overrides::default();
        // (problem, [h100, lavapipe, webgpu-16k, no-subgroups]) for
        // (forward, backward).
        let causal = Options {
            causal: true,
            ..Options::default()
        };
        let softcap = Options {
            softcap: Some(30.0),
            ..Options::default()
        };
        let table: [(Problem, [(Tier, Tier); 4]); 7] = [
            (
                plain("float16", 64, 64),
                [(Coop, Coop), (Tiled, Tiled), (Tiled, Tiled), (Tiled, Tiled)],
            ),
            (
                problem("float16", 128, 128, causal),
                [
                    (Coop, Coop),
                    (Tiled, Tiled),
                    (Simple, Simple),
                    (Tiled, Tiled),
                ],
            ),
            (
                plain("float32", 64, 64),
                [
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                ],
            ),
            // Variants run on the tiers that implement them.
            (
                problem("float16", 64, 64, softcap),
                [
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                    (Tiled, Tiled),
                ],
            ),
            // GQA with d != dv, both multiples of 16.
            (
                plain("float16", 112, 32),
                [
                    (Coop, Coop),
                    (Tiled, Tiled),
                    (Simple, Simple),
                    (Tiled, Tiled),
                ],
            ),
            // Head dims off the register tiles' grid.
            (
                plain("float16", 62, 40),
                [
                    (Simple, Simple),
                    (Simple, Simple),
                    (Simple, Simple),
                    (Simple, Simple),
                ],
            ),
            // Wider than the tiled kernels' outputs.
            (
                plain("float32", 256, 256),
                [
                    (Simple, Simple),
                    (Simple, Simple),
                    (Simple, Simple),
                    (Simple, Simple),
                ],
            ),
        ];
        for (p, want) in &table {
            for ((name, caps), want) in ADAPTERS.iter().zip(want) {
                let got = tiers(p, *caps, &no);
                assert_eq!(
                    got,
                    *want,
                    "{name}: {} d={} dv={} variants={:?}",
                    p.dtype.numpy_name(),
                    p.head_dim,
                    p.value_dim,
                    p.variant_names()
                );
            }
        }
    }

    #[test]
    fn overrides_narrow_the_choice() {
        use Tier::*;
        let p = plain("float16", 64, 64);
        let only = |max| Overrides {
            max_tier: Some(max),
            ..Overrides::default()
        };
        assert_eq!(tiers(&p, H100, &only(Tiled)), (Tiled, Tiled));
        assert_eq!(tiers(&p, H100, &only(Simple)), (Simple, Simple));
        assert_eq!(tiers(&p, H100, &only(Coop)), (Coop, Coop));
        // A 16 KiB adapter's tiles on the H100: smaller, still fitting.
        let small = Overrides {
            workgroup_bytes: Some(16 * 1024),
            ..Overrides::default()
        };
        let f = select_forward(&p, H100, &small);
        let big = select_forward(&p, H100, &Overrides::default());
        assert!(f.forward.tiles.q_rows < big.forward.tiles.q_rows);
        consistent(small.apply(H100), f.tier, &[f.forward]);
        // No subgroups: the tiled forward reduces through workgroup memory.
        let no_subgroups = Overrides {
            no_subgroups: true,
            ..Overrides::default()
        };
        let f = select_forward(&plain("float32", 64, 64), LAVAPIPE, &no_subgroups);
        assert_eq!((f.tier, f.forward.subgroups), (Tiled, false));
        // wgpu's own SPIR-V for the cooperative kernels needs its
        // subgroup barrier: without it they do not run.
        let naga = Overrides {
            naga_spirv: true,
            ..Overrides::default()
        };
        let b = select_backward(&p, H100, &naga);
        assert_eq!((b.tier, b.dq.passthrough), (Coop, false));
        let no_barrier = AdapterCaps {
            subgroup_barrier: false,
            ..H100
        };
        assert_eq!(tiers(&p, no_barrier, &naga).0, Tiled);
    }

    #[test]
    fn the_forward_never_specialises_for_the_mask_gradient() {
        let mask = [100, 70];
        let options = Options {
            mask: Some(ArrayInfo::new(&mask, "float32")),
            return_dmask: true,
            ..Options::default()
        };
        let p = problem("float32", 64, 64, options);
        let f = select_forward(&p, H100, &Overrides::default());
        let b = select_backward(&p, H100, &Overrides::default());
        assert!(!f.forward.variants.dmask && f.forward.variants.mask);
        assert!(b.dq.variants.dmask && b.dq.variants.mask);
    }

    /// A packed batch (attention_varlen) runs on the tier its dense
    /// problem would, the cooperative one included, with its pipelines
    /// keyed apart: `VARLEN` and the per-row starts (`WINDOW`) on. A
    /// problem that is not packed keys exactly as before.
    #[test]
    fn packed_batches_take_every_tier_with_their_own_pipelines() {
        use crate::problem::{validate_varlen_forward, SeqLens};
        let packed = |dtype: &str, d: usize, causal: bool| {
            let (cu_q, cu_k) = ([0i128, 40, 40, 100], [0i128, 20, 25, 70]);
            validate_varlen_forward(
                ArrayInfo::new(&[100, 8, d], dtype),
                ArrayInfo::new(&[70, 2, d], dtype),
                ArrayInfo::new(&[70, 2, d], dtype),
                SeqLens {
                    info: ArrayInfo::new(&[4], "int32"),
                    values: &cu_q,
                },
                SeqLens {
                    info: ArrayInfo::new(&[4], "int32"),
                    values: &cu_k,
                },
                &Options {
                    causal,
                    ..Options::default()
                },
            )
            .unwrap()
            .0
        };
        let no = Overrides::default();
        for (dtype, d, causal) in [
            ("float16", 64, true),
            ("float32", 64, false),
            ("float16", 62, false),
        ] {
            let p = packed(dtype, d, causal);
            let dense = if causal {
                problem(
                    dtype,
                    d,
                    d,
                    Options {
                        causal,
                        ..Options::default()
                    },
                )
            } else {
                plain(dtype, d, d)
            };
            for (name, caps) in ADAPTERS {
                assert_eq!(
                    tiers(&p, caps, &no),
                    tiers(&dense, caps, &no),
                    "{name} {dtype} d={d}"
                );
                let (f, b) = (
                    select_forward(&p, caps, &no),
                    select_backward(&p, caps, &no),
                );
                for key in [f.forward, b.dq, b.dkdv] {
                    assert!(key.variants.varlen && key.variants.window, "{name} {key:?}");
                }
                let (f, b) = (
                    select_forward(&dense, caps, &no),
                    select_backward(&dense, caps, &no),
                );
                for key in [f.forward, b.dq, b.dkdv] {
                    assert_eq!(key.variants, Variants::default(), "{name} {key:?}");
                }
            }
        }
    }
}
