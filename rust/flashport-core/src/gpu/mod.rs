//! The GPU backend: FlashAttention-2 forward and backward as WGSL compute
//! shaders (`shaders/` at the repository root) run through wgpu on Vulkan,
//! Metal or DX12.
//!
//! One context (device, queue, compiled pipelines) is created lazily per
//! process and shared by all threads; a lost device is dropped so that the
//! next call opens a new one. A call on device arrays only returns once its
//! work is queued; reading a result, a call on host arrays and
//! [`synchronize`] wait (`transfer.rs`). A call selects its kernels (`select`), uploads
//! its host inputs, runs one submission per chunk of heads (one in all
//! unless the arrays exceed the adapter's binding size) and reads the
//! outputs back; inputs that are device arrays are bound or copied on the
//! device instead, and outputs can stay there as new device arrays.
//!
//! Inputs are read on the GPU in their own dtype (float16 as packed pairs,
//! which needs no shader-f16 support); arithmetic is float32 (float16
//! products on cooperative matrices accumulate in float32), every output
//! is float32 on the GPU, and float16 outputs are rounded exactly as the
//! CPU backend rounds them.
//!
//! The files, by concern:
//! - `select`: which kernels and tiles a call runs (pure, tested without
//!   a GPU); `kernel`: the kernels and their tiers; `tiles/`: tile sizes
//!   fitted to workgroup memory, one file per tier;
//! - `forward`, `backward`: the passes, encoded and dispatched; `merge`:
//!   merging attention states; `decode/`: decoding over a KV cache, with
//!   its own layout and split choice (`decode::select`, pure);
//! - `params`: the uniform and the variants' data; `dispatch`: binding,
//!   recording and submitting a pass; `chunks`: the split by heads;
//! - `inputs`, `transfer`, `assemble`: arguments in, bytes across,
//!   results out; `checks`: what the backend refuses (dtypes, lengths);
//!   `device_array`: arrays kept on the GPU;
//! - `context`, `pipelines`, `pool`: the device, its compiled kernels and
//!   its reused buffers (the context owns a `pipeline_cache` and the
//!   `pool`s, which know nothing of it); `guard`: panics and lost devices
//!   as errors; `run`: the context a call's device arrays pin it to;
//! - `timing`: kernel timestamps and host phases; `shaders`, `spirv`: the
//!   WGSL sources and the SPIR-V of the cooperative kernels.
//! - `screen`: the pass that sends calls with NaN, infinities or huge
//!   values from the tiled and cooperative kernels to the simple ones;
//! - `kv_pool`: a KV cache's pools on the device (its writes, block
//!   copies and attention);
//! - `varlen`: packed batches of variable-length sequences, their row table
//!   in `vx` and the moves of device arrays between layouts.

mod arena;
mod assemble;
mod backward;
mod bfloat16;
pub(crate) mod caps;
mod checks;
mod chunks;
mod cm2;
mod context;
pub mod decode;
mod device_array;
mod dispatch;
mod forward;
mod guard;
mod inputs;
pub mod kernel;
mod kv_pool;
mod memory;
mod merge;
mod params;
mod pipeline_cache;
mod pipelines;
mod pool;
mod run;
mod screen;
pub mod select;
#[cfg(not(feature = "testing"))]
mod shaders;
#[cfg(feature = "testing")]
pub mod shaders;
#[cfg(not(feature = "testing"))]
mod spirv;
#[cfg(feature = "testing")]
pub mod spirv;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tiles;
mod timing;
mod transfer;
mod varlen;

use std::sync::OnceLock;

pub use backward::{backward, backward_arrays};
pub use context::AdapterInfo;
pub use device_array::{check_array_bytes, to_device, DeviceArray};
pub use forward::{forward, forward_arrays};
pub use kv_pool::GpuStorage;
pub use merge::merge_states;
pub use timing::{last_kernel_times, set_kernel_timing};
pub use varlen::swap_leading;

use crate::auto::GpuModel;
use crate::error::Result;
use guard::{guarded, run_on};

/// Waits until the GPU has done every call queued on it (calls on device
/// arrays return once their work is queued: `transfer.rs`), and returns
/// the error of a device lost on the way. Nothing to wait for where no GPU
/// context exists (none was opened, or a failed one was dropped, its error
/// raised by the call that found it).
pub fn synchronize() -> Result<()> {
    guarded("synchronizing with the GPU", || match context::current() {
        Some(ctx) => run_on(&ctx, |ctx| ctx.synchronize()),
        None => Ok(()),
    })
}

/// Adapters flashport can use, best first, without creating a device.
pub fn adapters() -> Vec<AdapterInfo> {
    guarded("listing adapters", || {
        Ok(context::enumerate().iter().map(context::describe).collect())
    })
    .unwrap_or_default()
}

/// Whether a non-software adapter exists (what `device="auto"` needs).
pub fn hardware_adapter_available() -> bool {
    hardware_gpu().is_some()
}

/// The best non-software adapter as `device="auto"`'s cost model sees it,
/// enumerated once per process.
pub fn hardware_gpu() -> Option<GpuModel> {
    static BEST: OnceLock<Option<GpuModel>> = OnceLock::new();
    *BEST.get_or_init(|| {
        guarded("listing adapters", || {
            Ok(context::enumerate()
                .iter()
                .find(|a| a.get_info().device_type != wgpu::DeviceType::Cpu)
                .map(|a| GpuModel {
                    discrete: a.get_info().device_type == wgpu::DeviceType::DiscreteGpu,
                    coop: context::coop_f16_f32(a),
                }))
        })
        .unwrap_or(None)
    })
}
