//! Tile and workgroup sizes of the kernels: the one place they are fitted
//! to an adapter, one file per tier.
//!
//! Every kernel keeps its tiles in workgroup memory (the GPU's SRAM), so
//! the adapter's `max_compute_workgroup_storage_size` bounds them: 16 KiB
//! on any WebGPU adapter, 32 KiB on lavapipe, 48 KiB on NVIDIA. The sizes
//! reach the WGSL as pipeline overrides, never by editing shader text.
//! Each layout here mirrors the `var<workgroup>` arrays of its shader;
//! tests/shaders.rs checks the two against each other through naga.

mod cm2;
mod coop;
pub mod decode;
mod loops;
mod simple;
mod tiled;

pub use cm2::{cm2_backward_tiles, cm2_forward_tiles, CM2_WORKGROUP};
pub use coop::{
    coop_backward_tiles, coop_elems, coop_forward_candidates, coop_forward_tiles, coop_o_columns,
    coop_staged_words, coop_workgroup_bytes, CoopBackwardLayout, COOP_BACKWARD_MAX_STAGED_WORDS,
    COOP_MAX_STAGED_WORDS,
};
pub use loops::{
    decode_iterations, iterations as loop_iterations, subgroup_decode_iterations,
    workgroup_iterations, LoopShape,
};
pub use simple::{simple_tiles, simple_tiles_within};
pub use tiled::{
    tiled_backward_tiles, tiled_forward_tiles, tiled_nv, tiled_workgroup_vec4s, BackwardLayout,
    TILED_BK, TILED_CG,
};

use super::kernel::{Kernel, Tier};
// `Tiles` is defined a floor down, beside the adapter's capabilities and
// the tiers (the test knobs name it too).
pub use crate::gpu_choice::Tiles;

/// Room left for whatever the backend compiler adds to workgroup memory
/// (alignment, its own scratch) in the simple and tiled kernels.
const COMPILER_SLACK: u64 = 256;

/// Bytes of workgroup memory a kernel declares for the given tiles; must
/// mirror the `var<workgroup>` arrays of its shader.
pub fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    match kernel.tier() {
        Tier::Simple => simple::workgroup_bytes(kernel, d, dv, t),
        Tier::Tiled => tiled::workgroup_bytes(kernel, d, dv, t),
        Tier::Coop => coop::workgroup_bytes(kernel, d, dv, t),
        // None declared: the driver places workgroup-scope matrices itself.
        Tier::Cm2 => 0,
    }
}

/// An adapter with `kib` KiB of workgroup memory and every feature, for
/// the tile tests.
#[cfg(test)]
pub(crate) fn test_caps(kib: u32) -> super::caps::AdapterCaps {
    super::caps::AdapterCaps {
        workgroup_storage_bytes: kib * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        subgroups: true,
        coop: true,
        ..super::caps::AdapterCaps::WEBGPU_DEFAULT
    }
}
