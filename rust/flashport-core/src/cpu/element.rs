//! The floating-point types the CPU kernels compute in.

use std::borrow::Cow;

use super::kernels;
use super::real::Real;
#[cfg(target_arch = "x86_64")]
use super::simd;
use crate::array::{Buffer, Slice};
use crate::error::Result;
use crate::runtime::buffers::{self, BufferPool, Pooled};
#[cfg(target_arch = "x86_64")]
use crate::runtime::parallel;

/// float32 or float64: the types the tile kernels are generic over. Their
/// arithmetic is [`Real`]'s; an element adds where its buffers are kept,
/// how inputs are viewed in it, and the tile products, portable
/// (`kernels.rs`) unless a type has SIMD kernels.
pub trait Element: Real {
    /// Where buffers of this type are kept between calls.
    fn pool() -> &'static BufferPool<Self>;
    /// Views an input in this type, converting (float16 inputs, a float32
    /// lse in a float64 problem) only when the stored type differs.
    fn view(s: Slice<'_>) -> Cow<'_, [Self]>;
    fn into_buffer(v: Vec<Self>) -> Buffer;

    // The tile products and the exponential, portable by default; a type
    // overrides them with SIMD kernels where the CPU has them. Shapes are
    // rows × columns of row-major contiguous matrices.

    /// Packs each input (see [`PackInput`]), all in one parallel pass, or
    /// gives `None` for those the kernels read as rows. Done once per call
    /// instead of once per tile.
    fn pack_inputs<const N: usize>(
        inputs: [PackInput<'_, Self>; N],
    ) -> Result<[Option<Pooled<Self>>; N]> {
        Ok(inputs.map(|_| None))
    }
    /// [`Element::pack_inputs`] of one input of one head, on this thread
    /// (inside a task, for the rare recomputations of
    /// docs/design.md#non-finite-inputs): the same layout as that head's
    /// part of the whole packing.
    fn pack_head(x: &[Self], rows: usize, cols: usize, packing: Packing) -> Option<Vec<Self>> {
        let _ = (x, rows, cols, packing);
        None
    }
    /// Elements one head takes in a [`Packing::Transposed`] result; the
    /// tile of a head that starts at row `start` (a multiple of 16) starts
    /// `start * cols` elements into it.
    fn packed_head_len(rows: usize, cols: usize) -> usize {
        rows * cols
    }
    /// `c = a · bᵀ`, `a` `m × k`, `b` `n × k`, `c` `m × n` with rows `ldc`
    /// apart. `b_packed`, when given, is the same tile as packed
    /// [`Packing::Transposed`]; otherwise `pack` (scratch of `k × n` rounded
    /// up to 16 columns) may be used to pack it here.
    #[allow(clippy::too_many_arguments)]
    fn matmul_nt(
        a: &[Self],
        b: &[Self],
        b_packed: Option<&[Self]>,
        c: &mut [Self],
        ldc: usize,
        (m, k, n): (usize, usize, usize),
        pack: &mut [Self],
    ) {
        let _ = (b_packed, pack);
        kernels::matmul_nt(a, b, c, ldc, m, k, n)
    }
    /// [`Element::matmul_nt`] that also sets `maxes[i]` to the largest
    /// element of row `i` of `c` (`-inf` for no columns); `lanes` is
    /// scratch of `8 m`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_nt_row_max(
        a: &[Self],
        b: &[Self],
        b_packed: Option<&[Self]>,
        c: &mut [Self],
        (m, k, n): (usize, usize, usize),
        pack: &mut [Self],
        maxes: &mut [Self],
        lanes: &mut [Self],
    ) {
        let _ = lanes;
        Self::matmul_nt(a, b, b_packed, c, n, (m, k, n), pack);
        for (i, max) in maxes[..m].iter_mut().enumerate() {
            *max = Self::row_max(&c[i * n..(i + 1) * n]);
        }
    }
    /// `c += a · b`, `a` `m × k` with rows `lda` apart, `b` `k × n`, `c`
    /// `m × n`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_acc(
        a: &[Self],
        lda: usize,
        b: &[Self],
        c: &mut [Self],
        m: usize,
        k: usize,
        n: usize,
    ) {
        kernels::matmul_acc(a, lda, b, c, m, k, n)
    }
    /// Elements one head takes in a [`Packing::Rows`] result; a tile
    /// starting at row `start` of a head starts `start * 16` elements into
    /// the head, whose panels lie `rows * 16` apart.
    fn rows_head_len(rows: usize, cols: usize) -> usize {
        rows * cols
    }
    /// `c += a · b` like [`Element::matmul_acc`], with `b` optionally given as
    /// packed [`Packing::Rows`]: `(tile start, panel stride)`.
    fn matmul_acc_packed(
        a: &[Self],
        lda: usize,
        b: &[Self],
        b_packed: Option<(&[Self], usize)>,
        c: &mut [Self],
        (m, k, n): (usize, usize, usize),
    ) {
        let _ = b_packed;
        Self::matmul_acc(a, lda, b, c, m, k, n)
    }
    /// `c += aᵀ · b`, `a` `m × k` with rows `lda` apart, `b` `m × n`, `c`
    /// `k × n`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_t_acc(
        a: &[Self],
        lda: usize,
        b: &[Self],
        c: &mut [Self],
        m: usize,
        k: usize,
        n: usize,
    ) {
        kernels::matmul_t_acc(a, lda, b, c, m, k, n)
    }
    /// Packs `x` (`rows × cols`) into `dst` (at least
    /// [`Element::rows_head_len`]`(rows, cols)` long) for the `b_packed` of
    /// [`Element::matmul_t_acc_packed`], returning the panel stride, or
    /// `None` (and leaves `dst` alone) when the kernels read rows directly.
    fn pack_rows(x: &[Self], rows: usize, cols: usize, dst: &mut [Self]) -> Option<usize> {
        let _ = (x, rows, cols, dst);
        None
    }
    /// [`Element::matmul_t_acc`] with `b` optionally as packed by
    /// [`Element::pack_rows`]: `(panels, panel stride)`.
    fn matmul_t_acc_packed(
        a: &[Self],
        lda: usize,
        b: &[Self],
        b_packed: Option<(&[Self], usize)>,
        c: &mut [Self],
        (m, k, n): (usize, usize, usize),
    ) {
        let _ = b_packed;
        Self::matmul_t_acc(a, lda, b, c, m, k, n)
    }
    /// The largest element; `-inf` for an empty or fully masked row.
    fn row_max(x: &[Self]) -> Self {
        kernels::row_max(x)
    }
    /// `x = exp(x - shift)` elementwise (`shift` finite); returns the sum.
    fn exp_shifted_sum(x: &mut [Self], shift: Self) -> Self {
        kernels::exp_shifted_sum(x, shift)
    }
}

