//! The binding of flashport-core's KV cache: `flashport._core.KVCache`,
//! the object behind `flashport.KVCache`. The cache sits behind a
//! read-write lock taken with the GIL released: appends, forks and frees
//! take it alone, attention calls share it, so Python threads may call
//! any method concurrently.

use std::sync::{PoisonError, RwLock};

use flashport_core as core;
use flashport_core::kvcache::{ArrayArg, CacheArgs, CacheShape};
use flashport_core::{DType, Input, Placement};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::arrays::{int_values, to_python, ArgMeta, Contiguous, Held};
use crate::detach::run_detached;
use crate::errors::raise;
use crate::numpy_out::to_numpy;
use crate::scalars;
use crate::variants::{variant_arrays, HeldVariants, VariantArgs};

/// An array the cache reads (k, v, q): held in its own float dtype, or
/// not at all when it has no float dtype (the core then names the
/// argument and its dtype).
fn hold<'py>(array: &Bound<'py, PyAny>, meta: &ArgMeta) -> PyResult<Option<Held<'py>>> {
    DType::from_numpy_name(&meta.dtype)
        .map(|dtype| Held::new(array, dtype))
        .transpose()
}

/// A held array's data, or an empty one for an array not held.
fn data<'a>(held: &'a Option<Contiguous<'a>>) -> Input<'a> {
    held.as_ref()
        .map_or(Input::Host(core::Slice::F32(&[])), Contiguous::input)
}

/// Calls `f` with an append's `k`, `v` and `tokens` as the core reads
/// them (the core checks their shapes and dtypes).
fn with_appended<R>(
    k: &Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
    tokens: Option<&Bound<'_, PyAny>>,
    f: impl FnOnce(ArrayArg<'_>, ArrayArg<'_>, Option<core::IntArray<'_>>) -> PyResult<R>,
) -> PyResult<R> {
    let (k_meta, v_meta) = (ArgMeta::read_main("k", k)?, ArgMeta::read_main("v", v)?);
    let (k_held, v_held) = (hold(k, &k_meta)?, hold(v, &v_meta)?);
    let (k_data, v_data) = (
        k_held.as_ref().map(|h| h.contiguous("k")).transpose()?,
        v_held.as_ref().map(|h| h.contiguous("v")).transpose()?,
    );
    let k = ArrayArg {
        info: k_meta.info(),
        data: data(&k_data),
    };
    let v = ArrayArg {
        info: v_meta.info(),
        data: data(&v_data),
    };
    let t_meta = tokens.map(|t| ArgMeta::read("tokens", t)).transpose()?;
    let t_values = match (tokens, &t_meta) {
        (Some(t), Some(meta)) => int_values("tokens", t, &meta.dtype)?,
        _ => Vec::new(),
    };
    let tokens = t_meta.as_ref().map(|meta| core::IntArray {
        shape: &meta.shape,
        dtype: &meta.dtype,
        values: &t_values,
    });
    f(k, v, tokens)
}

/// KVCache(num_blocks, block_size, heads_kv, head_dim, head_dim_v, layers,
/// dtype, device, swap_blocks): the private class behind `flashport.KVCache`; see its
/// docstrings for the contract.
#[pyclass(frozen, module = "flashport._core", name = "KVCache")]
pub struct KvCacheHandle {
    inner: RwLock<core::KvCache>,
    /// The cache's geometry, fixed at construction.
    shape: CacheShape,
}

impl KvCacheHandle {
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        if self.inner.is_poisoned() {
            return Err(raise(
                py,
                "InternalError",
                "this KVCache hit an internal error in an earlier call and can no longer be \
                 used (please report it)"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// Runs `f` on the cache with the GIL released, alone.
    fn write<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut core::KvCache) -> core::Result<R> + Send,
    ) -> PyResult<R> {
        self.check(py)?;
        run_detached(py, || {
            f(&mut self.inner.write().unwrap_or_else(PoisonError::into_inner))
        })
    }

    /// Runs `f` on the cache with the GIL released, beside other readers.
    fn read<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&core::KvCache) -> core::Result<R> + Send,
    ) -> PyResult<R> {
        self.check(py)?;
        run_detached(py, || {
            f(&self.inner.read().unwrap_or_else(PoisonError::into_inner))
        })
    }
}

