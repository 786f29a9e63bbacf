//! The compute kernels of the backend: a pass of FlashAttention-2 at a
//! tier. A kernel is the pair, not the product spelled out, so that a new
//! tier adds one `Tier` arm and one name suffix, and the rule for the one
//! pass that exists at a single tier (the backward's pre-pass) is written
//! once, in [`Kernel::new`].

// The tiers are defined a floor down, beside the adapter's capabilities
// and the tiles (the test knobs name them too).
pub use crate::gpu_choice::Tier;

/// The passes of FlashAttention-2 the backend runs as kernels: the
/// forward, and the backward as a pre-pass (`D = rowsum(dO ∘ O)`), then dQ
/// over query tiles and dK/dV over key tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    BackwardPreprocess,
    BackwardDq,
    BackwardDkDv,
}

impl Pass {
    /// Every pass, in declaration order (the order of `NAMES`' rows).
    pub const ALL: [Pass; 4] = [
        Pass::Forward,
        Pass::BackwardPreprocess,
        Pass::BackwardDq,
        Pass::BackwardDkDv,
    ];
}

/// One row of `NAMES`: `stem` joined to every suffix, at compile time.
macro_rules! joined {
    ([$($stem:literal),*], $suffixes:tt) => { [$(joined!(@row $stem, $suffixes)),*] };
    (@row $stem:literal, [$($suffix:literal),*]) => { [$(concat!($stem, $suffix)),*] };
}

/// Each kernel's name, by pass (rows, `Pass::ALL`'s order) and tier
/// (columns, `Tier::ALL`'s order): the pass's stem and the tier's suffix.
/// A name is the shader module's and the pipeline's label, the entry of
/// the kernel timings (`gpu/timing.rs`, Python's `_gpu_kernel_times`) and
/// what the shader tests look kernels up by, so the names never change.
/// The pre-pass's row has names for tiers it does not run at; no kernel
/// reaches them ([`Kernel::new`]).
const NAMES: [[&str; Tier::ALL.len()]; Pass::ALL.len()] = joined!(
    [
        "forward",
        "backward_preprocess",
        "backward_dq",
        "backward_dkdv"
    ],
    ["", "_tiled", "_coop", "_cm2"]
);

/// A compute kernel of the backend: a pass at a tier. Only [`Kernel::new`]
/// and the constructors built on it make one, so a pass at a tier it does
/// not exist at cannot be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernel {
    pass: Pass,
    tier: Tier,
}

impl Kernel {
    /// The simple kernels, which every adapter runs.
    pub const SIMPLE: [Kernel; 4] = [
        Kernel::forward(Tier::Simple),
        Kernel::PREPROCESS,
        Kernel::dkdv(Tier::Simple),
        Kernel::dq(Tier::Simple),
    ];

    /// The backward's pre-pass: one kernel, simple, for every tier's
    /// backward (it reads dO and O once; no tier has a faster one).
    pub const PREPROCESS: Kernel = Kernel {
        pass: Pass::BackwardPreprocess,
        tier: Tier::Simple,
    };

    /// `pass` at `tier`, where that kernel exists: every pass at every
    /// tier, but the pre-pass only at `Simple`.
    pub const fn new(pass: Pass, tier: Tier) -> Option<Kernel> {
        match (pass, tier) {
            (Pass::BackwardPreprocess, Tier::Tiled | Tier::Coop | Tier::Cm2) => None,
            _ => Some(Kernel { pass, tier }),
        }
    }

    /// The forward at `tier`.
    pub const fn forward(tier: Tier) -> Kernel {
        Kernel {
            pass: Pass::Forward,
            tier,
        }
    }

    /// The backward's dQ at `tier`.
    pub const fn dq(tier: Tier) -> Kernel {
        Kernel {
            pass: Pass::BackwardDq,
            tier,
        }
    }

    /// The backward's dK/dV at `tier`.
    pub const fn dkdv(tier: Tier) -> Kernel {
        Kernel {
            pass: Pass::BackwardDkDv,
            tier,
        }
    }

    pub const fn pass(self) -> Pass {
        self.pass
    }

    /// The tier of the kernel (the backward pre-pass serves every tier).
    pub const fn tier(self) -> Tier {
        self.tier
    }

