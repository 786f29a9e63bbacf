//! A submission's parameters (`gpu/arena.rs`): packed into arenas, a new
//! one where the open one is full, and uploaded alone where large; each
//! reaches the GPU whole, at the offset its binding names.

use flashport_core::gpu::testing::{params_round_trip, ARENA_BYTES};

use crate::require::gpu_present;

#[test]
fn parameters_reach_the_gpu_across_arenas() {
    if !gpu_present() {
        return;
    }
    let words = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| {
                (i ^ seed)
                    .wrapping_mul(2_654_435_761)
                    .rotate_left(seed % 32)
            })
            .collect()
    };
    let arena_words = (ARENA_BYTES / 4) as usize;
    // A uniform's size, odd sizes, one that nearly fills an arena (so the
    // next opens another), one larger than an arena (uploaded alone), and
    // enough in all for three arenas.
    let sizes = [
        24,
        1,
        3,
        arena_words / 3,
        arena_words / 2 + 5,
        24,
        arena_words * 2,
        7,
        arena_words / 4,
        arena_words / 4,
        arena_words / 4,
        24,
    ];
    let params: Vec<Vec<u32>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| words(n, i as u32 + 1))
        .collect();
    let back = params_round_trip(&params).unwrap();
    assert_eq!(back.len(), params.len());
    for (i, (got, want)) in back.iter().zip(&params).enumerate() {
        assert!(got == want, "parameter {i} ({} words) changed", want.len());
    }
}
