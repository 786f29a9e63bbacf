//! Where `device="auto"` runs a call on host arrays: a cost model of the
//! two devices, a table of rates rather than a timing, so that the choice
//! depends only on the problem and the machine, never on how a run went.
//!
//! The CPU's rates are per computing thread, as measured on the 2-core
//! development VM (AMD EPYC, AVX2+FMA: ~90 GFLOP/s a thread in float32 with
//! the SIMD kernels, ~25 with the portable ones, ~30 in float64). The GPU's
//! are what a mid-range discrete GPU reaches through the kernels here
//! (the H100 reaches 2–4× more: 20 TFLOP/s float32, 75 float16 on
//! cooperative matrices; an integrated GPU far less), plus a fixed cost
//! per call and the copies of NumPy inputs and outputs over the bus.
//! Conservative GPU rates keep small and medium problems on the CPU, where
//! a wrong choice costs least.

use crate::problem::{DType, Problem};

/// The CPU as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpuModel {
    pub threads: usize,
    /// float32 runs the AVX2+FMA kernels.
    pub simd: bool,
}

/// The GPU `auto` may use: a hardware adapter (never a software one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    /// A discrete GPU (its own memory, behind a bus); else integrated.
    pub discrete: bool,
    /// float16 runs on cooperative matrices (tensor cores).
    pub coop: bool,
}

/// FLOP/s of one CPU thread.
fn cpu_rate(dtype: DType, simd: bool) -> f64 {
    match (dtype, simd) {
        (DType::F64, _) => 30e9,
        (_, true) => 90e9,
        (_, false) => 25e9,
    }
}

/// Seconds the CPU takes for `p`'s forward.
pub fn cpu_seconds(p: &Problem, cpu: CpuModel) -> f64 {
    p.forward_flops() / (cpu.threads.max(1) as f64 * cpu_rate(p.dtype, cpu.simd))
}

/// Seconds the GPU takes for `p`'s forward on NumPy arrays: a fixed cost,
/// the kernels, and the inputs and outputs over the bus.
pub fn gpu_seconds(p: &Problem, gpu: GpuModel) -> f64 {
    let rate = match (gpu.discrete, p.dtype == DType::F16 && gpu.coop) {
        (true, true) => 40e12,
        (true, false) => 8e12,
        (false, _) => 0.5e12,
    };
    let (fixed, bandwidth) = if gpu.discrete {
        (1e-3, 10e9)
    } else {
        (0.5e-3, 20e9)
    };
    let element = if p.dtype == DType::F16 { 2.0 } else { 4.0 };
    let bytes = element * (p.q_len() + p.k_len() + p.v_len() + p.out_len()) as f64
        + 4.0 * p.lse_len() as f64;
    fixed + p.forward_flops() / rate + bytes / bandwidth
}

/// Whether `device="auto"` runs `p` on `gpu` rather than on `cpu`.
pub fn prefers_gpu(p: &Problem, cpu: CpuModel, gpu: Option<GpuModel>) -> bool {
    match gpu {
        Some(gpu) if p.dtype != DType::F64 => gpu_seconds(p, gpu) < cpu_seconds(p, cpu),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{validate_forward, ArrayInfo, Options};

    fn problem(dtype: &str, batch: usize, heads: usize, seq: usize, d: usize) -> Problem {
        let shape = [batch, heads, seq, d];
        let info = ArrayInfo::new(&shape, dtype);
        validate_forward(info, info, info, &Options::default()).unwrap()
    }

    const LAPTOP: CpuModel = CpuModel {
        threads: 8,
        simd: true,
    };
    const DISCRETE: GpuModel = GpuModel {
        discrete: true,
        coop: false,
    };
    const TENSOR_CORES: GpuModel = GpuModel {
        discrete: true,
        coop: true,
    };
    const INTEGRATED: GpuModel = GpuModel {
        discrete: false,
        coop: false,
    };

    #[test]
    fn small_problems_stay_on_the_cpu_large_ones_go_to_a_discrete_gpu() {
        let small = problem("float32", 1, 8, 256, 64);
        let large = problem("float32", 4, 16, 4096, 64);
        for gpu in [DISCRETE, TENSOR_CORES, INTEGRATED] {
            assert!(!prefers_gpu(&small, LAPTOP, Some(gpu)), "{gpu:?}");
        }
        assert!(prefers_gpu(&large, LAPTOP, Some(DISCRETE)));
        assert!(prefers_gpu(&large, LAPTOP, Some(TENSOR_CORES)));
        // Without a hardware GPU, or in float64, always the CPU.
        assert!(!prefers_gpu(&large, LAPTOP, None));
        let large64 = problem("float64", 4, 16, 4096, 64);
        assert!(!prefers_gpu(&large64, LAPTOP, Some(TENSOR_CORES)));
    }

    #[test]
    fn the_threshold_moves_with_the_machine() {
        // The smallest sequence (powers of two) at which the GPU wins.
        let threshold = |dtype: &str, cpu: CpuModel, gpu: GpuModel| {
            (6..18)
                .map(|e| 1usize << e)
                .find(|&n| prefers_gpu(&problem(dtype, 1, 16, n, 64), cpu, Some(gpu)))
        };
        let two_cores = CpuModel {
            threads: 2,
            simd: true,
        };
        let many_cores = CpuModel {
            threads: 64,
            simd: true,
        };
        let t_two = threshold("float32", two_cores, DISCRETE).unwrap();
        let t_many = threshold("float32", many_cores, DISCRETE).unwrap();
        assert!(t_two < t_many, "{t_two} {t_many}");
        // Tensor cores take float16 over earlier than float32.
        let t16 = threshold("float16", two_cores, TENSOR_CORES).unwrap();
        assert!(t16 <= t_two, "{t16} {t_two}");
        // An integrated GPU wins no earlier than a discrete one, if at all.
        let t_int = threshold("float32", two_cores, INTEGRATED).unwrap_or(usize::MAX);
        assert!(t_int >= t_two, "{t_int} {t_two}");
        // The portable CPU kernels give the GPU more problems.
        let portable = CpuModel {
            threads: 2,
            simd: false,
        };
        assert!(threshold("float32", portable, DISCRETE).unwrap() <= t_two);
    }
}