    /// The register-tiled kernels (run without naga's index clamps).
    pub fn is_tiled(self) -> bool {
        self.tier == Tier::Tiled
    }

    /// The cooperative-matrix kernels written in WGSL (their sources open
    /// with `enable` lines and need the device's cooperative-matrix
    /// feature).
    pub fn is_coop(self) -> bool {
        self.tier == Tier::Coop
    }

    pub fn name(self) -> &'static str {
        NAMES[self.pass as usize][self.tier as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel there is, with its name: the names are the shaders'
    /// and the pipelines' labels and what Python's kernel timings report,
    /// so they are pinned here, one by one.
    const TABLE: [(Pass, Tier, &str); 13] = [
        (Pass::Forward, Tier::Simple, "forward"),
        (
            Pass::BackwardPreprocess,
            Tier::Simple,
            "backward_preprocess",
        ),
        (Pass::BackwardDkDv, Tier::Simple, "backward_dkdv"),
        (Pass::BackwardDq, Tier::Simple, "backward_dq"),
        (Pass::Forward, Tier::Tiled, "forward_tiled"),
        (Pass::BackwardDq, Tier::Tiled, "backward_dq_tiled"),
        (Pass::BackwardDkDv, Tier::Tiled, "backward_dkdv_tiled"),
        (Pass::Forward, Tier::Coop, "forward_coop"),
        (Pass::BackwardDq, Tier::Coop, "backward_dq_coop"),
        (Pass::BackwardDkDv, Tier::Coop, "backward_dkdv_coop"),
        (Pass::Forward, Tier::Cm2, "forward_cm2"),
        (Pass::BackwardDq, Tier::Cm2, "backward_dq_cm2"),
        (Pass::BackwardDkDv, Tier::Cm2, "backward_dkdv_cm2"),
    ];

    #[test]
    fn the_pass_tier_table() {
        let mut made = Vec::new();
        for pass in Pass::ALL {
            for tier in Tier::ALL {
                let listed = TABLE.iter().find(|&&(p, t, _)| (p, t) == (pass, tier));
                match (Kernel::new(pass, tier), listed) {
                    (Some(k), Some(&(_, _, name))) => {
                        assert_eq!((k.pass(), k.tier()), (pass, tier));
                        assert_eq!(k.name(), name, "{pass:?} at {tier:?}");
                        made.push(k);
                    }
                    (None, None) => {}
                    (k, listed) => panic!("{pass:?} at {tier:?}: {k:?}, listed {listed:?}"),
                }
            }
        }
        assert_eq!(made.len(), TABLE.len());
        // The pre-pass is the only pass at a single tier.
        for tier in Tier::ALL {
            let exists = Kernel::new(Pass::BackwardPreprocess, tier).is_some();
            assert_eq!(exists, tier == Tier::Simple, "{tier:?}");
        }
        // Names are unique: they key pipelines and timings.
        let mut names: Vec<&str> = made.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), made.len());
    }

    #[test]
    fn the_constructors_agree_with_new() {
        for tier in Tier::ALL {
            assert_eq!(
                Some(Kernel::forward(tier)),
                Kernel::new(Pass::Forward, tier)
            );
            assert_eq!(Some(Kernel::dq(tier)), Kernel::new(Pass::BackwardDq, tier));
            assert_eq!(
                Some(Kernel::dkdv(tier)),
                Kernel::new(Pass::BackwardDkDv, tier)
            );
        }
        assert_eq!(
            Some(Kernel::PREPROCESS),
            Kernel::new(Pass::BackwardPreprocess, Tier::Simple)
        );
        assert!(Kernel::SIMPLE.iter().all(|k| k.tier() == Tier::Simple));
        let passes: Vec<Pass> = Kernel::SIMPLE.iter().map(|k| k.pass()).collect();
        assert_eq!(
            passes,
            [
                Pass::Forward,
                Pass::BackwardPreprocess,
                Pass::BackwardDkDv,
                Pass::BackwardDq
            ]
        );
    }

    #[test]
    fn tiled_and_coop_by_tier() {
        for &(pass, tier, _) in &TABLE {
            let k = Kernel::new(pass, tier).unwrap();
            assert_eq!(k.is_tiled(), tier == Tier::Tiled);
            assert_eq!(k.is_coop(), tier == Tier::Coop);
        }
    }
}
