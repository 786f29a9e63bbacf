"""flashport.KVCache against a plain-Python model of its documented rules.

A hypothesis state machine drives random interleavings of new_sequence,
append (model-like: each step's positions appended layer by layer, with or
without tokens, spanning any number of blocks), append_batch (the same for
several sequences in one call, checked against the model's appends row by
row), fork, free and attention.
The model keeps each sequence's keys and values per layer as lists, and the
pool's bookkeeping by the rules of the class docstring (free queue order,
reference counts, copy-on-write, prefix reuse by the token prefix itself).
After every step: attention over every live sequence and layer equals the
float64 oracle on the model's keys and values; each sequence's keys and
values gathered from the pools through its block table are exactly the
model's; block tables, reference counts, free/used/cached counts and
lengths are the model's; an append the pool cannot hold raises
CacheFullError with every observable state unchanged.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import flashport
import numpy as np
import pytest
from conftest import cache_state, gpu_adapters, overrides
from flashport import (
    BackendUnavailableError,
    CacheFullError,
    DTypeError,
    InvalidArgumentError,
    KVCache,
    ProblemTooLargeError,
    ShapeError,
    UnknownSequenceError,
    reference,
)
from hypothesis import event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

# Tolerance of attention against the float64 oracle, per cache dtype (the
# model's keys and values are already rounded to the dtype).
TOLERANCE = {"float16": 4e-3, "float32": 2e-5, "float64": 1e-10}

# A small vocabulary makes shared prefixes (and prefix hits) common.
VOCABULARY = 2

MASK = (1 << 62) - 1

# The pools' device for the scenarios (the state machine runs on every
# backend); explicit, so that FLASHPORT_DEVICE does not change what these
# tests run.
DEVICE = "cpu"


def make_cache(*args, device=DEVICE, **kw) -> flashport.KVCache:
    return flashport.KVCache(*args, device=device, **kw)


def kv_of(layer: int, key: int, heads_kv: int, d: int, dv: int, dtype) -> tuple:
    """The key and value of one position: a function of the layer and the
    whole token prefix up to it (``key``), as a model's would be, so that
    prefix reuse's trust holds. Standard normal, never zero."""
    rng = np.random.default_rng([layer, key])
    k = rng.standard_normal((heads_kv, d)).astype(dtype)
    v = rng.standard_normal((heads_kv, dv)).astype(dtype)
    return k, v


@dataclass
class Seq:
    """A sequence as the model sees it."""

    blocks: list[int]
    lengths: list[int]
    # Tokens the cache knows (given with appends), from position 0.
    tokens: list[int]
    # The sequence's true tokens and prefix keys (all positions appended on
    # some layer, and those of the step in flight).
    truth: list[int]
    prefix_keys: list[int]
    registered: int = 0
    # Per layer, per position: (k (heads_kv, d), v (heads_kv, dv)).
    kv: list[list[tuple]] = field(default_factory=list)

    def copy(self) -> Seq:
        return Seq(
            list(self.blocks),
            list(self.lengths),
            list(self.tokens),
            list(self.truth),
            list(self.prefix_keys),
            self.registered,
            [list(layer) for layer in self.kv],
        )


class CacheFull(Exception):
    pass


class TokensRefused(Exception):
    pass


