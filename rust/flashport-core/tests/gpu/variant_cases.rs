//! The attention variants' cases: a variant spec, its arrays, and the
//! comparison of the GPU with the float64 CPU reference, forward and
//! backward, on the simple and the tiled kernels.

use super::common::*;
use flashport_core::gpu::kernel::Tier;
use flashport_core::overrides::{self, Overrides};
use flashport_core::variants::MaskData;
use flashport_core::{
    cpu, gpu, validate_forward, ArrayInfo, DType, Options, Problem, Slice, VariantArrays,
    VariantOptions,
};

#[derive(Clone, Default)]
pub enum MaskArg {
    #[default]
    None,
    Bool(Vec<usize>),
    Float(Vec<usize>),
    /// A boolean mask of the given shape, keeping where `keep(row, key)`
    /// (of the last two axes).
    Blocks(Vec<usize>, fn(usize, usize) -> bool),
}

#[derive(Clone, Default)]
pub struct Spec {
    pub causal: bool,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f64>,
    pub dropout_p: f64,
    pub mask: MaskArg,
    /// Shape of the ALiBi slopes: `[heads_q]` or `[batch, heads_q]`.
    pub alibi: Option<Vec<usize>>,
    pub sinks: bool,
    pub dmask: bool,
}

/// A mask's values: mostly finite (or True), every 5th -inf (False), and
/// the first 16x16 block of each (row, key) plane entirely hidden so that
/// tiles are skipped.
fn mask_pattern(dims: &[usize], seed: u64) -> Vec<Option<f64>> {
    let n: usize = dims.iter().product();
    let (rows, keys) = match dims.len() {
        1 => (1, dims[0]),
        _ => (dims[dims.len() - 2], dims[dims.len() - 1]),
    };
    random(n, seed)
        .into_iter()
        .enumerate()
        .map(|(e, x)| {
            let (r, c) = ((e / keys) % rows, e % keys);
            let hidden = e % 5 == 3 || (r < 16 && c < 16 && rows > 1 && keys > 16);
            (!hidden).then_some(x)
        })
        .collect()
}

fn mask_pattern_of(shape: Option<&(Vec<usize>, bool)>, seed: u64) -> Vec<Option<f64>> {
    shape
        .map(|(shape, _)| mask_pattern(shape, seed))
        .unwrap_or_default()
}

