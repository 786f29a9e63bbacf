//! The WGSL sources, embedded at build time, and the override constants
//! that specialise them.

use super::kernel::{Kernel, Pass, Tier};
use super::select::PipelineKey;
pub use super::select::Variants;

/// The text of `shaders/<path>`, embedded at build time.
macro_rules! shader {
    ($path:literal) => {
        include_str!(concat!("../../../../shaders/", $path))
    };
}

// Fragments (shaders/lib): prepended to the kernels that use them.
/// What every kernel's scores take: the bit tests and codes of NaN and
/// infinities (docs/design.md#non-finite-inputs), tanh to float32
/// precision (softcap) and the score variants' switches
/// (lib/variants.wgsl), before lib/common.wgsl's text and decoding's.
macro_rules! scores {
    () => {
        concat!(
            shader!("lib/nonfinite.wgsl"),
            "\n",
            shader!("lib/tanh.wgsl"),
            "\n",
            shader!("lib/variants.wgsl")
        )
    };
}
const SCORES: &str = scores!();
pub(crate) const COMMON: &str = concat!(scores!(), "\n", shader!("lib/common.wgsl"));
const INPUT_F32: &str = shader!("lib/input_f32.wgsl");
const INPUT_F16: &str = shader!("lib/input_f16.wgsl");
const ROW_REDUCE_SUBGROUP: &str = shader!("lib/row_reduce_subgroup.wgsl");
const ROW_REDUCE_WORKGROUP: &str = shader!("lib/row_reduce_workgroup.wgsl");
const TILED: &str = shader!("lib/tiled.wgsl");
const TILED_BACKWARD: &str = shader!("lib/tiled_backward.wgsl");
const COOP: &str = shader!("lib/coop.wgsl");
const COOP_BACKWARD: &str = shader!("lib/coop_backward.wgsl");
const SCREENED: &str = shader!("lib/screened.wgsl");

// Kernels, one folder per tier.
const SIMPLE_FORWARD: &str = shader!("simple/forward.wgsl");
const SIMPLE_BACKWARD_PREPROCESS: &str = shader!("simple/backward_preprocess.wgsl");
const SIMPLE_BACKWARD_DQ: &str = shader!("simple/backward_dq.wgsl");
const SIMPLE_BACKWARD_DKDV: &str = shader!("simple/backward_dkdv.wgsl");
const TILED_FORWARD: &str = shader!("tiled/forward.wgsl");
const TILED_BACKWARD_DQ: &str = shader!("tiled/backward_dq.wgsl");
const TILED_BACKWARD_DKDV: &str = shader!("tiled/backward_dkdv.wgsl");
const COOP_FORWARD: &str = shader!("coop/forward.wgsl");
const COOP_BACKWARD_DQ: &str = shader!("coop/backward_dq.wgsl");
const COOP_BACKWARD_DKDV: &str = shader!("coop/backward_dkdv.wgsl");

/// The grid of the element-wise passes: workgroup size and invocation index.
macro_rules! grid {
    () => {
        shader!("lib/grid.wgsl")
    };
}

/// The rounding of float32 to float16 as the host rounds.
macro_rules! to_f16 {
    () => {
        shader!("lib/to_f16.wgsl")
    };
}

/// The device-array moves (a module of its own, after lib/grid.wgsl).
pub const DEVICE_ARRAYS: &str = concat!(
    grid!(),
    "\n",
    to_f16!(),
    "\n",
    shader!("device_arrays.wgsl")
);
/// The merge of attention states (a module of its own), after the
/// arithmetic it shares with decoding's combine pass (lib/merge.wgsl).
pub const MERGE_STATES: &str = concat!(
    grid!(),
    "\n",
    shader!("lib/merge.wgsl"),
    "\n",
    shader!("merge_states.wgsl")
);

// Decoding over a KV cache (src/gpu/decode/): a kernel with its own
// uniform, assembled from an input fragment, a cache-load fragment and
// the kernel, and a combine pass that is a module of its own.
const DECODE: &str = shader!("decode/decode.wgsl");
const DECODE_SUBGROUP: &str = shader!("decode/subgroup.wgsl");
const DECODE_COOP: &str = shader!("decode/coop.wgsl");
const DECODE_SHARED: &str = shader!("decode/shared.wgsl");
const DECODE_LOAD_VEC4: &str = shader!("decode/load_vec4.wgsl");
const DECODE_LOAD_ELEMENTS: &str = shader!("decode/load_elements.wgsl");
const DECODE_QUADS_VEC4: &str = shader!("decode/quads_vec4.wgsl");
const DECODE_QUADS_ELEMENTS: &str = shader!("decode/quads_elements.wgsl");
/// The split states' merge of decoding (a module of its own), its output
/// in float32.
pub const DECODE_COMBINE: &str = concat!(
    grid!(),
    "\n",
    shader!("lib/merge.wgsl"),
    "\n",
    shader!("decode/combine_f32.wgsl"),
    "\n",
    shader!("decode/combine.wgsl")
);
/// The same merge with its output rounded to float16 (a float16 output
/// kept on the device: no rounding pass after it).
pub const DECODE_COMBINE_F16: &str = concat!(
    grid!(),
    "\n",
    shader!("lib/merge.wgsl"),
    "\n",
    to_f16!(),
    "\n",
    shader!("decode/combine_f16.wgsl"),
    "\n",
    shader!("decode/combine.wgsl")
);

