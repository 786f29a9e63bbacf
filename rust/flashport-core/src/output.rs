//! What the passes return: the forward's output and log-sum-exp, the
//! backward's gradients, each in host [`Buffer`]s or in the [`Array`]s a
//! call's [`crate::array::Placement`] asks for.

use crate::array::{Array, Buffer};
use crate::error::Result;

/// Output of the forward pass, in host [`Buffer`]s or, from the
/// `_arrays` calls, in [`Array`]s where the call's [`crate::array::Placement`] put them.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardOutput<A = Buffer> {
    /// `(batch, heads_q, seq_q, value_dim)`, in the inputs' dtype.
    pub out: A,
    /// `(batch, heads_q, seq_q)`: natural-log log-sum-exp of the scaled
    /// scores of each query row; `-inf` for a row that sees no key.
    pub lse: A,
}

/// Gradients of the backward pass, in the inputs' dtype; `dk` and `dv`
/// have `heads_kv` heads. As with [`ForwardOutput`], `A` is [`Buffer`] or
/// [`Array`]. `dsinks` and `dmask` are computed on the host and stay
/// there: they are the gradients of host arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients<A = Buffer> {
    pub dq: A,
    pub dk: A,
    pub dv: A,
    /// `(heads_q,)`, float64, when the problem has sinks.
    pub dsinks: Option<Vec<f64>>,
    /// The float mask's gradient in the mask's shape, in the problem's
    /// compute dtype (float32 or float64), when `return_dmask` was asked.
    pub dmask: Option<Buffer>,
}

/// What a backend's backward returns before the variant gradients both
/// backends share are added: `dS` over the full `(batch, heads_q, seq_q,
/// seq_k)` when the mask's gradient is wanted (always on the host: the
/// host reduces it to the mask's shape).
#[derive(Debug, Clone, PartialEq)]
pub struct BackendGradients<A = Buffer> {
    pub dq: A,
    pub dk: A,
    pub dv: A,
    pub d_scores: Option<Buffer>,
}

impl ForwardOutput<Array> {
    /// The outputs in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<ForwardOutput> {
        Ok(ForwardOutput {
            out: self.out.into_host()?,
            lse: self.lse.into_host()?,
        })
    }
}

impl Gradients<Array> {
    /// The gradients in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<Gradients> {
        Ok(Gradients {
            dq: self.dq.into_host()?,
            dk: self.dk.into_host()?,
            dv: self.dv.into_host()?,
            dsinks: self.dsinks,
            dmask: self.dmask,
        })
    }
}

impl BackendGradients<Array> {
    /// The gradients in host memory, read back where they are on the GPU.
    pub fn into_host(self) -> Result<BackendGradients> {
        Ok(BackendGradients {
            dq: self.dq.into_host()?,
            dk: self.dk.into_host()?,
            dv: self.dv.into_host()?,
            d_scores: self.d_scores,
        })
    }
}

impl BackendGradients<Buffer> {
    /// Host gradients as a call's [`Array`]s.
    pub fn into_arrays(self) -> BackendGradients<Array> {
        BackendGradients {
            dq: Array::Host(self.dq),
            dk: Array::Host(self.dk),
            dv: Array::Host(self.dv),
            d_scores: self.d_scores,
        }
    }
}
