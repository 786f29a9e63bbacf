//! The two products of a decode tile, on the cache rows where they lie:
//! a tile is a list of the element offsets at which its keys' (or values')
//! rows start in the cache, so that a contiguous cache, a paged one and a
//! float16 one are read in place, each cached element once per block of
//! query rows, with no copy into a tile.
//!
//! Decoding reads each cached row once and computes little on it (four
//! query rows of a GQA group: 4·d multiply-adds per key and per value), so
//! its speed is that of memory. The hardware prefetchers lose the thread
//! of a walk that alternates between the keys and the values of a head
//! (and between blocks, when paged): without help the products waited on
//! memory half of the time (13 GB/s on the 2-core VM whose cores read 47).
//! So each kernel also prefetches the rows the next one of its kind will
//! read ([`Ahead`]), a few lines for each key it takes, and the requests
//! are in flight while it computes.
//!
//! Each output element is computed by the same operations in the same
//! order whatever the tile's length, the offsets (paged or contiguous) or
//! how many keys or rows a step handles, so the bits depend on the
//! arguments only: a score is one dot product over the head dimension
//! (eight lanes of fused multiply-adds, then a fixed tree of additions,
//! then the tail in order); an output column sums its tile's terms in key
//! order from zero, then adds that to the accumulator.
//!
//! With AVX2, FMA and F16C ([`available`]) float32 problems run the
//! kernels below, which read float32, float16 and bfloat16 rows (widened
//! in registers); everything else (float64, CPUs without them) runs
//! [`portable`].

#![allow(unsafe_code)]
// Elsewhere only the portable kernels run.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_variables))]

use half::{bf16, f16};

use crate::cpu::element::Element;
use crate::cpu::kernels::{axpy, dot};

/// Query rows a kernel step holds in registers.
const ROWS: usize = 4;

/// An element type a cache holds: the compute type itself, or float16 or
/// bfloat16 widened to it.
pub trait CacheElement: Copy + Send + Sync + 'static {
    /// How the SIMD kernels widen it.
    const KIND: Kind;
    fn to<T: Element>(self) -> T;
}

/// The cache element types the SIMD kernels know.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    F32,
    F16,
    BF16,
    /// Read by the portable kernels only.
    Other,
}

impl CacheElement for f32 {
    const KIND: Kind = Kind::F32;
    #[inline(always)]
    fn to<T: Element>(self) -> T {
        T::from_f64(self as f64)
    }
}

impl CacheElement for f64 {
    const KIND: Kind = Kind::Other;
    #[inline(always)]
    fn to<T: Element>(self) -> T {
        T::from_f64(self)
    }
}

impl CacheElement for f16 {
    const KIND: Kind = Kind::F16;
    #[inline(always)]
    fn to<T: Element>(self) -> T {
        T::from_f64(self.into())
    }
}

impl CacheElement for bf16 {
    const KIND: Kind = Kind::BF16;
    #[inline(always)]
    fn to<T: Element>(self) -> T {
        T::from_f64(self.into())
    }
}

/// Whether the SIMD kernels run (AVX2, FMA and F16C, and the portable
/// override off).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static F16C: OnceLock<bool> = OnceLock::new();
        crate::cpu::simd::available() && *F16C.get_or_init(|| is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Cache rows a kernel prefetches while it computes, spread over its keys
/// (the rows past them at its end): the rows the next product of its kind
/// reads, so that they come from L2 instead of memory. A prefetch never
/// faults, so any offsets may be given.
#[derive(Clone, Copy)]
pub struct Ahead<'a> {
    base: *const u8,
    starts: &'a [usize],
    /// Bytes per element, and per row.
    element: usize,
    row: usize,
}

impl<'a> Ahead<'a> {
    /// Rows of `width` elements at `starts` of `cache`.
    pub fn new<E>(cache: &[E], starts: &'a [usize], width: usize) -> Self {
        let element = std::mem::size_of::<E>();
        Ahead {
            base: cache.as_ptr().cast(),
            starts,
            element,
            row: width * element,
        }
    }

    /// Nothing to prefetch.
    pub fn none() -> Self {
        Ahead {
            base: std::ptr::null(),
            starts: &[],
            element: 0,
            row: 0,
        }
    }
}