/// The WGSL of the decode kernel: the input fragment of its dtype
/// (lib/input_f16.wgsl or input_f32.wgsl), the cache loads (four elements
/// at a time where d and d_v are multiples of 4, else element by element:
/// a binding's type cannot be an override), what the decode kernels share
/// (decode/shared.wgsl), then decode/decode.wgsl.
pub fn decode_source(f16_inputs: bool, vec4: bool) -> String {
    decode_kernel_source(f16_inputs, vec4, DECODE)
}

/// The WGSL of decoding's subgroup kernel (decode/subgroup.wgsl, which
/// names subgroup operations: only for devices with them), assembled as
/// [`decode_source`] is, with the quads its loads give
/// (decode/quads_vec4.wgsl or quads_elements.wgsl).
pub fn decode_subgroup_source(f16_inputs: bool, vec4: bool) -> String {
    let quads = if vec4 {
        DECODE_QUADS_VEC4
    } else {
        DECODE_QUADS_ELEMENTS
    };
    decode_kernel_source(f16_inputs, vec4, &[quads, DECODE_SUBGROUP].join("\n"))
}

/// The WGSL of decoding's cooperative-matrix kernel (decode/coop.wgsl):
/// lib/coop.wgsl first (its `enable` lines open the module), then what
/// the other decode kernels take but their cache loads (the kernel binds
/// the caches as eight halves a word itself).
pub fn decode_coop_source() -> String {
    let exp = std::env::var("FLASHPORT_EXPERIMENT_COOP_WGSL")
        .ok()
        .map(|p| std::fs::read_to_string(p).unwrap());
    let kernel = exp.as_deref().unwrap_or(DECODE_COOP);
    [COOP, INPUT_F16, SCORES, DECODE_SHARED, kernel].join("\n")
}

fn decode_kernel_source(f16_inputs: bool, vec4: bool, kernel: &str) -> String {
    let input = if f16_inputs { INPUT_F16 } else { INPUT_F32 };
    let load = if vec4 {
        DECODE_LOAD_VEC4
    } else {
        DECODE_LOAD_ELEMENTS
    };
    [input, SCORES, load, DECODE_SHARED, kernel].join("\n")
}
/// A KV cache's writes and block copies into its pools (a module of its
/// own, after the grid it shares: lib/grid.wgsl).
pub const KV_SCATTER: &str = concat!(grid!(), "\n", shader!("kv_scatter.wgsl"));

/// The screen in front of the fast attention kernels (a module of its
/// own, after the bit tests it shares with the kernels).
pub const SCREEN: &str = concat!(shader!("lib/nonfinite.wgsl"), "\n", shader!("screen.wgsl"));

/// attention_varlen's moves between layouts (a module of its own, after
/// lib/grid.wgsl).
pub const VARLEN: &str = concat!(grid!(), "\n", shader!("varlen.wgsl"));

