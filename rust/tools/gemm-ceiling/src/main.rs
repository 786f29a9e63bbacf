//! gemm-ceiling: the fastest float32 FMA GEMM and float16
//! cooperative-matrix GEMM flashport can write in WGSL, run through wgpu
//! on Vulkan, in TFLOP/s. GPU attention speed is reported as a fraction of
//! these: the limit of a portable backend on that GPU, measured in the same
//! run (benchmarks/gpu_bench.py reads the last line of stdout).
//!
//! Every configuration is checked before it is timed: against a float64
//! GEMM on a smaller size, and on a sample of elements at the timed size,
//! with outputs poisoned with NaN first. A configuration that gives wrong
//! results is reported and not eligible, and the process exits with
//! status 1.
//!
//! Each configuration runs in a child process of its own (this binary with
//! `--child`), under a time limit. On the H100 (driver 580), in one
//! process: a kernel that the driver failed to compile lost the device for
//! every later kernel; the cooperative kernels ran at half the speed they
//! reach in a process of their own (78 against 157 TFLOP/s for one
//! configuration) after the float32 sweep; and flashport's float32 kernels
//! were seen to slow several-fold after a cooperative one
//! (docs/gpu.md, "Measuring on the H100"). A child that fails or hangs costs its
//! configuration only.

mod coop;
mod fma;
mod gpu;
mod host;
mod measure;

use std::io::Read;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use host::{json_number, json_string};
use measure::{Outcome, Status};

const USAGE: &str = "usage: flashport-gemm-ceiling [--size N] [--reps N] [--quick]
  --size N   side of the square GEMM that is timed (default 4096; a multiple of 128)
  --reps N   timed runs per configuration, after warm-up (default 20)
  --quick    the first two configurations of each kind, a 256^3 check, one warm-up run
stderr: every configuration's result; stdout, last line: one JSON object";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    F32,
    F16,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::F32 => "f32",
            Kind::F16 => "f16",
        }
    }

    fn kernels(self) -> Vec<Kernel> {
        match self {
            Kind::F32 => fma::CONFIGS.iter().map(|&c| Kernel::Fma(c)).collect(),
            Kind::F16 => coop::CONFIGS.iter().map(|&c| Kernel::Coop(c)).collect(),
        }
    }
}

pub struct Args {
    pub size: u32,
    pub reps: usize,
    pub quick: bool,
    /// Set in a child process: the one configuration it measures.
    child: Option<(Kind, usize)>,
}

impl Args {
    /// The arguments that make a child measure configuration `index`.
    fn for_child(&self, kind: Kind, index: usize) -> Vec<String> {
        let mut v = vec![
            "--child".to_string(),
            kind.tag().to_string(),
            index.to_string(),
            "--size".to_string(),
            self.size.to_string(),
            "--reps".to_string(),
            self.reps.to_string(),
        ];
        if self.quick {
            v.push("--quick".to_string());
        }
        v
    }
}

fn parse_args(argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        size: 4096,
        reps: 20,
        quick: false,
        child: None,
    };
    let mut it = argv;
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(format!("{name} needs a positive integer"))
        };
        match arg.as_str() {
            "--size" => args.size = value("--size")?.min(u32::MAX as u64) as u32,
            "--reps" => args.reps = value("--reps")? as usize,
            "--quick" => args.quick = true,
            "--child" => {
                let kind = match it.next().as_deref() {
                    Some("f32") => Kind::F32,
                    Some("f16") => Kind::F16,
                    _ => return Err("--child needs f32 or f16 and an index".to_string()),
                };
                let index = it
                    .next()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|&i| i < kind.kernels().len())
                    .ok_or("--child needs a configuration index")?;
                args.child = Some((kind, index));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.size == 0 || args.size % 128 != 0 || args.size > 16384 {
        return Err(format!(
            "--size {} must be a positive multiple of 128 up to 16384",
            args.size
        ));
    }
    if args.reps == 0 || args.reps > 1000 {
        return Err("--reps must be between 1 and 1000".to_string());
    }
    Ok(args)
}

