//! AVX2 + FMA tile kernels for float32, chosen at run time when the CPU has
//! them (every x86-64 CPU since Haswell / Zen 1). Other machines run the
//! portable kernels in `kernels.rs`, which compute the same function.
//!
//! The products of a tile step are all `C += A·B` with B row-major (its rows
//! contiguous along the output columns): A's elements are broadcast and B's
//! rows streamed, a register block of 6 rows × 16 columns of C held in twelve
//! ymm registers across the whole depth loop, BLIS style.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether these kernels run: the CPU has AVX2 and FMA (checked once),
/// and the overrides do not ask for the portable kernels (what a CPU
/// without them runs, tested on one that has them).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    let cpu = *AVAILABLE
        .get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    cpu && !crate::overrides::current().portable_cpu
}

/// A strided view of the left operand: element (row `i`, depth `p`) is at
/// `data[i * row_stride + p * depth_stride]`, so that `A` and `Aᵀ` of a
/// row-major matrix are both expressible without copying.
#[derive(Clone, Copy)]
pub struct Lhs<'a> {
    pub data: &'a [f32],
    pub row_stride: usize,
    pub depth_stride: usize,
}

/// Rows of C per micro-kernel call.
const MR: usize = 6;
/// Columns of a packed panel of B: two ymm registers.
pub const PANEL: usize = 16;

/// The right operand of [`gemm`].
#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    /// Element `(p, j)` at `data[p * ld + j]`.
    RowMajor { data: &'a [f32], ld: usize },
    /// Packed in panels of [`PANEL`] columns: element `(p, j)` at
    /// `data[(j / PANEL) * panel_stride + p * PANEL + j % PANEL]`, the last
    /// panel padded with zeros. The rows of one panel are contiguous, so
    /// it sits in L1 without the set conflicts that a large row stride (a
    /// transposed key matrix has a stride of seq_k; a value matrix one of
    /// 256 or 512 bytes) would cause.
    Panels {
        data: &'a [f32],
        panel_stride: usize,
    },
}

/// Size of `cols` columns of depth `k` packed as [`Rhs::Panels`].
pub fn panels_len(k: usize, cols: usize) -> usize {
    cols.div_ceil(PANEL) * PANEL * k
}

/// Packs the transpose of `src` (`rows × k`, row-major) as [`Rhs::Panels`]
/// of depth `k` and `rows` columns into `dst` (`panels_len(k, rows)`).
pub fn pack_transposed_panels(src: &[f32], rows: usize, k: usize, dst: &mut [f32]) {
    let dst = &mut dst[..panels_len(k, rows)];
    for (panel, block) in dst.chunks_exact_mut(PANEL * k).enumerate() {
        let first = panel * PANEL;
        let width = PANEL.min(rows - first);
        if width == PANEL && available() {
            // SAFETY: AVX2 is present (checked); the panel's 16 source rows
            // and its `k × 16` destination are in bounds (sliced here).
            unsafe { transpose_panel_avx2(&src[first * k..(first + PANEL) * k], k, block) };
            continue;
        }
        for p in 0..k {
            let out = &mut block[p * PANEL..(p + 1) * PANEL];
            for (c, slot) in out.iter_mut().enumerate() {
                *slot = if c < width {
                    src[(first + c) * k + p]
                } else {
                    0.0
                };
            }
        }
    }
}

/// Transposes 16 rows of `k` floats (`src`) into `k` rows of 16 (`dst`),
/// eight by eight in registers: the packing of every key of a call runs
/// once per call, and element by element it cost as much as a small
/// causal problem's softmax.
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_panel_avx2(src: &[f32], k: usize, dst: &mut [f32]) {
    debug_assert!(src.len() >= PANEL * k && dst.len() >= PANEL * k);
    let k8 = k / 8 * 8;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for half in 0..2 {
        let rows = s.add(half * 8 * k);
        for p0 in (0..k8).step_by(8) {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(rows.add(i * k + p0)));
            for (j, column) in transpose8(r).into_iter().enumerate() {
                _mm256_storeu_ps(d.add((p0 + j) * PANEL + half * 8), column);
            }
        }
        for p in k8..k {
            for i in 0..8 {
                *d.add(p * PANEL + half * 8 + i) = *rows.add(i * k + p);
            }
        }
    }
}

