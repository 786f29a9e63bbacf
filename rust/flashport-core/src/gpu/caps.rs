//! What the kernel choice depends on from the adapter: the ground floor of
//! the GPU backend's selection (`select.rs`, `tiles/`, the overrides read
//! it; it reads none of them).

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

/// The loop limit of Mesa's llvmpipe (lavapipe) before 25.0: gallivm's
/// `LP_MAX_TGSI_LOOP_ITERATIONS`.
pub const LLVMPIPE_LOOP_LIMIT: u32 = 65535;

/// `AdapterCaps::loop_limit` of an adapter, from wgpu's `AdapterInfo`
/// (`name`, `driver`, `driver_info`): Mesa's llvmpipe (lavapipe) before
/// 25.0, whose gallivm counts every loop iteration of a shader invocation
/// in one counter and ends all loops when it runs out (measured on Mesa
/// 22.3.6; the counter is still in Mesa 24.2's source and gone from 25.0's,
/// and 25.0.7 was measured to have no limit). A version it cannot read
/// counts as limited.
pub fn driver_loop_limit(name: &str, driver: &str, driver_info: &str) -> Option<u32> {
    if driver != "llvmpipe" && !name.starts_with("llvmpipe") {
        return None;
    }
    // "Mesa 22.3.6 (LLVM 15.0.6)", "Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)".
    let major = driver_info
        .split_whitespace()
        .skip_while(|w| *w != "Mesa")
        .nth(1)
        .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    match major {
        Some(m) if m >= 25 => None,
        _ => Some(LLVMPIPE_LOOP_LIMIT),
    }
}