/// The WGSL of `kernel`: the fragments it takes (shaders/lib), then the
/// kernel (shaders/simple, tiled or coop). Every kernel takes
/// lib/common.wgsl (the uniform block, the visible key ranges and the
/// attention variants, one text for every kernel so their `Params` cannot
/// drift apart). The tiled forward takes its row reductions from a
/// fragment: a module that names subgroup operations does not validate on
/// a device without them, even in a branch an override disables, so the
/// two variants cannot be one text switched by an override. The simple
/// and tiled kernels take the element type of their inputs from a fragment
/// too (lib/input_f32.wgsl or input_f16.wgsl, by `f16_inputs`), since a
/// binding's type cannot be an override; the cooperative kernels take
/// float16 only and ignore `f16_inputs`.
pub fn source(kernel: Kernel, subgroups: bool, f16_inputs: bool) -> String {
    use {Pass::*, Tier::*};
    let input = if f16_inputs { INPUT_F16 } else { INPUT_F32 };
    let reduce = if subgroups {
        ROW_REDUCE_SUBGROUP
    } else {
        ROW_REDUCE_WORKGROUP
    };
    let parts: &[&str] = match (kernel.pass(), kernel.tier()) {
        (Forward, Simple) => &[COMMON, SCREENED, input, SIMPLE_FORWARD],
        // The one pre-pass, simple, serves every tier.
        (BackwardPreprocess, _) => &[COMMON, input, SIMPLE_BACKWARD_PREPROCESS],
        (BackwardDkDv, Simple) => &[COMMON, SCREENED, input, SIMPLE_BACKWARD_DKDV],
        (BackwardDq, Simple) => &[COMMON, SCREENED, input, SIMPLE_BACKWARD_DQ],
        (Forward, Tiled) => &[COMMON, input, TILED, reduce, TILED_FORWARD],
        (BackwardDq, Tiled) => &[COMMON, input, TILED, TILED_BACKWARD, TILED_BACKWARD_DQ],
        (BackwardDkDv, Tiled) => &[COMMON, input, TILED, TILED_BACKWARD, TILED_BACKWARD_DKDV],
        // lib/coop.wgsl comes first: it opens with `enable` directives,
        // which WGSL wants before any declaration.
        (Forward, Coop) => &[COOP, COMMON, COOP_FORWARD],
        (BackwardDq, Coop) => &[COOP, COMMON, COOP_BACKWARD, COOP_BACKWARD_DQ],
        (BackwardDkDv, Coop) => &[COOP, COMMON, COOP_BACKWARD, COOP_BACKWARD_DKDV],
        // GLSL, compiled ahead (shaders/cm2/, gpu/cm2.rs): no WGSL.
        (_, Cm2) => &[],
    };
    parts.join("\n")
}

/// The `override` values of a pipeline. Array sizes must be single
/// override identifiers, so the products are computed here (at least 1:
/// a zero-sized array is invalid, and `dv` may be 0).
pub fn overrides(key: &PipelineKey) -> Vec<(&'static str, f64)> {
    let mut c = tile_overrides(
        key.kernel,
        key.f16_inputs,
        key.d,
        key.dv,
        key.tiles,
        key.subgroups,
    );
    c.extend(variant_overrides(key.kernel, key.variants));
    c
}

