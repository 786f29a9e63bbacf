//! The one-subgroup diagnostic of the cooperative-matrix builtins
//! (shaders/coop_diagnostic.wgsl): runs it and compares each case with
//! what naga's documentation says it computes, and with the transpose.

use super::context::{self, Context};
use super::{output, read_back, upload};
use crate::{Error, Result};

pub(crate) const SOURCE: &str = include_str!("../../../../shaders/coop_diagnostic.wgsl");
const CASES: usize = 11;

fn a(i: usize, k: usize) -> f64 {
    i as f64 + k as f64 / 16.0
}

/// Row-major expected result of each case, from its description in the
/// shader (coopLoadT/coopStoreT row-major, coopLoad/coopStore
/// column-major, strides in elements: naga's documentation).
fn expected(case: usize, i: usize, n: usize) -> f64 {
    match case {
        0 => a(i, n),
        // Column-major store of A: out[n * 16 + i] = A[i][n], read here as
        // element (i, n) of the row-major output = A[n][i].
        1 => a(n, i),
        2 => a(n, i),
        3 => a(i, (n + 15) % 16),
        4 => a(i, (n + 1) % 16),
        5 => a(i, n) + 1000.0 * i as f64 + n as f64,
        6 => a(i + 3, n),
        7 => (0..4).map(|c| a(i + c, n)).sum(),
        8 => a(n, i),
        // A + 100 t is rounded to float16 when written (spacing 0.125 at
        // 200, 0.25 at 300).
        9 => (0..4)
            .map(|t| half::f16::from_f64(a(i, n) + 100.0 * t as f64).to_f64())
            .sum(),
        10 => 8.0 * a(i, n) + 12.0,
        _ => f64::NAN,
    }
}

const WHAT: [&str; CASES] = [
    "A(loadT) x I(loadT) -> storeT",
    "same -> store (column-major)",
    "A(load, column-major) x I",
    "A x P(loadT)",
    "A x P(load, column-major)",
    "A(loadT stride 24) x I + C(loadT storage f32 stride 20)",
    "function-local array of matrices, acc[3]",
    "function-local array, sum of 4 products",
    "storeT to workgroup f32, barrier, scalar transposed read",
    "loop: rewrite workgroup A behind barriers, accumulate",
    "loop: coop -> workgroup f32 -> scalar -> coop load, add",
];

/// Runs the diagnostic on the current context, built through wgpu's own
/// SPIR-V (`via_spirv` false: naga through wgpu, Vulkan memory model) or
/// through the SPIR-V written here with the memory model as `glsl450`
/// says. One line per case.
pub fn run(via_spirv: bool, glsl450: bool) -> Result<Vec<String>> {
    let ctx = context::get()?;
    if !ctx.coop {
        return Err(Error::Gpu(
            "no cooperative matrices on this context (FLASHPORT_GPU_COOP=0, or none on this adapter)".into(),
        ));
    }
    run_on(&ctx, via_spirv, glsl450)
}

fn run_on(ctx: &Context, via_spirv: bool, glsl450: bool) -> Result<Vec<String>> {
    let pipeline = if via_spirv {
        ctx.spirv_pipeline("coop_diagnostic", SOURCE, &[], false, glsl450)?
    } else {
        ctx.scoped("building the diagnostic", || {
            let module = ctx
                .device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some("coop_diagnostic"),
                    source: wgpu::ShaderSource::Wgsl(SOURCE.into()),
                });
            Ok(ctx
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("coop_diagnostic"),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                }))
        })?
    };
    let cin: Vec<f32> = (0..16 * 20)
        .map(|e| (1000 * (e / 20) + e % 20) as f32)
        .collect();
    let results = ctx.scoped("running the diagnostic", || {
        let cb = upload(ctx, "cin", bytemuck::cast_slice(&cin))?;
        let ob = output(ctx, "out", CASES * 256);
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: ob.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: cb.as_entire_binding(),
                },
            ],
        });
        let mut encoder = ctx.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(1, 1, 1);
        }
        read_back(ctx, encoder, &[(&ob, CASES * 256)])
    })?;
    let got = &results[0];
    let mut lines = Vec::new();
    for (case, what) in WHAT.iter().enumerate() {
        let at = |i: usize, n: usize| got[case * 256 + i * 16 + n] as f64;
        let (mut err, mut err_t) = (0.0f64, 0.0f64);
        for i in 0..16 {
            for n in 0..16 {
                err = err.max((at(i, n) - expected(case, i, n)).abs());
                err_t = err_t.max((at(n, i) - expected(case, i, n)).abs());
            }
        }
        let verdict = if err == 0.0 {
            "as documented".to_string()
        } else if err_t == 0.0 {
            "TRANSPOSED".to_string()
        } else {
            format!("WRONG (max error {err}, vs transpose {err_t})")
        };
        let row = |i: usize| {
            (0..16)
                .map(|n| format!("{}", at(i, n)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        lines.push(format!(
            "case {case} ({what}): {verdict}; row 0: [{}]; row 1: [{}]; row 15: [{}]",
            row(0),
            row(1),
            row(15)
        ));
    }
    Ok(lines)
}