/// The transpose of an 8 × 8 block held as eight rows.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// Packs `src` (`rows × cols`, row-major) as [`Rhs::Panels`] of depth
/// `rows` and `cols` columns, with a panel stride of `rows * PANEL`, into
/// `dst` (`panels_len(rows, cols)`).
pub fn pack_panels(src: &[f32], rows: usize, cols: usize, dst: &mut [f32]) {
    let dst = &mut dst[..panels_len(rows, cols)];
    for (panel, block) in dst.chunks_exact_mut(PANEL * rows).enumerate() {
        let first = panel * PANEL;
        let width = PANEL.min(cols - first);
        for (r, out) in block.chunks_exact_mut(PANEL).enumerate() {
            let line = &src[r * cols + first..r * cols + first + width];
            // A whole panel row as one fixed-size copy (two vector moves,
            // where a slice copy of run-time length is a call).
            let whole = (
                <&mut [f32; PANEL]>::try_from(&mut *out),
                <&[f32; PANEL]>::try_from(line),
            );
            if let (Ok(out), Ok(line)) = whole {
                *out = *line;
                continue;
            }
            out[..width].copy_from_slice(line);
            out[width..].fill(0.0);
        }
    }
}

/// `C (+)= A·B` for `m × n` C with row stride `ldc`, depth `k`: added to C
/// when `accumulate`, else written over it.
///
/// # Panics
/// If a slice is too short for the shape (checked once, up front, so the
/// unchecked accesses inside are in bounds), or for panels that do not
/// start at a panel boundary.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: Rhs<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * ldc + n <= c.len(), "output too short");
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                c[row * ldc..row * ldc + n].fill(0.0);
            }
        }
        return;
    }
    check_operands(m, n, k, &a, &b);
    // SAFETY: the CPU has AVX2 and FMA, and every access below stays
    // within the bounds (both checked above).
    unsafe {
        gemm_avx2(
            m,
            n,
            k,
            a,
            b,
            c.as_mut_ptr(),
            ldc,
            accumulate,
            std::ptr::null_mut(),
        )
    }
}

/// The checks of [`gemm`] on its inputs, for `m, n, k > 0`.
fn check_operands(m: usize, n: usize, k: usize, a: &Lhs<'_>, b: &Rhs<'_>) {
    let a_last = (m - 1) * a.row_stride + (k - 1) * a.depth_stride;
    assert!(a_last < a.data.len(), "lhs too short");
    match *b {
        Rhs::RowMajor { data, ld } => assert!((k - 1) * ld + n <= data.len(), "rhs too short"),
        Rhs::Panels { data, panel_stride } => assert!(
            (n - 1) / PANEL * panel_stride + k * PANEL <= data.len(),
            "rhs too short"
        ),
    }
    assert!(available(), "AVX2/FMA kernel called on a CPU without them");
}

/// `C = A·B` ([`gemm`] without accumulation) that also sets `row_max[i]`
/// to the largest element of row `i` of C, taken from the registers as
/// each block is stored instead of in a pass over C afterwards. `lanes`
/// (at least `8 m`) holds each row's running maximum per vector lane.
#[allow(clippy::too_many_arguments)]
pub fn gemm_row_max(
    m: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: Rhs<'_>,
    c: &mut [f32],
    ldc: usize,
    row_max: &mut [f32],
    lanes: &mut [f32],
) {
    let (row_max, lanes) = (&mut row_max[..m], &mut lanes[..8 * m]);
    if m == 0 || n == 0 || k == 0 {
        gemm(m, n, k, a, b, c, ldc, false);
        row_max.fill(if n == 0 { f32::NEG_INFINITY } else { 0.0 });
        return;
    }
    assert!((m - 1) * ldc + n <= c.len(), "output too short");
    check_operands(m, n, k, &a, &b);
    lanes.fill(f32::NEG_INFINITY);
    // SAFETY: as in `gemm` (same checks, above), and `lanes` holds 8
    // floats for each of the `m` rows.
    unsafe {
        gemm_avx2(
            m,
            n,
            k,
            a,
            b,
            c.as_mut_ptr(),
            ldc,
            false,
            lanes.as_mut_ptr(),
        )
    };
    for (max, row) in row_max.iter_mut().zip(lanes.chunks_exact(8)) {
        *max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    }
}