/// lib/variants.wgsl's switches, which the attention kernels
/// ([`variant_overrides`]) and decoding's (`gpu/decode`) take alike: the
/// one place a score variant becomes an override.
pub fn score_variant_overrides(softcap: bool, alibi: bool) -> [(&'static str, f64); 2] {
    let b = |x: bool| if x { 1.0 } else { 0.0 };
    [("SOFTCAP", b(softcap)), ("ALIBI", b(alibi))]
}

/// The variant overrides of `kernel` (none for the backward pre-pass,
/// which computes the same D for every variant).
pub fn variant_overrides(kernel: Kernel, v: Variants) -> Vec<(&'static str, f64)> {
    use {Pass::*, Tier::*};
    if kernel.pass() == BackwardPreprocess {
        return Vec::new();
    }
    let b = |x: bool| if x { 1.0 } else { 0.0 };
    let mut c = score_variant_overrides(v.softcap, v.alibi).to_vec();
    c.extend([
        ("MASK", b(v.mask)),
        ("SINKS", b(v.sinks)),
        ("DROPOUT", b(v.dropout)),
        ("WINDOW", b(v.window)),
        ("VARLEN", b(v.varlen)),
    ]);
    if matches!(
        (kernel.pass(), kernel.tier()),
        (BackwardDq, Simple | Tiled | Coop)
    ) {
        c.push(("DMASK", b(v.dmask)));
    }
    // The simple kernels screen their inputs for non-finite values
    // (lib/screened.wgsl); the pre-pass has returned above.
    if kernel.tier() == Simple {
        c.push(("SCREENED", b(v.screened)));
    }
    c
}

/// The overrides of `kernel` for the given head dimensions and tiles (also
/// what the shader tests specialise with). None depends on the input
/// element type, which is a fragment (`source`): `_f16_inputs` stays so
/// that callers need not change.
pub fn tile_overrides(
    kernel: Kernel,
    _f16_inputs: bool,
    d: u32,
    dv: u32,
    t: super::tiles::Tiles,
    subgroups: bool,
) -> Vec<(&'static str, f64)> {
    use {Pass::*, Tier::*};
    let (bq, bk) = (t.q_rows, t.k_rows);
    let n = |x: u32| x.max(1) as f64;
    match (kernel.pass(), kernel.tier()) {
        // Specialised in its SPIR-V (gpu/cm2.rs), not by WGSL overrides.
        (_, Cm2) => Vec::new(),
        (Forward, Tiled) => {
            let (q, kv, p, red) = super::tiles::tiled_workgroup_vec4s(d, dv, t, subgroups);
            let d4 = d / 4;
            let mut c = vec![
                ("RG", (t.workgroup / super::tiles::TILED_CG) as f64),
                ("D", d as f64),
                ("DV", dv as f64),
                ("NV", super::tiles::tiled_nv(dv) as f64),
                // K occupies rows of d/4 + 1 vec4s from 0; V follows it or
                // overwrites it.
                (
                    "V_OFF",
                    if t.kv_shared {
                        0.0
                    } else {
                        (bk * (d4 + 1)) as f64
                    },
                ),
                ("Q_ELEMS", q.max(1) as f64),
                ("KV_ELEMS", kv.max(1) as f64),
                ("P_ELEMS", p.max(1) as f64),
                ("PF_N", t.prefetch as f64),
            ];
            if !subgroups {
                c.push(("RED_ELEMS", red.max(1) as f64));
            }
            c
        }
        (BackwardDq | BackwardDkDv, Tiled) => {
            let l = super::tiles::BackwardLayout::new(kernel, d, dv, t);
            vec![
                ("RG", (t.workgroup / super::tiles::TILED_CG) as f64),
                ("D", d as f64),
                ("DV", dv as f64),
                ("ND", super::tiles::tiled_nv(d) as f64),
                ("NV", super::tiles::tiled_nv(dv) as f64),
                ("A0_ELEMS", l.a0.max(1) as f64),
                ("A1_ELEMS", l.a1.max(1) as f64),
                ("B_ELEMS", l.b.max(1) as f64),
                ("B1_OFF", l.b1_offset as f64),
                ("SHARED", if t.kv_shared { 1.0 } else { 0.0 }),
                ("W_ELEMS", l.w.max(1) as f64),
                (
                    "W2_ELEMS",
                    if l.w_arrays == 2 { l.w.max(1) } else { 1 } as f64,
                ),
                ("PF_N", t.prefetch as f64),
            ]
        }
        (Forward, Coop) => {
            let [k, v, qp, f] = super::tiles::coop_elems(d, dv, t);
            let (kw, vw) = super::tiles::coop_staged_words(d, dv, t);
            vec![
                ("W", (t.workgroup / 32) as f64),
                ("BK", bk as f64),
                ("D", d as f64),
                ("DV", dv as f64),
                ("K_ELEMS", k as f64),
                ("V_ELEMS", v as f64),
                ("QP_ELEMS", qp as f64),
                ("F_ELEMS", f as f64),
                ("KW", kw as f64),
                ("OC", super::tiles::coop_o_columns(dv, t) as f64),
                ("VW", vw as f64),
            ]
        }
        (BackwardDq | BackwardDkDv, Coop) => {
            let l = super::tiles::CoopBackwardLayout::new(kernel, d, dv, t);
            let (w0, w1) = l.staged_words(d, dv, t);
            let mut c = vec![
                ("W", (t.workgroup / 32) as f64),
                ("BS", l.streamed as f64),
                ("D", d as f64),
                ("DV", dv as f64),
                ("H_ELEMS", l.halves as f64),
                ("F_ELEMS", l.floats as f64),
                ("DV_OFF", l.second_off as f64),
                ("DW", w0 as f64),
                ("DVW", w1 as f64),
            ];
            if kernel.pass() == BackwardDq {
                c.push(("DS_OFF", l.weights_off as f64));
            } else {
                c.extend([
                    ("PT_OFF", l.weights_off as f64),
                    ("DT_OFF", l.weights2_off as f64),
                ]);
            }
            c
        }
        (BackwardPreprocess, _) => vec![("WG", t.workgroup as f64), ("DV", dv as f64)],
        (Forward, Simple) => vec![
            ("WG", t.workgroup as f64),
            ("BQ", bq as f64),
            ("BK", bk as f64),
            ("D", d as f64),
            ("DV", dv as f64),
            ("Q_ELEMS", n(bq * d)),
            ("K_ELEMS", n(bk * (d + 1))),
            ("V_ELEMS", n(bk * (dv + 1))),
            ("S_ELEMS", n(bq * bk)),
            ("O_ELEMS", n(bq * dv)),
            ("ROW_ELEMS", n(bq)),
        ],
        (BackwardDkDv | BackwardDq, Simple) => vec![
            ("WG", t.workgroup as f64),
            ("BQ", bq as f64),
            ("BK", bk as f64),
            ("D", d as f64),
            ("DV", dv as f64),
            ("Q_ELEMS", n(bq * d)),
            ("DO_ELEMS", n(bq * dv)),
            ("K_ELEMS", n(bk * (d + 1))),
            ("V_ELEMS", n(bk * (dv + 1))),
            ("S_ELEMS", n(bq * bk)),
            ("ROW_ELEMS", n(bq)),
        ],
    }
}
