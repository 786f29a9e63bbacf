//! Tile and workgroup sizes of the kernels: the one place they are chosen.
//!
//! Every kernel keeps its tiles in workgroup memory (the GPU's SRAM), so
//! the adapter's `max_compute_workgroup_storage_size` bounds them: 16 KiB
//! on any WebGPU adapter, 32 KiB on lavapipe, 48 KiB on NVIDIA. The sizes
//! reach the WGSL as pipeline overrides, never by editing shader text.

/// The compute kernels of the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Forward,
    BackwardPreprocess,
    BackwardDkDv,
    BackwardDq,
}

impl Kernel {
    pub const ALL: [Kernel; 4] = [
        Kernel::Forward,
        Kernel::BackwardPreprocess,
        Kernel::BackwardDkDv,
        Kernel::BackwardDq,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Forward => "forward",
            Kernel::BackwardPreprocess => "backward_preprocess",
            Kernel::BackwardDkDv => "backward_dkdv",
            Kernel::BackwardDq => "backward_dq",
        }
    }
}

/// What the choice depends on from the adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCaps {
    pub workgroup_storage_bytes: u32,
    pub max_invocations: u32,
    pub max_workgroup_size_x: u32,
}

impl DeviceCaps {
    /// The limits every WebGPU adapter guarantees.
    pub const WEBGPU_DEFAULT: DeviceCaps = DeviceCaps {
        workgroup_storage_bytes: 16 * 1024,
        max_invocations: 256,
        max_workgroup_size_x: 256,
    };
}

/// Tiles of one kernel: `q_rows` query rows and `k_rows` key rows staged
/// together, `workgroup` threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiles {
    pub q_rows: u32,
    pub k_rows: u32,
    pub workgroup: u32,
}

/// Threads per workgroup: enough to keep a GPU's SIMD lanes busy on the
/// per-element loops, few enough that a software rasteriser's barriers
/// stay cheap.
const WORKGROUP: u32 = 64;

/// Candidate (primary, secondary) tile heights, best first. The primary
/// tile is the one a workgroup owns (query rows in the forward and dQ
/// kernels, key rows in dK/dV); the secondary one is streamed through.
const CANDIDATES: [(u32, u32); 13] = [
    (64, 64),
    (64, 32),
    (32, 32),
    (32, 16),
    (16, 16),
    (16, 8),
    (8, 8),
    (8, 4),
    (4, 4),
    (4, 2),
    (2, 2),
    (2, 1),
    (1, 1),
];

/// Bytes of workgroup memory a kernel declares for the given tiles; must
/// mirror the `var<workgroup>` arrays of its shader.
pub fn workgroup_bytes(kernel: Kernel, d: u32, dv: u32, t: Tiles) -> u64 {
    let (bq, bk) = (t.q_rows as u64, t.k_rows as u64);
    let (d, dv) = (d as u64, dv as u64);
    let e = |n: u64| n.max(1);
    // K and V tiles have rows padded by one word (see KS/VS in the shaders).
    let (kt, vt) = (e(bk * (d + 1)), e(bk * (dv + 1)));
    let words = match kernel {
        Kernel::Forward => e(bq * d) + kt + vt + e(bq * bk) + e(bq * dv) + 3 * e(bq),
        // The dK/dV accumulators are sized like the K/V tiles.
        Kernel::BackwardDkDv => {
            2 * kt + 2 * vt + e(bq * d) + e(bq * dv) + 2 * e(bq * bk) + 3 * e(bq)
        }
        Kernel::BackwardDq => 2 * e(bq * d) + e(bq * dv) + kt + vt + e(bq * bk) + 3 * e(bq),
        Kernel::BackwardPreprocess => 0,
    };
    4 * words
}

/// Chooses the tiles of `kernel` for head dimensions `d` (q, k) and `dv`
/// (v, out) on an adapter with `caps`.
pub fn choose(kernel: Kernel, d: u32, dv: u32, caps: DeviceCaps) -> Tiles {
    let workgroup = WORKGROUP
        .min(caps.max_invocations)
        .min(caps.max_workgroup_size_x)
        .max(1);
    // Leave room for whatever the backend compiler adds to workgroup
    // memory (alignment, its own scratch).
    let budget = (caps.workgroup_storage_bytes as u64).saturating_sub(256);
    for (primary, secondary) in CANDIDATES {
        let tiles = match kernel {
            Kernel::BackwardDkDv => Tiles {
                q_rows: secondary,
                k_rows: primary,
                workgroup,
            },
            _ => Tiles {
                q_rows: primary,
                k_rows: secondary,
                workgroup,
            },
        };
        if workgroup_bytes(kernel, d, dv, tiles) <= budget {
            return tiles;
        }
    }
    Tiles {
        q_rows: 1,
        k_rows: 1,
        workgroup,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_head_dim_fits_webgpu_default_16_kib() {
        let caps = DeviceCaps::WEBGPU_DEFAULT;
        for kernel in Kernel::ALL {
            for d in 1..=256 {
                for dv in (0..=256).step_by(7).chain([255, 256]) {
                    let t = choose(kernel, d, dv, caps);
                    let bytes = workgroup_bytes(kernel, d, dv, t);
                    assert!(
                        bytes <= 16 * 1024,
                        "{kernel:?} d={d} dv={dv} {t:?}: {bytes} B"
                    );
                }
            }
        }
    }

    #[test]
    fn larger_memory_gives_larger_tiles() {
        let small = choose(Kernel::Forward, 64, 64, DeviceCaps::WEBGPU_DEFAULT);
        let large = choose(
            Kernel::Forward,
            64,
            64,
            DeviceCaps {
                workgroup_storage_bytes: 48 * 1024,
                ..DeviceCaps::WEBGPU_DEFAULT
            },
        );
        assert!(large.q_rows * large.k_rows > small.q_rows * small.k_rows);
        let wide = choose(Kernel::BackwardDkDv, 256, 256, DeviceCaps::WEBGPU_DEFAULT);
        assert!(wide.k_rows >= 1 && wide.q_rows >= 1);
    }
}
