//! Hooks for the test suites (cargo feature `testing`, never in the
//! release wheel): the thread's overrides, a device to lose, the queue's
//! depth.

use std::panic::catch_unwind;

use flashport_core as core;
use flashport_core::gpu::kernel::Tier;
use flashport_core::gpu::tiles::Tiles;
use flashport_core::overrides::{self, Overrides};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::detach::run_detached;

/// _testing_set_overrides(**knobs): the calling thread's overrides
/// (flashport_core::overrides::Overrides), all off when none is given.
#[pyfunction]
#[pyo3(signature = (*, max_tier=None, workgroup_bytes=None, no_subgroups=false,
                    binding_limit=None, naga_spirv=false, portable_cpu=false,
                    decode_workgroup=None, decode_keys=None, decode_lanes=None,
                    decode_prefetch=None, decode_checked=false, coop_forward=None,
                    cm2_forward=None, spin_us=None))]
#[allow(clippy::too_many_arguments)]
pub fn _testing_set_overrides(
    max_tier: Option<&str>,
    workgroup_bytes: Option<u32>,
    no_subgroups: bool,
    binding_limit: Option<u64>,
    naga_spirv: bool,
    portable_cpu: bool,
    decode_workgroup: Option<u32>,
    decode_keys: Option<u32>,
    decode_lanes: Option<u32>,
    decode_prefetch: Option<bool>,
    decode_checked: bool,
    coop_forward: Option<(u32, u32)>,
    cm2_forward: Option<(u32, u32)>,
    spin_us: Option<u64>,
) -> PyResult<()> {
    let max_tier = match max_tier {
        None => None,
        Some("simple") => Some(Tier::Simple),
        Some("tiled") => Some(Tier::Tiled),
        Some("coop") => Some(Tier::Coop),
        Some("cm2") => Some(Tier::Cm2),
        Some(other) => {
            return Err(PyTypeError::new_err(format!(
                "max_tier={other:?}: expected \"simple\", \"tiled\", \"coop\" or \"cm2\""
            )))
        }
    };
    overrides::set(Overrides {
        max_tier,
        workgroup_bytes,
        no_subgroups,
        binding_limit,
        naga_spirv,
        portable_cpu,
        decode_workgroup,
        decode_keys,
        decode_lanes,
        decode_prefetch,
        decode_checked,
        // (subgroups, key rows)
        coop_forward: coop_forward.map(|(w, bk)| Tiles {
            q_rows: 16 * w,
            k_rows: bk,
            workgroup: 32 * w,
            kv_shared: false,
            prefetch: 0,
        }),
        // (query rows, keys a step); the shaders' workgroups are fixed
        cm2_forward: cm2_forward.map(|(q_rows, k_rows)| Tiles {
            q_rows,
            k_rows,
            workgroup: flashport_core::gpu::tiles::CM2_WORKGROUP,
            kv_shared: false,
            prefetch: 0,
        }),
        spin: spin_us.map(std::time::Duration::from_micros),
    });
    Ok(())
}

/// _testing_lose_device(index=0): destroys the device of gpu:index, as a
/// driver reset would (the failure-path tests); nothing where that GPU
/// has no context.
#[pyfunction]
#[pyo3(signature = (index=0))]
pub fn _testing_lose_device(py: Python<'_>, index: usize) {
    py.detach(|| {
        let _ = catch_unwind(|| core::gpu::testing::lose_device(index));
    });
}

/// _testing_held_call_that_fails(): a queued call on the default GPU that
/// the context may hold back and whose commands wgpu refuses: GpuError,
/// and its device dropped (the error-path tests of held calls).
#[pyfunction]
pub fn _testing_held_call_that_fails(py: Python<'_>) -> PyResult<()> {
    run_detached(py, core::gpu::testing::held_call_that_fails)
}

/// _testing_queued_submissions(index=0) -> int: the GPU submissions queued
/// without a wait that gpu:index's context has not yet seen finish (the
/// bound on them is what the tests check).
#[pyfunction]
#[pyo3(signature = (index=0))]
pub fn _testing_queued_submissions(index: usize) -> usize {
    core::gpu::testing::queued_submissions(index)
}

/// _testing_held_calls(index=0) -> int: the queued calls whose commands
/// gpu:index's context holds back, not yet submitted.
#[pyfunction]
#[pyo3(signature = (index=0))]
pub fn _testing_held_calls(index: usize) -> usize {
    core::gpu::testing::held_calls(index)
}

/// _testing_open_gpus() -> list[int]: the indices of the GPUs with a
/// context open in this process (which GPU a worker's calls ran on).
#[pyfunction]
pub fn _testing_open_gpus() -> Vec<usize> {
    core::gpu::testing::open_gpus()
}
