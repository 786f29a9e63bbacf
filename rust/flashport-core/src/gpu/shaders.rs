//! The WGSL sources, embedded at build time, and the override constants
//! that specialise them.

use super::context::PipelineKey;
use super::tiles::Kernel;

pub(crate) const FORWARD: &str = include_str!("../../../../shaders/forward.wgsl");
pub(crate) const BACKWARD_PREPROCESS: &str =
    include_str!("../../../../shaders/backward_preprocess.wgsl");
pub(crate) const BACKWARD_DKDV: &str = include_str!("../../../../shaders/backward_dkdv.wgsl");
pub(crate) const BACKWARD_DQ: &str = include_str!("../../../../shaders/backward_dq.wgsl");

pub(crate) fn source(kernel: Kernel) -> &'static str {
    match kernel {
        Kernel::Forward => FORWARD,
        Kernel::BackwardPreprocess => BACKWARD_PREPROCESS,
        Kernel::BackwardDkDv => BACKWARD_DKDV,
        Kernel::BackwardDq => BACKWARD_DQ,
    }
}

/// The `override` values of a pipeline. Array sizes must be single
/// override identifiers, so the products are computed here (at least 1:
/// a zero-sized array is invalid, and `dv` may be 0).
pub(crate) fn overrides(key: &PipelineKey) -> Vec<(&'static str, f64)> {
    let t = key.tiles;
    let (bq, bk, d, dv) = (t.q_rows, t.k_rows, key.d, key.dv);
    let n = |x: u32| x.max(1) as f64;
    let f16 = if key.f16_inputs { 1.0 } else { 0.0 };
    match key.kernel {
        Kernel::BackwardPreprocess => vec![
            ("WG", t.workgroup as f64),
            ("DV", dv as f64),
            ("IN_F16", f16),
        ],
        Kernel::Forward => vec![
            ("WG", t.workgroup as f64),
            ("BQ", bq as f64),
            ("BK", bk as f64),
            ("D", d as f64),
            ("DV", dv as f64),
            ("IN_F16", f16),
            ("Q_ELEMS", n(bq * d)),
            ("K_ELEMS", n(bk * (d + 1))),
            ("V_ELEMS", n(bk * (dv + 1))),
            ("S_ELEMS", n(bq * bk)),
            ("O_ELEMS", n(bq * dv)),
            ("ROW_ELEMS", n(bq)),
        ],
        Kernel::BackwardDkDv | Kernel::BackwardDq => vec![
            ("WG", t.workgroup as f64),
            ("BQ", bq as f64),
            ("BK", bk as f64),
            ("D", d as f64),
            ("DV", dv as f64),
            ("IN_F16", f16),
            ("Q_ELEMS", n(bq * d)),
            ("DO_ELEMS", n(bq * dv)),
            ("K_ELEMS", n(bk * (d + 1))),
            ("V_ELEMS", n(bk * (dv + 1))),
            ("S_ELEMS", n(bq * bk)),
            ("ROW_ELEMS", n(bq)),
        ],
    }
}
