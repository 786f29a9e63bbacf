//! Which kernels a call runs, with which tiles: one pure function per pass
//! of what the problem needs and what the adapter offers, written once for
//! the forward and the backward, and tested below on a table of adapters
//! without a GPU. Nothing here reads the environment.

pub use super::caps::{driver_loop_limit, AdapterCaps, LLVMPIPE_LOOP_LIMIT};
use super::kernel::{Kernel, Tier};
use super::tiles::{self, LoopShape, Tiles};
use crate::error::{Error, Result};
pub use crate::overrides::Overrides;
use crate::problem::{DType, Problem};

/// Which attention variants a pipeline is specialised for. Each is an
/// override of shaders/lib/common.wgsl, so that a plain call's pipeline
/// compiles none of their code.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Variants {
    pub softcap: bool,
    pub alibi: bool,
    pub mask: bool,
    pub sinks: bool,
    pub dropout: bool,
    /// A left window bound (causal and a right bound are uniforms).
    pub window: bool,
    /// The dQ kernels write the full score gradient.
    pub dmask: bool,
    /// A packed batch of variable-length sequences: rows' keys from the
    /// row table (with `window`, since rows start later than key 0).
    pub varlen: bool,
    /// A simple kernel behind the screen (src/gpu/screen.rs): it runs only
    /// where the screen raised its flag (lib/screened.wgsl).
    pub screened: bool,
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
    /// A cooperative-matrix-2 kernel over whole tiles only (seq_q and seq_k
    /// multiples of its rows and keys): it then loads and stores without
    /// clamping at the arrays' edges, which cost the forward up to a third
    /// of its time at d = 128 (`exact_tiles`). False for every other kernel.
    pub exact_tiles: bool,
}

/// Whether `kernel` with `tiles` covers `shape`'s rows and keys in whole
/// tiles, where that changes its pipeline (the cooperative-matrix-2
/// kernels: docs/gpu.md#cooperative-matrices-2).
pub fn exact_tiles(kernel: Kernel, tiles: Tiles, shape: LoopShape) -> bool {
    kernel.tier() == Tier::Cm2
        && shape.seq_q % tiles.q_rows.max(1) as u64 == 0
        && shape.seq_k % tiles.k_rows.max(1) as u64 == 0
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
        screened: false,
    }
}

/// What the loop counts of `p`'s kernels depend on beyond their pipelines.
pub fn loop_shape(p: &Problem) -> LoopShape {
    LoopShape {
        seq_q: p.seq_q as u64,
        seq_k: p.seq_k as u64,
        group: p.group_size() as u64,
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
    shape: LoopShape,
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
            shape: loop_shape(p),
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
            exact_tiles: exact_tiles(kernel, tiles, self.shape),
        }
    }

    /// A simple kernel: its usual tiles, or where the adapter has a loop
    /// limit, tiles within it where the usual ones are not.
    fn simple(&self, kernel: Kernel) -> PipelineKey {
        let t = match self.caps.loop_limit {
            None => tiles::simple_tiles(kernel, self.d, self.dv, self.caps),
            Some(limit) => {
                tiles::simple_tiles_within(kernel, self.d, self.dv, self.caps, limit as u64, |t| {
                    let key = self.key(kernel, t);
                    (
                        tiles::loop_iterations(&key, self.shape),
                        tiles::workgroup_iterations(&key, self.shape),
                    )
                })
            }
        };
        self.key(kernel, t)
    }

    /// Whether the cooperative-matrix-2 kernels may run: float16, not a
    /// packed batch, without dropout or a mask's gradient (every other
    /// variant: shaders/cm2/common.glsl).
    fn cm2(&self, p: &Problem, ov: &Overrides) -> bool {
        self.f16
            && p.dropout.is_none()
            && !p.return_dmask
            && p.varlen.is_none()
            && self.caps.cm2
            && self.passthrough
            && ov.allows(Tier::Cm2)
            // Tiles forced for the cooperative forward ask for that kernel.
            && ov.coop_forward.is_none()
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
    let at = |tier, t| (tier, keys.key(Kernel::forward(tier), t));
    let cm2 = keys
        .cm2(p, ov)
        .then(|| tiles::cm2_forward_tiles(d, dv).map(|t| ov.cm2_forward.unwrap_or(t)))
        .flatten()
        .map(|t| at(Tier::Cm2, t));
    let coop = || {
        keys.coop(p, ov)
            .then(|| match ov.coop_forward {
                None => tiles::coop_forward_tiles(d, dv, caps),
                Some(want) => tiles::coop_forward_candidates(d, dv, caps).find(|&t| t == want),
            })
            .flatten()
            .map(|t| at(Tier::Coop, t))
    };
    let tiled = || {
        ov.allows(Tier::Tiled)
            .then(|| tiles::tiled_forward_tiles(d, dv, caps))
            .flatten()
            .map(|t| at(Tier::Tiled, t))
    };
    let (tier, forward) = cm2
        .or_else(coop)
        .or_else(tiled)
        .unwrap_or_else(|| (Tier::Simple, keys.simple(Kernel::forward(Tier::Simple))));
    ForwardPlan { tier, forward }
}