#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_avx2(
    m: usize,
    n: usize,
    k: usize,
    a: Lhs<'_>,
    b: Rhs<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    row_max: *mut f32,
) {
    let op = Operands {
        a,
        c,
        ldc,
        k,
        accumulate,
        row_max,
    };
    // Column panels outside, row blocks inside: a panel of B (k × 16) stays
    // in L1 while every row block of A streams past it.
    let (b_ptr, b_step, panel_stride) = match b {
        Rhs::RowMajor { data, ld } => (data.as_ptr(), ld, PANEL),
        Rhs::Panels { data, panel_stride } => (data.as_ptr(), PANEL, panel_stride),
    };
    let row_major = matches!(b, Rhs::RowMajor { .. });
    let mut j = 0;
    let mut panel_index = 0;
    while j < n {
        let width = PANEL.min(n - j);
        let b_panel = b_ptr.add(panel_index * panel_stride);
        if width == PANEL || !row_major {
            // A padded last panel still computes 16 columns (its padding is
            // zeros) and stores only `width` of them.
            for_row_blocks(m, |i, rows| match rows {
                6 => panel::<6, 2>(&op, i, j, b_panel, b_step, width),
                5 => panel::<5, 2>(&op, i, j, b_panel, b_step, width),
                4 => panel::<4, 2>(&op, i, j, b_panel, b_step, width),
                3 => panel::<3, 2>(&op, i, j, b_panel, b_step, width),
                2 => panel::<2, 2>(&op, i, j, b_panel, b_step, width),
                _ => panel::<1, 2>(&op, i, j, b_panel, b_step, width),
            });
        } else {
            // A row-major tail cannot be read 16 wide: 8 wide, then scalars.
            let mut col = j;
            if width >= 8 {
                for_row_blocks(m, |i, rows| match rows {
                    6 => panel::<6, 1>(&op, i, col, b_panel, b_step, 8),
                    5 => panel::<5, 1>(&op, i, col, b_panel, b_step, 8),
                    4 => panel::<4, 1>(&op, i, col, b_panel, b_step, 8),
                    3 => panel::<3, 1>(&op, i, col, b_panel, b_step, 8),
                    2 => panel::<2, 1>(&op, i, col, b_panel, b_step, 8),
                    _ => panel::<1, 1>(&op, i, col, b_panel, b_step, 8),
                });
                col += 8;
            }
            for col in col..n {
                for i in 0..m {
                    let mut sum = 0.0f32;
                    for p in 0..k {
                        sum = op.a_at(i, p).mul_add(*b_ptr.add(p * b_step + col), sum);
                    }
                    let out = c.add(i * ldc + col);
                    *out = if accumulate { *out + sum } else { sum };
                    if !row_max.is_null() {
                        let lane = row_max.add(i * 8 + col % 8);
                        *lane = lane.read().max(sum);
                    }
                }
            }
        }
        j += width;
        panel_index += 1;
    }
}

struct Operands<'a> {
    a: Lhs<'a>,
    c: *mut f32,
    ldc: usize,
    k: usize,
    accumulate: bool,
    /// Null, or 8 lanes a row of C: each lane's running maximum over the
    /// columns stored so far.
    row_max: *mut f32,
}

