//! What the GPU tests share: deterministic data, problems and cases, the
//! comparison with the float64 reference (the CPU backend in float64 on
//! upcast inputs), the kernels a call ran, and overrides.

pub use super::require::gpu_present;
use flashport_core::gpu::kernel::Tier;
use flashport_core::overrides::{self, Overrides};
use flashport_core::{
    bf16, cpu, f16, gpu, validate_forward, ArrayInfo, Buffer, DType, ForwardOutput, Options,
    Problem, Slice, VariantArrays, VariantOptions,
};

/// Deterministic values in [-1, 1), never exactly 0.
pub fn random(n: usize, seed: u64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = ((state >> 11) as f64) / ((1u64 << 53) as f64) * 2.0 - 1.0;
            if x == 0.0 {
                0.5
            } else {
                x
            }
        })
        .collect()
}

/// (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, value_dim).
pub type Shape = (usize, usize, usize, usize, usize, usize, usize);

pub const SHAPES: [Shape; 5] = [
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 2, 37, 53, 16, 24),
    (1, 2, 1, 65, 17, 64, 32),
    (1, 1, 1, 130, 130, 128, 128),
    (1, 2, 2, 20, 33, 256, 8),
];

pub fn problem(s: Shape, causal: bool, dtype: &str) -> Problem {
    let (b, hq, hkv, sq, sk, d, dv) = s;
    validate_forward(
        ArrayInfo::new(&[b, hq, sq, d], dtype),
        ArrayInfo::new(&[b, hkv, sk, d], dtype),
        ArrayInfo::new(&[b, hkv, sk, dv], dtype),
        &Options::from(VariantOptions {
            causal,
            ..VariantOptions::default()
        }),
    )
    .unwrap()
}

pub fn f64_problem(p: &Problem) -> Problem {
    Problem {
        dtype: DType::F64,
        ..*p
    }
}

pub fn as_f64(b: &Buffer) -> Vec<f64> {
    match b {
        Buffer::F16(x) => x.iter().map(|v| v.to_f64()).collect(),
        Buffer::BF16(x) => x.iter().map(|v| v.to_f64()).collect(),
        Buffer::F32(x) => x.iter().map(|&v| v as f64).collect(),
        Buffer::F64(x) => x.clone(),
    }
}

