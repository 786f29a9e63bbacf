//! A KV cache's pools in host memory, for the CPU's
//! `attention_with_kvcache`.

use half::{bf16, f16};

use crate::array::{Array, Buffer, Input, Placement, Slice};
use crate::blocks::plan::{BlockCopy, WriteRun};
use crate::blocks::{CacheShape, Storage};
use crate::decode;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::output::ForwardOutput;
use crate::problem::{DType, KvCacheProblem};
use crate::variants::VariantArrays;

#[derive(Debug)]
pub struct CpuStorage {
    shape: CacheShape,
    /// Per layer.
    keys: Vec<Buffer>,
    values: Vec<Buffer>,
}

/// `len` zeros from the allocator's zeroed memory (calloc: the pages of a
/// large pool stay untouched until a block is written), so that a cache
/// takes memory as it fills, not all at construction.
fn zeros<T: bytemuck::Zeroable>(len: usize, bytes: usize) -> Result<Vec<T>> {
    bytemuck::allocation::try_zeroed_slice_box::<T>(len)
        .map(|pool| pool.into_vec())
        .map_err(|_| {
            Error::TooLarge(format!(
                "a KV cache pool of {bytes} bytes could not be allocated in host memory"
            ))
        })
}

/// A zeroed buffer of `len` elements of `dtype`, taking memory as it is
/// written (the pools, and the swap space's).
pub(crate) fn pool(dtype: DType, len: usize) -> Result<Buffer> {
    Ok(match dtype {
        DType::F16 => Buffer::F16(zeros::<f16>(len, len * 2)?),
        DType::BF16 => Buffer::BF16(zeros::<bf16>(len, len * 2)?),
        DType::F32 => Buffer::F32(zeros::<f32>(len, len * 4)?),
        DType::F64 => Buffer::F64(zeros::<f64>(len, len * 8)?),
    })
}

/// The host slice of a token array (`k` or `v`) the CPU writes from.
fn host<'a>(argument: &str, input: Input<'a>) -> Result<Slice<'a>> {
    match input {
        Input::Host(s) => Ok(s),
        Input::Device(_) => Err(Error::Value {
            argument: argument.to_string(),
            value: "a device array".to_string(),
            reason: "this KV cache lives in host memory (device=\"cpu\"); pass a NumPy array \
                     (the device array's .numpy())"
                .to_string(),
        }),
    }
}

/// Copies the runs of each row `r` of `n` tokens of `dim` elements per
/// head from row `r` of `src` `(rows, heads, n, dim)` into `dst`
/// `(num_blocks, heads, block_size, dim)`.
fn scatter<T: Copy>(
    dst: &mut [T],
    src: &[T],
    rows: &[&[WriteRun]],
    (heads, n, dim, block_size): (usize, usize, usize, usize),
) {
    for (r, runs) in rows.iter().enumerate() {
        for run in runs.iter() {
            let len = run.source.len() * dim;
            for h in 0..heads {
                let from = ((r * heads + h) * n + run.source.start) * dim;
                let to = ((run.block * heads + h) * block_size + run.offset) * dim;
                dst[to..to + len].copy_from_slice(&src[from..from + len]);
            }
        }
    }
}

fn scatter_buffer(
    argument: &str,
    dst: &mut Buffer,
    src: Slice<'_>,
    rows: &[&[WriteRun]],
    dims: (usize, usize, usize, usize),
) -> Result<()> {
    match (dst, src) {
        (Buffer::F16(d), Slice::F16(s)) => scatter(d, s, rows, dims),
        (Buffer::BF16(d), Slice::BF16(s)) => scatter(d, s, rows, dims),
        (Buffer::F32(d), Slice::F32(s)) => scatter(d, s, rows, dims),
        (Buffer::F64(d), Slice::F64(s)) => scatter(d, s, rows, dims),
        (d, s) => {
            return Err(Error::DType {
                argument: argument.to_string(),
                dtype: s.dtype().numpy_name().to_string(),
                reason: format!("the cache holds {}", d.as_slice().dtype().numpy_name()),
            })
        }
    }
    Ok(())
}

