"""flashport.KVCache: a paged KV cache for generation (block pool, block
tables, reference-counted sharing, copy-on-write, prefix reuse). The
bookkeeping, the storage and all validation (integer arguments included)
live in the Rust core (``flashport._core.KVCache``); this module forwards
the arguments as given and states the contract."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, overload

import numpy as np
import numpy.typing as npt

from . import _core
from ._attention import Tensor, Window, _main_array, _result, _variants
from ._device import DeviceArray, as_native_array
from ._errors import DTypeError, InvalidArgumentError

__all__ = ["KVCache"]


def _ids(seq_ids: int | Iterable[int]) -> Iterable[int]:
    """A swap's sequence ids as the core takes them: one id becomes a list
    of one (the core checks every id, and refuses a bool)."""
    if isinstance(seq_ids, int | np.integer) and not isinstance(seq_ids, bool):
        return [seq_ids]
    return seq_ids


def _tokens(tokens: npt.ArrayLike | None) -> np.ndarray | None:
    """An append's token ids as the core takes them (which checks their
    dtype and shape): NumPy only, since the host reads them."""
    if isinstance(tokens, DeviceArray):
        raise InvalidArgumentError(
            "tokens is a flashport.DeviceArray: token ids are read on the host and must "
            "be a NumPy integer array"
        )
    if tokens is None:
        return None
    tokens = as_native_array(tokens)
    if tokens.size == 0 and tokens.dtype.kind == "f":
        # np.asarray([]) is float64; no token is no token.
        tokens = tokens.astype(np.int64)
    return tokens


class KVCache:
    """A paged cache of attention keys and values for generation, its pools
    in host memory (``device="cpu"``) or GPU memory (``device="gpu"``).

    ``KVCache(num_blocks, block_size, heads_kv, head_dim, *, head_dim_v=None,
    layers=1, dtype=np.float32, device=None)`` preallocates, for each of
    ``layers`` layers, a key pool ``(num_blocks, heads_kv, block_size,
    head_dim)`` and a value pool ``(num_blocks, heads_kv, block_size,
    head_dim_v)``: the paged layout of :func:`flashport.attention_with_kvcache`.
    Any ``block_size >= 1``; ``dtype`` float16, bfloat16 (``ml_dtypes``),
    float32 or float64.

    Sequences and layers
    --------------------
    A sequence is an int id from :meth:`new_sequence` (or :meth:`fork`); ids
    are never reused. Its positions live in blocks listed by its block table;
    **a block spans every layer** (block ``b`` is slot range ``b`` of every
    layer's pools), so a sequence has one table for all layers, and **each
    layer has its own length**: the positions appended on that layer. A
    model's forward over ``n`` new tokens does, for each layer ``l``::

        cache.append(sid, k_l, v_l, layer=l, tokens=new_tokens)  # (heads_kv, n, d)
        o_l = cache.attention(q_l, [sid], layer=l)               # sees layer l's length

    A decode step of a batch appends to every sequence at once, one call per
    layer (:meth:`append_batch`: the same as the appends in order, in one
    write)::

        cache.append_batch(seq_ids, k_l, v_l, layer=l)     # (len(seq_ids), heads_kv, 1, d)
        o_l = cache.attention(q_l, seq_ids, layer=l)

    The first layer to reach past the sequence's blocks takes new blocks (for
    all layers); the others find them. ``length(sid)`` is the positions
    written on every layer (the smallest layer length); ``length(sid,
    layer=l)`` is one layer's.

    Sharing
    -------
    Every block has a reference count, the number of sequences holding it.
    Free blocks (count 0) wait in a queue: freed blocks join its back, new
    blocks come from its front (the order is deterministic).

    * :meth:`fork` shares every block, a partly filled last one included
      (counts go up; no block is needed). Beam search is fork + free;
      parallel sampling is ``n`` forks of the prompt.
    * **Copy-on-write:** the first append into a block held by more than one
      sequence copies that block (all its layers) into a fresh block first,
      so no sequence ever sees another's tokens.
    * :meth:`free` counts the sequence's blocks down (last block first);
      blocks at 0 return to the queue.
    * **Prefix reuse** (vLLM's prefix caching), when appends give the
      ``tokens`` of their positions: a full block is identified by a 128-bit
      hash chained over its whole prefix (the parent block's hash, the
      block's tokens; the chain's root is the cache's identity: layers,
      heads, dimensions, block size, dtype). A block is cached once it is
      full on every layer and its tokens are known. An append that reaches a
      new block and covers all of its positions, with tokens known from
      position 0 through that block, adopts the cached block of the same
      prefix (count up) instead of storing a copy; positions in an adopted
      block are not written, on that layer or any later one. A freed cached
      block keeps its hash and stays adoptable until the queue hands it out
      for new data (least recently freed first).

    Shared: full blocks of the same token prefix at the same positions, and
    after a fork every block until one side writes into it. Not shared: a
    partly filled block (except between a sequence and its forks until the
    first write), blocks appended without tokens, and a block whose prefix
    another block already held when it filled (it stays an unshared
    duplicate, as in vLLM). Like vLLM, prefix reuse trusts that the same
    tokens at the same positions give the same keys and values on every layer
    (the same model, weights and positions): the keys and values an append
    gives for an adopted block's positions are skipped, not compared.

    ``tokens`` may be given on the first layer's append or on every layer's;
    positions whose tokens are known must get the same ones again, and
    tokens must continue the known tokens from position 0 (after positions
    appended without tokens on every layer, later tokens are refused). A fork
    inherits its parent's tokens. Adoption happens on the append that first
    reaches a block, so give the tokens with the first layer's append to
    reuse a prefix; tokens given only on later layers still let the
    sequence's full blocks be cached for others.

    Swapping
    --------
    With ``swap_blocks > 0`` the cache has a swap space in host memory
    (PagedAttention's swapping; a budget of its own, on the CPU too), for a
    scheduler that preempts sequences when the pool runs short.
    :meth:`swap_out` moves sequences (a request's forks together) out of
    the pool: each distinct block they hold is copied to a host block once
    (one device read for the whole call), then they leave the pool as
    :meth:`free` would leave it. :meth:`swap_in` brings them back into
    fresh blocks (one device write): every key, value, length, token and
    prefix hash is as before. A block shared with a sequence that stays
    keeps serving it and is copied for the swapped one, which gets its own
    copy back (sharing resumes only through prefix reuse). A swapped
    sequence may be swapped in, freed, measured (:meth:`length`) or asked
    about (:meth:`is_swapped`); attention, appends, forks and block tables
    raise :class:`InvalidArgumentError` until it is swapped in. Either swap
    raises :class:`CacheFullError` with nothing changed when the swap space
    (out) or the pool (in) has too few free blocks.

    Errors and threads
    ------------------
    Each mutating call checks its arguments and plans all of its work (blocks
    taken, adopted, copied) before it changes anything: an append that needs
    more free blocks than there are raises :class:`CacheFullError` (a
    ``MemoryError``) and leaves the cache, its counts and every sequence as
    they were; so does any failure of :meth:`append_batch`, whichever row it
    is in. An unknown or freed sequence id raises
    :class:`UnknownSequenceError` (a ``KeyError``), a layer out of range
    :class:`InvalidArgumentError`, wrong shapes :class:`ShapeError`, wrong
    dtypes :class:`DTypeError`, each naming the argument. The cache is safe
    to use from several Python threads: appends, forks and frees run one at
    a time, attention calls run together, all with the GIL released.

    Arguments
    ---------
    num_blocks, block_size : int
        The pool's blocks and the token slots of each (both ``>= 1``).
    heads_kv, head_dim : int
        Key/value heads and the key head dimension.
    head_dim_v : int, optional
        The value head dimension; ``head_dim`` by default.
    layers : int
        Layers whose keys and values each block holds (default 1).
    dtype : float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64
        Of the pools, and of every ``k``, ``v`` and ``q`` passed (not cast).
    swap_blocks : int
        Host blocks of the swap space (default 0: no swapping), each one
        block of every layer's keys and values.
    device : None, "auto", "cpu", "gpu" or "gpu:N"
        Where the pools live. ``None`` follows ``FLASHPORT_DEVICE`` like
        every flashport call; ``"auto"`` and ``"cpu"`` keep them in host
        memory. ``"gpu"`` (the default GPU) and ``"gpu:N"`` (that one of
        :func:`flashport.devices`) allocate them in GPU memory (float16 or float32;
        float64 raises :class:`DTypeError`; no adapter raises
        :class:`BackendUnavailableError`): appends write on the device
        (``k`` and ``v`` may be NumPy arrays, uploaded token by token, or
        DeviceArrays), copy-on-write copies there, and attention decodes
        directly on the pool. A pool larger than one GPU storage binding is
        kept in several buffers; a block larger than one raises
        :class:`ProblemTooLargeError`.
    """

    __slots__ = ("_cache", "_config")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        heads_kv: int,
        head_dim: int,
        *,
        head_dim_v: int | None = None,
        layers: int = 1,
        dtype: npt.DTypeLike = np.float32,
        device: str | None = None,
        swap_blocks: int = 0,
    ) -> None:
        try:
            dtype_name = np.dtype(dtype).name
        except TypeError:
            raise DTypeError(
                f"dtype={dtype!r}: not a NumPy dtype; a KVCache holds float16, bfloat16, "
                "float32 or float64"
            ) from None
        if device is not None and not isinstance(device, str):
            raise InvalidArgumentError(
                f'device={device!r}: expected None, "auto", "cpu", "gpu" or "gpu:N"'
            )
        self._cache = _core.KVCache(
            num_blocks,
            block_size,
            heads_kv,
            head_dim,
            head_dim_v,
            layers,
            dtype_name,
            device,
            swap_blocks,
        )
        self._config = self._cache.config()

    # -- sequences ---------------------------------------------------------

    def new_sequence(self) -> int:
        """A new, empty sequence's id (no block is taken until it is
        appended to)."""
        return self._cache.new_sequence()

    def fork(self, sid: int) -> int:
        """A new sequence sharing every block of ``sid`` (its partly filled
        last block too), with the same layer lengths and tokens. Each
        block's reference count goes up by one; no block is taken, so fork
        never raises :class:`CacheFullError`."""
        return self._cache.fork(sid)

    def free(self, sid: int) -> None:
        """Ends sequence ``sid``: its blocks' counts go down by one, blocks at
        0 return to the free queue (cached ones stay adoptable until reused).
        The id is unknown from then on."""
        self._cache.free(sid)

    def swap_out(self, seq_ids: int | Iterable[int]) -> None:
        """Moves sequence(s) ``seq_ids`` (an id, or ids swapped together:
        a request's forks) out of the pool into the swap space; see
        Swapping. Raises :class:`CacheFullError`, changing nothing, when the
        swap space has fewer free blocks than the distinct blocks they
        hold."""
        self._cache.swap_out(_ids(seq_ids))

    def swap_in(self, seq_ids: int | Iterable[int]) -> None:
        """Brings swapped sequence(s) ``seq_ids`` back into fresh blocks of
        the pool, every value as it was; see Swapping. Raises
        :class:`CacheFullError`, changing nothing, when the pool has fewer
        free blocks than the distinct host blocks they hold."""
        self._cache.swap_in(_ids(seq_ids))

    def is_swapped(self, sid: int) -> bool:
        """Whether sequence ``sid`` is swapped out (an unknown id raises
        :class:`UnknownSequenceError`)."""
        return self._cache.is_swapped(sid)

    def append(
        self,
        sid: int,
        k: Tensor,
        v: Tensor,
        *,
        layer: int = 0,
        tokens: npt.ArrayLike | None = None,
    ) -> None:
        """Appends ``n`` positions to ``layer`` of sequence ``sid``.

        ``k`` is ``(heads_kv, n, head_dim)`` and ``v`` ``(heads_kv, n,
        head_dim_v)``, in the cache's dtype; they are copied into their slots
        (the cost is the ``n`` positions, not the sequence). ``tokens``, an
        integer array ``(n,)``, gives the positions' token ids for prefix
        reuse (see the class docstring). Blocks are taken from the free queue
        as the layer's length passes the sequence's blocks; a shared block
        written into is copied first. Everything is checked and planned
        before anything changes; :class:`CacheFullError` if the free blocks
        do not suffice.
        """
        self._cache.append(sid, _main_array(k), _main_array(v), layer, _tokens(tokens))

    def append_batch(
        self,
        seq_ids: Iterable[int],
        k: Tensor,
        v: Tensor,
        *,
        layer: int = 0,
        tokens: npt.ArrayLike | None = None,
    ) -> None:
        """Appends ``n`` positions to ``layer`` of each sequence of
        ``seq_ids`` in one call: a decode step of a batch (``n = 1``) is one
        ``append_batch`` and one :meth:`attention` per layer.

        ``k`` is ``(len(seq_ids), heads_kv, n, head_dim)`` and ``v``
        ``(len(seq_ids), heads_kv, n, head_dim_v)``, row ``b`` for sequence
        ``seq_ids[b]`` (the layout of :meth:`attention`'s ``q``); ``tokens``,
        if given, is an integer array ``(len(seq_ids), n)``. Every sequence
        gets the same ``n``; a sequence may appear only once
        (:class:`InvalidArgumentError` otherwise).

        The result is exactly that of ``append(seq_ids[b], k[b], v[b],
        layer=layer, tokens=tokens[b])`` for ``b = 0, 1, ...`` in order: the
        same blocks taken from the free queue in the same order, the same
        copy-on-write and prefix reuse (a block an earlier row fills and
        caches can be adopted by a later row), the same bits in the pools.
        It is one call into the core and one write of the pools (on the GPU
        one upload of ``k`` and one of ``v``, one scatter, queued without
        waiting). Every row is checked and planned before the call returns
        anything: if any row fails (:class:`CacheFullError` when the free
        blocks do not suffice for the rows together, refused tokens, an
        unknown id) the cache is exactly as it was, rows before it included.
        """
        self._cache.append_batch(seq_ids, _main_array(k), _main_array(v), layer, _tokens(tokens))

    @overload
    def attention(
        self,
        q: Tensor,
        seq_ids: Iterable[int],
        *,
        layer: int = ...,
        causal: bool = ...,
        scale: float | None = ...,
        window: Window | None = ...,
        alibi_slopes: npt.ArrayLike | None = ...,
        softcap: float | None = ...,
        sinks: npt.ArrayLike | None = ...,
        num_splits: int | None = ...,
        return_lse: Literal[False] = ...,
    ) -> np.ndarray: ...
    @overload
    def attention(
        self,
        q: Tensor,
        seq_ids: Iterable[int],
        *,
        layer: int = ...,
        causal: bool = ...,
        scale: float | None = ...,
        window: Window | None = ...,
        alibi_slopes: npt.ArrayLike | None = ...,
        softcap: float | None = ...,
        sinks: npt.ArrayLike | None = ...,
        num_splits: int | None = ...,
        return_lse: Literal[True],
    ) -> tuple[np.ndarray, np.ndarray]: ...
    def attention(
        self,
        q: Tensor,
        seq_ids: Iterable[int],
        *,
        layer: int = 0,
        causal: bool = True,
        scale: float | None = None,
        window: Window | None = None,
        alibi_slopes: npt.ArrayLike | None = None,
        softcap: float | None = None,
        sinks: npt.ArrayLike | None = None,
        num_splits: int | None = None,
        return_lse: bool = False,
    ) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
        """Attention of ``q`` over ``layer`` of the sequences ``seq_ids``.

        ``q`` is ``(len(seq_ids), heads_q, seq_q, head_dim)`` in the cache's
        dtype, ``heads_q`` a multiple of ``heads_kv`` (GQA); row ``b`` is
        sequence ``seq_ids[b]``, whose query row ``i`` is at position
        ``length(seq_ids[b], layer=layer) - seq_q + i`` (the queries are the
        sequence's last ``seq_q`` positions, appended already). Sequences of
        different lengths batch together, a sequence may appear more than
        once. Computed by :func:`attention_with_kvcache` directly on the
        layer's pools with the sequences' block table (no gather into
        contiguous memory); ``causal`` (default ``True``), ``scale``,
        ``window``, ``alibi_slopes``, ``softcap``, ``sinks``, ``num_splits``
        and ``return_lse`` mean what they mean there.

        Returns ``o`` ``(len(seq_ids), heads_q, seq_q, head_dim_v)`` in the
        cache's dtype, and with ``return_lse=True`` also the log-sum-exp
        ``(len(seq_ids), heads_q, seq_q)``.
        """
        out, lse = self._cache.attention(
            _main_array(q),
            seq_ids,
            layer,
            _variants(
                causal=causal,
                scale=scale,
                window=window,
                alibi_slopes=alibi_slopes,
                softcap=softcap,
                sinks=sinks,
            ),
            num_splits,
            return_lse,
        )
        return (_result(out), _result(lse)) if return_lse else _result(out)

    # -- queries -----------------------------------------------------------

    def length(self, sid: int, *, layer: int | None = None) -> int:
        """Positions of sequence ``sid`` written on every layer, or on
        ``layer`` if it is given."""
        return self._cache.length(sid, layer)

    def block_table(self, seq_ids: Iterable[int]) -> np.ndarray:
        """The sequences' block tables: int32 ``(len(seq_ids), most blocks
        any of them holds)``, row ``b`` listing sequence ``seq_ids[b]``'s
        blocks in position order, padded with -1. With the pools of
        :meth:`read_layer` and the layer lengths it is what
        :func:`attention_with_kvcache` reads."""
        return self._cache.block_table(seq_ids)

    def ref_counts(self) -> np.ndarray:
        """int64 ``(num_blocks,)``: how many sequences hold each block."""
        return self._cache.ref_counts()

    def read_layer(self, layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``layer``'s pools: keys ``(num_blocks, heads_kv,
        block_size, head_dim)`` and values ``(..., head_dim_v)``. Slots no
        sequence has written hold anything."""
        return self._cache.read_layer(layer)

    @property
    def sequences(self) -> list[int]:
        """The live sequences' ids (in the pool or swapped out), in
        increasing order."""
        return sorted(self._cache.sequences() + self._cache.swapped())

    @property
    def swapped(self) -> list[int]:
        """The swapped-out sequences' ids, in increasing order."""
        return self._cache.swapped()

    def __contains__(self, sid: object) -> bool:
        # The ids every method takes: integers, never a bool (which the
        # methods refuse; True is not sequence 1). Anything else is no id
        # of a live sequence, as a dict answers for a key of another type.
        if isinstance(sid, bool) or not isinstance(sid, int | np.integer):
            return False
        return int(sid) in self.sequences

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are reused
        when needed)."""
        return self._cache.usage()[0]

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence; ``num_free_blocks +
        num_used_blocks == num_blocks``."""
        return self._cache.usage()[1]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix (adoptable by prefix), used or
        free."""
        return self._cache.usage()[2]

    @property
    def num_swap_blocks(self) -> int:
        """Host blocks of the swap space (``swap_blocks``)."""
        return self._cache.swap_usage()[0]

    @property
    def num_free_swap_blocks(self) -> int:
        """Host blocks of the swap space no swapped sequence holds."""
        return self._cache.swap_usage()[1]

    @property
    def num_blocks(self) -> int:
        return self._config[0]

    @property
    def block_size(self) -> int:
        return self._config[1]

    @property
    def heads_kv(self) -> int:
        return self._config[2]

    @property
    def head_dim(self) -> int:
        return self._config[3]

    @property
    def head_dim_v(self) -> int:
        return self._config[4]

    @property
    def layers(self) -> int:
        return self._config[5]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._config[6])

    @property
    def device(self) -> str:
        """Where the pools live: ``"cpu"`` or ``"gpu:N"``."""
        return self._config[7]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's key and value pools."""
        return self._config[8]

    def __repr__(self) -> str:
        free, used, _ = self._cache.usage()
        return (
            f"KVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"heads_kv={self.heads_kv}, head_dim={self.head_dim}, "
            f"head_dim_v={self.head_dim_v}, layers={self.layers}, dtype={self.dtype.name}, "
            f"device={self.device!r}; {used} blocks used, {free} free, "
            f"{len(self.sequences)} sequences)"
        )