#[pymethods]
impl KvCacheHandle {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, heads_kv, head_dim, head_dim_v, layers, dtype, device, swap_blocks))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        heads_kv: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        head_dim_v: Option<&Bound<'_, PyAny>>,
        layers: &Bound<'_, PyAny>,
        dtype: &str,
        device: Option<&str>,
        swap_blocks: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let args = CacheArgs {
            num_blocks: scalars::index("num_blocks", num_blocks)?,
            block_size: scalars::index("block_size", block_size)?,
            heads_kv: scalars::index("heads_kv", heads_kv)?,
            head_dim: scalars::index("head_dim", head_dim)?,
            head_dim_v: head_dim_v
                .map(|d| scalars::index("head_dim_v", d))
                .transpose()?,
            layers: scalars::index("layers", layers)?,
            dtype,
            swap_blocks: scalars::index("swap_blocks", swap_blocks)?,
        };
        let cache = run_detached(py, || core::KvCache::new(&args, device))?;
        Ok(KvCacheHandle {
            shape: *cache.shape(),
            inner: RwLock::new(cache),
        })
    }

    fn new_sequence(&self, py: Python<'_>) -> PyResult<u64> {
        self.write(py, |c| Ok(c.new_sequence()))
    }

    fn fork(&self, py: Python<'_>, sid: &Bound<'_, PyAny>) -> PyResult<u64> {
        let sid = scalars::seq_id("sid", sid)?;
        self.write(py, |c| c.fork(sid))
    }

    fn free(&self, py: Python<'_>, sid: &Bound<'_, PyAny>) -> PyResult<()> {
        let sid = scalars::seq_id("sid", sid)?;
        self.write(py, |c| c.free(sid))
    }

    /// swap_out(seq_ids): the sequences' blocks to the swap space, together.
    fn swap_out(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = scalars::indices("seq_ids", seq_ids)?;
        self.write(py, |c| c.swap_out(&ids))
    }

    /// swap_in(seq_ids): the sequences back into the pools, together.
    fn swap_in(&self, py: Python<'_>, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = scalars::indices("seq_ids", seq_ids)?;
        self.write(py, |c| c.swap_in(&ids))
    }

    fn is_swapped(&self, py: Python<'_>, sid: &Bound<'_, PyAny>) -> PyResult<bool> {
        let sid = scalars::seq_id("sid", sid)?;
        self.read(py, |c| c.is_swapped(sid))
    }

    /// swapped() -> list[int]: the swapped-out sequences' ids, increasing.
    fn swapped(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.read(py, |c| Ok(c.manager().swapped_ids().collect()))
    }

    /// (swap blocks, free swap blocks).
    fn swap_usage(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.read(py, |c| {
            let swap = c.manager().swap_pool();
            Ok((swap.num_blocks(), swap.num_free()))
        })
    }

    #[pyo3(signature = (sid, k, v, layer, tokens))]
    fn append(
        &self,
        py: Python<'_>,
        sid: &Bound<'_, PyAny>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (sid, layer) = (
            scalars::seq_id("sid", sid)?,
            scalars::index("layer", layer)?,
        );
        with_appended(k, v, tokens, |k, v, tokens| {
            self.write(py, |c| c.append(sid, layer, k, v, tokens))
        })
    }

    #[pyo3(signature = (seq_ids, k, v, layer, tokens))]
    fn append_batch(
        &self,
        py: Python<'_>,
        seq_ids: &Bound<'_, PyAny>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids = scalars::indices("seq_ids", seq_ids)?;
        let layer = scalars::index("layer", layer)?;
        with_appended(k, v, tokens, |k, v, tokens| {
            self.write(py, |c| c.append_batch(&ids, layer, k, v, tokens))
        })
    }

    #[pyo3(signature = (q, seq_ids, layer, variants, num_splits, return_lse))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        seq_ids: &Bound<'py, PyAny>,
        layer: &Bound<'py, PyAny>,
        variants: VariantArgs<'py>,
        num_splits: &Bound<'py, PyAny>,
        return_lse: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        // Checked for the Python wrapper, which returns lse only when set.
        scalars::flag("return_lse", return_lse)?;
        let ids = scalars::indices("seq_ids", seq_ids)?;
        let layer = scalars::index("layer", layer)?;
        let q_meta = ArgMeta::read_main("q", q)?;
        let q_held = hold(q, &q_meta)?;
        let q_data = q_held.as_ref().map(|h| h.contiguous("q")).transpose()?;
        let q = ArrayArg {
            info: q_meta.info(),
            data: data(&q_data),
        };
        let variant_metas = variants.metas()?;
        let num_splits = scalars::integer("num_splits", num_splits)?;
        let options = core::KvCacheOptions {
            variants: variants.options(&variant_metas)?,
            num_splits,
        };
        // The KV cache takes no mask (validation refuses one).
        let held_variants = HeldVariants::new(&variants, None)?;
        let arrays = variant_arrays(&held_variants, &None, &None);
        let placement = Placement::of_inputs(&[q.data]);
        let (out, problem) = self.read(py, |c| {
            c.attention(q, &ids, layer, &options, &arrays, placement)
        })?;
        Ok((
            to_python(py, out.out, &problem.out_shape())?,
            to_python(py, out.lse, &problem.lse_shape())?,
        ))
    }

    #[pyo3(signature = (sid, layer))]
    fn length(
        &self,
        py: Python<'_>,
        sid: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let sid = scalars::seq_id("sid", sid)?;
        let layer = layer.map(|l| scalars::index("layer", l)).transpose()?;
        self.read(py, |c| c.length(sid, layer))
    }

    /// block_table(seq_ids) -> int32 array (len(seq_ids), most blocks held),
    /// padded with -1 (int64 for a pool of more than 2**31 blocks).
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = scalars::indices("seq_ids", seq_ids)?;
        let (table, width) = self.read(py, |c| c.block_table(&ids))?;
        let shape = [ids.len(), width];
        if self.shape.num_blocks <= i32::MAX as usize {
            let narrow: Vec<i32> = table.iter().map(|&b| b as i32).collect();
            Ok(PyArray1::from_vec(py, narrow).reshape(shape)?.into_any())
        } else {
            Ok(PyArray1::from_vec(py, table).reshape(shape)?.into_any())
        }
    }

    /// ref_counts() -> int64 array (num_blocks,): the sequences holding
    /// each block.
    fn ref_counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let counts = self.read(py, |c| {
            Ok(c.manager()
                .pool()
                .ref_counts()
                .iter()
                .map(|&n| n as i64)
                .collect::<Vec<i64>>())
        })?;
        Ok(PyArray1::from_vec(py, counts).into_any())
    }

    /// read_layer(layer) -> (k_pool, v_pool): copies of a layer's pools.
    fn read_layer<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let layer = scalars::index("layer", layer)?;
        let (k, v) = self.read(py, |c| c.read_layer(layer))?;
        Ok((
            to_numpy(py, k, &self.shape.k_pool_shape())?,
            to_numpy(py, v, &self.shape.v_pool_shape())?,
        ))
    }

    /// sequences() -> list[int]: the live sequences' ids, increasing.
    fn sequences(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.read(py, |c| Ok(c.manager().sequence_ids().collect()))
    }

    /// (num_blocks, block_size, heads_kv, head_dim, head_dim_v, layers,
    /// dtype name, device, nbytes)
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let device = self.read(py, |c| Ok(c.device()))?;
        let s = self.shape;
        let nbytes = s.nbytes().unwrap_or(usize::MAX);
        (
            s.num_blocks,
            s.block_size,
            s.heads_kv,
            s.head_dim,
            s.head_dim_v,
            s.layers,
            s.dtype.numpy_name(),
            device,
            nbytes,
        )
            .into_pyobject(py)
    }

    /// (free, used, cached) block counts.
    fn usage(&self, py: Python<'_>) -> PyResult<(usize, usize, usize)> {
        self.read(py, |c| {
            let pool = c.manager().pool();
            Ok((pool.num_free(), pool.num_used(), pool.num_cached()))
        })
    }
}