impl Operands<'_> {
    #[inline(always)]
    unsafe fn a_at(&self, i: usize, p: usize) -> f32 {
        *self
            .a
            .data
            .as_ptr()
            .add(i * self.a.row_stride + p * self.a.depth_stride)
    }
}

/// Calls `f(first_row, rows)` for blocks of `MR` rows, then the remainder.
#[inline(always)]
fn for_row_blocks(m: usize, mut f: impl FnMut(usize, usize)) {
    let mut i = 0;
    while i < m {
        let rows = MR.min(m - i);
        f(i, rows);
        i += rows;
    }
}

/// The micro-kernel: rows `i0 .. i0 + R` × columns `j0 .. j0 + 8·V` of C
/// (of which the first `width` are stored), accumulated over the whole
/// depth in `R·V` ymm registers — 12 of the 16 at R = 6, V = 2: enough
/// independent FMA chains to cover their latency on two FMA ports. Row `p`
/// of the B panel starts at `b + p * b_step`.
#[target_feature(enable = "avx2,fma")]
// Kept out of line: inlined into the column loop, LLVM spilled the twelve
// accumulators to the stack inside the depth loop (half the speed).
#[inline(never)]
unsafe fn panel<const R: usize, const V: usize>(
    op: &Operands<'_>,
    i0: usize,
    j0: usize,
    b: *const f32,
    b_step: usize,
    width: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    let base = op.a.data.as_ptr().add(i0 * op.a.row_stride);
    let rows: [*const f32; R] = std::array::from_fn(|r| base.add(r * op.a.row_stride));
    let mut b_row = b;
    // Contiguous rows of A (the common case) get unit-stride addressing, so
    // the loop body is loads and FMAs, not index arithmetic.
    let step = op.a.depth_stride;
    for p in 0..op.k {
        let mut b = [_mm256_setzero_ps(); V];
        for (v, b_v) in b.iter_mut().enumerate() {
            *b_v = _mm256_loadu_ps(b_row.add(8 * v));
        }
        let offset = if step == 1 { p } else { p * step };
        for (row, acc_r) in rows.iter().zip(acc.iter_mut()) {
            let x = _mm256_broadcast_ss(&*row.add(offset));
            for v in 0..V {
                acc_r[v] = _mm256_fmadd_ps(x, b[v], acc_r[v]);
            }
        }
        b_row = b_row.add(b_step);
    }
    if width < 8 * V {
        return store_block(op, i0, j0, width, acc);
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let out = op.c.add((i0 + r) * op.ldc + j0);
        for (v, acc_v) in acc_r.iter().enumerate() {
            let dst = out.add(8 * v);
            let value = if op.accumulate {
                _mm256_add_ps(_mm256_loadu_ps(dst), *acc_v)
            } else {
                *acc_v
            };
            _mm256_storeu_ps(dst, value);
        }
        if !op.row_max.is_null() {
            let lanes = op.row_max.add((i0 + r) * 8);
            let mut max = _mm256_loadu_ps(lanes);
            for acc_v in acc_r {
                max = _mm256_max_ps(max, *acc_v);
            }
            _mm256_storeu_ps(lanes, max);
        }
    }
}