/// Max relative errors of (out, lse, dq, dk, dv, dmask).
pub fn check_spec(
    s: Shape,
    dtype: DType,
    spec: &Spec,
    seed: u64,
    fwd_tol: f64,
    bwd_tol: f64,
) -> [f64; 6] {
    let (b, hq, hkv, sq, sk, d, dv) = s;
    let dt_name = dtype.numpy_name();
    let mask_shape: Option<(Vec<usize>, bool)> = match &spec.mask {
        MaskArg::None => None,
        MaskArg::Bool(shape) => Some((shape.clone(), true)),
        MaskArg::Float(shape) => Some((shape.clone(), false)),
        MaskArg::Blocks(shape, _) => Some((shape.clone(), true)),
    };
    let pattern = match &spec.mask {
        MaskArg::Blocks(shape, keep) => {
            let (rows, keys) = (shape[shape.len() - 2], shape[shape.len() - 1]);
            let n: usize = shape.iter().product();
            (0..n)
                .map(|e| keep((e / keys) % rows, e % keys).then_some(1.0))
                .collect()
        }
        _ => mask_pattern_of(mask_shape.as_ref(), seed + 7),
    };
    let mask_bool: Vec<bool> = pattern.iter().map(Option::is_some).collect();
    let mask_f32: Vec<f32> = pattern
        .iter()
        .map(|x| x.map_or(f32::NEG_INFINITY, |v| v as f32))
        .collect();
    let slopes: Vec<f64> = spec
        .alibi
        .as_ref()
        .map(|shape| {
            random(shape.iter().product(), seed + 8)
                .iter()
                .map(|x| (x.abs() * 0.5) as f32 as f64)
                .collect()
        })
        .unwrap_or_default();
    let sinks: Vec<f64> = random(hq, seed + 9)
        .iter()
        .map(|x| (2.0 * x) as f32 as f64)
        .collect();
    let sinks_shape = [hq];
    let options = Options::from(VariantOptions {
        causal: spec.causal,
        window: spec.window,
        softcap: spec.softcap,
        dropout_p: spec.dropout_p,
        seed: (spec.dropout_p > 0.0).then_some(0x1234_5678_9abc + seed as i128),
        mask: mask_shape.as_ref().map(|(shape, is_bool)| {
            ArrayInfo::new(shape, if *is_bool { "bool" } else { "float32" })
        }),
        alibi_slopes: spec
            .alibi
            .as_ref()
            .map(|shape| ArrayInfo::new(shape, "float32")),
        sinks: spec.sinks.then(|| ArrayInfo::new(&sinks_shape, "float32")),
        ..VariantOptions::default()
    });
    let p = validate_forward(
        ArrayInfo::new(&[b, hq, sq, d], dt_name),
        ArrayInfo::new(&[b, hkv, sk, d], dt_name),
        ArrayInfo::new(&[b, hkv, sk, dv], dt_name),
        &options,
    )
    .unwrap();
    let arrays = VariantArrays {
        mask: mask_shape.as_ref().map(|(_, is_bool)| {
            if *is_bool {
                MaskData::Bool(&mask_bool)
            } else {
                MaskData::Float(Slice::F32(&mask_f32))
            }
        }),
        alibi_slopes: spec.alibi.as_ref().map(|_| slopes.as_slice()),
        sinks: spec.sinks.then_some(sinks.as_slice()),
        segments: None,
    };
    let c = Case {
        q: Inputs::new(random(p.q_len(), seed), dtype),
        k: Inputs::new(random(p.k_len(), seed + 1), dtype),
        v: Inputs::new(random(p.v_len(), seed + 2), dtype),
        p,
    };
    let p64 = f64_problem(&c.p);
    let reference = cpu::forward(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &arrays,
    )
    .unwrap();
    let got = gpu::forward(
        &c.p,
        c.q.slice(dtype),
        c.k.slice(dtype),
        c.v.slice(dtype),
        &arrays,
    )
    .unwrap();
    let ref_out = as_f64(&reference.out);
    let ref_lse = as_f64(&reference.lse);
    let e_out = rel_err(&as_f64(&got.out), &ref_out);
    let e_lse = rel_err(&as_f64(&got.lse), &ref_lse);

    let o = Inputs::new(ref_out, dtype);
    let lse32: Vec<f32> = ref_lse.iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), seed + 99), dtype);
    let pb = Problem {
        return_dmask: spec.dmask,
        ..c.p
    };
    let ref_g = cpu::backward(
        &f64_problem(&pb),
        [
            d_out.slice(DType::F64),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            o.slice(DType::F64),
            Slice::F64(&lse64),
        ],
        &arrays,
    )
    .unwrap();
    let g = gpu::backward(
        &pb,
        [
            d_out.slice(dtype),
            c.q.slice(dtype),
            c.k.slice(dtype),
            c.v.slice(dtype),
            o.slice(dtype),
            Slice::F32(&lse32),
        ],
        &arrays,
    )
    .unwrap();
    let e_dmask = match (&g.d_scores, &ref_g.d_scores) {
        (Some(a), Some(b)) => rel_err(&as_f64(a), &as_f64(b)),
        (None, None) => 0.0,
        _ => panic!("d_scores returned by only one backend"),
    };
    let errs = [
        e_out,
        e_lse,
        rel_err(&as_f64(&g.dq), &as_f64(&ref_g.dq)),
        rel_err(&as_f64(&g.dk), &as_f64(&ref_g.dk)),
        rel_err(&as_f64(&g.dv), &as_f64(&ref_g.dv)),
        e_dmask,
    ];
    assert!(
        errs[0].max(errs[1]) <= fwd_tol && errs[2..].iter().all(|&e| e <= bwd_tol),
        "{dtype:?} {s:?} {:?}: out/lse/dq/dk/dv/dmask errors {errs:?}",
        overrides::current()
    );
    errs
}

/// Runs `f` with the simple kernels and with the tiled ones, and reports
/// the worst errors of each under `name`.
pub fn both_kernels(name: &str, mut f: impl FnMut() -> [f64; 6]) {
    for simple in [true, false] {
        let max_tier = simple.then_some(Tier::Simple);
        let ov = Overrides {
            max_tier,
            ..overrides::current()
        };
        let errs = overrides::with(ov, &mut f);
        eprintln!(
            "{name} ({}): out {:.1e} lse {:.1e} dq {:.1e} dk {:.1e} dv {:.1e} dmask {:.1e}",
            if simple { "simple" } else { "tiled" },
            errs[0],
            errs[1],
            errs[2],
            errs[3],
            errs[4],
            errs[5]
        );
    }
}

pub fn worst(a: [f64; 6], b: [f64; 6]) -> [f64; 6] {
    std::array::from_fn(|i| a[i].max(b[i]))
}

/// Shapes that are no tile multiples; the second has more queries than
/// keys, so causal rows that see no key.
pub const VARIANT_SHAPES: [Shape; 2] = [(2, 4, 2, 37, 53, 16, 24), (1, 2, 1, 45, 30, 32, 8)];

pub fn each_shape(spec: &Spec, seed: u64) -> [f64; 6] {
    VARIANT_SHAPES
        .iter()
        .enumerate()
        .map(|(i, &s)| check_spec(s, DType::F32, spec, seed + 10 * i as u64, 1e-4, 4e-4))
        .fold([0.0; 6], worst)
}
