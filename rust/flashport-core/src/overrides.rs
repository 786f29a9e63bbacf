//! Test and benchmark knobs: one explicit value, all off by default. Only
//! the `testing` cargo feature compiles a way to set them (`set`, for the
//! calling thread); the release build always computes with the defaults,
//! and nothing here reads the environment.

use crate::gpu_choice::{AdapterCaps, Tier, Tiles};

/// The knobs. A call reads them once, on the thread that makes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// The fastest tier a call may use: `Simple` everywhere, or `Tiled`
    /// where the cooperative kernels would run (to compare tiers on one
    /// adapter).
    pub max_tier: Option<Tier>,
    /// Fit tiles to at most this much workgroup memory (a 16 KiB adapter's
    /// tiles on a larger one).
    pub workgroup_bytes: Option<u32>,
    /// Reduce rows through workgroup memory even where subgroups exist.
    pub no_subgroups: bool,
    /// Plan chunks for bindings of at most this many bytes (the split by
    /// heads on small arrays).
    pub binding_limit: Option<u64>,
    /// Build the cooperative kernels from wgpu's own SPIR-V even where the
    /// passthrough would be used.
    pub naga_spirv: bool,
    /// Run the portable CPU kernels even where AVX2 and FMA exist (what
    /// other CPUs run).
    pub portable_cpu: bool,
    /// Decoding's subgroup kernel with workgroups of this many invocations
    /// (where it fits; else the workgroup kernel runs).
    pub decode_workgroup: Option<u32>,
    /// Decoding's subgroup kernel with this many keys per walker and pass
    /// (4 or 8).
    pub decode_keys: Option<u32>,
    /// Decoding's subgroup kernel with walkers of at most this many lanes.
    pub decode_lanes: Option<u32>,
    /// Decoding's subgroup kernel prefetching the next pass's loads, or
    /// not, whatever the registers they take.
    pub decode_prefetch: Option<bool>,
    /// Decoding's kernels with naga's index clamps, as a debug build or
    /// `FLASHPORT_GPU_CHECKED=1` runs them.
    pub decode_checked: bool,

    /// The cooperative forward with these tiles where they fit (one of
    /// `tiles::coop_forward_candidates`; else the next tier runs).
    pub coop_forward: Option<Tiles>,
    /// The cooperative-matrix-2 forward with these tiles (query rows and
    /// keys a step), where its head dimensions fit at all.
    pub cm2_forward: Option<Tiles>,
    /// Poll for GPU work this long before sleeping, instead of the
    /// context's own time (which is zero on a software adapter).
    pub spin: Option<std::time::Duration>,
}

impl Overrides {
    /// The defaults, as a constant.
    pub const NONE: Overrides = Overrides {
        max_tier: None,
        workgroup_bytes: None,
        no_subgroups: false,
        binding_limit: None,
        naga_spirv: false,
        portable_cpu: false,
        decode_workgroup: None,
        decode_keys: None,
        decode_lanes: None,
        decode_prefetch: None,
        decode_checked: false,
        coop_forward: None,
        cm2_forward: None,
        spin: None,
    };

    /// `caps` as the overrides narrow them.
    pub fn apply(&self, mut caps: AdapterCaps) -> AdapterCaps {
        if let Some(bytes) = self.workgroup_bytes {
            caps.workgroup_storage_bytes = caps.workgroup_storage_bytes.min(bytes);
        }
        if self.no_subgroups {
            caps.subgroups = false;
        }
        caps
    }

    pub(crate) fn allows(&self, tier: Tier) -> bool {
        self.max_tier.is_none_or(|max| tier <= max)
    }
}

#[cfg(feature = "testing")]
thread_local! {
    static CURRENT: std::cell::Cell<Overrides> = const { std::cell::Cell::new(Overrides::NONE) };
}

/// The overrides of the calling thread.
#[cfg(feature = "testing")]
pub fn current() -> Overrides {
    CURRENT.with(std::cell::Cell::get)
}

/// The defaults: nothing can set overrides without the `testing` feature.
#[cfg(not(feature = "testing"))]
#[inline(always)]
pub fn current() -> Overrides {
    Overrides::NONE
}

/// Sets the calling thread's overrides for the calls it makes from now on.
#[cfg(feature = "testing")]
pub fn set(overrides: Overrides) {
    CURRENT.with(|c| c.set(overrides));
}

/// Runs `f` with the calling thread's overrides set to `overrides`, then
/// restores the ones it had.
#[cfg(feature = "testing")]
pub fn with<R>(overrides: Overrides, f: impl FnOnce() -> R) -> R {
    let before = current();
    set(overrides);
    struct Restore(Overrides);
    impl Drop for Restore {
        fn drop(&mut self) {
            set(self.0);
        }
    }
    let _restore = Restore(before);
    f()
}

/// Runs `f` (on a helper thread of a call) with `caller`, the overrides of
/// the thread that made the call.
#[inline(always)]
pub fn on_helper<R>(caller: Overrides, f: impl FnOnce() -> R) -> R {
    #[cfg(feature = "testing")]
    return with(caller, f);
    #[cfg(not(feature = "testing"))]
    {
        let _ = caller;
        f()
    }
}