/// The bits of a buffer, so that equality also holds for NaN and tells -0
/// from 0.
pub fn bits(b: &Buffer) -> Vec<u64> {
    match b {
        Buffer::F16(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
        Buffer::BF16(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
        Buffer::F32(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
        Buffer::F64(x) => x.iter().map(|v| v.to_bits()).collect(),
    }
}

/// Values rounded to the dtype under test, kept as f64 for the reference.
pub struct Inputs {
    pub f64: Vec<f64>,
    pub f32: Vec<f32>,
    pub f16: Vec<f16>,
    pub bf16: Vec<bf16>,
}

impl Inputs {
    pub fn new(values: Vec<f64>, dtype: DType) -> Inputs {
        let f16: Vec<f16> = values.iter().map(|&x| f16::from_f64(x)).collect();
        let bf16: Vec<bf16> = values.iter().map(|&x| bf16::from_f64(x)).collect();
        let f32: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        let f64 = match dtype {
            DType::F16 => f16.iter().map(|x| x.to_f64()).collect(),
            DType::BF16 => bf16.iter().map(|x| x.to_f64()).collect(),
            _ => f32.iter().map(|&x| x as f64).collect(),
        };
        Inputs {
            f64,
            f32,
            f16,
            bf16,
        }
    }
    pub fn slice(&self, dtype: DType) -> Slice<'_> {
        match dtype {
            DType::F16 => Slice::F16(&self.f16),
            DType::BF16 => Slice::BF16(&self.bf16),
            DType::F32 => Slice::F32(&self.f32),
            DType::F64 => Slice::F64(&self.f64),
        }
    }
}

/// The GPU kernels the last call on this thread ran, by name (empty where
/// the adapter has no timestamp queries).
pub fn kernels_run() -> Vec<String> {
    kernel_times_run().into_iter().map(|(n, _)| n).collect()
}

/// The GPU kernels the last call on this thread ran and their seconds.
/// Behind the screen (src/gpu/screen.rs) a call records its tiled or
/// cooperative kernels and then the simple ones, whose workgroups return
/// at once on the finite data of these tests: the screen and those simple
/// kernels are left out.
pub fn kernel_times_run() -> Vec<(String, f64)> {
    let times: Vec<(String, f64)> = gpu::last_kernel_times()
        .into_iter()
        .filter(|(n, _)| !n.starts_with("host:"))
        .collect();
    if !times.iter().any(|(n, _)| n == "screen") {
        return times;
    }
    let screened = ["screen", "forward", "backward_dq", "backward_dkdv"];
    times
        .into_iter()
        .filter(|(n, _)| !screened.contains(&n.as_str()))
        .collect()
}

/// max |got − want| / max |want| (with a floor for all-zero references);
/// infinite where `got` is not finite and `want` is, or where infinities
/// differ.
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if w.is_infinite() {
                if g == w {
                    0.0
                } else {
                    f64::INFINITY
                }
            } else if g.is_finite() {
                (g - w).abs() / scale
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max)
}

pub struct Case {
    pub p: Problem,
    pub q: Inputs,
    pub k: Inputs,
    pub v: Inputs,
}

pub fn case(s: Shape, causal: bool, dtype: DType, seed: u64) -> Case {
    let p = problem(s, causal, dtype.numpy_name());
    Case {
        q: Inputs::new(random(p.q_len(), seed), dtype),
        k: Inputs::new(random(p.k_len(), seed + 1), dtype),
        v: Inputs::new(random(p.v_len(), seed + 2), dtype),
        p,
    }
}

/// The calling thread's overrides with the fastest tier capped at `max`.
pub fn max_tier(max: Tier) -> Overrides {
    Overrides {
        max_tier: Some(max),
        ..overrides::current()
    }
}

/// The calling thread's overrides with bindings of at most `bytes`.
pub fn binding_limit(bytes: usize) -> Overrides {
    Overrides {
        binding_limit: Some(bytes as u64),
        ..overrides::current()
    }
}

/// The calling thread's overrides with at most `bytes` of workgroup memory.
pub fn workgroup_bytes(bytes: u32) -> Overrides {
    Overrides {
        workgroup_bytes: Some(bytes),
        ..overrides::current()
    }
}

/// The forward of `c` on the GPU, inputs in the case's dtype, no variants.
pub fn gpu_forward(c: &Case) -> ForwardOutput {
    let dt = c.p.dtype;
    gpu::forward(
        &c.p,
        c.q.slice(dt),
        c.k.slice(dt),
        c.v.slice(dt),
        &VariantArrays::default(),
    )
    .unwrap()
}

/// The forward of `c` in float64 on the CPU, the reference.
pub fn reference_forward(c: &Case) -> ForwardOutput {
    cpu::forward(
        &f64_problem(&c.p),
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap()
}

/// Checks forward and backward of one case; returns (forward, backward)
/// relative errors.
pub fn check(c: &Case, fwd_tol: f64, bwd_tol: f64) -> (f64, f64) {
    let dt = c.p.dtype;
    let p64 = f64_problem(&c.p);
    let reference = reference_forward(c);
    let got = gpu_forward(c);
    assert_eq!(got.out.len(), c.p.out_len());
    assert!(matches!(got.lse, Buffer::F32(_)), "lse must be float32");
    let ref_out = as_f64(&reference.out);
    let ref_lse = as_f64(&reference.lse);
    let e_out = rel_err(&as_f64(&got.out), &ref_out);
    let e_lse = rel_err(&as_f64(&got.lse), &ref_lse);
    let fwd = e_out.max(e_lse);
    assert!(
        fwd <= fwd_tol,
        "forward {:?}: out error {e_out:e}, lse error {e_lse:e}",
        c.p
    );
    // Rows that see no key: exactly 0 and -inf.
    let dv = c.p.value_dim;
    for (row, &l) in ref_lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(as_f64(&got.lse)[row], f64::NEG_INFINITY);
            assert!(as_f64(&got.out)[row * dv..(row + 1) * dv]
                .iter()
                .all(|&x| x == 0.0));
        }
    }

    // The backward gets the reference O and lse, rounded to the dtype
    // under test, so both sides see the same inputs.
    let o = Inputs::new(ref_out, dt);
    let lse32: Vec<f32> = ref_lse.iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), 99), dt);
    let ref_g = cpu::backward(
        &p64,
        [
            d_out.slice(DType::F64),
            c.q.slice(DType::F64),
            c.k.slice(DType::F64),
            c.v.slice(DType::F64),
            o.slice(DType::F64),
            Slice::F64(&lse64),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    let g = gpu::backward(
        &c.p,
        [
            d_out.slice(dt),
            c.q.slice(dt),
            c.k.slice(dt),
            c.v.slice(dt),
            o.slice(dt),
            Slice::F32(&lse32),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    let errs = [
        rel_err(&as_f64(&g.dq), &as_f64(&ref_g.dq)),
        rel_err(&as_f64(&g.dk), &as_f64(&ref_g.dk)),
        rel_err(&as_f64(&g.dv), &as_f64(&ref_g.dv)),
    ];
    let bwd = errs.iter().cloned().fold(0.0, f64::max);
    assert!(
        bwd <= bwd_tol,
        "backward {:?}: dq/dk/dv errors {errs:?}",
        c.p
    );
    (fwd, bwd)
}