class Model:
    """The rules of flashport.KVCache on block ids, with prefixes compared
    by their tokens (the cache compares their chained hashes)."""

    def __init__(self, num_blocks: int, block_size: int, layers: int, swap_blocks: int = 0) -> None:
        self.bs = block_size
        self.layers = layers
        self.num_blocks = num_blocks
        self.free_queue = list(range(num_blocks))
        self.count = [0] * num_blocks
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.cached: dict[tuple, int] = {}
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0
        # The swap space: sequences swapped out hold host blocks.
        self.swap_free = list(range(swap_blocks))
        self.swap_count = [0] * swap_blocks
        self.swapped: dict[int, Seq] = {}

    def new_sequence(self) -> int:
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = Seq([], [0] * self.layers, [], [], [], 0, [[] for _ in range(self.layers)])
        return sid

    def fork(self, sid: int) -> int:
        child = self.seqs[sid].copy()
        for b in child.blocks:
            self.count[b] += 1
        new = self.next_id
        self.next_id += 1
        self.seqs[new] = child
        return new

    def free(self, sid: int) -> None:
        if sid in self.swapped:
            for b in reversed(self.swapped.pop(sid).blocks):
                self._release_host(b)
            return
        for b in reversed(self.seqs.pop(sid).blocks):
            self.count[b] -= 1
            if self.count[b] == 0:
                self.free_queue.append(b)

    def _release_host(self, b: int) -> None:
        self.swap_count[b] -= 1
        if self.swap_count[b] == 0:
            self.swap_free.append(b)

    def swap_out(self, ids: list[int]) -> None:
        """One host block per distinct block, in table order; then the
        sequences leave the pool as free() leaves it. CacheFull having
        changed nothing when the swap space is short."""
        distinct: list[int] = []
        for sid in ids:
            distinct += [b for b in self.seqs[sid].blocks if b not in distinct]
        if len(distinct) > len(self.swap_free):
            raise CacheFull
        host = dict(zip(distinct, self.swap_free[: len(distinct)], strict=True))
        del self.swap_free[: len(distinct)]
        for sid in ids:
            seq = self.seqs.pop(sid)
            for b in reversed(seq.blocks):
                self.count[b] -= 1
                if self.count[b] == 0:
                    self.free_queue.append(b)
            seq.blocks = [host[b] for b in seq.blocks]
            for h in seq.blocks:
                self.swap_count[h] += 1
            seq.registered = 0
            self.swapped[sid] = seq

    def swap_in(self, ids: list[int]) -> None:
        """A fresh block from the queue's front per distinct host block;
        the full blocks with known tokens offered to the prefix cache again.
        CacheFull having changed nothing when the pool is short."""
        distinct: list[int] = []
        for sid in ids:
            distinct += [h for h in self.swapped[sid].blocks if h not in distinct]
        if len(distinct) > len(self.free_queue):
            raise CacheFull
        fresh = dict(zip(distinct, self.free_queue[: len(distinct)], strict=True))
        for b in fresh.values():
            self.free_queue.remove(b)
            if self.key_of[b] is not None:
                del self.cached[self.key_of[b]]
                self.key_of[b] = None
        for sid in ids:
            seq = self.swapped.pop(sid)
            for h in seq.blocks:
                self._release_host(h)
                self.count[fresh[h]] += 1
            seq.blocks = [fresh[h] for h in seq.blocks]
            full = min(min(seq.lengths) // self.bs, len(seq.tokens) // self.bs)
            for i in range(full):
                b = seq.blocks[i]
                prefix = tuple(seq.tokens[: (i + 1) * self.bs])
                if self.key_of[b] is None and prefix not in self.cached:
                    self.cached[prefix] = b
                    self.key_of[b] = prefix
            seq.registered = full
            self.seqs[sid] = seq

    def append(self, sid: int, layer: int, n: int, tokens: list[int] | None, kv: list) -> None:
        """Appends by the rules, or raises CacheFull / TokensRefused having
        changed nothing."""
        bs, seq = self.bs, self.seqs[sid]
        start = seq.lengths[layer]
        end = start + n
        known = len(seq.tokens)
        new_tokens: list[int] = []
        if tokens is not None and n > 0:
            if start > known:
                raise TokensRefused
            for i, t in enumerate(tokens):
                if start + i < known:
                    assert seq.tokens[start + i] == t
                else:
                    new_tokens.append(t)
        all_known = seq.tokens + new_tokens
        have = len(seq.blocks)
        reach = -(-end // bs) if n else 0
        shared = [
            i
            for i in range(start // bs, min(reach, have))
            if self.key_of[seq.blocks[i]] is None and self.count[seq.blocks[i]] > 1
        ]
        adopted, new = {}, []
        for i in range(have, max(reach, have)):
            prefix = tuple(all_known[: (i + 1) * bs]) if len(all_known) >= (i + 1) * bs else None
            if prefix is not None and prefix in self.cached:
                adopted[i] = self.cached[prefix]
            else:
                new.append(i)
        adopting_free = [b for b in adopted.values() if self.count[b] == 0]
        available = [b for b in self.free_queue if b not in adopting_free]
        need = len(shared) + len(new)
        if need > len(available):
            raise CacheFull
        fresh = available[:need]
        if adopted:
            event("prefix blocks adopted")
        if shared:
            event("copy-on-write")
        if any(self.key_of[b] is not None for b in fresh):
            event("cached block evicted")
        for b in adopted.values():
            if self.count[b] == 0:
                self.free_queue.remove(b)
            self.count[b] += 1
        for b in fresh:
            self.free_queue.remove(b)
            if self.key_of[b] is not None:
                del self.cached[self.key_of[b]]
                self.key_of[b] = None
            self.count[b] = 1
        take = iter(fresh)
        for i in shared:
            self.count[seq.blocks[i]] -= 1
            seq.blocks[i] = next(take)
        for i in range(have, max(reach, have)):
            seq.blocks.append(adopted[i] if i in adopted else next(take))
        seq.lengths[layer] = end
        seq.tokens += new_tokens
        seq.kv[layer] += kv
        full = min(min(seq.lengths) // bs, len(seq.tokens) // bs)
        for i in range(seq.registered, full):
            b = seq.blocks[i]
            prefix = tuple(seq.tokens[: (i + 1) * bs])
            if self.key_of[b] is None and prefix not in self.cached:
                self.cached[prefix] = b
                self.key_of[b] = prefix
        seq.registered = max(seq.registered, full)


def assert_same(before: dict, after: dict) -> None:
    # GPU pools are poisoned with NaN in the test suite until written: the
    # pools compare by their bytes.
    names = ("ids", "swapped", "swap", "swapped_lengths", "table", "counts", "usage", "lengths")
    for name in (*names, "pools"):
        assert before[name] == after[name], name


class KVCacheMachine(RuleBasedStateMachine):
    device = "cpu"

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 3, 4, 5, 7, 16]),
        heads_kv=st.integers(1, 2),
        group=st.sampled_from([1, 2, 3]),
        d=st.integers(1, 9),
        dv=st.integers(1, 9),
        layers=st.integers(1, 3),
        dtype=st.sampled_from(["float32", "float32", "float64", "float16"]),
        swap_blocks=st.sampled_from([0, 2, 6, 24]),
    )
    def setup(self, num_blocks, block_size, heads_kv, group, d, dv, layers, dtype, swap_blocks):
        if self.device == "gpu" and dtype == "float64":
            # The GPU refuses float64 (test_gpu_cache_errors).
            dtype = "float32"
        note(
            f"KVCache({num_blocks}, {block_size}, {heads_kv}, {d}, {dv}, {layers}, {dtype}, "
            f"swap_blocks={swap_blocks})"
        )
        self.cache = make_cache(
            num_blocks,
            block_size,
            heads_kv,
            d,
            head_dim_v=dv,
            layers=layers,
            dtype=dtype,
            device=self.device,
            swap_blocks=swap_blocks,
        )
        assert self.cache.device == {"gpu": "gpu:0"}.get(self.device, self.device)
        self.model = Model(num_blocks, block_size, layers, swap_blocks)
        self.shape = (heads_kv, heads_kv * group, d, dv)
        self.dtype = np.dtype(dtype)
        self.rng = np.random.default_rng(num_blocks * 1000 + block_size)
        # A text many sequences follow (so that prompts share prefixes).
        self.text = self.rng.integers(0, VOCABULARY, 4096).tolist()
        for _ in range(2):
            self.new_sequence()

    # -- rules ---------------------------------------------------------------

    @rule()
    def new_sequence(self):
        assert self.cache.new_sequence() == self.model.new_sequence()

    def _live(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.model.seqs)), label="sid")

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = self._live(data)
        assert self.cache.fork(sid) == self.model.fork(sid)

    @precondition(lambda self: self.model.seqs or self.model.swapped)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted({*self.model.seqs, *self.model.swapped})))
        self.cache.free(sid)
        self.model.free(sid)

    def _swap(self, data, pool, do, undo_model) -> None:
        """Swaps 1-3 distinct sequences of ``pool`` out or in, as the model
        says: done, or refused with CacheFullError and nothing changed."""
        ids = data.draw(
            st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=3, unique=True),
            label="seq_ids",
        )
        before = cache_state(self.cache)
        saved = self._snapshot_model(list(self.model.seqs))
        saved_swap = (
            list(self.model.swap_free),
            list(self.model.swap_count),
            {s: q.copy() for s, q in self.model.swapped.items()},
        )
        try:
            undo_model(ids)
        except CacheFull:
            event("swap refused: full")
            with pytest.raises(CacheFullError, match="nothing was changed"):
                do(ids)
            assert_same(before, cache_state(self.cache))
            assert (self.model.swap_free, self.model.swap_count) == saved_swap[:2]
            self._restore_model(saved)
            return
        event(f"swap of {len(ids)}")
        do(ids)

    @precondition(lambda self: self.model.seqs and self.model.swap_count)
    @rule(data=st.data())
    def swap_out(self, data):
        self._swap(data, self.model.seqs, self.cache.swap_out, self.model.swap_out)

    @precondition(lambda self: self.model.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        sid = sorted(self.model.swapped)[0]
        # A swapped sequence refuses attention (and appends) until then.
        _, heads_q, d, _ = self.shape
        q = np.zeros((1, heads_q, 1, d), self.dtype) + 1
        with pytest.raises(InvalidArgumentError, match="is swapped out"):
            self.cache.attention(q, [sid])
        self._swap(data, self.model.swapped, self.cache.swap_in, self.model.swap_in)

    def _next_append(self, sid: int, data, n: int | None = None) -> tuple[int, int]:
        """The layer and positions of the next append of a model's forward on
        a sequence: the step in flight on its next layer, or a new step on
        layer 0 (``n`` positions, or any number), whose true tokens follow
        the common text or not."""
        seq = self.model.seqs[sid]
        lengths = seq.lengths
        behind = [layer for layer in range(self.model.layers) if lengths[layer] < lengths[0]]
        if behind:
            return behind[0], lengths[0] - lengths[behind[0]]
        # Tokens of a step the cache refused are drawn again.
        del seq.truth[lengths[0] :], seq.prefix_keys[lengths[0] :]
        if n is None:
            bs = self.model.bs
            n = data.draw(
                st.one_of(st.integers(0, 2), st.integers(0, 3 * bs + 1)), label="positions"
            )
        start = lengths[0]
        if data.draw(st.integers(0, 4), label="follow the text") > 0:
            new = self.text[start : start + n]
        else:
            new = data.draw(
                st.lists(st.integers(0, VOCABULARY - 1), min_size=n, max_size=n), label="tokens"
            )
        for t in new:
            previous = seq.prefix_keys[-1] if seq.prefix_keys else 0
            seq.truth.append(t)
            seq.prefix_keys.append(hash((previous, t)) & MASK)
        return 0, n

    def _append(self, sid: int, layer: int, n: int, give: bool) -> None:
        """Appends to the cache and the model alike, or checks that both
        refuse (CacheFullError, refused tokens) and nothing changed."""
        seq = self.model.seqs[sid]
        start = seq.lengths[layer]
        tokens = seq.truth[start : start + n] if give else None
        heads_kv, _, d, dv = self.shape
        kv = [
            kv_of(layer, seq.prefix_keys[p], heads_kv, d, dv, self.dtype)
            for p in range(start, start + n)
        ]
        k = np.stack([x[0] for x in kv], axis=1) if n else np.empty((heads_kv, 0, d), self.dtype)
        v = np.stack([x[1] for x in kv], axis=1) if n else np.empty((heads_kv, 0, dv), self.dtype)
        before = cache_state(self.cache)
        state = (
            list(self.model.free_queue),
            list(self.model.count),
            dict(self.model.cached),
            list(self.model.key_of),
            seq.copy(),
        )
        try:
            self.model.append(sid, layer, n, tokens, kv)
        except CacheFull:
            note(f"CacheFull: append {n} to layer {layer} of {sid}")
            event("cache full")
            with pytest.raises(CacheFullError, match="nothing was changed"):
                self.cache.append(sid, k, v, layer=layer, tokens=tokens)
            assert_same(before, cache_state(self.cache))
            self._check_model_unchanged(sid, state)
            return
        except TokensRefused:
            event("tokens refused")
            with pytest.raises(InvalidArgumentError, match=r"tokens=.*without tokens"):
                self.cache.append(sid, k, v, layer=layer, tokens=np.asarray(tokens))
            assert_same(before, cache_state(self.cache))
            self._check_model_unchanged(sid, state)
            return
        self.cache.append(
            sid, k, v, layer=layer, tokens=None if tokens is None else np.asarray(tokens)
        )

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def append(self, data):
        """The next append of a model's forward on one sequence, with its
        tokens or without."""
        sid = self._live(data)
        layer, n = self._next_append(sid, data)
        self._append(sid, layer, n, data.draw(st.integers(0, 4), label="give tokens") > 0)

    @rule(data=st.data())
    def new_prompt(self, data):
        """A new request whose prompt starts like the others' (a shared
        system prompt), prefilled layer by layer with its tokens."""
        sid = self.model.new_sequence()
        assert self.cache.new_sequence() == sid
        n = data.draw(st.integers(1, 4 * self.model.bs), label="prompt")
        for _ in range(self.model.layers):
            layer, n = self._next_append(sid, data, n)
            self._append(sid, layer, n, True)

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def beam(self, data):
        """A step of beam search: fork a sequence, and the child appends one
        token on every layer (finishing a step in flight first)."""
        parent = self._live(data)
        child = self.cache.fork(parent)
        assert child == self.model.fork(parent)
        for _ in range(self.model.layers):
            layer, n = self._next_append(child, data, 1)
            self._append(child, layer, n, data.draw(st.integers(0, 4), label="give") > 0)

    def _next_key(self, sid: int) -> tuple:
        """What ``_next_append`` would give ``sid`` without drawing: the
        layer of its step in flight and the positions left, or ``None`` for
        a new step on layer 0."""
        lengths = self.model.seqs[sid].lengths
        behind = [layer for layer in range(self.model.layers) if lengths[layer] < lengths[0]]
        return (behind[0], lengths[0] - lengths[behind[0]]) if behind else None

    def _snapshot_model(self, ids) -> tuple:
        m = self.model
        return (
            list(m.free_queue),
            list(m.count),
            dict(m.cached),
            list(m.key_of),
            {sid: m.seqs[sid].copy() for sid in ids},
        )

    def _restore_model(self, saved) -> None:
        m = self.model
        m.free_queue, m.count, m.cached, m.key_of = saved[0], saved[1], saved[2], saved[3]
        m.seqs.update(saved[4])

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def append_batch(self, data):
        """A step of a batch in one call (``append_batch``): the sequences
        whose next append of a model's forward is the same layer and count
        (a new step on layer 0, or the same step in flight), in any order,
        with or without tokens. The model appends row by row in that order;
        if a row fails, the batch changes nothing (rows before it included),
        and the cache raises that row's error by its index. Now and then an
        id twice or a freed id, which the cache refuses first."""
        groups: dict = {}
        for sid in sorted(self.model.seqs):
            groups.setdefault(self._next_key(sid), []).append(sid)
        key = data.draw(st.sampled_from(sorted(groups, key=str)), label="step")
        members = groups[key]
        ids = data.draw(st.permutations(members), label="order")
        ids = ids[: data.draw(st.integers(1, len(ids)), label="rows")]
        if key is None:
            bs = self.model.bs
            n = data.draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * bs + 1)), label="n")
        else:
            n = key[1]
        layer = 0 if key is None else key[0]
        for sid in ids:
            assert self._next_append(sid, data, n) == (layer, n)
        heads_kv, _, d, dv = self.shape
        give = data.draw(st.integers(0, 3), label="give tokens") > 0
        tokens = None
        if give:
            tokens = np.array(
                [
                    self.model.seqs[sid].truth[
                        self.model.seqs[sid].lengths[layer] : self.model.seqs[sid].lengths[layer]
                        + n
                    ]
                    for sid in ids
                ],
                dtype=np.int64,
            ).reshape(len(ids), n)
        kvs = [
            [
                kv_of(layer, self.model.seqs[sid].prefix_keys[p], heads_kv, d, dv, self.dtype)
                for p in range(
                    self.model.seqs[sid].lengths[layer], self.model.seqs[sid].lengths[layer] + n
                )
            ]
            for sid in ids
        ]
        k = np.empty((len(ids), heads_kv, n, d), self.dtype)
        v = np.empty((len(ids), heads_kv, n, dv), self.dtype)
        for r, row in enumerate(kvs):
            for p, (kp, vp) in enumerate(row):
                k[r, :, p], v[r, :, p] = kp, vp
        before = cache_state(self.cache)
        refused = data.draw(st.integers(0, 9), label="refused ids")
        if refused == 0:
            bad = [*ids, ids[0]]
            bk, bv = np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]])
            with pytest.raises(InvalidArgumentError, match=rf"seq_ids\[{len(ids)}\]=.*is also"):
                self.cache.append_batch(bad, bk, bv, layer=layer)
            assert_same(before, cache_state(self.cache))
            return
        if refused == 1:
            freed = self.cache.new_sequence()
            assert freed == self.model.new_sequence()
            self.cache.free(freed)
            self.model.free(freed)
            bad = [*ids, freed]
            bk, bv = np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]])
            before = cache_state(self.cache)
            with pytest.raises(UnknownSequenceError, match="that sequence was freed"):
                self.cache.append_batch(bad, bk, bv, layer=layer)
            assert_same(before, cache_state(self.cache))
            return
        saved = self._snapshot_model(ids)
        for r, sid in enumerate(ids):
            row_tokens = None if tokens is None else tokens[r].tolist()
            try:
                self.model.append(sid, layer, n, row_tokens, kvs[r])
            except (CacheFull, TokensRefused) as e:
                self._restore_model(saved)
                if isinstance(e, CacheFull):
                    event("batch: cache full")
                    error, message = CacheFullError, rf"seq_ids\[{r}\].*nothing was changed"
                else:
                    event("batch: tokens refused")
                    error, message = InvalidArgumentError, rf"tokens\[{r}\]=.*without tokens"
                with pytest.raises(error, match=message):
                    self.cache.append_batch(ids, k, v, layer=layer, tokens=tokens)
                assert_same(before, cache_state(self.cache))
                return
        event(f"batch of {min(len(ids), 3)}{'+' if len(ids) > 3 else ''} rows")
        self.cache.append_batch(ids, k, v, layer=layer, tokens=tokens)

    def _check_model_unchanged(self, sid, state):
        # The model, too, refuses before changing anything.
        m = self.model
        assert [m.free_queue, m.count, m.cached, m.key_of] == list(state[:4])
        assert m.seqs[sid].lengths == state[4].lengths

    @precondition(lambda self: self.model.seqs)
    @rule(data=st.data())
    def attention_batch(self, data):
        """A batch of any live sequences (repeats allowed), several query
        rows, non-causal or causal, on any layer."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model.seqs)), min_size=1, max_size=4))
        layer = data.draw(st.integers(0, self.model.layers - 1))
        seq_q = data.draw(st.integers(1, 3))
        causal = data.draw(st.booleans())
        self._check_attention(ids, layer, seq_q, causal)

    # -- invariants ----------------------------------------------------------

    def _reference(self, sid, layer, q, causal):
        heads_kv, _, d, dv = self.shape
        pairs = self.model.seqs[sid].kv[layer]
        k = np.stack([p[0] for p in pairs], axis=1) if pairs else np.zeros((heads_kv, 0, d))
        v = np.stack([p[1] for p in pairs], axis=1) if pairs else np.zeros((heads_kv, 0, dv))
        length = k.shape[1]
        if length == 0:
            return np.zeros((*q.shape[:-1], dv))
        # Queries at the last seq_q positions (some before 0 when the
        # sequence is shorter: they see nothing when causal).
        return reference.attention(q, k, v, causal=causal, q_offset=length - q.shape[1], k_offset=0)

    def _check_attention(self, ids, layer, seq_q, causal):
        _, heads_q, d, _ = self.shape
        q = self.rng.standard_normal((len(ids), heads_q, seq_q, d)).astype(self.dtype)
        out = self.cache.attention(q, ids, layer=layer, causal=causal)
        assert out.dtype == self.dtype and out.shape == (len(ids), heads_q, seq_q, self.shape[3])
        for b, sid in enumerate(ids):
            want = self._reference(sid, layer, q[b], causal)
            length = len(self.model.seqs[sid].kv[layer])
            if causal:
                # Rows before position 0 see no key: output 0.
                hidden = max(0, seq_q - length)
                want[:, :hidden] = 0
            np.testing.assert_allclose(
                out[b].astype(np.float64),
                want,
                atol=TOLERANCE[self.dtype.name],
                rtol=0,
                err_msg=f"sequence {sid}, layer {layer}",
            )

    @invariant()
    def bookkeeping_is_the_models(self):
        if not hasattr(self, "model"):
            return
        m, cache = self.model, self.cache
        ids = sorted(m.seqs)
        assert cache.sequences == sorted({*ids, *m.swapped})
        assert cache.swapped == sorted(m.swapped)
        assert cache.num_free_swap_blocks == len(m.swap_free)
        for s, seq in m.swapped.items():
            assert cache.is_swapped(s)
            assert [cache.length(s, layer=layer) for layer in range(m.layers)] == seq.lengths
        table = cache.block_table(ids)
        width = max((len(m.seqs[s].blocks) for s in ids), default=0)
        want = np.full((len(ids), width), -1)
        for row, s in enumerate(ids):
            want[row, : len(m.seqs[s].blocks)] = m.seqs[s].blocks
        assert table.dtype == np.int32 and table.tolist() == want.tolist()
        counts = cache.ref_counts()
        assert counts.tolist() == m.count
        # Independently of the model: a count is the number of tables
        # holding the block, and no table holds a block twice.
        holders = np.zeros(m.num_blocks, dtype=np.int64)
        for s in ids:
            blocks = m.seqs[s].blocks
            assert len(set(blocks)) == len(blocks)
            holders[blocks] += 1
        assert counts.tolist() == holders.tolist()
        used = int(np.count_nonzero(counts))
        assert (cache.num_free_blocks, cache.num_used_blocks) == (m.num_blocks - used, used)
        assert cache.num_free_blocks == len(m.free_queue)
        assert cache.num_cached_blocks == len(m.cached)
        for s in ids:
            lengths = m.seqs[s].lengths
            assert cache.length(s) == min(lengths)
            for layer in range(m.layers):
                assert cache.length(s, layer=layer) == lengths[layer]

    @invariant()
    def every_sequence_holds_its_own_keys_and_values(self):
        """Gathered through its block table, each sequence's keys and values
        on each layer are exactly the ones appended to it (and, by prefix
        reuse, the identical ones of the same prefix): never another's."""
        if not hasattr(self, "model"):
            return
        m, cache = self.model, self.cache
        ids = sorted(m.seqs)
        if not ids:
            return
        table = cache.block_table(ids)
        for layer in range(m.layers):
            k_pool, v_pool = cache.read_layer(layer)
            lengths = [m.seqs[s].lengths[layer] for s in ids]
            for row, s in enumerate(ids):
                keys, values = reference.cached_sequence(k_pool, v_pool, lengths, row, table)
                pairs = m.seqs[s].kv[layer]
                assert keys.shape[1] == len(pairs)
                for p, (k, v) in enumerate(pairs):
                    assert np.array_equal(keys[:, p], k), (s, layer, p)
                    assert np.array_equal(values[:, p], v), (s, layer, p)

    @invariant()
    def attention_of_every_sequence_is_the_oracles(self):
        if not hasattr(self, "model") or not self.model.seqs:
            return
        ids = sorted(self.model.seqs)
        for layer in range(self.model.layers):
            self._check_attention(ids, layer, 1, True)