/// The backward's kernels for `p` on an adapter with `caps`: the fastest
/// tier whose dQ and dK/dV tiles both fit.
pub fn select_backward(p: &Problem, caps: AdapterCaps, ov: &Overrides) -> BackwardPlan {
    let caps = ov.apply(caps);
    let keys = Keys::new(p, caps, ov, variants_of(p));
    let (d, dv) = (keys.d, keys.dv);
    let pair = |tier, (tq, tkv)| {
        let (dq, dkdv) = (Kernel::dq(tier), Kernel::dkdv(tier));
        (tier, keys.key(dq, tq), keys.key(dkdv, tkv))
    };
    // (The score gradient, which the cm2 kernels do not write, keeps a
    // backward off them: `Keys::cm2`.)
    let cm2 = keys
        .cm2(p, ov)
        .then(|| tiles::cm2_backward_tiles(d, dv))
        .flatten()
        .map(|t| pair(Tier::Cm2, (t, t)));
    let coop = || {
        keys.coop(p, ov)
            .then(|| tiles::coop_backward_tiles(d, dv, caps))
            .flatten()
            .map(|t| pair(Tier::Coop, t))
    };
    let tiled = || {
        ov.allows(Tier::Tiled)
            .then(|| tiles::tiled_backward_tiles(d, dv, caps))
            .flatten()
            .map(|t| pair(Tier::Tiled, t))
    };
    let (tier, dq, dkdv) = cm2.or_else(coop).or_else(tiled).unwrap_or_else(|| {
        (
            Tier::Simple,
            keys.simple(Kernel::dq(Tier::Simple)),
            keys.simple(Kernel::dkdv(Tier::Simple)),
        )
    });
    BackwardPlan {
        tier,
        preprocess: keys.simple(Kernel::PREPROCESS),
        dq,
        dkdv,
    }
}

/// The simple forward kernel that runs behind `plan`'s tiled or cooperative
/// one and does its work again where the screen finds NaN, infinities or
/// huge values (src/gpu/screen.rs): none where `plan`
/// is simple already (it follows docs/design.md#non-finite-inputs itself),
/// or where the simple kernel would pass the driver's loop limit, which
/// the fast kernel does not (such calls keep it, and IEEE arithmetic's
/// NaN: docs/gpu.md).
pub fn simple_forward(
    p: &Problem,
    caps: AdapterCaps,
    ov: &Overrides,
    plan: &ForwardPlan,
) -> Option<PipelineKey> {
    if plan.tier == Tier::Simple {
        return None;
    }
    let variants = Variants {
        screened: true,
        ..plan.forward.variants
    };
    let key = Keys::new(p, ov.apply(caps), ov, variants).simple(Kernel::forward(Tier::Simple));
    check_loop_limit(p, ov.apply(caps), &[key]).ok()?;
    Some(key)
}