/// The epilogue of [`panel`] for a block narrower than its registers:
/// stores (or adds) the `width` columns and updates the row maxima from
/// them. Out of line and given the accumulators by value: in the same
/// function as the depth loop, these loops over them made LLVM keep all
/// twelve in memory throughout it (2.4 times slower).
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn store_block<const R: usize, const V: usize>(
    op: &Operands<'_>,
    i0: usize,
    j0: usize,
    width: usize,
    acc: [[__m256; V]; R],
) {
    if !op.row_max.is_null() {
        for (r, acc_r) in acc.iter().enumerate() {
            let lanes = op.row_max.add((i0 + r) * 8);
            if width == 8 * V {
                let mut max = _mm256_loadu_ps(lanes);
                for acc_v in acc_r {
                    max = _mm256_max_ps(max, *acc_v);
                }
                _mm256_storeu_ps(lanes, max);
            } else {
                // Padding columns (zeros) must not count.
                let mut spill = [0.0f32; 16];
                for (v, acc_v) in acc_r.iter().enumerate() {
                    _mm256_storeu_ps(spill.as_mut_ptr().add(8 * v), *acc_v);
                }
                for (col, &value) in spill.iter().take(width).enumerate() {
                    let lane = lanes.add(col % 8);
                    *lane = lane.read().max(value);
                }
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let out = op.c.add((i0 + r) * op.ldc + j0);
        if width == 8 * V {
            for (v, acc_v) in acc_r.iter().enumerate() {
                let dst = out.add(8 * v);
                let value = if op.accumulate {
                    _mm256_add_ps(_mm256_loadu_ps(dst), *acc_v)
                } else {
                    *acc_v
                };
                _mm256_storeu_ps(dst, value);
            }
        } else {
            let mut spill = [0.0f32; 16];
            for (v, acc_v) in acc_r.iter().enumerate() {
                _mm256_storeu_ps(spill.as_mut_ptr().add(8 * v), *acc_v);
            }
            for (col, &value) in spill.iter().take(width).enumerate() {
                let dst = out.add(col);
                *dst = if op.accumulate { *dst + value } else { value };
            }
        }
    }
}

/// `1.5 · 2^23 + 8 · 127`: adding it to `x·8·log2 e` (magnitude below
/// 2^11 after the clamps) rounds that to an integer `n`, held in the low
/// mantissa bits as `n + 8·127`: its low three bits are `n mod 8`, the
/// table index, and the bits above them `floor(n / 8) + 127`, the biased
/// exponent of `2^(n/8)`.
const SHIFTER: f32 = 12_583_928.0;
/// `8·log2(e)` split in two (eight times the float nearest `log2 e`, and
/// eight times the rest), so that `x·8·log2 e - n` is exact to a few units
/// in the last place of the reduced argument even for `|x|` near 88.
const LOG2E_X8_HI: f32 = 8.0 * std::f32::consts::LOG2_E;
const LOG2E_X8_LO: f32 = 8.0 * 1.925_963e-8;
/// `2^(j/8)` for `j = 0..8` (float32, rounded to nearest), as bits less
/// `j << 20` and the exponent bias `127 << 23`: adding the rounded bits of
/// `n + 8·127` shifted left by 20 (whose `j << 20` part is in the same
/// place, and whose higher bits fall off the top) then gives the bits of
/// `2^(n/8)` in one integer addition, with no mask and no multiply.
const EXP2_EIGHTHS_BITS: [i32; 8] = {
    const EXP2_EIGHTHS: [f32; 8] = [
        1.0,
        1.090_507_7,
        1.189_207_1,
        1.296_839_6,
        std::f32::consts::SQRT_2,
        1.542_210_8,
        1.681_792_8,
        1.834_008_1,
    ];
    let mut bits = [0i32; 8];
    let mut j = 0;
    while j < 8 {
        bits[j] = (EXP2_EIGHTHS[j].to_bits() as i32)
            .wrapping_sub((j as i32) << 20)
            .wrapping_sub(127 << 23);
        j += 1;
    }
    bits
};
/// `2^(r/8) = 1 + r·(c1 + c2·r + c3·r²)` on `|r| <= 1/2`: minimax for the
/// relative error (2.9e-8 with these float32 coefficients, a quarter of an
/// ulp), the constant term 1 so that `exp(0)` is exactly 1.
const EXP2_EIGHTH_POLY: [f32; 3] = [8.664_341e-2, 3.754_025_6e-3, 1.083_910_5e-4];

/// `exp(x)` for 8 lanes as `2^(n/8) · 2^(r/8)`, `n` the nearest integer to
/// `x·8·log2 e` and `|r| <= 1/2`: `2^(n/8)` from a table of the eight
/// fractions `2^(j/8)` plus the rounding addition's bits (see [`SHIFTER`],
/// [`EXP2_EIGHTHS_BITS`]), `2^(r/8)` from a cubic. 13 vector operations,
/// 8 of them on the FMA pipes; the degree-6 polynomial over `|f| <= 1/2`
/// that this replaced took 15 and 10, and the softmax pass (the forward's
/// largest cost after its two products) 15-21% longer.
///
/// Within 1.2 ulp where the result is a normal float (the test sweeps
/// -88 ..= 88). `-inf` (a masked score) and anything at or below -88 give
/// exactly 0 (the clamp makes `n + 8·127 = 0`: every bit cancels); between
/// -88 and about -87.3, where `e^x` is below the smallest normal float, the
/// result is zero or a subnormal off by less than that. NaN stays NaN.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    exp8xn([x])[0]
}

/// [`exp8`] of `N` vectors, each step applied to all of them before the
/// next: one exponential is a chain of ten dependent operations (~35
/// cycles), and written one vector at a time the out-of-order window held
/// too few chains to keep the pipes busy.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8xn<const N: usize>(x: [__m256; N]) -> [__m256; N] {
    // The constant first: `min`/`max` return their second operand when
    // either is NaN. The clamps keep `n + 8·127` in 0 .. 2^11, the bits
    // the table addition assumes.
    let x = x.map(|x| _mm256_min_ps(_mm256_set1_ps(88.0), x));
    let x = x.map(|x| _mm256_max_ps(_mm256_set1_ps(-88.0), x));
    let hi = _mm256_set1_ps(LOG2E_X8_HI);
    let t = x.map(|x| _mm256_fmadd_ps(x, hi, _mm256_set1_ps(SHIFTER)));
    let n = t.map(|t| _mm256_sub_ps(t, _mm256_set1_ps(SHIFTER)));
    let r: [__m256; N] = std::array::from_fn(|i| _mm256_fmsub_ps(x[i], hi, n[i]));
    let r: [__m256; N] =
        std::array::from_fn(|i| _mm256_fmadd_ps(x[i], _mm256_set1_ps(LOG2E_X8_LO), r[i]));
    let table = _mm256_loadu_si256(EXP2_EIGHTHS_BITS.as_ptr().cast());
    // `vpermd` reads the low three bits of each index lane: `n mod 8`.
    let scale = t.map(|t| {
        let bits = _mm256_castps_si256(t);
        let fraction = _mm256_permutevar8x32_epi32(table, bits);
        _mm256_castsi256_ps(_mm256_add_epi32(fraction, _mm256_slli_epi32::<20>(bits)))
    });
    let [c1, c2, c3] = EXP2_EIGHTH_POLY.map(|c| _mm256_set1_ps(c));
    let q = r.map(|r| _mm256_fmadd_ps(_mm256_fmadd_ps(c3, r, c2), r, c1));
    // scale + (scale·r)·q: the multiply runs beside the polynomial.
    std::array::from_fn(|i| _mm256_fmadd_ps(_mm256_mul_ps(scale[i], r[i]), q[i], scale[i]))
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hmax(v: __m256) -> f32 {
    let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// The largest element (`-inf` for an empty or fully masked row).
pub fn row_max(x: &[f32]) -> f32 {
    assert!(available());
    // SAFETY: AVX2 is present (asserted); loads stay inside `x`.
    unsafe { row_max_avx2(x) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn row_max_avx2(x: &[f32]) -> f32 {
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        acc = _mm256_max_ps(acc, _mm256_loadu_ps(chunk.as_ptr()));
    }
    tail.iter().fold(hmax(acc), |m, &v| m.max(v))
}

/// `x[i] = exp(x[i] - shift)` (`shift` finite); returns the sum of the new
/// values.
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    assert!(available());
    // SAFETY: AVX2/FMA are present (asserted); accesses stay inside `x`.
    unsafe { exp_shifted_sum_avx2(x, shift) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_sum_avx2(x: &mut [f32], shift: f32) -> f32 {
    let shift_v = _mm256_set1_ps(shift);
    let mut sum = _mm256_setzero_ps();
    let mut quads = x.chunks_exact_mut(32);
    for quad in &mut quads {
        let p = quad.as_mut_ptr();
        let v: [__m256; 4] =
            std::array::from_fn(|i| _mm256_sub_ps(_mm256_loadu_ps(p.add(8 * i)), shift_v));
        // Added in element order, as one vector at a time would.
        for (i, e) in exp8xn(v).into_iter().enumerate() {
            _mm256_storeu_ps(p.add(8 * i), e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    let mut chunks = quads.into_remainder().chunks_exact_mut(8);
    for chunk in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift_v));
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
        sum = _mm256_add_ps(sum, e);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        // The tail goes through the same lanes, padded with exp(-inf) = 0:
        // element i always lands in lane i % 8, so the sum of a row does not
        // depend on where its tile happens to end (a causal tile ends at the
        // last visible key of its last query row).
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..tail.len()].copy_from_slice(tail);
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), shift_v));
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        tail.copy_from_slice(&buf[..tail.len()]);
        sum = _mm256_add_ps(sum, e);
    }
    hsum(sum)
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
                (x as f32 / u32::MAX as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn gemm_matches_naive_on_ragged_shapes() {
        if !available() {
            return;
        }
        for (m, n, k) in [(1, 1, 1), (5, 23, 7), (4, 16, 64), (9, 40, 3), (64, 64, 64)] {
            let a = filled(m * k, 1);
            let b = filled(k * n, 2);
            let c0 = filled(m * n, 3);
            let mut c = c0.clone();
            let lhs = Lhs {
                data: &a,
                row_stride: k,
                depth_stride: 1,
            };
            let rhs = Rhs::RowMajor { data: &b, ld: n };
            gemm(m, n, k, lhs, rhs, &mut c, n, true);
            // Transposed view of the same data: rows of Aᵀ are columns of A.
            let mut a_t = vec![0.0; k * m];
            for i in 0..m {
                for p in 0..k {
                    a_t[p * m + i] = a[i * k + p];
                }
            }
            let mut c_t = c0.clone();
            let lhs_t = Lhs {
                data: &a_t,
                row_stride: 1,
                depth_stride: m,
            };
            gemm(m, n, k, lhs_t, rhs, &mut c_t, n, true);
            // The same product from B packed in panels, written over C.
            let mut b_rows = vec![0.0; n * k];
            for p in 0..k {
                for j in 0..n {
                    b_rows[j * k + p] = b[p * n + j];
                }
            }
            let mut packed = vec![f32::NAN; panels_len(k, n)];
            pack_transposed_panels(&b_rows, n, k, &mut packed);
            let mut c_p = vec![f32::NAN; m * n];
            gemm(
                m,
                n,
                k,
                lhs,
                Rhs::Panels {
                    data: &packed,
                    panel_stride: PANEL * k,
                },
                &mut c_p,
                n,
                false,
            );
            // The same product with its row maxima from the registers.
            let mut c_m = vec![f32::NAN; m * n];
            let (mut maxes, mut lanes) = (vec![f32::NAN; m], vec![f32::NAN; 8 * m]);
            let panels = Rhs::Panels {
                data: &packed,
                panel_stride: PANEL * k,
            };
            gemm_row_max(m, n, k, lhs, panels, &mut c_m, n, &mut maxes, &mut lanes);
            assert_eq!(c_m, c_p);
            for (i, &max) in maxes.iter().enumerate() {
                let want = c_p[i * n..(i + 1) * n]
                    .iter()
                    .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                assert_eq!(max, want, "{m}x{n}x{k} row {i}");
            }
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = c0[i * n + j] as f64
                        + (0..k)
                            .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                            .sum::<f64>();
                    assert!(
                        (c[i * n + j] as f64 - want).abs() < 1e-5,
                        "{m}x{n}x{k} at {i},{j}"
                    );
                    assert_eq!(c[i * n + j], c_t[i * n + j]);
                    assert!((c_p[i * n + j] + c0[i * n + j] - c[i * n + j]).abs() < 1e-5);
                }
            }
        }
    }

    #[test]
    fn packing_places_every_element() {
        for (rows, k) in [(16, 8), (37, 13), (48, 64), (5, 3)] {
            let src = filled(rows * k, 4);
            let mut dst = vec![f32::NAN; panels_len(k, rows)];
            pack_transposed_panels(&src, rows, k, &mut dst);
            for j in 0..rows.next_multiple_of(PANEL) {
                for p in 0..k {
                    let got = dst[(j / PANEL) * PANEL * k + p * PANEL + j % PANEL];
                    let want = if j < rows { src[j * k + p] } else { 0.0 };
                    assert_eq!(got.to_bits(), want.to_bits(), "{rows}x{k} at {j},{p}");
                }
            }
            // The same rows as a (depth × columns) matrix packed directly.
            let mut dst = vec![f32::NAN; panels_len(rows, k)];
            pack_panels(&src, rows, k, &mut dst);
            for p in 0..rows {
                for j in 0..k.next_multiple_of(PANEL) {
                    let got = dst[(j / PANEL) * PANEL * rows + p * PANEL + j % PANEL];
                    let want = if j < k { src[p * k + j] } else { 0.0 };
                    assert_eq!(got.to_bits(), want.to_bits(), "{rows}x{k} at {p},{j}");
                }
            }
        }
    }

    #[test]
    fn exp_is_accurate_and_masks_to_zero() {
        if !available() {
            return;
        }
        let mut x: Vec<f32> = (0..100_001).map(|i| -90.0 + i as f32 * 0.0009).collect();
        x.push(f32::NEG_INFINITY);
        let original = x.clone();
        let sum = exp_shifted_sum(&mut x, 0.0);
        // The positive side on its own: its sum would overflow.
        let positive: Vec<f32> = (1..=20_000).map(|i| i as f32 * 0.0044).collect();
        let mut e_positive = positive.clone();
        exp_shifted_sum(&mut e_positive, 0.0);
        for (&e, &v) in x
            .iter()
            .zip(&original)
            .chain(e_positive.iter().zip(&positive))
        {
            let want = (v as f64).exp();
            if v <= -88.0 {
                assert_eq!(e, 0.0, "exp({v})");
            } else if want >= f32::MIN_POSITIVE as f64 {
                let nearest = want as f32;
                let ulp = (f32::from_bits(nearest.to_bits() + 1) - nearest) as f64;
                let ulps = ((e as f64) - want).abs() / ulp;
                assert!(ulps <= 1.25, "exp({v}) = {e}, {ulps} ulp from {want}");
            } else {
                // Between the flush and the smallest normal float: zero or
                // a subnormal, off by less than the smallest normal.
                assert!(
                    ((e as f64) - want).abs() <= f32::MIN_POSITIVE as f64,
                    "exp({v})"
                );
            }
        }
        let want: f64 = original
            .iter()
            .filter(|&&v| v >= -87.3)
            .map(|&v| (v as f64).exp())
            .sum();
        assert!((sum as f64 - want).abs() < 1e-5 * want);
        // The shift is subtracted before the exponential, exp(0) is exactly
        // 1, and NaN stays NaN.
        let mut y = [3.5f32, 2.5, f32::NAN, 1.0, 3.5, 3.5, 3.5, 3.5, 3.5];
        exp_shifted_sum(&mut y, 3.5);
        assert_eq!(y[0], 1.0);
        assert_eq!(y[8], 1.0);
        assert!(((y[1] as f64) - (-1.0f64).exp()).abs() <= 4.0 * f32::EPSILON as f64);
        assert!(y[2].is_nan());
        assert_eq!(row_max(&original), original[100_000]);
        assert_eq!(row_max(&[f32::NEG_INFINITY; 3]), f32::NEG_INFINITY);
    }
}
