//! The cooperative-matrix float16 kernels (tensor cores), forward and
//! backward, against the float64 reference, where the adapter has them;
//! elsewhere each test says so on stderr instead of passing silently.

use super::common::*;
use flashport_core::gpu::kernel::Tier;
use flashport_core::gpu::testing::{adapter_caps, plans};
use flashport_core::gpu::tiles::{self, Tiles};
use flashport_core::overrides::{self, Overrides};
use flashport_core::{cpu, gpu, DType, Slice, VariantArrays};

/// Whether the shared context's adapter has the cooperative kernels.
pub fn coop_available() -> bool {
    adapter_caps().unwrap().coop
}

/// The overrides that let the cooperative kernels run (`coop`: the
/// calling thread's cap on the tier kept) or stop at the tiled ones.
fn coop_or_tiled(coop: bool) -> Overrides {
    let current = overrides::current();
    Overrides {
        max_tier: if coop {
            current.max_tier
        } else {
            Some(Tier::Tiled)
        },
        ..current
    }
}

/// The calling thread's overrides with the cooperative forward's tiles set
/// to `layout` (None: the default ones).
fn with_layout(layout: Option<Tiles>) -> Overrides {
    Overrides {
        coop_forward: layout,
        ..overrides::current()
    }
}

/// Forward errors (out, lse) of `c` against the float64 CPU, with the
/// cooperative kernel on or off for this thread; also the kernels it ran.
fn forward_errors(c: &Case, coop: bool) -> (f64, f64, Vec<String>) {
    // Which kernels ran is read from their timestamps.
    gpu::set_kernel_timing(true);
    let reference = cpu::forward(
        &f64_problem(&c.p),
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let got = overrides::with(coop_or_tiled(coop), || {
        gpu::forward(
            &c.p,
            c.q.slice(DType::F16),
            c.k.slice(DType::F16),
            c.v.slice(DType::F16),
            &VariantArrays::default(),
        )
    })
    .unwrap();
    let kernels = kernels_run();
    let ref_lse = as_f64(&reference.lse);
    let (out, lse) = (as_f64(&got.out), as_f64(&got.lse));
    let dv = c.p.value_dim;
    for (row, &l) in ref_lse.iter().enumerate() {
        if l == f64::NEG_INFINITY {
            assert_eq!(lse[row], f64::NEG_INFINITY, "{:?} row {row}", c.p);
            assert!(out[row * dv..(row + 1) * dv].iter().all(|&x| x == 0.0));
        }
    }
    (
        rel_err(&out, &as_f64(&reference.out)),
        rel_err(&lse, &ref_lse),
        kernels,
    )
}

#[test]
fn coop_forward_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    if !coop_available() {
        eprintln!(
            "NOT TESTED: this adapter has no 16x16x16 float16 cooperative matrices: \
             the cooperative-matrix forward does not run here"
        );
        return;
    }
    // Head dimensions up to 128, both ways of d != dv, GQA, sizes that are
    // not tile multiples.
    let shapes: [Shape; 8] = [
        (1, 2, 1, 65, 17, 64, 32),
        (1, 1, 1, 130, 130, 128, 128),
        (1, 4, 2, 70, 90, 112, 32),
        (2, 4, 2, 37, 53, 16, 48),
        (1, 3, 1, 40, 9, 16, 16),
        (1, 2, 2, 300, 300, 64, 64),
        (1, 2, 1, 1000, 1000, 64, 64),
        (1, 1, 1, 77, 1030, 32, 96),
    ];
    // A shape whose cooperative tiles do not fit this adapter runs other
    // kernels and is skipped (tiers.rs checks that the plan is what runs).
    let mut worst = [0.0f64; 4];
    let mut tested = 0;
    // Every tile layout the adapter fits, not only the default one (each
    // shape's first test uses the default).
    let caps = adapter_caps().unwrap();
    for (i, &s) in shapes.iter().enumerate() {
        let layouts: Vec<Option<Tiles>> = std::iter::once(None)
            .chain(tiles::coop_forward_candidates(s.5 as u32, s.6 as u32, caps).map(Some))
            .collect();
        for (n, causal) in [false, true].into_iter().enumerate() {
            for (g, grow) in [false, true].into_iter().enumerate() {
                let layout = layouts[(i + 2 * n + g) % layouts.len()];
                let mut c = case(s, causal, DType::F16, 70 + i as u64);
                let plan = overrides::with(with_layout(layout), || plans(&c.p).unwrap());
                if plan.0.tier != Tier::Coop {
                    eprintln!("{s:?}: runs other kernels here; not tested");
                    continue;
                }
                tested += 1;
                if grow {
                    // Keys that grow along the sequence (and large scores)
                    // move the rows' maxima tile after tile: the lazy
                    // rescaling runs.
                    let (sk, d) = (c.p.seq_k, c.p.head_dim);
                    let scaled: Vec<f64> =
                        c.k.f64
                            .iter()
                            .enumerate()
                            .map(|(e, &x)| x * 4.0 * (1.0 + ((e / d) % sk) as f64 / 64.0).min(8.0))
                            .collect();
                    c.k = Inputs::new(scaled, DType::F16);
                    c.q = Inputs::new(c.q.f64.iter().map(|x| x.abs() * 2.0).collect(), DType::F16);
                }
                let (o, l, kernels) =
                    overrides::with(with_layout(layout), || forward_errors(&c, true));
                assert!(
                    kernels.is_empty() || kernels.iter().all(|k| k == "forward_coop"),
                    "expected the cooperative forward, ran {kernels:?}"
                );
                let (so, sl, _) = forward_errors(&c, false);
                eprintln!(
                    "coop {s:?} causal={causal} grow={grow} {:?}: out {o:.2e} lse {l:.2e} \
                     (scalar float16: out {so:.2e} lse {sl:.2e})",
                    plan.0.forward.tiles
                );
                assert!(
                    o <= 1e-2 && l <= 1e-2,
                    "{s:?} causal={causal}: out {o:e}, lse {l:e}"
                );
                worst = [
                    worst[0].max(o),
                    worst[1].max(l),
                    worst[2].max(so),
                    worst[3].max(sl),
                ];
            }
        }
    }
    eprintln!(
        "cooperative forward worst relative error: out {:.2e}, lse {:.2e} \
         (scalar float16 kernels: out {:.2e}, lse {:.2e})",
        worst[0], worst[1], worst[2], worst[3]
    );
    assert!(tested > 0, "no shape ran the cooperative forward");
}