/// The simple dQ and dK/dV kernels behind `plan`'s, as [`simple_forward`]
/// says.
pub fn simple_backward(
    p: &Problem,
    caps: AdapterCaps,
    ov: &Overrides,
    plan: &BackwardPlan,
) -> Option<(PipelineKey, PipelineKey)> {
    if plan.tier == Tier::Simple {
        return None;
    }
    let variants = Variants {
        screened: true,
        ..plan.dq.variants
    };
    let keys = Keys::new(p, ov.apply(caps), ov, variants);
    let (dq, dkdv) = (
        keys.simple(Kernel::dq(Tier::Simple)),
        keys.simple(Kernel::dkdv(Tier::Simple)),
    );
    check_loop_limit(p, ov.apply(caps), &[dq, dkdv]).ok()?;
    Some((dq, dkdv))
}

/// Refuses a call whose kernels (`keys`, as selected for `p`) would run
/// more loop iterations in one subgroup than the adapter's driver allows
/// (`AdapterCaps::loop_limit`): the driver would cut their loops short and
/// hand back wrong or unwritten outputs without an error.
pub fn check_loop_limit(p: &Problem, caps: AdapterCaps, keys: &[PipelineKey]) -> Result<()> {
    let Some(limit) = caps.loop_limit else {
        return Ok(());
    };
    for key in keys {
        let n = tiles::loop_iterations(key, loop_shape(p));
        if n > limit as u64 {
            return Err(Error::TooLarge(format!(
                "the GPU kernel {} would run {n} loop iterations in one invocation on this \
                 shape (batch={}, heads={}/{}, seq_q={}, seq_k={}, d={}, d_v={}), and this \
                 adapter's driver (Mesa's llvmpipe before 25.0) silently ends a shader's \
                 loops after {limit}; use device=\"cpu\" (or Mesa 25 or newer)",
                key.kernel.name(),
                p.batch,
                p.heads_q,
                p.heads_kv,
                p.seq_q,
                p.seq_k,
                p.head_dim,
                p.value_dim
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{validate_backward, ArrayInfo, Options, VariantOptions};

    /// An NVIDIA H100 through Vulkan (driver 580).
    const H100: AdapterCaps = AdapterCaps {
        workgroup_storage_bytes: 48 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        coop: true,
        passthrough: true,
        subgroup_barrier: true,
        cm2: false,
        loop_limit: None,
    };
    /// The H100 opened with NVIDIA's cooperative matrices 2.
    const H100_CM2: AdapterCaps = AdapterCaps { cm2: true, ..H100 };
    /// Mesa's lavapipe (CI): subgroups of 8 lanes, no cooperative matrices,
    /// and (Mesa 22.3) the loop limit.
    const LAVAPIPE: AdapterCaps = AdapterCaps {
        workgroup_storage_bytes: 32 * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        coop: false,
        passthrough: true,
        subgroup_barrier: false,
        cm2: false,
        loop_limit: Some(LLVMPIPE_LOOP_LIMIT),
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
        assert_eq!(b.preprocess.kernel, Kernel::PREPROCESS);
        (f.tier, b.tier)
    }

    #[test]
    fn each_adapter_gets_the_fastest_tier_that_fits() {
        use Tier::*;
        let no = Overrides::default();
        // (problem, [h100, lavapipe, webgpu-16k, no-subgroups]) for
        // (forward, backward).
        let causal = Options::from(VariantOptions {
            causal: true,
            ..VariantOptions::default()
        });
        let softcap = Options::from(VariantOptions {
            softcap: Some(30.0),
            ..VariantOptions::default()
        });
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
    fn the_cm2_forward_takes_the_cooperative_tier_s_plain_problems() {
        use Tier::*;
        let f16 = plain("float16", 64, 64);
        let f = select_forward(&f16, H100_CM2, &Overrides::default());
        assert_eq!((f.tier, f.forward.kernel), (Cm2, Kernel::forward(Cm2)));
        assert_eq!(f.forward.tiles, tiles::cm2_forward_tiles(64, 64).unwrap());
        // Its backward too, the screen's simple kernels behind them.
        let b = select_backward(&f16, H100_CM2, &Overrides::default());
        assert_eq!(
            (b.tier, b.dq.kernel, b.dkdv.kernel),
            (Cm2, Kernel::dq(Cm2), Kernel::dkdv(Cm2))
        );
        assert_eq!(b.preprocess.kernel, Kernel::PREPROCESS);
        assert_eq!(b.dkdv.tiles, tiles::cm2_backward_tiles(64, 64).unwrap());
        assert!(simple_forward(&f16, H100_CM2, &Overrides::default(), &f).is_some());
        assert!(simple_backward(&f16, H100_CM2, &Overrides::default(), &b).is_some());
        for (p, why) in [
            (plain("float16", 128, 64), "d != dv"),
            (plain("float16", 16, 112), "small and odd multiples of 16"),
        ] {
            let f = select_forward(&p, H100_CM2, &Overrides::default());
            assert_eq!(f.tier, Cm2, "{why}");
        }
        let coop_only = |p: &Problem, ov: &Overrides, why: &str| {
            assert_ne!(select_forward(p, H100_CM2, ov).tier, Cm2, "{why}");
            assert_ne!(select_backward(p, H100_CM2, ov).tier, Cm2, "{why}");
        };
        let none = Overrides::default();
        coop_only(&plain("float32", 64, 64), &none, "float32");
        coop_only(&plain("float16", 72, 72), &none, "d not a multiple of 16");
        coop_only(&plain("float16", 256, 256), &none, "d above 128");
        let softcap = Options::from(VariantOptions {
            softcap: Some(30.0),
            ..VariantOptions::default()
        });
        // Every variant on cm2 but dropout (and a mask's gradient).
        let window = Options::from(VariantOptions {
            window: Some((100, 3)),
            causal: true,
            ..VariantOptions::default()
        });
        let heads = [8];
        let alibi = Options::from(VariantOptions {
            alibi_slopes: Some(ArrayInfo::new(&heads, "float32")),
            ..VariantOptions::default()
        });
        let keys = [70];
        let mask = Options::from(VariantOptions {
            mask: Some(ArrayInfo::new(&keys, "bool")),
            ..VariantOptions::default()
        });
        let sinks = Options::from(VariantOptions {
            sinks: Some(ArrayInfo::new(&heads, "float32")),
            ..VariantOptions::default()
        });
        for (options, why) in [
            (softcap, "softcap"),
            (window, "window"),
            (alibi, "alibi"),
            (mask, "mask"),
            (sinks, "sinks"),
        ] {
            let p = problem("float16", 64, 64, options);
            assert_eq!(tiers(&p, H100_CM2, &none), (Cm2, Cm2), "{why}");
            let v = select_forward(&p, H100_CM2, &none).forward.variants;
            assert_eq!(
                (v.softcap, v.window, v.alibi, v.mask, v.sinks),
                (
                    why == "softcap",
                    why == "window",
                    why == "alibi",
                    why == "mask",
                    why == "sinks"
                ),
                "{why}"
            );
        }
        let dropout = Options::from(VariantOptions {
            dropout_p: 0.1,
            seed: Some(1),
            ..VariantOptions::default()
        });
        coop_only(&problem("float16", 64, 64, dropout), &none, "dropout");
        coop_only(
            &f16,
            &Overrides {
                max_tier: Some(Coop),
                ..none
            },
            "capped at Coop",
        );
        let naga = Overrides {
            naga_spirv: true,
            ..none
        };
        coop_only(&f16, &naga, "no passthrough");
        let forced = Overrides {
            coop_forward: tiles::coop_forward_tiles(64, 64, H100),
            ..none
        };
        let f = select_forward(&f16, H100_CM2, &forced);
        assert_eq!(
            f.forward.kernel,
            Kernel::forward(Tier::Coop),
            "coop tiles forced"
        );
        // Without the extension, the cooperative kernel as before.
        assert_eq!(select_forward(&f16, H100, &none).tier, Coop);
        // The test problem's 100 rows over 70 keys are not whole tiles.
        assert!(!select_forward(&f16, H100_CM2, &none).forward.exact_tiles);
    }

    #[test]
    fn whole_tiles_are_told_apart_for_the_cm2_forward_only() {
        let t = tiles::cm2_forward_tiles(64, 64).unwrap();
        let shape = |seq_q, seq_k| LoopShape {
            seq_q,
            seq_k,
            group: 1,
        };
        assert!(exact_tiles(
            Kernel::forward(Tier::Cm2),
            t,
            shape(4096, 4096)
        ));
        assert!(exact_tiles(Kernel::forward(Tier::Cm2), t, shape(64, 128)));
        assert!(!exact_tiles(
            Kernel::forward(Tier::Cm2),
            t,
            shape(4096, 4095)
        ));
        assert!(!exact_tiles(
            Kernel::forward(Tier::Cm2),
            t,
            shape(100, 4096)
        ));
        assert!(!exact_tiles(Kernel::forward(Tier::Cm2), t, shape(1, 64)));
        assert!(!exact_tiles(
            Kernel::forward(Tier::Coop),
            t,
            shape(4096, 4096)
        ));
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
            return_dmask: true,
            ..Options::from(VariantOptions {
                mask: Some(ArrayInfo::new(&mask, "float32")),
                ..VariantOptions::default()
            })
        };
        let p = problem("float32", 64, 64, options);
        let f = select_forward(&p, H100, &Overrides::default());
        let b = select_backward(&p, H100, &Overrides::default());
        assert!(!f.forward.variants.dmask && f.forward.variants.mask);
        assert!(b.dq.variants.dmask && b.dq.variants.mask);
    }

    #[test]
    fn llvmpipe_before_mesa_25_has_the_loop_limit() {
        let llvmpipe = "llvmpipe (LLVM 15.0.6, 256 bits)";
        let limit = Some(LLVMPIPE_LOOP_LIMIT);
        for (name, driver, info, want) in [
            (llvmpipe, "llvmpipe", "Mesa 22.3.6 (LLVM 15.0.6)", limit),
            (
                llvmpipe,
                "llvmpipe",
                "Mesa 24.2.8-1ubuntu1~24.04.1 (LLVM 19.1.1)",
                limit,
            ),
            (
                llvmpipe,
                "llvmpipe",
                "Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)",
                None,
            ),
            (llvmpipe, "llvmpipe", "Mesa 26.1.0 (LLVM 20.1.2)", None),
            // A version it cannot read counts as limited.
            (llvmpipe, "llvmpipe", "", limit),
            (llvmpipe, "", "", limit),
            ("NVIDIA H100 80GB HBM3", "NVIDIA", "580.95.05", None),
            (
                "AMD Radeon RX 7900 XTX (RADV NAVI31)",
                "radv",
                "Mesa 24.2.8",
                None,
            ),
        ] {
            assert_eq!(
                driver_loop_limit(name, driver, info),
                want,
                "{name} / {info}"
            );
        }
    }

    fn shaped(s: [usize; 7], dtype: &str) -> Problem {
        let [b, hq, hkv, sq, sk, d, dv] = s;
        let (q, k, v, lse) = (
            [b, hq, sq, d],
            [b, hkv, sk, d],
            [b, hkv, sk, dv],
            [b, hq, sq],
        );
        let o = [b, hq, sq, dv];
        let (qi, ki, vi, oi) = (
            ArrayInfo::new(&q, dtype),
            ArrayInfo::new(&k, dtype),
            ArrayInfo::new(&v, dtype),
            ArrayInfo::new(&o, dtype),
        );
        let lse = ArrayInfo::new(&lse, "float32");
        validate_backward(oi, qi, ki, vi, oi, lse, &Options::default()).unwrap()
    }

    fn keys(p: &Problem, caps: AdapterCaps) -> Vec<PipelineKey> {
        let (f, b) = (
            select_forward(p, caps, &Overrides::NONE),
            select_backward(p, caps, &Overrides::NONE),
        );
        vec![f.forward, b.preprocess, b.dq, b.dkdv]
    }

    /// The shapes: lavapipe's usual simple tiles run past its loop
    /// limit (unwritten outputs); with the limit known, the plan stays
    /// within it. Other adapters, and shapes within the limit, keep the
    /// usual tiles.
    #[test]
    fn loop_limited_adapters_get_simple_tiles_within_the_limit() {
        let unlimited = AdapterCaps {
            loop_limit: None,
            ..LAVAPIPE
        };
        let limit = LLVMPIPE_LOOP_LIMIT as u64;
        // (shape, passes: the forward's key, or all four)
        for (s, passes) in [
            ([1, 1, 1, 64, 64, 1024, 1024], 1),
            ([1, 4, 1, 221, 244, 46, 122], 4),
        ] {
            let p = shaped(s, "float32");
            let counts = |caps| -> Vec<u64> {
                keys(&p, caps)[..passes]
                    .iter()
                    .map(|k| tiles::loop_iterations(k, loop_shape(&p)))
                    .collect()
            };
            let before = counts(unlimited);
            assert!(before.iter().any(|&n| n > limit), "{s:?}: {before:?}");
            let usual = &keys(&p, unlimited)[..passes];
            check_loop_limit(&p, unlimited, usual).unwrap();
            assert!(check_loop_limit(&p, LAVAPIPE, usual).is_err());
            let after = counts(LAVAPIPE);
            assert!(after.iter().all(|&n| n <= limit), "{s:?}: {after:?}");
            let lean = &keys(&p, LAVAPIPE)[..passes];
            check_loop_limit(&p, LAVAPIPE, lean).unwrap();
            for key in lean {
                assert!(key.tiles.workgroup <= LAVAPIPE.max_invocations);
                let bytes = tiles::workgroup_bytes(key.kernel, key.d, key.dv, key.tiles);
                assert!(bytes <= LAVAPIPE.workgroup_storage_bytes as u64, "{key:?}");
            }
            for caps in [H100, AdapterCaps::WEBGPU_DEFAULT, unlimited] {
                for key in keys(&p, caps).into_iter().filter(|k| !k.kernel.is_tiled()) {
                    let usual = tiles::simple_tiles(key.kernel, key.d, key.dv, caps);
                    assert_eq!(key.tiles, usual);
                }
            }
            let short = shaped([s[0], s[1], s[2], 8, 8, s[5], s[6]], "float32");
            assert_eq!(keys(&short, LAVAPIPE), keys(&short, unlimited));
        }
        // d = 1024's backward stays over the limit even so: refused.
        let p = shaped([1, 1, 1, 64, 64, 1024, 1024], "float32");
        assert!(check_loop_limit(&p, LAVAPIPE, &keys(&p, LAVAPIPE)).is_err());
    }

    /// Behind the screen: a tiled or cooperative plan gets the simple
    /// kernels of the same problem built to run behind it (variants
    /// included, dmask only in dQ as selected), a simple plan none (it follows the rules itself), and a
    /// loop-limited driver none where the simple kernels would pass its
    /// limit but the tiled ones do not.
    #[test]
    fn the_screen_sends_fast_plans_to_the_simple_kernels_of_the_same_problem() {
        let no = Overrides::default();
        let causal = Options::from(VariantOptions {
            causal: true,
            softcap: Some(20.0),
            ..VariantOptions::default()
        });
        for (p, caps) in [
            (plain("float16", 64, 64), H100),
            (problem("float32", 64, 48, causal), LAVAPIPE),
            (plain("float32", 64, 64), AdapterCaps::WEBGPU_DEFAULT),
            (plain("float16", 64, 64), NO_SUBGROUPS),
        ] {
            let f = select_forward(&p, caps, &no);
            let b = select_backward(&p, caps, &no);
            assert_ne!(f.tier, Tier::Simple);
            let sf = simple_forward(&p, caps, &no, &f).unwrap();
            let screened = |k: PipelineKey| PipelineKey {
                variants: Variants {
                    screened: true,
                    ..k.variants
                },
                ..k
            };
            let plain = simple_keys(&p, caps);
            assert_eq!(sf, screened(plain[0]));
            assert_eq!(
                sf.variants,
                Variants {
                    screened: true,
                    ..f.forward.variants
                }
            );
            let (sq, skv) = simple_backward(&p, caps, &no, &b).unwrap();
            assert_eq!(
                (sq.kernel, skv.kernel),
                (Kernel::dq(Tier::Simple), Kernel::dkdv(Tier::Simple))
            );
            assert_eq!([sq, skv], [screened(plain[2]), screened(plain[3])]);
            assert!(sq.variants.screened && !b.dq.variants.screened);
        }
        // d = 256: simple already.
        let wide = plain("float32", 256, 256);
        let f = select_forward(&wide, H100, &no);
        assert_eq!(f.tier, Tier::Simple);
        assert_eq!(simple_forward(&wide, H100, &no, &f), None);
        let b = select_backward(&wide, H100, &no);
        assert_eq!(simple_backward(&wide, H100, &no, &b), None);
        // 40 000 keys at d = 64: the tiled forward fits lavapipe's loop
        // limit, the simple one does not.
        let long = shaped([1, 1, 1, 1, 40_000, 64, 64], "float32");
        let f = select_forward(&long, LAVAPIPE, &no);
        assert_eq!(f.tier, Tier::Tiled);
        check_loop_limit(&long, LAVAPIPE, &[f.forward]).unwrap();
        assert_eq!(simple_forward(&long, LAVAPIPE, &no, &f), None);
        assert!(simple_forward(&long, H100, &no, &select_forward(&long, H100, &no)).is_some());
    }

    /// The keys of `p` on `caps` with the simple tier only.
    fn simple_keys(p: &Problem, caps: AdapterCaps) -> Vec<PipelineKey> {
        let ov = Overrides {
            max_tier: Some(Tier::Simple),
            ..Overrides::NONE
        };
        let (f, b) = (select_forward(p, caps, &ov), select_backward(p, caps, &ov));
        vec![f.forward, b.preprocess, b.dq, b.dkdv]
    }

    /// Where no tiles stay within the limit, the call is refused, naming
    /// the driver; the same plan is fine on an adapter without the limit.
    #[test]
    fn past_the_loop_limit_the_call_is_refused() {
        // The simple kernels (d = 256 > the tiled backward's 128) and the
        // tiled forward (d = 64), each far past the limit.
        for s in [[1, 1, 1, 1, 20000, 256, 256], [1, 1, 1, 1, 400_000, 64, 64]] {
            let p = shaped(s, "float32");
            let err = check_loop_limit(&p, LAVAPIPE, &keys(&p, LAVAPIPE)).unwrap_err();
            match err {
                Error::TooLarge(m) => assert!(m.contains("llvmpipe") && m.contains("cpu"), "{m}"),
                other => panic!("{other:?}"),
            }
            check_loop_limit(&p, H100, &keys(&p, H100)).unwrap();
        }
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
                &Options::from(VariantOptions {
                    causal,
                    ..VariantOptions::default()
                }),
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
                    Options::from(VariantOptions {
                        causal,
                        ..VariantOptions::default()
                    }),
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