static F32_POOL: BufferPool<f32> = BufferPool::new();
static F64_POOL: BufferPool<f64> = BufferPool::new();

impl Element for f32 {
    fn pool() -> &'static BufferPool<f32> {
        &F32_POOL
    }
    fn view(s: Slice<'_>) -> Cow<'_, [f32]> {
        match s {
            Slice::F32(x) => Cow::Borrowed(x),
            Slice::F16(x) => Cow::Owned(x.iter().map(|v| v.to_f32()).collect()),
            Slice::BF16(x) => Cow::Owned(x.iter().map(|v| v.to_f32()).collect()),
            Slice::F64(x) => Cow::Owned(x.iter().map(|&v| v as f32).collect()),
        }
    }
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F32(v)
    }

    #[cfg(target_arch = "x86_64")]
    fn pack_inputs<const N: usize>(
        inputs: [PackInput<'_, f32>; N],
    ) -> Result<[Option<Pooled<f32>>; N]> {
        if !simd::available() {
            return Ok(inputs.map(|_| None));
        }
        Ok(pack_f32(inputs)?.map(Some))
    }
    #[cfg(target_arch = "x86_64")]
    fn pack_head(x: &[f32], rows: usize, cols: usize, packing: Packing) -> Option<Vec<f32>> {
        if !simd::available() {
            return None;
        }
        let mut dst = match packing {
            Packing::Transposed => vec![0.0; simd::panels_len(cols, rows)],
            Packing::Rows => vec![0.0; simd::panels_len(rows, cols)],
        };
        if !dst.is_empty() {
            match packing {
                Packing::Transposed => simd::pack_transposed_panels(x, rows, cols, &mut dst),
                Packing::Rows => simd::pack_panels(x, rows, cols, &mut dst),
            }
        }
        Some(dst)
    }
    #[cfg(target_arch = "x86_64")]
    fn packed_head_len(rows: usize, cols: usize) -> usize {
        simd::panels_len(cols, rows)
    }
    #[cfg(target_arch = "x86_64")]
    fn rows_head_len(rows: usize, cols: usize) -> usize {
        simd::panels_len(rows, cols)
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_acc_packed(
        a: &[f32],
        lda: usize,
        b: &[f32],
        b_packed: Option<(&[f32], usize)>,
        c: &mut [f32],
        (m, k, n): (usize, usize, usize),
    ) {
        match b_packed {
            Some((data, panel_stride)) if simd::available() => {
                let lhs = simd::Lhs {
                    data: a,
                    row_stride: lda,
                    depth_stride: 1,
                };
                let rhs = simd::Rhs::Panels { data, panel_stride };
                simd::gemm(m, n, k, lhs, rhs, c, n, true);
            }
            _ => Self::matmul_acc(a, lda, b, c, m, k, n),
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_nt(
        a: &[f32],
        b: &[f32],
        b_packed: Option<&[f32]>,
        c: &mut [f32],
        ldc: usize,
        (m, k, n): (usize, usize, usize),
        pack: &mut [f32],
    ) {
        if !simd::available() {
            return kernels::matmul_nt(a, b, c, ldc, m, k, n);
        }
        let packed = match b_packed {
            Some(packed) => packed,
            None => {
                simd::pack_transposed_panels(b, n, k, pack);
                &*pack
            }
        };
        let lhs = simd::Lhs {
            data: a,
            row_stride: k,
            depth_stride: 1,
        };
        simd::gemm(
            m,
            n,
            k,
            lhs,
            simd::Rhs::Panels {
                data: packed,
                panel_stride: simd::PANEL * k,
            },
            c,
            ldc,
            false,
        );
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_nt_row_max(
        a: &[f32],
        b: &[f32],
        b_packed: Option<&[f32]>,
        c: &mut [f32],
        (m, k, n): (usize, usize, usize),
        pack: &mut [f32],
        maxes: &mut [f32],
        lanes: &mut [f32],
    ) {
        if !simd::available() {
            kernels::matmul_nt(a, b, c, n, m, k, n);
            for (i, max) in maxes[..m].iter_mut().enumerate() {
                *max = kernels::row_max(&c[i * n..(i + 1) * n]);
            }
            return;
        }
        let packed = match b_packed {
            Some(packed) => packed,
            None => {
                simd::pack_transposed_panels(b, n, k, pack);
                &*pack
            }
        };
        let lhs = simd::Lhs {
            data: a,
            row_stride: k,
            depth_stride: 1,
        };
        let rhs = simd::Rhs::Panels {
            data: packed,
            panel_stride: simd::PANEL * k,
        };
        simd::gemm_row_max(m, n, k, lhs, rhs, c, n, maxes, lanes);
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_acc(a: &[f32], lda: usize, b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
        if !simd::available() {
            return kernels::matmul_acc(a, lda, b, c, m, k, n);
        }
        let lhs = simd::Lhs {
            data: a,
            row_stride: lda,
            depth_stride: 1,
        };
        simd::gemm(
            m,
            n,
            k,
            lhs,
            simd::Rhs::RowMajor { data: b, ld: n },
            c,
            n,
            true,
        );
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_t_acc(a: &[f32], lda: usize, b: &[f32], c: &mut [f32], m: usize, k: usize, n: usize) {
        if !simd::available() {
            return kernels::matmul_t_acc(a, lda, b, c, m, k, n);
        }
        // Row r of aᵀ is column r of a: unit stride across rows, lda along
        // depth.
        let lhs = simd::Lhs {
            data: a,
            row_stride: 1,
            depth_stride: lda,
        };
        simd::gemm(
            k,
            n,
            m,
            lhs,
            simd::Rhs::RowMajor { data: b, ld: n },
            c,
            n,
            true,
        );
    }
    #[cfg(target_arch = "x86_64")]
    fn pack_rows(x: &[f32], rows: usize, cols: usize, dst: &mut [f32]) -> Option<usize> {
        if !simd::available() {
            return None;
        }
        simd::pack_panels(x, rows, cols, dst);
        Some(rows * simd::PANEL)
    }
    #[cfg(target_arch = "x86_64")]
    fn matmul_t_acc_packed(
        a: &[f32],
        lda: usize,
        b: &[f32],
        b_packed: Option<(&[f32], usize)>,
        c: &mut [f32],
        (m, k, n): (usize, usize, usize),
    ) {
        match b_packed {
            Some((data, panel_stride)) if simd::available() => {
                // Row r of aᵀ is column r of a; b in panels, not rows a
                // head dimension apart (at d = 128 such rows conflict in
                // L1: 79 GFLOP/s for this product, 88 from panels).
                let lhs = simd::Lhs {
                    data: a,
                    row_stride: 1,
                    depth_stride: lda,
                };
                let rhs = simd::Rhs::Panels { data, panel_stride };
                simd::gemm(k, n, m, lhs, rhs, c, n, true);
            }
            _ => Self::matmul_t_acc(a, lda, b, c, m, k, n),
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn row_max(x: &[f32]) -> f32 {
        if simd::available() {
            simd::row_max(x)
        } else {
            kernels::row_max(x)
        }
    }
    #[cfg(target_arch = "x86_64")]
    fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
        if simd::available() {
            simd::exp_shifted_sum(x, shift)
        } else {
            kernels::exp_shifted_sum(x, shift)
        }
    }
}

/// How [`Element::pack_inputs`] lays out an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// Transposed into panels, for [`Element::matmul_nt`]'s `b_packed`.
    Transposed,
    /// In row panels, for [`Element::matmul_acc_packed`]'s `b_packed`.
    Rows,
}

/// One input of [`Element::pack_inputs`]: `heads` blocks of `rows × cols`.
pub struct PackInput<'a, T> {
    pub x: &'a [T],
    pub heads: usize,
    pub rows: usize,
    pub cols: usize,
    pub packing: Packing,
}

/// Packs every head of every input in one parallel pass (each pass costs
/// the caller a hand-over to the helper threads and back), into buffers
/// kept from earlier calls where they fit.
#[cfg(target_arch = "x86_64")]
fn pack_f32<const N: usize>(inputs: [PackInput<'_, f32>; N]) -> Result<[Pooled<f32>; N]> {
    use std::mem::MaybeUninit;
    enum Dst<'a> {
        Kept(&'a mut [f32]),
        New(&'a mut [MaybeUninit<f32>]),
    }
    let head_len = |i: &PackInput<'_, f32>| match i.packing {
        Packing::Transposed => simd::panels_len(i.cols, i.rows),
        Packing::Rows => simd::panels_len(i.rows, i.cols),
    };
    let lens = inputs.each_ref().map(|i| i.heads * head_len(i));
    // Panels pad each row to 16 columns: for a narrow head dimension the
    // copy is larger than the input, so it is reserved fallibly.
    let mut taken = Vec::with_capacity(N);
    for len in lens {
        taken.push(F32_POOL.take(len, "the packed copy of k and v for the CPU kernels")?);
    }
    let Ok(mut outs): std::result::Result<[Pooled<f32>; N], _> = taken.try_into() else {
        unreachable!("one buffer per input");
    };
    let kept: [bool; N] = std::array::from_fn(|n| outs[n].len() == lens[n]);
    let mut items = Vec::new();
    for (n, (input, out)) in inputs.iter().zip(outs.iter_mut()).enumerate() {
        let (dst_len, src_len) = (head_len(input), input.rows * input.cols);
        if lens[n] == 0 {
            continue;
        }
        // Each head's source and destination (both non-empty here).
        let sources = input.x.chunks(src_len);
        let dsts: Vec<Dst<'_>> = if kept[n] {
            out.chunks_mut(dst_len).map(Dst::Kept).collect()
        } else {
            buffers::spare(out.vec_mut(), lens[n])
                .chunks_mut(dst_len)
                .map(Dst::New)
                .collect()
        };
        for (dst, src) in dsts.into_iter().zip(sources) {
            items.push((input, dst, src));
        }
    }
    parallel::for_every(items, |(input, dst, src)| {
        let dst = match dst {
            Dst::Kept(dst) => dst,
            Dst::New(dst) => buffers::zero_init(dst),
        };
        match input.packing {
            Packing::Transposed => simd::pack_transposed_panels(src, input.rows, input.cols, dst),
            Packing::Rows => simd::pack_panels(src, input.rows, input.cols, dst),
        }
    });
    for (n, out) in outs.iter_mut().enumerate() {
        if !kept[n] {
            // SAFETY: the heads' chunks above cover all `lens[n]` elements
            // (`lens[n]` is `heads` destination chunks, and `x` holds
            // `heads` source chunks), or `lens[n]` is 0; each chunk was
            // initialised by `zero_init`.
            unsafe { out.vec_mut().set_len(lens[n]) };
        }
    }
    Ok(outs)
}

impl Element for f64 {
    fn pool() -> &'static BufferPool<f64> {
        &F64_POOL
    }
    fn view(s: Slice<'_>) -> Cow<'_, [f64]> {
        match s {
            Slice::F64(x) => Cow::Borrowed(x),
            Slice::F32(x) => Cow::Owned(x.iter().map(|&v| v as f64).collect()),
            Slice::F16(x) => Cow::Owned(x.iter().map(|v| v.to_f64()).collect()),
            Slice::BF16(x) => Cow::Owned(x.iter().map(|v| v.to_f64()).collect()),
        }
    }
    fn into_buffer(v: Vec<Self>) -> Buffer {
        Buffer::F64(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_copy_larger_than_memory_is_an_error() {
        // With vm.overcommit_memory=1 the kernel grants any reservation.
        let always = std::fs::read_to_string("/proc/sys/vm/overcommit_memory")
            .is_ok_and(|mode| mode.trim() == "1");
        if !simd::available() || always {
            return;
        }
        // Panels pad a head dimension of 1 to 16 columns: 2**40 rows need
        // 64 TiB. Sizes are checked before any element is read.
        let x = [1.0f32; 16];
        let input = PackInput {
            x: &x,
            heads: 1,
            rows: 1 << 40,
            cols: 1,
            packing: Packing::Transposed,
        };
        match f32::pack_inputs([input]) {
            Err(crate::error::Error::TooLarge(msg)) => {
                assert!(msg.contains("packed copy"), "{msg}")
            }
            other => panic!("expected TooLarge, got {:?}", other.map(|_| ())),
        }
    }
}
