//! The compute kernels of the backend, by tier.

/// The kernel tiers, slowest first: every shape runs on `Simple`; `Tiled`
/// where its register tiles fit (head dims multiples of 4); `Coop` for
/// float16 without variants where the adapter has cooperative matrices.
/// `select` takes the fastest tier a call fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// One query (or key) row per invocation, tiles in workgroup memory
    /// (shaders/simple/).
    Simple,
    /// Register-tiled float32 arithmetic, float16 widened as it is loaded
    /// (shaders/tiled/).
    Tiled,
    /// float16 products on cooperative matrices (tensor cores,
    /// shaders/coop/).
    Coop,
    /// float16 on NVIDIA's cooperative matrices 2, each step inside the
    /// matrices (GLSL, shaders/cm2/; `gpu/cm2.rs`); the backward's pre-pass
    /// is the simple one, as for every tier.
    Cm2,
}

/// The compute kernels of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Forward,
    BackwardPreprocess,
    BackwardDkDv,
    BackwardDq,
    ForwardTiled,
    BackwardDqTiled,
    BackwardDkDvTiled,
    ForwardCoop,
    BackwardDqCoop,
    BackwardDkDvCoop,
    ForwardCm2,
    BackwardDqCm2,
    BackwardDkDvCm2,
}

impl Kernel {
    /// The simple kernels, which every adapter runs.
    pub const SIMPLE: [Kernel; 4] = [
        Kernel::Forward,
        Kernel::BackwardPreprocess,
        Kernel::BackwardDkDv,
        Kernel::BackwardDq,
    ];

    /// The tier of the kernel (the backward pre-pass serves every tier).
    pub fn tier(self) -> Tier {
        match self {
            Kernel::Forward
            | Kernel::BackwardPreprocess
            | Kernel::BackwardDkDv
            | Kernel::BackwardDq => Tier::Simple,
            Kernel::ForwardTiled | Kernel::BackwardDqTiled | Kernel::BackwardDkDvTiled => {
                Tier::Tiled
            }
            Kernel::ForwardCoop | Kernel::BackwardDqCoop | Kernel::BackwardDkDvCoop => Tier::Coop,
            Kernel::ForwardCm2 | Kernel::BackwardDqCm2 | Kernel::BackwardDkDvCm2 => Tier::Cm2,
        }
    }

    /// The register-tiled kernels (run without naga's index clamps).
    pub fn is_tiled(self) -> bool {
        self.tier() == Tier::Tiled
    }

    /// The cooperative-matrix kernels written in WGSL (their sources open
    /// with `enable` lines and need the device's cooperative-matrix
    /// feature).
    pub fn is_coop(self) -> bool {
        self.tier() == Tier::Coop
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Forward => "forward",
            Kernel::BackwardPreprocess => "backward_preprocess",
            Kernel::BackwardDkDv => "backward_dkdv",
            Kernel::BackwardDq => "backward_dq",
            Kernel::ForwardTiled => "forward_tiled",
            Kernel::BackwardDqTiled => "backward_dq_tiled",
            Kernel::BackwardDkDvTiled => "backward_dkdv_tiled",
            Kernel::ForwardCoop => "forward_coop",
            Kernel::BackwardDqCoop => "backward_dq_coop",
            Kernel::BackwardDkDvCoop => "backward_dkdv_coop",
            Kernel::ForwardCm2 => "forward_cm2",
            Kernel::BackwardDqCm2 => "backward_dq_cm2",
            Kernel::BackwardDkDvCm2 => "backward_dkdv_cm2",
        }
    }
}