/// Prefetches every row of `ahead` into L2 at once.
pub fn prefetch(ahead: Ahead<'_>) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address.
    unsafe {
        simd::prefetch_rows(ahead, 0..ahead.starts.len())
    }
}

/// Panics unless every row `starts[j] .. starts[j] + width` lies in a
/// cache of `len` elements.
fn check_rows(starts: &[usize], width: usize, len: usize) {
    assert!(
        starts.iter().all(|&s| s + width <= len),
        "a cache row lies outside the cache"
    );
}

/// `out[r * ld + j] = q[r] · cache[starts[j] ..][.. d]` for the `rows`
/// query rows of `q` (`rows × d`) and the keys of `starts`: the scores of
/// a tile (the scale is in `q`).
pub fn scores<E: CacheElement>(
    q: &[f32],
    (rows, d): (usize, usize),
    cache: &[E],
    starts: &[usize],
    out: &mut [f32],
    ld: usize,
    ahead: Ahead<'_>,
) {
    let n = starts.len();
    if rows == 0 || n == 0 {
        return;
    }
    assert!(available() && E::KIND != Kind::Other);
    assert!(q.len() >= rows * d && n <= ld && out.len() >= (rows - 1) * ld + n);
    check_rows(starts, d, cache.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the kernels' features, and every access is in
    // bounds (both checked above).
    unsafe {
        simd::scores(
            q.as_ptr(),
            rows,
            d,
            cache.as_ptr(),
            starts,
            out.as_mut_ptr(),
            ld,
            ahead,
        );
    }
}

/// `acc[r * dv + c] += Σ_j p[r * ldp + j] · cache[starts[j] + c]` for the
/// `rows` rows of `acc` (`rows × dv`) and the values of `starts`: a tile's
/// probabilities times its values, added to the output accumulator.
pub fn accumulate<E: CacheElement>(
    p: &[f32],
    ldp: usize,
    cache: &[E],
    starts: &[usize],
    acc: &mut [f32],
    (rows, dv): (usize, usize),
    ahead: Ahead<'_>,
) {
    let n = starts.len();
    if rows == 0 || n == 0 || dv == 0 {
        return;
    }
    assert!(available() && E::KIND != Kind::Other);
    assert!(n <= ldp && p.len() >= (rows - 1) * ldp + n && acc.len() >= rows * dv);
    check_rows(starts, dv, cache.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `scores`.
    unsafe {
        simd::accumulate(
            p.as_ptr(),
            ldp,
            cache.as_ptr(),
            starts,
            acc.as_mut_ptr(),
            rows,
            dv,
            ahead,
        );
    }
}

/// The same two products for any compute type, row by row: what float64
/// problems and CPUs without the SIMD kernels run. `scratch` holds a row
/// (a float16 or bfloat16 row is widened there).
pub mod portable {
    use super::*;

    /// A cache row in the compute type: the row itself, or widened into
    /// `scratch`.
    #[inline]
    fn row<'a, T: Element, E: CacheElement>(
        cache: &'a [E],
        start: usize,
        width: usize,
        scratch: &'a mut [T],
    ) -> &'a [T] {
        let src = &cache[start..start + width];
        if std::any::TypeId::of::<E>() == std::any::TypeId::of::<T>() {
            // SAFETY: E is T.
            return unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<T>(), width) };
        }
        let dst = &mut scratch[..width];
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to();
        }
        dst
    }

    /// [`super::scores`] in the compute type.
    pub fn scores<T: Element, E: CacheElement>(
        q: &[T],
        (rows, d): (usize, usize),
        cache: &[E],
        starts: &[usize],
        out: &mut [T],
        ld: usize,
        scratch: &mut [T],
    ) {
        for (j, &start) in starts.iter().enumerate() {
            let k = row(cache, start, d, scratch);
            for r in 0..rows {
                out[r * ld + j] = if d == 0 {
                    T::ZERO
                } else {
                    dot(&q[r * d..(r + 1) * d], k)
                };
            }
        }
    }

    /// [`super::accumulate`] in the compute type.
    pub fn accumulate<T: Element, E: CacheElement>(
        p: &[T],
        ldp: usize,
        cache: &[E],
        starts: &[usize],
        acc: &mut [T],
        (rows, dv): (usize, usize),
        scratch: &mut [T],
    ) {
        for (j, &start) in starts.iter().enumerate() {
            let v = row(cache, start, dv, scratch);
            for r in 0..rows {
                axpy(&mut acc[r * dv..(r + 1) * dv], p[r * ldp + j], v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Ahead, CacheElement, Kind, ROWS};

    /// Prefetches lines `lines` (of 64 bytes) of row `j` of `ahead`, if
    /// it exists, into L2.
    #[inline(always)]
    unsafe fn prefetch_lines(ahead: Ahead<'_>, j: usize, lines: std::ops::Range<usize>) {
        if let Some(&start) = ahead.starts.get(j) {
            let row = ahead.base.wrapping_add(start * ahead.element);
            for line in lines {
                _mm_prefetch::<_MM_HINT_T1>(row.wrapping_add(line * 64).cast());
            }
        }
    }

    /// Prefetches rows `range` of `ahead` (those that exist) into L2.
    #[inline(always)]
    pub unsafe fn prefetch_rows(ahead: Ahead<'_>, range: std::ops::Range<usize>) {
        let lines = ahead.row.div_ceil(64);
        for j in range {
            prefetch_lines(ahead, j, 0..lines);
        }
    }

    /// Eight elements of a cache row from `p`, as float32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8<E: CacheElement>(p: *const E) -> __m256 {
        match E::KIND {
            Kind::F32 => _mm256_loadu_ps(p.cast()),
            Kind::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            // bfloat16 is the high half of a float32.
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p.cast()),
            ))),
        }
    }

    #[inline(always)]
    fn scalar<E: CacheElement>(x: E) -> f32 {
        x.to::<f32>()
    }

    /// The sums of the lanes of `a[0..R]` (R ≤ 4, the rest taken as 0):
    /// lane `r` of the result is `((a0 + a1) + (a2 + a3)) + ((a4 + a5) +
    /// (a6 + a7))` of `a[r]`, whatever the other vectors are.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn sums<const R: usize>(a: [__m256; R]) -> __m128 {
        let at = |r: usize| if r < R { a[r] } else { _mm256_setzero_ps() };
        let h = _mm256_hadd_ps(_mm256_hadd_ps(at(0), at(1)), _mm256_hadd_ps(at(2), at(3)));
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scores<E: CacheElement>(
        q: *const f32,
        rows: usize,
        d: usize,
        cache: *const E,
        starts: &[usize],
        out: *mut f32,
        ld: usize,
        ahead: Ahead<'_>,
    ) {
        let mut r = 0;
        while r < rows {
            let (q, out) = (q.add(r * d), out.add(r * ld));
            // The first row block prefetches.
            let ahead = if r == 0 { ahead } else { Ahead::none() };
            match (rows - r).min(ROWS) {
                4 => scores_rows::<E, 4>(q, d, cache, starts, out, ld, ahead),
                3 => scores_rows::<E, 3>(q, d, cache, starts, out, ld, ahead),
                2 => scores_rows::<E, 2>(q, d, cache, starts, out, ld, ahead),
                _ => scores_rows::<E, 1>(q, d, cache, starts, out, ld, ahead),
            }
            r += ROWS;
        }
        // The rows ahead past those the keys' steps took.
        let step = keys_per_step(rows.min(ROWS));
        prefetch_rows(
            ahead,
            starts.len().next_multiple_of(step)..ahead.starts.len(),
        );
    }

    /// The scores of `R` query rows, [`keys_per_step`] keys at a time (each key its
    /// own `R` accumulators, so a key's sums do not depend on the others).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline(never)]
    unsafe fn scores_rows<E: CacheElement, const R: usize>(
        q: *const f32,
        d: usize,
        cache: *const E,
        starts: &[usize],
        out: *mut f32,
        ld: usize,
        ahead: Ahead<'_>,
    ) {
        let n = starts.len();
        let mut j = 0;
        while j < n {
            let step = keys_per_step(R);
            prefetch_rows(ahead, j..j + step);
            let k = |i: usize| cache.add(starts[(j + i).min(n - 1)]);
            let out = out.add(j);
            match (n - j).min(step) {
                1 => score_keys::<E, R, 1>(q, d, [k(0)], out, ld),
                2 => score_keys::<E, R, 2>(q, d, [k(0), k(1)], out, ld),
                3 => score_keys::<E, R, 3>(q, d, [k(0), k(1), k(2)], out, ld),
                4 => score_keys::<E, R, 4>(q, d, std::array::from_fn(k), out, ld),
                5 => score_keys::<E, R, 5>(q, d, std::array::from_fn(k), out, ld),
                _ => score_keys::<E, R, 6>(q, d, std::array::from_fn(k), out, ld),
            }
            j += step;
        }
    }

    /// Keys the score kernel takes at a time for `rows` rows: enough
    /// independent sums (`rows` per key) to cover the latency of the fused
    /// multiply-add, within the 16 registers.
    pub const fn keys_per_step(rows: usize) -> usize {
        match rows {
            1 => 6,
            2 => 4,
            _ => 3,
        }
    }

    /// The scores of `R` rows and `K` keys, `R·K` accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    unsafe fn score_keys<E: CacheElement, const R: usize, const K: usize>(
        q: *const f32,
        d: usize,
        k: [*const E; K],
        out: *mut f32,
        ld: usize,
    ) {
        let mut a = [[_mm256_setzero_ps(); R]; K];
        let mut p = 0;
        while p + 8 <= d {
            let x: [__m256; K] = std::array::from_fn(|i| load8(k[i].add(p)));
            for r in 0..R {
                let qv = _mm256_loadu_ps(q.add(r * d + p));
                for i in 0..K {
                    a[i][r] = _mm256_fmadd_ps(qv, x[i], a[i][r]);
                }
            }
            p += 8;
        }
        // Reduced in registers, all keys before any store: reduced and
        // stored key by key, the accumulators went through the stack.
        let totals: [__m128; K] = std::array::from_fn(|i| sums(a[i]));
        if d % 8 == 0 {
            for (i, &total) in totals.iter().enumerate() {
                let mut lanes = [0.0f32; 4];
                _mm_storeu_ps(lanes.as_mut_ptr(), total);
                for (r, &lane) in lanes.iter().enumerate().take(R) {
                    *out.add(r * ld + i) = lane;
                }
            }
        } else {
            for (i, &total) in totals.iter().enumerate() {
                finish_scores::<E, R>(total, q, d, k[i], out.add(i), ld);
            }
        }
    }

    /// Stores a key's `R` scores: the lane sums, then the head dimension's
    /// tail past the last multiple of 8, in order.
    #[inline(always)]
    unsafe fn finish_scores<E: CacheElement, const R: usize>(
        total: __m128,
        q: *const f32,
        d: usize,
        k: *const E,
        out: *mut f32,
        ld: usize,
    ) {
        let mut sums = [0.0f32; 4];
        _mm_storeu_ps(sums.as_mut_ptr(), total);
        for (r, &sum) in sums.iter().enumerate().take(R) {
            let mut s = sum;
            for p in d / 8 * 8..d {
                s = (*q.add(r * d + p)).mul_add(scalar(*k.add(p)), s);
            }
            *out.add(r * ld) = s;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn accumulate<E: CacheElement>(
        p: *const f32,
        ldp: usize,
        cache: *const E,
        starts: &[usize],
        acc: *mut f32,
        rows: usize,
        dv: usize,
        ahead: Ahead<'_>,
    ) {
        let mut r = 0;
        while r < rows {
            let (p, acc) = (p.add(r * ldp), acc.add(r * dv));
            let ahead = if r == 0 { ahead } else { Ahead::none() };
            match (rows - r).min(ROWS) {
                4 => accumulate_rows::<E, 4>(p, ldp, cache, starts, acc, dv, ahead),
                3 => accumulate_rows::<E, 3>(p, ldp, cache, starts, acc, dv, ahead),
                2 => accumulate_rows::<E, 2>(p, ldp, cache, starts, acc, dv, ahead),
                _ => accumulate_rows::<E, 1>(p, ldp, cache, starts, acc, dv, ahead),
            }
            r += ROWS;
        }
        // The rows ahead past those the passes over the keys took (all of
        // them when there is no pass of 16 columns).
        let taken = if dv >= 16 { starts.len() } else { 0 };
        prefetch_rows(ahead, taken..ahead.starts.len());
    }

    /// Vectors of 8 columns per pass for `rows` rows: as many as the
    /// registers hold beside one value vector each and a broadcast (16 in
    /// all), so that the passes' independent sums cover the latency of
    /// the fused multiply-add.
    const fn widest(rows: usize) -> usize {
        match rows {
            1 => 6,
            2 => 4,
            3 => 3,
            // Three (twelve sums) ran 45% slower than two: LLVM spilled.
            _ => 2,
        }
    }

    /// The widths, in vectors of 8 columns, of the passes over `vectors`
    /// vectors for `rows` rows: the widest, except that a remainder of one
    /// more than that is halved instead of leaving one vector alone.
    fn passes(vectors: usize, rows: usize) -> impl Iterator<Item = usize> {
        let widest = widest(rows);
        let mut left = vectors;
        std::iter::from_fn(move || {
            let v = match left {
                0 => return None,
                l if l == widest + 1 => l.div_ceil(2),
                l => l.min(widest),
            };
            left -= v;
            Some(v)
        })
    }

    /// `R` rows of the accumulator in passes over the tile's keys, each of
    /// a few vectors of 8 columns held in registers ([`passes`]), then the
    /// columns past the last multiple of 8 one by one; each column's terms
    /// summed in key order from zero and added to the accumulator.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline(never)]
    unsafe fn accumulate_rows<E: CacheElement, const R: usize>(
        p: *const f32,
        ldp: usize,
        cache: *const E,
        starts: &[usize],
        acc: *mut f32,
        dv: usize,
        ahead: Ahead<'_>,
    ) {
        // Each pass prefetches its share of the lines of each row ahead,
        // so that the requests are spread over the whole product.
        let count = passes(dv / 8, R).count();
        let lines = ahead.row.div_ceil(64);
        let mut c = 0;
        for (i, v) in passes(dv / 8, R).enumerate() {
            let share = i * lines / count..(i + 1) * lines / count;
            let pass = Pass {
                p,
                ldp,
                cache: cache.add(c),
                starts,
                acc: acc.add(c),
                dv,
                ahead,
                share,
            };
            match v {
                1 => pass.run::<R, 1>(),
                2 => pass.run::<R, 2>(),
                3 => pass.run::<R, 3>(),
                4 => pass.run::<R, 4>(),
                5 => pass.run::<R, 5>(),
                _ => pass.run::<R, 6>(),
            }
            c += 8 * v;
        }
        for c in c..dv {
            for r in 0..R {
                let mut s = 0.0f32;
                for (j, &start) in starts.iter().enumerate() {
                    s = (*p.add(r * ldp + j)).mul_add(scalar(*cache.add(start + c)), s);
                }
                *acc.add(r * dv + c) += s;
            }
        }
    }

    /// One pass of [`accumulate_rows`]: its first column's place in the
    /// values (`cache` already offset) and the accumulator (`acc`).
    struct Pass<'a, E> {
        p: *const f32,
        ldp: usize,
        cache: *const E,
        starts: &'a [usize],
        acc: *mut f32,
        dv: usize,
        ahead: Ahead<'a>,
        share: std::ops::Range<usize>,
    }

    impl<E: CacheElement> Pass<'_, E> {
        /// `R` rows × `V` vectors.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline(never)]
        unsafe fn run<const R: usize, const V: usize>(&self) {
            let mut a = [[_mm256_setzero_ps(); V]; R];
            for (j, &start) in self.starts.iter().enumerate() {
                prefetch_lines(self.ahead, j, self.share.clone());
                let row = self.cache.add(start);
                let v: [__m256; V] = std::array::from_fn(|h| load8(row.add(8 * h)));
                for (r, a_r) in a.iter_mut().enumerate() {
                    let w = _mm256_broadcast_ss(&*self.p.add(r * self.ldp + j));
                    for h in 0..V {
                        a_r[h] = _mm256_fmadd_ps(w, v[h], a_r[h]);
                    }
                }
            }
            for (r, a_r) in a.iter().enumerate() {
                for (h, &a_h) in a_r.iter().enumerate() {
                    let dst = self.acc.add(r * self.dv + 8 * h);
                    _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), a_h));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(len: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// A pool of `rows` rows of `width` values in a scattered order with
    /// gaps (NaN, never read), and where each row starts.
    fn scattered(rows: usize, width: usize, seed: u32) -> (Vec<f32>, Vec<usize>) {
        let values = filled(rows * width, seed);
        let slots = 2 * rows + 1;
        let mut pool = vec![f32::NAN; slots * width];
        let mut order: Vec<usize> = (0..slots).collect();
        order.sort_by_key(|&i| (i as u32 ^ seed).wrapping_mul(2654435761));
        let starts: Vec<usize> = order[..rows].iter().map(|&slot| slot * width).collect();
        for (j, &start) in starts.iter().enumerate() {
            pool[start..start + width].copy_from_slice(&values[j * width..(j + 1) * width]);
        }
        (pool, starts)
    }

    const SHAPES: [(usize, usize, usize); 9] = [
        (1, 1, 1),
        (4, 128, 64),
        (5, 13, 7),
        (3, 8, 2),
        (9, 64, 33),
        (2, 40, 3),
        (4, 24, 4),
        (8, 17, 5),
        (1, 130, 64),
    ];

    #[test]
    fn kernels_compute_the_products() {
        for &(rows, d, n) in &SHAPES {
            let (pool, starts) = scattered(n, d, 1);
            let q = filled(rows * d, 2);
            let p = filled(rows * n, 3);
            let acc0 = filled(rows * d, 4);
            let key = |j: usize| &pool[starts[j]..starts[j] + d];
            let want_scores: Vec<f64> = (0..rows * n)
                .map(|i| {
                    let (r, j) = (i / n, i % n);
                    (0..d).map(|c| q[r * d + c] as f64 * key(j)[c] as f64).sum()
                })
                .collect();
            let want_acc: Vec<f64> = (0..rows * d)
                .map(|i| {
                    let (r, c) = (i / d, i % d);
                    let terms: f64 = (0..n).map(|j| p[r * n + j] as f64 * key(j)[c] as f64).sum();
                    acc0[i] as f64 + terms
                })
                .collect();
            let close = |got: &[f32], want: &[f64], what: &str| {
                for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                    let tol = 1e-5 * (1.0 + w.abs()) * (d.max(n) as f64).sqrt();
                    assert!(
                        (g as f64 - w).abs() <= tol,
                        "{what} {rows}x{d}x{n} at {i}: {g} {w}"
                    );
                }
            };
            let mut scratch = vec![0.0f32; d];
            let mut out = vec![f32::NAN; rows * n];
            portable::scores(&q, (rows, d), &pool, &starts, &mut out, n, &mut scratch);
            close(&out, &want_scores, "portable scores");
            let mut acc = acc0.clone();
            portable::accumulate(&p, n, &pool, &starts, &mut acc, (rows, d), &mut scratch);
            close(&acc, &want_acc, "portable accumulate");
            if !available() {
                continue;
            }
            let mut out = vec![f32::NAN; rows * n];
            scores(&q, (rows, d), &pool, &starts, &mut out, n, Ahead::none());
            close(&out, &want_scores, "scores");
            let mut acc = acc0.clone();
            let ahead = Ahead::new(&pool, &starts, d);
            accumulate(&p, n, &pool, &starts, &mut acc, (rows, d), ahead);
            close(&acc, &want_acc, "accumulate");
        }
    }

    /// The bits of a score or an accumulated column depend on its own
    /// row, key and values only: not on where the rows lie (paged or
    /// contiguous), nor on the other rows and keys of the call.
    #[test]
    fn bits_do_not_depend_on_the_layout_or_the_neighbours() {
        if !available() {
            return;
        }
        for &(rows, d, n) in &SHAPES {
            let (pool, starts) = scattered(n, d, 5);
            let contiguous: Vec<f32> = starts
                .iter()
                .flat_map(|&s| pool[s..s + d].iter().copied())
                .collect();
            let in_order: Vec<usize> = (0..n).map(|j| j * d).collect();
            let q = filled(rows * d, 6);
            let p = filled(rows * n, 7);
            let acc0 = filled(rows * d, 8);
            let mut a = vec![0.0f32; rows * n];
            let mut b = vec![0.0f32; rows * n];
            scores(&q, (rows, d), &pool, &starts, &mut a, n, Ahead::none());
            scores(
                &q,
                (rows, d),
                &contiguous,
                &in_order,
                &mut b,
                n,
                Ahead::none(),
            );
            assert_eq!(a, b, "{rows}x{d}x{n}");
            // Each row alone, and the keys in two calls.
            let cut = n / 2;
            for r in 0..rows {
                let row = &q[r * d..(r + 1) * d];
                let mut one = vec![0.0f32; n];
                scores(
                    row,
                    (1, d),
                    &pool,
                    &starts[..cut],
                    &mut one,
                    n,
                    Ahead::none(),
                );
                scores(
                    row,
                    (1, d),
                    &pool,
                    &starts[cut..],
                    &mut one[cut..],
                    n,
                    Ahead::none(),
                );
                assert_eq!(one, a[r * n..(r + 1) * n], "{rows}x{d}x{n} row {r}");
            }
            let (mut a, mut b) = (acc0.clone(), acc0.clone());
            accumulate(&p, n, &pool, &starts, &mut a, (rows, d), Ahead::none());
            accumulate(
                &p,
                n,
                &contiguous,
                &in_order,
                &mut b,
                (rows, d),
                Ahead::none(),
            );
            assert_eq!(a, b, "{rows}x{d}x{n}");
            for r in 0..rows {
                let mut one = acc0[r * d..(r + 1) * d].to_vec();
                let probabilities = &p[r * n..(r + 1) * n];
                accumulate(
                    probabilities,
                    n,
                    &pool,
                    &starts,
                    &mut one,
                    (1, d),
                    Ahead::none(),
                );
                assert_eq!(one, a[r * d..(r + 1) * d], "{rows}x{d}x{n} row {r}");
            }
        }
    }

    /// A float16 or bfloat16 cache gives the bits of the float32 cache of
    /// its values.
    #[test]
    fn half_caches_read_as_their_values() {
        if !available() {
            return;
        }
        for &(rows, d, n) in &SHAPES {
            let (pool, starts) = scattered(n, d, 9);
            let halves: Vec<f16> = pool.iter().map(|&x| f16::from_f32(x)).collect();
            let brains: Vec<bf16> = pool.iter().map(|&x| bf16::from_f32(x)).collect();
            let widened = [
                halves.iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
                brains.iter().map(|x| x.to_f32()).collect(),
            ];
            let q = filled(rows * d, 10);
            let p = filled(rows * n, 11);
            let mut got = [vec![0.0f32; rows * n], vec![0.0f32; rows * n]];
            scores(
                &q,
                (rows, d),
                &halves,
                &starts,
                &mut got[0],
                n,
                Ahead::none(),
            );
            scores(
                &q,
                (rows, d),
                &brains,
                &starts,
                &mut got[1],
                n,
                Ahead::none(),
            );
            for (got, wide) in got.iter().zip(&widened) {
                let mut want = vec![0.0f32; rows * n];
                scores(&q, (rows, d), wide, &starts, &mut want, n, Ahead::none());
                assert_eq!(*got, want, "{rows}x{d}x{n}");
            }
            let mut got = [vec![0.0f32; rows * d], vec![0.0f32; rows * d]];
            accumulate(
                &p,
                n,
                &halves,
                &starts,
                &mut got[0],
                (rows, d),
                Ahead::none(),
            );
            accumulate(
                &p,
                n,
                &brains,
                &starts,
                &mut got[1],
                (rows, d),
                Ahead::none(),
            );
            for (got, wide) in got.iter().zip(&widened) {
                let mut want = vec![0.0f32; rows * d];
                accumulate(&p, n, wide, &starts, &mut want, (rows, d), Ahead::none());
                assert_eq!(*got, want, "{rows}x{d}x{n}");
            }
        }
    }
}