/// Backward errors (dq, dk, dv) of `c` in float16 against the float64 CPU,
/// with the cooperative kernels on or off for this thread; also the
/// kernels the last call ran. Both sides get the reference O and lse.
fn backward_errors(c: &Case, coop: bool) -> ([f64; 3], Vec<String>) {
    // Which kernels ran is read from their timestamps.
    gpu::set_kernel_timing(true);
    let p64 = f64_problem(&c.p);
    let reference = cpu::forward(
        &p64,
        c.q.slice(DType::F64),
        c.k.slice(DType::F64),
        c.v.slice(DType::F64),
        &VariantArrays::default(),
    )
    .unwrap();
    let o = Inputs::new(as_f64(&reference.out), DType::F16);
    let lse32: Vec<f32> = as_f64(&reference.lse).iter().map(|&x| x as f32).collect();
    let lse64: Vec<f64> = lse32.iter().map(|&x| x as f64).collect();
    let d_out = Inputs::new(random(c.p.out_len(), 98), DType::F16);
    let want = cpu::backward(
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
    let got = overrides::with(coop_or_tiled(coop), || {
        gpu::backward(
            &c.p,
            [
                d_out.slice(DType::F16),
                c.q.slice(DType::F16),
                c.k.slice(DType::F16),
                c.v.slice(DType::F16),
                o.slice(DType::F16),
                Slice::F32(&lse32),
            ],
            &VariantArrays::default(),
        )
    })
    .unwrap();
    let kernels = kernels_run();
    (
        [
            rel_err(&as_f64(&got.dq), &as_f64(&want.dq)),
            rel_err(&as_f64(&got.dk), &as_f64(&want.dk)),
            rel_err(&as_f64(&got.dv), &as_f64(&want.dv)),
        ],
        kernels,
    )
}

/// The cooperative-matrix float16 backward against float64, at the
/// float16 tolerance of float16_matches_float64_reference: seq_q != seq_k
/// both ways (causal rows with no visible key where seq_q > seq_k), GQA,
/// d != dv, sizes that are not multiples of the tiles, and scores large
/// enough that P is far from uniform.
#[test]
fn coop_backward_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    if !coop_available() {
        eprintln!(
            "NOT TESTED: this adapter has no 16x16x16 float16 cooperative matrices: \
             the cooperative-matrix backward does not run here"
        );
        return;
    }
    // Capped at the tier: where NVIDIA's cooperative matrices 2 are open,
    // the default is theirs (cm2_backward_matches_float64_reference).
    overrides::with(max_tier(Tier::Coop), || {
        backward_against_float64(Tier::Coop, ["backward_dq_coop", "backward_dkdv_coop"])
    });
}

