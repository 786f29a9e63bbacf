//! Thin Python bindings of flashport-core: NumPy arrays in and out, the GIL
//! released while the core computes, core errors mapped to flashport's
//! Python exceptions. No attention logic lives here. One file a concept;
//! this one only registers them.

mod alloc;
mod arrays;
mod attention;
mod decode;
mod detach;
mod device_array;
mod errors;
mod kvcache;
mod merge;
mod numpy_out;
mod scalars;
mod sum;
/// The core's test hooks (cargo feature `testing`: the development build,
/// never the wheel).
#[cfg(feature = "testing")]
mod testing;
mod variants;
mod varlen;

use pyo3::prelude::*;

/// Huge pages for large blocks, as NumPy asks for its arrays (see alloc.rs).
#[global_allocator]
static ALLOCATOR: alloc::HugePagesForLarge = alloc::HugePagesForLarge;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<device_array::DeviceArray>()?;
    m.add_class::<kvcache::KvCacheHandle>()?;
    m.add_function(wrap_pyfunction!(arrays::to_device, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention, m)?)?;
    m.add_function(wrap_pyfunction!(attention::attention_backward, m)?)?;
    m.add_function(wrap_pyfunction!(merge::merge_states, m)?)?;
    m.add_function(wrap_pyfunction!(sum::sum_widened, m)?)?;
    m.add_function(wrap_pyfunction!(varlen::attention_varlen, m)?)?;
    m.add_function(wrap_pyfunction!(varlen::attention_varlen_backward, m)?)?;
    m.add_function(wrap_pyfunction!(decode::attention_with_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(device_array::devices, m)?)?;
    m.add_function(wrap_pyfunction!(device_array::synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(device_array::_gpu_kernel_times, m)?)?;
    m.add_function(wrap_pyfunction!(device_array::_gpu_kernel_timing, m)?)?;
    #[cfg(feature = "testing")]
    {
        m.add_function(wrap_pyfunction!(testing::_testing_set_overrides, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_lose_device, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_held_call_that_fails, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_queued_submissions, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_held_calls, m)?)?;
        m.add_function(wrap_pyfunction!(testing::_testing_open_gpus, m)?)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
