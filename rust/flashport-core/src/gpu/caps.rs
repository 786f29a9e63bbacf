//! What the kernel choice depends on from the adapter: [`AdapterCaps`],
//! defined a floor down in `crate::gpu_choice` (the test knobs name it
//! too) and re-exported here for the backend, and what the driver tells
//! of it (its loop limit). The ground floor of the GPU backend's selection:
//! `select.rs` and `tiles/` read it; it reads none of them.

pub use crate::gpu_choice::AdapterCaps;

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