/// One kernel configuration of either kind.
#[derive(Clone, Copy)]
pub enum Kernel {
    Fma(fma::FmaConfig),
    Coop(coop::CoopConfig),
}

impl Kernel {
    fn name(&self) -> String {
        match self {
            Kernel::Fma(c) => c.name(),
            Kernel::Coop(c) => c.name(),
        }
    }

    fn wgsl(&self) -> String {
        match self {
            Kernel::Fma(c) => c.wgsl(),
            Kernel::Coop(c) => c.wgsl(),
        }
    }

    fn is_coop(&self) -> bool {
        matches!(self, Kernel::Coop(_))
    }

    fn tile(&self) -> (u32, u32, u32) {
        match self {
            Kernel::Fma(c) => (c.bm(), c.bn(), c.bk),
            Kernel::Coop(c) => (c.bm(), c.bn(), c.bk),
        }
    }

    fn threads(&self) -> u32 {
        match self {
            Kernel::Fma(c) => c.threads(),
            Kernel::Coop(c) => c.threads(),
        }
    }

    fn workgroup_bytes(&self) -> u32 {
        match self {
            Kernel::Fma(c) => c.workgroup_bytes(),
            Kernel::Coop(c) => c.workgroup_bytes(),
        }
    }

    fn well_formed(&self) -> bool {
        match self {
            Kernel::Fma(c) => c.well_formed(),
            Kernel::Coop(c) => c.well_formed(),
        }
    }

    fn divides(&self, n: u32) -> bool {
        let (bm, bn, bk) = self.tile();
        n % bm == 0 && n % bn == 0 && n % bk == 0
    }
}

/// Why `kernel` cannot run on the adapter at these sizes, if it cannot.
fn unfit(kernel: &Kernel, info: &gpu::AdapterInfo, args: &Args) -> Option<String> {
    let check_n = args.size.min(if args.quick { 256 } else { 512 });
    if !kernel.well_formed() {
        Some("its tiles do not split over its invocations".to_string())
    } else if kernel.workgroup_bytes() > info.max_workgroup_bytes {
        Some(format!(
            "{} bytes of workgroup memory, the adapter has {}",
            kernel.workgroup_bytes(),
            info.max_workgroup_bytes
        ))
    } else if kernel.threads() > info.max_invocations {
        Some(format!(
            "{} invocations, the adapter allows {}",
            kernel.threads(),
            info.max_invocations
        ))
    } else if !kernel.divides(check_n) || !kernel.divides(args.size) {
        Some(format!(
            "its tiles do not divide {check_n} and {}",
            args.size
        ))
    } else {
        None
    }
}

/// The best configuration of one kind, and how many gave wrong results.
struct Sweep {
    best: Option<(String, Outcome)>,
    wrong: usize,
    errors: usize,
}

/// Runs each configuration of `kind` in a child process.
fn sweep(kind: Kind, info: &gpu::AdapterInfo, args: &Args) -> Result<Sweep, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let mut sweep = Sweep {
        best: None,
        wrong: 0,
        errors: 0,
    };
    let kernels = kind.kernels();
    let count = if args.quick { 2 } else { kernels.len() };
    let limit = child_time_limit(info, args);
    for (index, kernel) in kernels.iter().enumerate().take(count) {
        let name = kernel.name();
        if let Some(why) = unfit(kernel, info, args) {
            eprintln!("  {name}: skipped ({why})");
            continue;
        }
        let outcome = match run_child_process(&exe, args.for_child(kind, index), limit) {
            Ok(stdout) => Outcome::from_output(&stdout).unwrap_or_else(|| {
                eprintln!("  {name}: FAILED, its process printed no result");
                Outcome::error()
            }),
            Err(e) => {
                eprintln!("  {name}: FAILED: {e}");
                Outcome::error()
            }
        };
        match outcome.status {
            Status::Passed => {
                if sweep
                    .best
                    .as_ref()
                    .is_none_or(|(_, b)| outcome.score() > b.score())
                {
                    sweep.best = Some((name, outcome));
                }
            }
            Status::Wrong => sweep.wrong += 1,
            Status::Error => sweep.errors += 1,
        }
    }
    Ok(sweep)
}

