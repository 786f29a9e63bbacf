//! The GPU backend: FlashAttention-2 forward and backward as WGSL compute
//! shaders (`shaders/` at the repository root) run through wgpu on Vulkan,
//! Metal or DX12.
//!
//! One context (device, queue, compiled pipelines) is created lazily per
//! adapter (`gpu:N`, in the order of `adapters.rs`) and shared by all
//! threads; a lost device is dropped so that the next call on that GPU
//! opens a new one, and the other GPUs' contexts carry on. A call on device arrays only returns once its
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
//! - `adapters`: which adapter is `gpu:N` (pure, tested without a GPU);
//! - `context`, `pipelines`, `pool`: the devices, their compiled kernels and
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

mod adapters;
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

pub use adapters::{name as device_name, Gpu};
pub use backward::{backward, backward_arrays};
pub use context::AdapterInfo;
pub use device_array::{check_array_bytes, to_device, to_device_on, DeviceArray};
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
/// the error of a device lost on the way: `gpu:N`'s, or with `None` every
/// GPU's that has a context (the first error, once all were waited for).
/// Nothing to wait for where no context exists (none was opened, or a
/// failed one was dropped, its error raised by the call that found it).
pub fn synchronize(gpu: Option<usize>) -> Result<()> {
    let contexts = match gpu {
        Some(index) => context::current(index).into_iter().collect(),
        None => context::open_contexts(),
    };
    let mut first = Ok(());
    for ctx in contexts {
        let waited = guarded("synchronizing with the GPU", || {
            run_on(&ctx, |ctx| ctx.synchronize())
        });
        if first.is_ok() {
            first = waited;
        }
    }
    first
}

/// Adapters flashport can use, `gpu:0` first, without creating a device.
pub fn adapters() -> Vec<AdapterInfo> {
    guarded("listing adapters", || {
        Ok(context::enumerate()
            .iter()
            .enumerate()
            .map(|(i, a)| context::describe(i, a))
            .collect())
    })
    .unwrap_or_default()
}

/// How many adapters `gpu:N` can name (N below it).
pub fn adapter_count() -> usize {
    guarded("listing adapters", || Ok(context::enumerate().len())).unwrap_or(0)
}

/// Whether a non-software adapter exists (what `device="auto"` needs).
pub fn hardware_adapter_available() -> bool {
    hardware_gpu(Gpu::Best).is_some()
}

/// `gpu` as `device="auto"`'s cost model sees it, where it is a hardware
/// adapter (`Best`: the first hardware one); the adapters are described
/// once per process.
pub fn hardware_gpu(gpu: Gpu) -> Option<GpuModel> {
    static MODELS: OnceLock<Vec<Option<GpuModel>>> = OnceLock::new();
    let models = MODELS.get_or_init(|| {
        guarded("listing adapters", || {
            Ok(context::enumerate()
                .iter()
                .map(|a| {
                    let kind = a.get_info().device_type;
                    (kind != wgpu::DeviceType::Cpu).then(|| GpuModel {
                        discrete: kind == wgpu::DeviceType::DiscreteGpu,
                        coop: context::coop_f16_f32(a),
                    })
                })
                .collect())
        })
        .unwrap_or_default()
    });
    match gpu {
        Gpu::Best => models.iter().flatten().next().copied(),
        // Test copies (`context::enumerate`) repeat the adapters.
        Gpu::Index(n) if !models.is_empty() => models[n % models.len()],
        Gpu::Index(_) => None,
    }
}
