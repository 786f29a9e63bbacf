//! flashport-core: exact FlashAttention-2, forward and backward, on the CPU
//! (`cpu/`) and on any GPU through wgpu (`gpu/`).
//!
//! This crate is pure Rust (no Python): validate a problem with
//! [`validate_forward`] / [`validate_backward`], then run it with
//! [`attention()`] / [`attention_backward`] on contiguous row-major buffers in
//! `(batch, heads, seq, dim)` order. On the GPU, inputs may also be
//! [`DeviceArray`]s (uploaded once with [`to_device`]) and outputs may stay
//! there: [`attention_arrays`] / [`attention_backward_arrays`] take
//! [`Input`]s and return [`Array`]s where the [`Placement`] says.
//!
//! The arrays, by where they live: a [`Slice`] borrows host memory and a
//! [`Buffer`] owns it; a [`DeviceArray`] lives on the GPU; an [`Input`] is
//! either of the borrowed kinds, an [`Array`] either of the owned ones.
//!
//! ```
//! use flashport_core::{attention, validate_forward, ArrayInfo, Device, Options, Buffer, Slice};
//! use flashport_core::VariantOptions;
//! let (q, k, v) = (vec![0.5f32; 4 * 8], vec![0.25f32; 6 * 8], vec![1.0f32; 6 * 8]);
//! let problem = validate_forward(
//!     ArrayInfo::new(&[4, 8], "float32"),
//!     ArrayInfo::new(&[6, 8], "float32"),
//!     ArrayInfo::new(&[6, 8], "float32"),
//!     &Options::from(VariantOptions { causal: true, ..VariantOptions::default() }),
//! ).unwrap();
//! let out = attention(
//!     Device::Cpu, &problem, Slice::F32(&q), Slice::F32(&k), Slice::F32(&v), &Default::default(),
//! ).unwrap();
//! let Buffer::F32(o) = out.out else { unreachable!() };
//! assert!(o.iter().all(|x| (x - 1.0).abs() < 1e-6));
//! ```

// This file only declares the modules and re-exports the public names.
// Inside the crate a module imports a name from the module that defines
// it, never through here: the crate root stands above everything, and no
// backend imports the entry points that dispatch to it (docs/development.md,
// "Layers"; `python3 scripts/layers.py` counts the imports that run up).

pub mod array;
pub mod attention;
pub mod auto;
pub mod blocks;
pub mod broadcast;
pub mod cpu;
pub mod decode;
pub mod device;
pub mod env;
pub mod error;
pub mod fork;
pub mod gpu;
pub mod gpu_choice;
pub mod host_memory;
pub mod interrupt;
pub mod kvcache;
pub mod merge;
pub mod output;
pub mod overrides;
pub mod problem;
pub(crate) mod runtime;
pub mod scalar;
pub mod splits;
pub mod variants;
pub mod varlen;

pub use array::{Array, Buffer, Input, Placement, Slice};
pub use attention::{attention, attention_arrays, attention_backward, attention_backward_arrays};
pub use cpu::sum::{sum_widened, sum_widened_into, SumOut};
pub use decode::attention_with_kvcache_arrays;
pub use device::{Device, DEVICE_ENV};
pub use error::{Error, Result};
pub use gpu::{to_device, DeviceArray};
pub use half::{bf16, f16};
pub use kvcache::KvCache;
pub use merge::{merge_states, merge_states_arrays};
pub use output::{BackendGradients, ForwardOutput, Gradients};
pub use problem::validate_sum;
pub use problem::{
    validate_backward, validate_forward, validate_merge, ArrayInfo, DType, MergeProblem, Options,
    Parts, Problem, SumProblem, VariantOptions,
};
pub use problem::{validate_kvcache, CacheLayout, IntArray, KvCacheOptions, KvCacheProblem};
pub use problem::{validate_varlen_backward, validate_varlen_forward, Segments, SeqLens};
pub use variants::{MaskData, VariantArrays};
pub use varlen::{
    attention_varlen, attention_varlen_arrays, attention_varlen_backward,
    attention_varlen_backward_arrays,
};
