//! The same call gives the same bits, again and from several threads.

use super::common::*;
use flashport_core::{gpu, Buffer, DType, Slice, VariantArrays};

#[test]
fn results_are_bitwise_reproducible() {
    if !gpu_present() {
        return;
    }
    let c = case((2, 4, 2, 37, 53, 16, 24), true, DType::F32, 5);
    let run = || {
        gpu::forward(
            &c.p,
            c.q.slice(DType::F32),
            c.k.slice(DType::F32),
            c.v.slice(DType::F32),
            &VariantArrays::default(),
        )
        .unwrap()
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    let Buffer::F32(lse) = &a.lse else { panic!() };
    let d_out = Inputs::new(random(c.p.out_len(), 8), DType::F32);
    let o = Inputs::new(as_f64(&a.out), DType::F32);
    let grad = || {
        gpu::backward(
            &c.p,
            [
                d_out.slice(DType::F32),
                c.q.slice(DType::F32),
                c.k.slice(DType::F32),
                c.v.slice(DType::F32),
                o.slice(DType::F32),
                Slice::F32(lse),
            ],
            &VariantArrays::default(),
        )
        .unwrap()
    };
    assert_eq!(grad(), grad());

    // Concurrent callers share the context and still get the same bits.
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let (q, k, v) = (c.q.f32.clone(), c.k.f32.clone(), c.v.f32.clone());
            let p = c.p;
            std::thread::spawn(move || {
                gpu::forward(
                    &p,
                    Slice::F32(&q),
                    Slice::F32(&k),
                    Slice::F32(&v),
                    &VariantArrays::default(),
                )
                .unwrap()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), a);
    }
}
