//! The words the GPU's kernel choice is made of: what it reads of the
//! adapter ([`AdapterCaps`]), and what it picks, a [`Tier`] and a kernel's
//! [`Tiles`]. Plain values with nothing of the backend in them, so that
//! the test knobs (`overrides.rs`), which name all three and which the
//! runtime and the CPU read too, stand below the GPU backend rather than
//! beside it. The backend keeps their old paths (`gpu::caps`,
//! `gpu::kernel`, `gpu::tiles`) by re-exports; the choice itself is
//! `gpu/select.rs`, the tiles' sizes `gpu/tiles/`.

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
    /// The device was opened with NVIDIA's cooperative matrices 2
    /// (`gpu/cm2.rs`; with `coop` and `passthrough`).
    pub cm2: bool,
    /// The driver silently ends every loop of a subgroup once the
    /// subgroup's loops have run this many iterations in all (Mesa's
    /// llvmpipe before 25.0: `driver_loop_limit`, src/gpu/tiles/loops.rs).
    /// Where set, the simple kernels' tiles are chosen to stay within it
    /// and a call whose kernels would not is refused (`check_loop_limit`).
    pub loop_limit: Option<u32>,
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
        cm2: false,
        loop_limit: None,
    };
}

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

impl Tier {
    /// Every tier, in declaration order (the order of `NAMES`' columns).
    pub const ALL: [Tier; 4] = [Tier::Simple, Tier::Tiled, Tier::Coop, Tier::Cm2];
}

/// Tiles of one kernel: `q_rows` query rows and `k_rows` key rows staged
/// together, `workgroup` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiles {
    pub q_rows: u32,
    pub k_rows: u32,
    pub workgroup: u32,
    /// Tiled kernels: the two streamed tiles share workgroup memory, the
    /// second loaded over the first once the products that read it are
    /// done, instead of side by side (for head dimensions that do not fit).
    /// The forward streams K then V; dQ streams V then K; dK/dV streams dO,
    /// then Q, then dO again.
    pub kv_shared: bool,
    /// Tiled kernels: vec4s of the next streamed tiles each invocation
    /// prefetches into registers during the current tile (0: none).
    pub prefetch: u32,
}
