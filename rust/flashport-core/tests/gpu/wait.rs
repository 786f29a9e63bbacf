//! How a call waits for its GPU work: polling first (the default on a
//! hardware adapter) or sleeping in the driver at once (a software one).
//! Both must give the same bits, including for submissions with nothing
//! to track, where a zero-timeout wait once tripped an assertion inside
//! wgpu-core.

use super::common::*;
use flashport_core::overrides::{self, Overrides};
use flashport_core::{gpu, Buffer, DType, Slice, VariantArrays};
use std::time::Duration;

/// Forward and backward outputs of `c` on the GPU, as bits.
fn run(c: &Case) -> Vec<Vec<u64>> {
    let f = gpu_forward(c);
    let d_out: Vec<f32> = random(c.p.out_len(), 9).iter().map(|&x| x as f32).collect();
    let (Buffer::F32(o), Buffer::F32(lse)) = (&f.out, &f.lse) else {
        panic!("float32 inputs gave other outputs");
    };
    let g = gpu::backward(
        &c.p,
        [
            Slice::F32(&d_out),
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            Slice::F32(o),
            Slice::F32(lse),
        ],
        &VariantArrays::default(),
    )
    .unwrap();
    [&f.out, &f.lse, &g.dq, &g.dk, &g.dv]
        .into_iter()
        .map(bits)
        .collect()
}

#[test]
fn polling_and_sleeping_give_the_same_results() {
    if !gpu_present() {
        return;
    }
    let shapes: [(Shape, bool); 4] = [
        ((1, 2, 1, 37, 53, 16, 8), true),
        ((2, 4, 2, 70, 90, 32, 48), false),
        ((1, 2, 1, 0, 5, 8, 8), false),
        ((1, 1, 1, 0, 0, 4, 4), true),
    ];
    let values: Vec<f32> = random(999, 3).iter().map(|&x| x as f32).collect();
    let mut seen = Vec::new();
    // Sleeping at once, polling (for longer than any of these calls) and
    // polling briefly before sleeping.
    for spin in [
        Duration::ZERO,
        Duration::from_secs(10),
        Duration::from_micros(1),
    ] {
        let ov = Overrides {
            spin: Some(spin),
            ..overrides::current()
        };
        let got = overrides::with(ov, || {
            let mut got: Vec<Vec<Vec<u64>>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(s, causal))| run(&case(s, causal, DType::F32, 40 + i as u64)))
                .collect();
            let t = gpu::to_device("q", Slice::F32(&values), &[values.len()]).unwrap();
            got.push(vec![bits(&t.to_host().unwrap())]);
            got
        });
        seen.push(got);
    }
    assert_eq!(seen[0][4], vec![bits(&Buffer::F32(values))]);
    assert!(seen.iter().all(|g| *g == seen[0]));
}