class GpuKVCacheMachine(KVCacheMachine):
    device = "gpu"


def test_state_machine(backend):
    """Random interleavings against the model, with the pools on each
    backend (fewer and shorter runs on the GPU: lavapipe is slow)."""
    if backend == "gpu":
        machine, steps, examples = GpuKVCacheMachine, 20, max(12, settings().max_examples // 8)
    else:
        machine, steps, examples = KVCacheMachine, 40, max(60, settings().max_examples)
    run_state_machine_as_test(
        machine,
        settings=settings(stateful_step_count=steps, max_examples=examples, deadline=None),
    )


# ---------------------------------------------------------------------------
# Scenarios


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_parallel_sampling_and_beams_share_the_prompt():
    """n forks of a prompt share its blocks; the first write into the
    shared last block copies it; a second prompt with the same tokens adopts
    the cached full blocks; freeing returns blocks to the pool."""
    rng = np.random.default_rng(0)
    cache = make_cache(64, 4, 2, 8, layers=2)
    prompt = rng.integers(0, 1000, 10)
    kv = [(_normal(rng, (2, 10, 8)), _normal(rng, (2, 10, 8))) for _ in range(2)]
    root = cache.new_sequence()
    for layer, (k, v) in enumerate(kv):
        cache.append(root, k, v, layer=layer, tokens=prompt)
    assert cache.num_used_blocks == 3 and cache.num_cached_blocks == 2
    samples = [cache.fork(root) for _ in range(8)]
    assert cache.num_used_blocks == 3
    assert cache.ref_counts()[:3].tolist() == [9, 9, 9]
    outs = {}
    for i, s in enumerate(samples):
        for layer in range(2):
            k, v = _normal(rng, (2, 1, 8)), _normal(rng, (2, 1, 8))
            cache.append(s, k, v, layer=layer, tokens=[i])
            q = _normal(rng, (1, 4, 1, 8))
            outs[s, layer] = (q, k, v, cache.attention(q, [s], layer=layer))
    # Each sample copied the partly filled block once (for both layers).
    assert cache.num_used_blocks == 3 + 8
    assert cache.ref_counts()[:3].tolist() == [9, 9, 1]
    for (_, layer), (q, k, v, o) in outs.items():
        keys = np.concatenate([kv[layer][0], k], axis=1)
        values = np.concatenate([kv[layer][1], v], axis=1)
        want = reference.attention(q[0], keys, values, causal=True)
        np.testing.assert_allclose(o[0], want, atol=2e-5)
    # The same prompt again: two blocks adopted, one written.
    again = cache.new_sequence()
    for layer, (k, v) in enumerate(kv):
        cache.append(again, k, v, layer=layer, tokens=prompt)
    assert cache.num_used_blocks == 3 + 8 + 1
    assert cache.block_table([again])[0, :2].tolist() == [0, 1]
    for s in [root, again, *samples]:
        cache.free(s)
    assert (cache.num_free_blocks, cache.num_used_blocks) == (64, 0)
    assert cache.num_cached_blocks == 2
    assert cache.sequences == []


def test_the_cache_is_what_attention_with_kvcache_reads():
    """read_layer, block_table and the layer lengths, given to
    attention_with_kvcache, give the cache's own attention, with every
    variant keyword passed through."""
    rng = np.random.default_rng(1)
    cache = make_cache(40, 3, 2, 8, head_dim_v=5, layers=3, dtype=np.float64)
    ids = [cache.new_sequence() for _ in range(3)]
    for i, s in enumerate(ids):
        for layer in range(3):
            n = 4 + 5 * i
            cache.append(
                s,
                _normal(rng, (2, n, 8), np.float64),
                _normal(rng, (2, n, 5), np.float64),
                layer=layer,
            )
    ids.append(cache.fork(ids[1]))
    cache.append(
        ids[-1], _normal(rng, (2, 2, 8), np.float64), _normal(rng, (2, 2, 5), np.float64), layer=1
    )
    q = _normal(rng, (4, 6, 2, 8), np.float64)
    kw = dict(
        window=(5, 0),
        alibi_slopes=rng.uniform(0.1, 1, 6),
        softcap=4.0,
        sinks=rng.standard_normal(6),
        scale=0.3,
        num_splits=2,
    )
    o, lse = cache.attention(q, ids, layer=1, return_lse=True, **kw)
    k_pool, v_pool = cache.read_layer(1)
    lengths = [cache.length(s, layer=1) for s in ids]
    assert lengths == [4, 9, 14, 11]
    table = cache.block_table(ids)
    o2, lse2 = flashport.attention_with_kvcache(
        q, k_pool, v_pool, lengths, block_table=table, return_lse=True, device="cpu", **kw
    )
    assert np.array_equal(o, o2) and np.array_equal(lse, lse2)
    want, want_lse = reference.attention_with_kvcache(
        q, k_pool, v_pool, lengths, block_table=table, return_lse=True, **kw
    )
    np.testing.assert_allclose(o, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_threads_on_different_sequences_give_the_serial_results():
    """Python threads append to and attend over their own sequences (two
    layers, model-like) while another thread forks and frees a shared one:
    each thread's outputs are bitwise those of the same calls made serially,
    and the bookkeeping ends consistent."""
    rng = np.random.default_rng(2)
    steps, threads, layers = 30, 6, 2

    def item(n):
        return [
            (_normal(rng, (2, n, 32)), _normal(rng, (2, n, 16)), _normal(rng, (1, 4, 2, 32)))
            for _ in range(layers)
        ]

    work = [[item(1 + (i + j) % 4) for j in range(steps)] for i in range(threads)]

    def run(cache, sid, items, results, barrier=None):
        if barrier is not None:
            barrier.wait()
        for per_layer in items:
            for layer, (k, v, q) in enumerate(per_layer):
                cache.append(sid, k, v, layer=layer)
                results.append(cache.attention(q, [sid], layer=layer, causal=False))

    def churn(cache, stop):
        base = cache.new_sequence()
        cache.append(base, *item(7)[0][:2])
        forks = 0
        while not stop.is_set() or forks < 50:
            child = cache.fork(base)
            cache.free(child)
            forks += 1
        cache.free(base)

    serial_cache = make_cache(400, 5, 2, 32, head_dim_v=16, layers=layers)
    serial = []
    for items in work:
        out: list = []
        run(serial_cache, serial_cache.new_sequence(), items, out)
        serial.append(out)
    cache = make_cache(400, 5, 2, 32, head_dim_v=16, layers=layers)
    sids = [cache.new_sequence() for _ in range(threads)]
    results: list[list] = [[] for _ in range(threads)]
    barrier, stop = threading.Barrier(threads), threading.Event()
    pool = [
        threading.Thread(target=run, args=(cache, sids[i], work[i], results[i], barrier))
        for i in range(threads)
    ]
    churner = threading.Thread(target=churn, args=(cache, stop))
    churner.start()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    stop.set()
    churner.join()
    for i in range(threads):
        assert len(results[i]) == steps * layers
        for got, want in zip(results[i], serial[i], strict=True):
            assert np.array_equal(got, want)
    assert cache.num_used_blocks == serial_cache.num_used_blocks
    assert cache.sequences == sids
    counts = cache.ref_counts()
    assert counts.max() == 1 and counts.sum() == cache.num_used_blocks


def test_an_adopted_prefix_is_read_not_rewritten():
    """Prefix reuse trusts that the same tokens give the same keys and
    values: a second sequence with the prompt's tokens reads the first's
    blocks, whatever keys and values it passes for those positions."""
    rng = np.random.default_rng(5)
    cache = make_cache(8, 4, 1, 8)
    tokens = [3, 1, 4, 1, 5, 9]
    k1, v1 = _normal(rng, (1, 6, 8)), _normal(rng, (1, 6, 8))
    k2, v2 = _normal(rng, (1, 6, 8)), _normal(rng, (1, 6, 8))
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, k1, v1, tokens=tokens)
    cache.append(b, k2, v2, tokens=tokens)
    table = cache.block_table([a, b])
    assert table[0, 0] == table[1, 0] and table[0, 1] != table[1, 1]
    assert cache.ref_counts()[table[0, 0]] == 2
    q = _normal(rng, (2, 2, 1, 8))
    o = cache.attention(q, [a, b])
    keys = np.concatenate([k1[:, :4], k2[:, 4:]], axis=1)
    values = np.concatenate([v1[:, :4], v2[:, 4:]], axis=1)
    np.testing.assert_allclose(o[0], reference.attention(q[0], k1, v1, causal=True), atol=2e-5)
    np.testing.assert_allclose(
        o[1], reference.attention(q[1], keys, values, causal=True), atol=2e-5
    )
    # Without tokens nothing is shared.
    c = cache.new_sequence()
    cache.append(c, k2, v2)
    np.testing.assert_allclose(
        cache.attention(q[1:], [c])[0],
        reference.attention(q[1], k2, v2, causal=True),
        atol=2e-5,
    )
    assert cache.num_used_blocks == 2 + 1 + 2


@given(
    block_size=st.sampled_from([1, 2, 3, 6, 7, 16]),
    n=st.integers(1, 40),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_one_sequence_any_block_size_and_dtype(block_size, n, dtype):
    rng = np.random.default_rng(n)
    cache = make_cache(-(-n // block_size), block_size, 3, 4, head_dim_v=6, dtype=dtype)
    s = cache.new_sequence()
    k, v = _normal(rng, (3, n, 4), dtype), _normal(rng, (3, n, 6), dtype)
    split = n // 3
    cache.append(s, k[:, :split], v[:, :split])
    cache.append(s, k[:, split:], v[:, split:])
    assert cache.num_free_blocks == 0
    q = _normal(rng, (1, 6, 2, 4), dtype)
    o = cache.attention(q, [s])
    want = reference.attention(q[0], k, v, causal=True)
    tol = {np.float16: 4e-3, np.float32: 2e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(o[0].astype(np.float64), want, atol=tol)
    # The pool is full: a block's worth more does not fit, and nothing
    # changes.
    more_k, more_v = (
        _normal(rng, (3, block_size, 4), dtype),
        _normal(rng, (3, block_size, 6), dtype),
    )
    with pytest.raises(CacheFullError):
        cache.append(s, more_k, more_v)
    assert cache.length(s) == n
    assert np.array_equal(cache.attention(q, [s]), o)


# ---------------------------------------------------------------------------
# Errors


def _cache(**kw):
    args = dict(head_dim_v=3, layers=2)
    args.update(kw)
    return make_cache(4, 2, 2, 4, **args)


def test_exception_classes():
    assert issubclass(CacheFullError, flashport.FlashportError)
    assert issubclass(CacheFullError, MemoryError)
    assert issubclass(UnknownSequenceError, flashport.FlashportError)
    assert issubclass(UnknownSequenceError, KeyError)
    assert str(UnknownSequenceError("sid=3: gone")) == "sid=3: gone"


def test_unknown_and_freed_sequences_are_named():
    cache = _cache()
    rng = np.random.default_rng(3)
    k, v = _normal(rng, (2, 1, 4)), _normal(rng, (2, 1, 3))
    with pytest.raises(
        UnknownSequenceError, match=r"^sid=0: no such sequence: the cache has made none"
    ):
        cache.fork(0)
    a = cache.new_sequence()
    b = cache.new_sequence()
    cache.append(a, k, v)
    cache.free(a)
    q = _normal(rng, (2, 2, 1, 4))
    calls = [
        (lambda: cache.append(a, k, v), "sid=0: that sequence was freed"),
        (lambda: cache.fork(a), "sid=0: that sequence was freed"),
        (lambda: cache.free(a), "sid=0: that sequence was freed"),
        (lambda: cache.length(a), "sid=0: that sequence was freed"),
        (lambda: cache.attention(q, [b, a]), r"seq_ids\[1\]=0: that sequence was freed"),
        (
            lambda: cache.block_table([b, 7]),
            r"seq_ids\[1\]=7: no such sequence: the cache has made ids 0 to 1",
        ),
        (lambda: cache.append(-1, k, v), "sid=-1: no such sequence"),
        (lambda: cache.append(2**80, k, v), "no such sequence"),
    ]
    for call, message in calls:
        with pytest.raises(UnknownSequenceError, match=message):
            call()
    assert a not in cache and b in cache


def test_integers_beyond_int64_are_quoted_as_passed():
    """Sizes and ids beyond int64 are refused with the value the caller
    wrote (they were saturated first, and the message said
    9223372036854775807)."""
    with pytest.raises(ProblemTooLargeError, match=r"^num_blocks=18446744073709551616 "):
        KVCache(2**64, 4, 2, 4)
    with pytest.raises(InvalidArgumentError, match=r"^layers=-18446744073709551616: "):
        KVCache(8, 4, 2, 4, layers=-(2**64))
    cache = _cache()
    cache.new_sequence()
    before = cache_state(cache)
    calls = [
        (lambda: cache.fork(2**64), r"^'?sid=18446744073709551616: no such sequence"),
        (lambda: cache.free(-(2**70)), r"^'?sid=-1180591620717411303424: no such sequence"),
        (lambda: cache.length(2**63), r"^'?sid=9223372036854775808: no such sequence"),
        (
            lambda: cache.block_table([0, 2**64]),
            r"^'?seq_ids\[1\]=18446744073709551616: no such sequence",
        ),
    ]
    for call, message in calls:
        with pytest.raises(UnknownSequenceError, match=message):
            call()
    assert_same(before, cache_state(cache))


def test_token_ids_beyond_int64_are_refused_not_merged():
    """Token ids above 2^63 saturated to one value, so two different prompts
    could share a prefix block; they are refused by index and value, and
    the cache is as it was."""
    cache = _cache()
    sid = cache.new_sequence()
    k, v = np.ones((2, 2, 4), np.float32), np.ones((2, 2, 3), np.float32)
    before = cache_state(cache)
    tokens = np.array([2**63 + 1, 2**63 + 2], np.uint64)
    with pytest.raises(InvalidArgumentError, match=r"^tokens\[0\]=9223372036854775809: "):
        cache.append(sid, k, v, tokens=tokens)
    assert_same(before, cache_state(cache))


def test_membership_follows_the_methods_id_rules():
    """`in` answers for the ids the methods take: a bool is none (the
    methods refuse it; True is not sequence 1), nor is any non-integer."""
    cache = _cache()
    a, b = cache.new_sequence(), cache.new_sequence()
    assert (a, b) == (0, 1)
    assert 1 in cache and np.int64(1) in cache and np.uint8(0) in cache
    for not_an_id in (True, False, np.True_, 1.0, "1", None, 2**80, -1):
        assert not_an_id not in cache, not_an_id
    with pytest.raises(InvalidArgumentError, match="sid=True: expected an integer, got a bool"):
        cache.length(True)


def test_bad_arguments_are_named_and_change_nothing():
    rng = np.random.default_rng(4)
    cache = _cache()
    s = cache.new_sequence()
    k, v = _normal(rng, (2, 3, 4)), _normal(rng, (2, 3, 3))
    cache.append(s, k, v, tokens=[1, 2, 3])
    before = cache_state(cache)
    cases = [
        (dict(layer=2), InvalidArgumentError, r"layer=2: the cache has 2 layer\(s\): 0 to 1"),
        (dict(layer=-1), InvalidArgumentError, "layer=-1"),
        (dict(layer=1.0), InvalidArgumentError, "layer=1.0: expected an integer"),
        (
            dict(k=k[:1]),
            ShapeError,
            r"k has shape \(1, 3, 4\); expected \(heads_kv, n, head_dim\) = \(2, n, 4\)",
        ),
        (dict(k=k[..., :3]), ShapeError, r"k has shape \(2, 3, 3\)"),
        (dict(v=v[:, :2]), ShapeError, "k holds 3 positions but v holds 2"),
        (dict(v=k), ShapeError, r"v has shape \(2, 3, 4\); expected \(heads_kv, n, head_dim_v\)"),
        (dict(k=k[None]), ShapeError, r"k has shape \(1, 2, 3, 4\)"),
        (dict(k=k.astype(np.float64)), DTypeError, "k has dtype float64: the cache holds float32"),
        (dict(v=v.astype(np.int32)), DTypeError, "v has dtype int32: the cache holds float32"),
        (
            dict(tokens=[1, 2]),
            ShapeError,
            r"tokens has shape \(2,\); expected one token id per appended position, \(3,\)",
        ),
        (dict(tokens=np.ones(3)), DTypeError, "tokens has dtype float64"),
        (dict(tokens=[[1, 2, 3]]), ShapeError, r"tokens has shape \(1, 3\)"),
    ]
    for change, error, message in cases:
        args = dict(k=k, v=v, layer=1, tokens=None)
        args.update(change)
        with pytest.raises(error, match=message):
            cache.append(s, args["k"], args["v"], layer=args["layer"], tokens=args["tokens"])
        assert_same(before, cache_state(cache))
    # Tokens that contradict the known ones, on either layer.
    with pytest.raises(
        InvalidArgumentError, match=r"tokens\[1\]=9: position 1 of sequence 0 holds token 2"
    ):
        cache.append(s, k, v, layer=1, tokens=[1, 9, 3])
    t = cache.new_sequence()
    cache.append(t, k, v)
    cache.append(t, k, v, layer=1)
    with pytest.raises(InvalidArgumentError, match="were appended without tokens"):
        cache.append(t, k[:, :1], v[:, :1], tokens=[4])
    assert cache.length(t) == 3
    # Attention.
    q = _normal(rng, (1, 4, 1, 4))
    with pytest.raises(
        ShapeError,
        match=r"q has shape \(1, 4, 1, 4\); expected \(len\(seq_ids\), heads_q, seq_q, "
        r"head_dim\) = \(2",
    ):
        cache.attention(q, [s, s])
    with pytest.raises(ShapeError, match="must divide"):
        cache.attention(_normal(rng, (1, 3, 1, 4)), [s])
    with pytest.raises(DTypeError, match="q has dtype float64: the cache holds float32"):
        cache.attention(q.astype(np.float64), [s])
    with pytest.raises(InvalidArgumentError, match="layer=5"):
        cache.attention(q, [s], layer=5)
    with pytest.raises(InvalidArgumentError, match="seq_ids=0: expected a sequence"):
        cache.attention(q, s)
    with pytest.raises(InvalidArgumentError, match="num_splits"):
        cache.attention(q, [s], num_splits=0)
    with pytest.raises(InvalidArgumentError, match="layer=2"):
        cache.read_layer(2)
    with pytest.raises(InvalidArgumentError, match="layer=2"):
        cache.length(s, layer=2)
    assert [cache.length(s, layer=layer) for layer in range(2)] == [3, 0]
    assert cache.block_table([s]).tolist() == before["table"][:1]


@pytest.mark.parametrize(
    "kw,error,message",
    [
        (
            dict(num_blocks=0),
            InvalidArgumentError,
            "num_blocks=0: the number of blocks must be at least 1",
        ),
        (dict(block_size=0), InvalidArgumentError, "block_size=0"),
        (dict(heads_kv=-1), InvalidArgumentError, "heads_kv=-1"),
        (dict(head_dim=0), InvalidArgumentError, "head_dim=0"),
        (dict(head_dim_v=0), InvalidArgumentError, "head_dim_v=0"),
        (dict(layers=0), InvalidArgumentError, "layers=0"),
        (dict(num_blocks=2.0), InvalidArgumentError, "num_blocks=2.0: expected an integer"),
        (dict(layers=True), InvalidArgumentError, "layers=True"),
        (dict(dtype=np.int32), DTypeError, "dtype has dtype int32"),
        (dict(dtype="nonsense"), DTypeError, "not a NumPy dtype"),
        (dict(device="tpu"), InvalidArgumentError, "device"),
        (
            dict(num_blocks=2**62),
            flashport.ProblemTooLargeError,
            "larger than this machine can address",
        ),
    ],
)
def test_constructor_errors(kw, error, message):
    args = dict(num_blocks=4, block_size=2, heads_kv=2, head_dim=4)
    args.update(kw)
    with pytest.raises(error, match=message):
        flashport.KVCache(**args)


def test_properties_and_repr(monkeypatch):
    cache = flashport.KVCache(6, 5, 2, 8, head_dim_v=4, layers=3, dtype=np.float16, device="auto")
    assert (cache.num_blocks, cache.block_size, cache.heads_kv, cache.head_dim) == (6, 5, 2, 8)
    assert (cache.head_dim_v, cache.layers, cache.dtype, cache.device) == (4, 3, np.float16, "cpu")
    assert cache.nbytes == 3 * 6 * 2 * 5 * (8 + 4) * 2
    s = cache.new_sequence()
    assert repr(cache) == (
        "KVCache(num_blocks=6, block_size=5, heads_kv=2, head_dim=8, head_dim_v=4, layers=3, "
        "dtype=float16, device='cpu'; 0 blocks used, 6 free, 1 sequences)"
    )
    assert cache.length(s) == 0 and cache.block_table([s]).shape == (1, 0)
    k_pool, v_pool = cache.read_layer(2)
    assert k_pool.shape == (6, 2, 5, 8) and v_pool.shape == (6, 2, 5, 4)
    # device=None follows FLASHPORT_DEVICE, as every entry point does.
    monkeypatch.setenv("FLASHPORT_DEVICE", "gpu")
    if gpu_adapters():
        assert flashport.KVCache(1, 1, 1, 1).device == "gpu:0"
    else:
        with pytest.raises(BackendUnavailableError):
            flashport.KVCache(1, 1, 1, 1)
    assert flashport.KVCache(1, 1, 1, 1, device="cpu").device == "cpu"


# ---------------------------------------------------------------------------
# The GPU's pools


def _mirror_script(caches, rng, dtype, heads_kv, d, dv):
    """The same appends, forks and frees on each cache (copy-on-write of
    partly filled blocks, blocks freed and taken again); the live ids."""

    def append(sid, n):
        for layer in range(2):
            k = rng.standard_normal((heads_kv, n, d)).astype(dtype)
            v = rng.standard_normal((heads_kv, n, dv)).astype(dtype)
            for c in caches:
                c.append(sid, k, v, layer=layer)

    def each(f):
        ids = {f(c) for c in caches}
        assert len(ids) == 1
        return ids.pop()

    a = each(lambda c: c.new_sequence())
    append(a, 5)
    b = each(lambda c: c.fork(a))
    append(b, 2)
    append(a, 1)
    c = each(lambda c: c.new_sequence())
    append(c, 9)
    each(lambda x: x.free(b))
    e = each(lambda x: x.fork(c))
    append(e, 3)
    append(c, 1)
    return [a, c, e]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_pools_split_over_buffers_give_the_cpus_results(gpu, dtype):
    """A pool larger than one storage binding is kept in several buffers
    (here a binding limit lowered while the cache is made: three blocks of
    the value pool per buffer); writes, copies and attention across the
    buffers give the CPU cache's keys, values and outputs."""
    heads_kv, block_size, d, dv = 2, 3, 8, 12
    widest = heads_kv * block_size * dv * np.dtype(dtype).itemsize
    with overrides(binding_limit=256 + 16 + 3 * widest):
        split = make_cache(
            12, block_size, heads_kv, d, head_dim_v=dv, layers=2, dtype=dtype, device=gpu
        )
    whole = make_cache(
        12, block_size, heads_kv, d, head_dim_v=dv, layers=2, dtype=dtype, device=gpu
    )
    cpu = make_cache(12, block_size, heads_kv, d, head_dim_v=dv, layers=2, dtype=dtype)
    ids = _mirror_script([split, whole, cpu], np.random.default_rng(5), dtype, heads_kv, d, dv)
    table = cpu.block_table(ids)
    rng = np.random.default_rng(6)
    for layer in range(2):
        lengths = [cpu.length(s, layer=layer) for s in ids]
        pools = [c.read_layer(layer) for c in (split, whole, cpu)]
        for row in range(len(ids)):
            want = reference.cached_sequence(*pools[2], lengths, row, table)
            for got in pools[:2]:
                have = reference.cached_sequence(*got, lengths, row, table)
                assert all(np.array_equal(h, w) for h, w in zip(have, want, strict=True))
        q = rng.standard_normal((len(ids), 2 * heads_kv, 2, d)).astype(dtype)
        want_o, want_lse = cpu.attention(q, ids, layer=layer, causal=True, return_lse=True)
        tol = TOLERANCE[np.dtype(dtype).name]
        for c in (split, whole):
            o, lse = c.attention(q, ids, layer=layer, causal=True, return_lse=True)
            scale = np.abs(want_o.astype(np.float64)).max()
            assert np.abs(o.astype(np.float64) - want_o).max() <= 4 * tol * scale
            assert np.allclose(lse, want_lse, rtol=4 * tol, atol=4 * tol)


def test_gpu_cache_errors(gpu):
    with pytest.raises(DTypeError, match=r"dtype has dtype float64.*GPU"):
        make_cache(4, 2, 2, 4, dtype=np.float64, device=gpu)
    # A block larger than one binding: refused when the cache is made.
    with (
        overrides(binding_limit=64),
        pytest.raises(flashport.ProblemTooLargeError, match="one block of this KV cache"),
    ):
        make_cache(4, 16, 2, 64, device=gpu)
    cache = make_cache(4, 2, 2, 4, device=gpu)
    assert cache.device == "gpu:0"


def test_gpu_cache_without_an_adapter_is_refused_by_name(tmp_path):
    """device="gpu" where no adapter exists (the Vulkan loader pointed at no
    driver, in a child process) is the error every GPU call gives."""
    import subprocess
    import sys

    code = (
        "import flashport\n"
        "try:\n"
        "    flashport.KVCache(4, 2, 2, 4, device='gpu')\n"
        "except flashport.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {
        **os.environ,
        "VK_DRIVER_FILES": str(tmp_path / "none.json"),
        "VK_ICD_FILENAMES": str(tmp_path / "none.json"),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "refused: no GPU adapter" in out.stdout, out.stdout + out.stderr
