//! The GPU backend against a float64 reference (the CPU backend in
//! float64 on upcast inputs), on whatever adapter wgpu finds: Mesa's
//! lavapipe in CI. Without an adapter each test says so and returns,
//! unless FLASHPORT_REQUIRE_GPU=1 (CI), where that is a failure, as in
//! tests/conftest.py.
//!
//! One test binary, by area:
//! - `common`: data, cases, the reference comparison, overrides;
//! - `kernels`: the plain kernels of each tier; `determinism`: the same
//!   bits again; `tiers`: the adapters, and the selection's plan is what
//!   runs;
//! - `variant_cases`, `variants`, `variant_edges`: the attention variants;
//! - `coop`: the cooperative-matrix kernels; `coop_diagnostic`: their
//!   builtins, on a device of its own;
//! - `device_arrays`: arrays kept on the GPU; `errors`: what is refused;
//! - `decode`: decoding over paged KV caches (`attention_with_kvcache`);
//! - `kvcache`: `KvCache` with its pools on the GPU;
//! - `loop_limit`: kernels whose threads loop long (lavapipe's limit).
//! - `wait`: polling for GPU work or sleeping until it is done;
//! - `arena`: the parameters of a submission, packed.
//!
//! The knobs are `flashport_core::overrides` (per thread, restored by
//! `overrides::with`); nothing here reads another environment variable.

mod arena;
mod common;
mod coop;
mod coop_diagnostic;
mod decode;
mod determinism;
mod device_arrays;
mod errors;
mod kernels;
mod kvcache;
mod loop_limit;
mod require;
mod tiers;
mod variant_cases;
mod variant_edges;
mod variants;
mod wait;