/// The float16 backward on NVIDIA's cooperative matrices 2 against float64,
/// on the cases and at the tolerance of the cooperative one.
#[test]
fn cm2_backward_matches_float64_reference() {
    if !gpu_present() {
        return;
    }
    if !adapter_caps().unwrap().cm2 {
        eprintln!(
            "NOT TESTED: this adapter has no cooperative matrices 2 (VK_NV_cooperative_matrix2): \
             their backward does not run here"
        );
        return;
    }
    backward_against_float64(Tier::Cm2, ["backward_dq_cm2", "backward_dkdv_cm2"]);
}

/// The backward of `tier` (which must run, as `names` for dQ and dK/dV)
/// against float64: seq_q != seq_k both ways (causal rows with no visible
/// key where seq_q > seq_k), GQA, d != dv, sizes that are not multiples of
/// the tiles, and scores large enough that P is far from uniform.
fn backward_against_float64(tier: Tier, names: [&str; 2]) {
    // Head dimensions up to 128, both ways of d != dv, GQA, sizes that are
    // not tile multiples.
    let shapes: [Shape; 8] = [
        (1, 2, 1, 65, 17, 64, 32),
        (1, 1, 1, 130, 130, 128, 128),
        (1, 4, 2, 70, 90, 112, 32),
        (2, 4, 2, 37, 53, 16, 48),
        (1, 3, 1, 40, 9, 16, 16),
        (1, 2, 2, 300, 300, 64, 64),
        (1, 4, 1, 200, 1000, 64, 64),
        (1, 1, 1, 77, 1030, 32, 96),
    ];
    let mut worst = [0.0f64; 2];
    let mut tested = 0;
    for (i, &s) in shapes.iter().enumerate() {
        for causal in [false, true] {
            for sharp in [false, true] {
                let mut c = case(s, causal, DType::F16, 170 + i as u64);
                if plans(&c.p).unwrap().1.tier != tier {
                    eprintln!("{s:?}: runs other kernels here; not tested");
                    continue;
                }
                tested += 1;
                if sharp {
                    // Scores of several units: P far from uniform, dS
                    // spread over magnitudes.
                    c.q = Inputs::new(c.q.f64.iter().map(|x| x * 6.0).collect(), DType::F16);
                }
                let (e, kernels) = backward_errors(&c, true);
                assert!(
                    kernels.is_empty() || kernels[1..] == names,
                    "expected {names:?}, ran {kernels:?}"
                );
                let (se, _) = backward_errors(&c, false);
                let (w, sw) = (
                    e.iter().cloned().fold(0.0, f64::max),
                    se.iter().cloned().fold(0.0, f64::max),
                );
                eprintln!(
                    "{tier:?} backward {s:?} causal={causal} sharp={sharp}: dq/dk/dv {:.2e} {:.2e} {:.2e} \
                     (scalar float16: {:.2e} {:.2e} {:.2e})",
                    e[0], e[1], e[2], se[0], se[1], se[2]
                );
                assert!(
                    w <= 1e-2,
                    "{s:?} causal={causal} sharp={sharp}: dq/dk/dv {e:?}"
                );
                worst = [worst[0].max(w), worst[1].max(sw)];
            }
        }
    }
    eprintln!(
        "{tier:?} backward worst relative error {:.2e} (scalar float16 kernels {:.2e})",
        worst[0], worst[1]
    );
    assert!(tested > 0, "no shape ran the {tier:?} backward");
}
