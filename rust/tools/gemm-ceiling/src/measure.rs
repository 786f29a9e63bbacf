//! One configuration on the device: checked, then timed (the child
//! process's work).

use crate::gpu::Gpu;
use crate::host::{self, json_number, Rng};
use crate::{Args, Kernel};

/// Relative Frobenius error allowed against float64. float32 with float32
/// accumulation lands near 1e-6 at these sizes; the float16 inputs are
/// rounded before the reference sees them, so only the accumulation
/// differs there too, but tensor cores may accumulate in reduced
/// precision.
const F32_TOLERANCE: f64 = 1e-5;
const F16_TOLERANCE: f64 = 1e-3;
/// Elements of the timed size's output compared with float64 dot products.
const SAMPLES: usize = 256;

/// One square problem on the device: A, B (float32 or float16), C
/// (float32), the dimensions, and the inputs' values on the host.
struct Operands {
    n: u32,
    a: wgpu::Buffer,
    b: wgpu::Buffer,
    c: wgpu::Buffer,
    dims: wgpu::Buffer,
    /// The inputs as the GPU sees them (float16 values are exact here).
    a_host: Vec<f32>,
    b_host: Vec<f32>,
}

impl Operands {
    fn new(gpu: &Gpu, n: u32, f16: bool, seed: u64) -> Operands {
        let len = (n as usize) * (n as usize);
        let mut rng = Rng::new(seed);
        let mut values = || -> Vec<f32> {
            (0..len)
                .map(|_| {
                    let x = rng.uniform();
                    if f16 {
                        half::f16::from_f32(x).to_f32()
                    } else {
                        x
                    }
                })
                .collect()
        };
        let a_host = values();
        let b_host = values();
        let upload = |label: &str, v: &[f32]| {
            if f16 {
                let halves: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                gpu.storage(label, bytemuck::cast_slice(&halves))
            } else {
                gpu.storage(label, bytemuck::cast_slice(v))
            }
        };
        let a = upload("a", &a_host);
        let b = upload("b", &b_host);
        let c = gpu.storage("c", &vec![0u8; len * 4]);
        let dims = gpu.uniform("dims", bytemuck::cast_slice(&[n, n, n, 0u32]));
        Operands {
            n,
            a,
            b,
            c,
            dims,
            a_host,
            b_host,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Checked and timed.
    Passed,
    /// Timed, but its results were wrong.
    Wrong,
    /// Did not build or run (the message went to stderr).
    Error,
}

/// What one configuration measured; NaN where not measured.
pub struct Outcome {
    pub status: Status,
    pub gpu_tflops: f64,
    pub wall_tflops: f64,
    pub check_error: f64,
    pub sample_error: f64,
}

const RESULT_TAG: &str = "gemm-ceiling-result";

impl Outcome {
    pub fn error() -> Outcome {
        Outcome {
            status: Status::Error,
            gpu_tflops: f64::NAN,
            wall_tflops: f64::NAN,
            check_error: f64::NAN,
            sample_error: f64::NAN,
        }
    }

    /// The line a child prints on stdout for the parent.
    pub fn to_line(&self) -> String {
        let status = match self.status {
            Status::Passed => "passed",
            Status::Wrong => "wrong",
            Status::Error => "error",
        };
        format!(
            "{RESULT_TAG} {status} {:e} {:e} {:e} {:e}",
            self.gpu_tflops, self.wall_tflops, self.check_error, self.sample_error
        )
    }

    /// The outcome in a child's stdout, if it printed one.
    pub fn from_output(stdout: &str) -> Option<Outcome> {
        let line = stdout.lines().rev().find(|l| l.starts_with(RESULT_TAG))?;
        let mut words = line.split_whitespace().skip(1);
        let status = match words.next()? {
            "passed" => Status::Passed,
            "wrong" => Status::Wrong,
            "error" => Status::Error,
            _ => return None,
        };
        let mut number = || words.next().and_then(|w| w.parse::<f64>().ok());
        Some(Outcome {
            status,
            gpu_tflops: number()?,
            wall_tflops: number()?,
            check_error: number()?,
            sample_error: number()?,
        })
    }

    /// The rate the sweep ranks by: GPU time where the adapter has
    /// timestamps, else wall time.
    pub fn score(&self) -> f64 {
        if self.gpu_tflops.is_finite() {
            self.gpu_tflops
        } else {
            self.wall_tflops
        }
    }
}

/// Checks `kernel` against float64 at the check size (in full) and at the
/// timed size (on a sample of elements), outputs poisoned with NaN first,
/// then times it. Prints the configuration's line on stderr.
pub fn measure(gpu: &Gpu, kernel: Kernel, args: &Args) -> Result<Outcome, String> {
    let name = kernel.name();
    let f16 = kernel.is_coop();
    let check_n = args.size.min(if args.quick { 256 } else { 512 });
    let seed = if f16 { 16 } else { 32 };
    let check = Operands::new(gpu, check_n, f16, seed);
    let timed = (args.size != check_n).then(|| Operands::new(gpu, args.size, f16, seed + 1));
    let big = timed.as_ref().unwrap_or(&check);
    let tolerance = if f16 { F16_TOLERANCE } else { F32_TOLERANCE };
    let warmups = if args.quick { 1 } else { 3 };

    let pipeline = gpu.pipeline(&name, &kernel.wgsl())?;
    let (bm, bn, _) = kernel.tile();
    let groups = |n: u32| (n / bn, n / bm);

    let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let reference = host::gemm_f64(&wide(&check.a_host), &wide(&check.b_host), check_n as usize);
    let group = gpu.bind_group(&pipeline, &[&check.a, &check.b, &check.c, &check.dims]);
    gpu.poison(&check.c);
    gpu.run(&pipeline, &group, groups(check.n), 1)?;
    let got = gpu.read_f32(&check.c)?;
    let check_error = host::relative_error(got.iter().copied().zip(reference.iter().copied()));

    let big_group = match &timed {
        Some(t) => gpu.bind_group(&pipeline, &[&t.a, &t.b, &t.c, &t.dims]),
        None => group,
    };
    let sample_error = match &timed {
        Some(t) => {
            gpu.poison(&t.c);
            gpu.run(&pipeline, &big_group, groups(t.n), 1)?;
            let got = gpu.read_f32(&t.c)?;
            let n = t.n as usize;
            let mut rng = Rng::new(7);
            let pairs: Vec<(f32, f64)> = (0..SAMPLES)
                .map(|_| {
                    let (i, j) = (rng.below(n), rng.below(n));
                    (got[i * n + j], host::dot(&t.a_host, &t.b_host, n, i, j))
                })
                .collect();
            host::relative_error(pairs.into_iter())
        }
        None => f64::NAN,
    };

    gpu.run(&pipeline, &big_group, groups(big.n), warmups)?;
    let (mut gpu_times, mut wall_times) =
        gpu.run(&pipeline, &big_group, groups(big.n), args.reps)?;
    let flops = 2.0 * (big.n as f64).powi(3);
    let gpu_s = if gpu_times.is_empty() {
        f64::NAN
    } else {
        host::median(&mut gpu_times)
    };
    let wall_s = host::median(&mut wall_times);
    let passed = check_error <= tolerance && (sample_error.is_nan() || sample_error <= tolerance);
    let outcome = Outcome {
        status: if passed {
            Status::Passed
        } else {
            Status::Wrong
        },
        gpu_tflops: flops / gpu_s * 1e-12,
        wall_tflops: flops / wall_s * 1e-12,
        check_error,
        sample_error,
    };
    let finite = |x: f64| x.is_finite().then_some(x);
    eprintln!(
        "  {name}: {} TFLOP/s (GPU {} ms), wall {:.3} TFLOP/s ({:.3} ms); \
         error {check_error:.2e} at {check_n}^3{}{}",
        json_number(finite(outcome.gpu_tflops), 3),
        json_number(finite(gpu_s * 1e3), 3),
        outcome.wall_tflops,
        wall_s * 1e3,
        if sample_error.is_nan() {
            String::new()
        } else {
            format!(", {sample_error:.2e} on {SAMPLES} samples at {}^3", big.n)
        },
        if passed { "" } else { "  FAILED the check" }
    );
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_lines_round_trip() {
        let o = Outcome {
            status: Status::Wrong,
            gpu_tflops: 44.25,
            wall_tflops: 42.0,
            check_error: 4.0e-7,
            sample_error: f64::NAN,
        };
        let back = Outcome::from_output(&format!("noise\n{}\n", o.to_line())).unwrap();
        assert_eq!(back.status, Status::Wrong);
        assert_eq!(back.gpu_tflops, 44.25);
        assert_eq!(back.check_error, 4.0e-7);
        assert!(back.sample_error.is_nan());
        assert!(Outcome::from_output("nothing here").is_none());
    }
}