/// How long a child may take before it is killed: a kernel that hangs the
/// GPU would otherwise hang the benchmark (one did on the H100). Two
/// minutes for starting, compiling and checking, plus every run at 0.1
/// TFLOP/s (0.001 on a software adapter).
fn child_time_limit(info: &gpu::AdapterInfo, args: &Args) -> Duration {
    let runs = args.reps as f64 + 5.0;
    let rate = if info.device_type == "Cpu" { 1e9 } else { 1e11 };
    let flops = 2.0 * (args.size as f64).powi(3);
    Duration::from_secs_f64(120.0 + runs * flops / rate)
}

/// Runs this executable with `child_args` and returns its stdout, or why
/// it gave none.
fn run_child_process(
    exe: &std::path::Path,
    child_args: Vec<String>,
    limit: Duration,
) -> Result<String, String> {
    let mut child = Command::new(exe)
        .args(child_args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting a child process: {e}"))?;
    // The child prints one short line, far below a pipe's buffer, so it
    // cannot block on stdout while this waits.
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                // A process blocked in the driver on a hung GPU may not die
                // at once; the sweep goes on without waiting for it.
                for _ in 0..100 {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                return Err(format!("killed after {:.0} s", limit.as_secs_f64()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("waiting for the child process: {e}")),
        }
    };
    let mut stdout = String::new();
    if let Some(mut pipe) = child.stdout.take() {
        pipe.read_to_string(&mut stdout)
            .map_err(|e| format!("reading the child's output: {e}"))?;
    }
    if stdout.is_empty() {
        return Err(format!("the child process ended with {status}"));
    }
    Ok(stdout)
}

/// A child's work: measure one configuration and print its outcome line.
fn run_child(kind: Kind, index: usize, args: &Args) -> ExitCode {
    let kernel = kind.kernels()[index];
    let outcome = gpu::Gpu::open(kind == Kind::F16)
        .and_then(|gpu| measure::measure(&gpu, kernel, args))
        .unwrap_or_else(|e| {
            eprintln!("  {}: FAILED to build or run: {e}", kernel.name());
            Outcome::error()
        });
    println!("{}", outcome.to_line());
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gemm-ceiling: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some((kind, index)) = args.child {
        return run_child(kind, index, &args);
    }
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gemm-ceiling: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(args: &Args) -> Result<ExitCode, String> {
    let info = gpu::describe()?;
    eprintln!(
        "gemm-ceiling: {} ({}, {}), Vulkan; {}^3, median of {} runs; {}",
        info.name,
        info.device_type,
        info.driver,
        args.size,
        args.reps,
        if info.timestamps {
            "GPU timestamps"
        } else {
            "no timestamp queries: wall time only"
        }
    );
    eprintln!("float32 FMA:");
    let f32_sweep = sweep(Kind::F32, &info, args)?;
    eprintln!("float16 cooperative matrix:");
    let f16_sweep = match &info.coop {
        Ok(()) => Some(sweep(Kind::F16, &info, args)?),
        Err(why) => {
            eprintln!("  skipped: {why}");
            None
        }
    };

    let wrong = f32_sweep.wrong + f16_sweep.as_ref().map_or(0, |s| s.wrong);
    let errors = f32_sweep.errors + f16_sweep.as_ref().map_or(0, |s| s.errors);
    if errors > 0 {
        eprintln!("{errors} configuration(s) did not build or run (see above)");
    }
    let checked = wrong == 0 && f32_sweep.best.is_some();
    let field = |prefix: &str, best: Option<&(String, Outcome)>| {
        let finite = |x: f64| x.is_finite().then_some(x);
        format!(
            "\"{prefix}_tflops\": {}, \"{prefix}_wall_tflops\": {}, \"{prefix}_config\": {}, \
             \"{prefix}_error\": {}",
            json_number(best.and_then(|(_, o)| finite(o.score())), 3),
            json_number(best.and_then(|(_, o)| finite(o.wall_tflops)), 3),
            best.map_or("null".to_string(), |(name, _)| json_string(name)),
            best.map_or("null".to_string(), |(_, o)| {
                let worst = if o.sample_error.is_nan() {
                    o.check_error
                } else {
                    o.check_error.max(o.sample_error)
                };
                format!("{worst:.3e}")
            }),
        )
    };
    let f16_skipped = match (&info.coop, &f16_sweep) {
        (Err(why), _) => json_string(why),
        (Ok(()), Some(s)) if s.best.is_none() => {
            json_string("no cooperative configuration passed (see stderr)")
        }
        _ => "null".to_string(),
    };
    println!(
        "{{\"adapter\": {}, \"driver\": {}, \"backend\": \"vulkan\", \"size\": {}, \
         \"reps\": {}, \"timing\": {}, {}, {}, \"f16_coop_skipped\": {}, \"checked\": {}}}",
        json_string(&info.name),
        json_string(&info.driver),
        args.size,
        args.reps,
        json_string(if info.timestamps {
            "gpu timestamps"
        } else {
            "wall"
        }),
        field("f32_fma", f32_sweep.best.as_ref()),
        field("f16_coop", f16_sweep.as_ref().and_then(|s| s.best.as_ref())),
        f16_skipped,
        checked
    );
    Ok(if checked {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Parses and validates WGSL the way wgpu would for a device with every
/// capability, then writes it as SPIR-V (wgpu's Vulkan path): what can be
/// checked of a kernel without the hardware it runs on.
#[cfg(test)]
fn compile_for_tests(source: &str) -> Result<Vec<u32>, String> {
    use wgpu::naga;
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    );
    validator.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    validator.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    let info = validator
        .validate(&module)
        .map_err(|e| e.emit_to_string(source))?;
    // What wgpu asks of naga for the modules `Gpu::pipeline` builds
    // (`ShaderRuntimeChecks::unchecked`).
    let unchecked = naga::proc::BoundsCheckPolicy::Unchecked;
    let options = naga::back::spv::Options {
        lang_version: (1, 5),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: unchecked,
            buffer: unchecked,
            image_load: unchecked,
            binding_array: unchecked,
        },
        force_loop_bounding: false,
        ..Default::default()
    };
    let pipeline = naga::back::spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".to_string(),
    };
    naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
        .map_err(|e| format!("writing SPIR-V: {e}"))
}

/// How many instructions with `opcode` a SPIR-V module holds.
#[cfg(test)]
fn count_opcode(words: &[u32], opcode: u32) -> usize {
    let mut at = 5;
    let mut count = 0;
    while at < words.len() {
        let len = (words[at] >> 16) as usize;
        if words[at] & 0xffff == opcode {
            count += 1;
        }
        if len == 0 {
            break;
        }
        at += len;
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100's Vulkan limits (48 KiB of workgroup memory): every
    /// configuration must run there.
    const H100_WORKGROUP_BYTES: u32 = 48 << 10;

    /// Function-scope arrays are what the register tiles must not be.
    fn no_private_arrays(source: &str) -> bool {
        !source
            .lines()
            .any(|l| l.trim_start().starts_with("var ") && l.contains("array<"))
    }

    #[test]
    fn fma_kernels_validate_and_fit() {
        for c in fma::CONFIGS {
            assert!(c.well_formed(), "{}", c.name());
            assert!(c.workgroup_bytes() <= H100_WORKGROUP_BYTES, "{}", c.name());
            assert!(c.threads() <= 1024, "{}", c.name());
            let source = c.wgsl();
            assert!(no_private_arrays(&source), "{}", c.name());
            let words = compile_for_tests(&source).unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            // OpExtInst (Fma) per vec4 accumulator update, none folded away.
            let fmas = count_opcode(&words, 12);
            assert!(
                fmas as u32 >= c.bk * c.tm * c.tn / 4,
                "{}: {fmas} fma",
                c.name()
            );
        }
    }

    #[test]
    fn coop_kernels_validate_and_fit() {
        const OP_COOPERATIVE_MATRIX_MUL_ADD_KHR: u32 = 4459;
        const OP_COOPERATIVE_MATRIX_STORE_KHR: u32 = 4458;
        for c in coop::CONFIGS {
            assert!(c.well_formed(), "{}", c.name());
            assert!(c.workgroup_bytes() <= H100_WORKGROUP_BYTES, "{}", c.name());
            assert!(c.threads() <= 1024, "{}", c.name());
            let source = c.wgsl();
            assert!(no_private_arrays(&source), "{}", c.name());
            let words = compile_for_tests(&source).unwrap_or_else(|e| panic!("{}: {e}", c.name()));
            assert_eq!(
                count_opcode(&words, OP_COOPERATIVE_MATRIX_MUL_ADD_KHR) as u32,
                c.fm * c.fn_ * c.bk / 16,
                "{}",
                c.name()
            );
            assert_eq!(
                count_opcode(&words, OP_COOPERATIVE_MATRIX_STORE_KHR) as u32,
                c.fm * c.fn_,
                "{}",
                c.name()
            );
        }
    }

    #[test]
    fn quick_runs_on_small_workgroup_memory() {
        // lavapipe (CI) has 32 KiB: the first two of each kind must fit.
        for c in &fma::CONFIGS[..2] {
            assert!(c.workgroup_bytes() <= 32 << 10, "{}", c.name());
        }
        for c in &coop::CONFIGS[..2] {
            assert!(c.workgroup_bytes() <= 48 << 10, "{}", c.name());
        }
    }

    #[cfg(unix)]
    #[test]
    fn child_processes_are_read_and_killed() {
        let echo = std::path::Path::new("/bin/echo");
        let out = run_child_process(echo, vec!["hello".into()], Duration::from_secs(30));
        assert_eq!(out.unwrap().trim(), "hello");
        let sleep = std::path::Path::new("/bin/sleep");
        let start = Instant::now();
        let err = run_child_process(sleep, vec!["30".into()], Duration::from_millis(200));
        assert!(err.unwrap_err().contains("killed"));
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn arguments_parse_and_reach_the_child() {
        let argv = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let args = parse_args(argv("--size 512 --reps 5 --quick").into_iter()).unwrap();
        assert_eq!((args.size, args.reps, args.quick), (512, 5, true));
        let child = parse_args(args.for_child(Kind::F16, 1).into_iter()).unwrap();
        assert_eq!(child.child, Some((Kind::F16, 1)));
        assert_eq!((child.size, child.reps, child.quick), (512, 5, true));
        assert!(parse_args(argv("--size 100").into_iter()).is_err());
        assert!(parse_args(argv("--reps 0").into_iter()).is_err());
        assert!(parse_args(argv("--child f16 999").into_iter()).is_err());
        assert!(parse_args(argv("--bogus").into_iter()).is_err());
    }

    #[test]
    fn every_tile_divides_the_default_sizes() {
        for n in [256u32, 512, 4096] {
            for k in fma::CONFIGS
                .iter()
                .map(|&c| Kernel::Fma(c))
                .chain(coop::CONFIGS.iter().map(|&c| Kernel::Coop(c)))
            {
                assert!(k.divides(n), "{} at {n}", k.name());
            }
        }
    }
}