/// Copies `len` elements from `src[from..]` to `dst[to..]` (the same
/// dtype: both are the cache's).
pub(crate) fn copy_span(dst: &mut Buffer, to: usize, src: &Buffer, from: usize, len: usize) {
    match (dst, src) {
        (Buffer::F16(d), Buffer::F16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
        (Buffer::BF16(d), Buffer::BF16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
        (Buffer::F32(d), Buffer::F32(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
        (Buffer::F64(d), Buffer::F64(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
        _ => unreachable!("a cache's buffers share its dtype"),
    }
}

/// Blocks `blocks` of `pool` (`span` elements each), gathered in order.
pub(crate) fn gather_blocks(
    pool: &Buffer,
    dtype: DType,
    span: usize,
    blocks: &[usize],
) -> Result<Buffer> {
    let mut out = self::pool(dtype, span * blocks.len())?;
    for (i, &b) in blocks.iter().enumerate() {
        copy_span(&mut out, i * span, pool, b * span, span);
    }
    Ok(out)
}

/// Blocks `blocks` of every layer's key and value buffers, gathered per
/// layer (`lens`: the elements of a block of keys and of values): the
/// layout [`crate::blocks::Storage::read_blocks`] gives, for the pools
/// and the swap space alike.
pub(crate) fn gather_layers(
    keys: &[Buffer],
    values: &[Buffer],
    dtype: DType,
    (ks, vs): (usize, usize),
    blocks: &[usize],
) -> Result<Vec<(Buffer, Buffer)>> {
    keys.iter()
        .zip(values)
        .map(|(k, v)| {
            Ok((
                gather_blocks(k, dtype, ks, blocks)?,
                gather_blocks(v, dtype, vs, blocks)?,
            ))
        })
        .collect()
}

/// [`gather_layers`]' layout written back into blocks `blocks`.
pub(crate) fn scatter_layers(
    keys: &mut [Buffer],
    values: &mut [Buffer],
    (ks, vs): (usize, usize),
    blocks: &[usize],
    data: &[(Buffer, Buffer)],
) {
    for ((k, v), (dk, dv)) in keys.iter_mut().zip(values.iter_mut()).zip(data) {
        scatter_blocks(k, ks, blocks, dk);
        scatter_blocks(v, vs, blocks, dv);
    }
}

/// Block `i` of `data` (gathered as [`gather_blocks`] does) into block
/// `blocks[i]` of `pool`.
pub(crate) fn scatter_blocks(pool: &mut Buffer, span: usize, blocks: &[usize], data: &Buffer) {
    for (i, &b) in blocks.iter().enumerate() {
        copy_span(pool, b * span, data, i * span, span);
    }
}

fn copy_block(buffer: &mut Buffer, span: usize, copy: BlockCopy) {
    let (src, dst) = (copy.src * span, copy.dst * span);
    match buffer {
        Buffer::F16(b) => b.copy_within(src..src + span, dst),
        Buffer::BF16(b) => b.copy_within(src..src + span, dst),
        Buffer::F32(b) => b.copy_within(src..src + span, dst),
        Buffer::F64(b) => b.copy_within(src..src + span, dst),
    }
}

impl CpuStorage {
    /// Zeroed pools for every layer (an error, not an abort, if host
    /// memory cannot hold them).
    pub fn new(shape: CacheShape) -> Result<Self> {
        // The whole cache against what the machine gives a process: its
        // pools are reserved, not touched, so an allocation would succeed
        // far past memory and the process be killed as the cache fills.
        let total = shape.nbytes().expect("validated") as u128;
        if !crate::host_memory::admits(total) {
            return Err(Error::TooLarge(format!(
                "a KV cache of {} layer(s) of key pools {} and value pools {} takes {total} \
                 bytes, more than this machine has{}; use fewer blocks or layers",
                shape.layers,
                crate::error::shape_str(&shape.k_pool_shape()),
                crate::error::shape_str(&shape.v_pool_shape()),
                crate::host_memory::why()
            )));
        }
        let mut keys = Vec::with_capacity(shape.layers);
        let mut values = Vec::with_capacity(shape.layers);
        for _ in 0..shape.layers {
            keys.push(pool(shape.dtype, shape.k_pool_len())?);
            values.push(pool(shape.dtype, shape.v_pool_len())?);
        }
        Ok(CpuStorage {
            shape,
            keys,
            values,
        })
    }
}

impl Storage for CpuStorage {
    fn device(&self) -> String {
        "cpu".to_string()
    }

    fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<()> {
        let s = &self.shape;
        let (k_span, v_span) = (
            s.heads_kv * s.block_size * s.head_dim,
            s.heads_kv * s.block_size * s.head_dim_v,
        );
        for &copy in copies {
            for (k, v) in self.keys.iter_mut().zip(&mut self.values) {
                copy_block(k, k_span, copy);
                copy_block(v, v_span, copy);
            }
        }
        Ok(())
    }

    fn write(
        &mut self,
        layer: usize,
        n: usize,
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        let s = self.shape;
        let (k, v) = (host("k", k)?, host("v", v)?);
        let dims = |dim| (s.heads_kv, n, dim, s.block_size);
        scatter_buffer("k", &mut self.keys[layer], k, rows, dims(s.head_dim))?;
        scatter_buffer("v", &mut self.values[layer], v, rows, dims(s.head_dim_v))
    }

    fn append(
        &mut self,
        layer: usize,
        n: usize,
        copies: &[BlockCopy],
        rows: &[&[WriteRun]],
        k: Input<'_>,
        v: Input<'_>,
    ) -> Result<()> {
        // Refused inputs are refused before the copies change any block.
        host("k", k)?;
        host("v", v)?;
        self.copy_blocks(copies)?;
        self.write(layer, n, rows, k, v)
    }

    fn attention(
        &self,
        layer: usize,
        problem: &KvCacheProblem,
        q: Input<'_>,
        variants: &VariantArrays<'_>,
        outputs: Placement,
    ) -> Result<ForwardOutput<Array>> {
        let q = host("q", q)?;
        let (k, v) = (self.keys[layer].as_slice(), self.values[layer].as_slice());
        decode::attention_with_kvcache_arrays(
            Device::Cpu,
            problem,
            [q.into(), k.into(), v.into()],
            variants,
            outputs,
        )
    }

    fn read(&self, layer: usize) -> Result<(Buffer, Buffer)> {
        Ok((self.keys[layer].clone(), self.values[layer].clone()))
    }

    fn read_blocks(&self, blocks: &[usize]) -> Result<Vec<(Buffer, Buffer)>> {
        let lens = self.shape.block_lens();
        gather_layers(&self.keys, &self.values, self.shape.dtype, lens, blocks)
    }

    fn write_blocks(&mut self, blocks: &[usize], data: &[(Buffer, Buffer)]) -> Result<()> {
        let lens = self.shape.block_lens();
        scatter_layers(&mut self.keys, &mut self.values, lens, blocks, data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> CacheShape {
        CacheShape {
            num_blocks: 3,
            block_size: 2,
            heads_kv: 2,
            head_dim: 3,
            head_dim_v: 1,
            layers: 2,
            dtype: DType::F32,
            swap_blocks: 0,
        }
    }

    #[test]
    fn writes_runs_into_their_slots_and_copies_blocks_on_every_layer() {
        let mut st = CpuStorage::new(shape()).unwrap();
        // 3 tokens, heads 2: k[h, t, :] = 100h + 10t + (0, 1, 2).
        let k: Vec<f32> = (0..2)
            .flat_map(|h| {
                (0..3).flat_map(move |t| (0..3).map(move |e| (100 * h + 10 * t + e) as f32))
            })
            .collect();
        let v: Vec<f32> = (0..6).map(|i| -(i as f32) - 1.0).collect();
        let runs = [
            WriteRun {
                block: 2,
                offset: 1,
                source: 0..1,
            },
            WriteRun {
                block: 0,
                offset: 0,
                source: 1..3,
            },
        ];
        st.write(1, 3, &[&runs], Slice::F32(&k).into(), Slice::F32(&v).into())
            .unwrap();
        let (Buffer::F32(kp), Buffer::F32(vp)) = st.read(1).unwrap() else {
            panic!()
        };
        let at = |b: usize, h: usize, slot: usize| ((b * 2 + h) * 2 + slot) * 3;
        assert_eq!(kp[at(2, 0, 1)..at(2, 0, 1) + 3], [0.0, 1.0, 2.0]);
        assert_eq!(kp[at(2, 1, 1)..at(2, 1, 1) + 3], [100.0, 101.0, 102.0]);
        assert_eq!(
            kp[at(0, 1, 0)..at(0, 1, 0) + 6],
            [110.0, 111.0, 112.0, 120.0, 121.0, 122.0]
        );
        // v (heads 2, 3 tokens, dim 1) = -1 .. -6; block 0 holds tokens 1, 2.
        assert_eq!(vp[..4], [-2.0, -3.0, -5.0, -6.0]);
        // Layer 0 untouched.
        let (Buffer::F32(k0), _) = st.read(0).unwrap() else {
            panic!()
        };
        assert!(k0.iter().all(|&x| x == 0.0));
        st.copy_blocks(&[BlockCopy { src: 0, dst: 1 }]).unwrap();
        let (Buffer::F32(kp2), Buffer::F32(vp2)) = st.read(1).unwrap() else {
            panic!()
        };
        assert_eq!(kp2[12..24], kp[..12]);
        assert_eq!(vp2[4..8], vp[..4]);
        assert_eq!(kp2[24..], kp[24..]);
    }

    #[test]
    fn each_rows_runs_read_their_own_row_of_the_batch() {
        let mut st = CpuStorage::new(shape()).unwrap();
        // 2 rows of heads 2, 2 tokens, dim 3: k[r, h, t, e] = 1000r + 100h
        // + 10t + e + 1 (never 0); v (dim 1) = -(1 + its index).
        let k: Vec<f32> = (0..24)
            .map(|i| (1000 * (i / 12) + 100 * (i / 6 % 2) + 10 * (i / 3 % 2) + i % 3 + 1) as f32)
            .collect();
        let v: Vec<f32> = (0..8).map(|i| -(i as f32) - 1.0).collect();
        // Row 0's token 1 into block 1 slot 0; row 1's tokens 0, 1 into
        // block 2 slots 0, 1.
        let row0 = [WriteRun {
            block: 1,
            offset: 0,
            source: 1..2,
        }];
        let row1 = [WriteRun {
            block: 2,
            offset: 0,
            source: 0..2,
        }];
        st.write(
            0,
            2,
            &[&row0, &row1],
            Slice::F32(&k).into(),
            Slice::F32(&v).into(),
        )
        .unwrap();
        let (Buffer::F32(kp), Buffer::F32(vp)) = st.read(0).unwrap() else {
            panic!()
        };
        let at = |b: usize, h: usize, slot: usize| ((b * 2 + h) * 2 + slot) * 3;
        assert_eq!(kp[at(1, 0, 0)..at(1, 0, 0) + 3], [11.0, 12.0, 13.0]);
        assert_eq!(kp[at(1, 1, 0)..at(1, 1, 0) + 3], [111.0, 112.0, 113.0]);
        assert_eq!(
            kp[at(2, 1, 0)..at(2, 1, 0) + 6],
            [1101.0, 1102.0, 1103.0, 1111.0, 1112.0, 1113.0]
        );
        // v (rows 2, heads 2, 2 tokens, dim 1) = -1 .. -8: row 0's token 1
        // is -2 (head 0) and -4 (head 1), row 1's tokens -5, -6 and -7, -8.
        assert_eq!(vp[4..], [-2.0, 0.0, -4.0, 0.0, -5.0, -6.0, -7.0, -8.0]);
        assert_eq!(vp[..4], [0.0; 4]);
        // Block 0 and layer 1 untouched.
        assert!(kp[..12].iter().all(|&x| x == 0.0));
        let (Buffer::F32(k1), _) = st.read(1).unwrap() else {
            panic!()
        };
        assert!(k1.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn refuses_device_inputs_and_other_dtypes_by_name() {
        let mut st = CpuStorage::new(shape()).unwrap();
        let k = [1.0f64; 6];
        let v = [1.0f32; 2];
        let runs = [WriteRun {
            block: 0,
            offset: 0,
            source: 0..1,
        }];
        let e = st
            .write(0, 1, &[&runs], Slice::F64(&k).into(), Slice::F32(&v).into())
            .unwrap_err();
        assert!(e.to_string().starts_with("k has dtype float64"), "{e}");
    }
}
