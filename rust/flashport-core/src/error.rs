//! Typed errors of the core. Each variant maps to one specific Python
//! exception in the bindings, so callers can tell a bad shape from a bad
//! dtype from a missing GPU without parsing messages.

/// Everything that can go wrong in a flashport call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An array has the wrong number of dimensions or a size that does not
    /// agree with the other arguments. The message names the argument and
    /// the shapes seen.
    #[error("{0}")]
    Shape(String),

    /// An array has a dtype flashport does not compute in, or the arrays'
    /// dtypes disagree.
    #[error("{argument} has dtype {dtype}: {reason}")]
    DType {
        argument: String,
        dtype: String,
        reason: String,
    },

    /// A scalar or string argument has an invalid value.
    #[error("{argument}={value}: {reason}")]
    Value {
        argument: String,
        value: String,
        reason: String,
    },

    /// The requested device cannot be used here (no adapter, or a feature
    /// the adapter lacks).
    #[error("{0}")]
    BackendUnavailable(String),

    /// The problem is larger than the device can address even when split.
    #[error("{0}")]
    TooLarge(String),

    /// A KV cache has too few free blocks for an append. Raised before
    /// anything changes: the cache is exactly as before the call.
    #[error("{0}")]
    CacheFull(String),

    /// A KV cache's sequence id that was never made or was freed.
    #[error("{argument}={value}: {reason}")]
    UnknownSequence {
        argument: String,
        value: String,
        reason: String,
    },

    /// The GPU failed while running: a lost device, a failed submission, a
    /// buffer that could not be mapped.
    #[error("{0}")]
    Gpu(String),

    /// The caller's interrupt check (`interrupt::with_check`) asked the
    /// call to stop, and it stopped without a result.
    #[error("the call was interrupted")]
    Interrupted,
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn shape_str(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => {
            let inner: Vec<String> = shape.iter().map(|s| s.to_string()).collect();
            format!("({})", inner.join(", "))
        }
    }
}
