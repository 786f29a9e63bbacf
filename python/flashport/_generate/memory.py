"""KV memory accounting of a paged cache against contiguous per-request
caches, read from the cache's own block tables, lengths and reference
counts.

* **Paged**: the memory allocated is the blocks some sequence holds; the
  live slots are, in each of those blocks, the positions its holders have
  written (a shared block counted once, however many tables list it).
* **Contiguous**: each sequence reserves ``max_len`` positions up front and
  holds its own copy of everything, its prompt included; the live slots are
  its length.
* **Sharing**: the blocks held against the blocks the same sequences would
  hold if each had its own copy of its table's blocks (the table entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import flashport


@dataclass(frozen=True)
class Snapshot:
    """One moment of the cache, for a set of sequences. Counts are in blocks
    and in token slots (a slot is one position of every layer's keys and
    values)."""

    sequences: int
    tokens: int  # sum of the sequences' lengths
    blocks_held: int  # distinct blocks in their tables
    table_entries: int  # blocks they would hold without sharing
    live_slots: int  # distinct positions written in the blocks held
    block_size: int

    @property
    def allocated_slots(self) -> int:
        return self.blocks_held * self.block_size


def snapshot(cache: flashport.KVCache, seq_ids: list[int]) -> Snapshot:
    bs = cache.block_size
    lengths = [cache.length(s) for s in seq_ids]
    fill: dict[int, int] = {}
    entries = 0
    if seq_ids:
        table = cache.block_table(seq_ids)
        for row, length in zip(table, lengths, strict=True):
            held = -(-length // bs)
            entries += held
            for i, block in enumerate(row[:held].tolist()):
                fill[block] = max(fill.get(block, 0), min(bs, length - i * bs))
    return Snapshot(
        sequences=len(seq_ids),
        tokens=sum(lengths),
        blocks_held=len(fill),
        table_entries=entries,
        live_slots=sum(fill.values()),
        block_size=bs,
    )


def check_pool(cache: flashport.KVCache, every: Snapshot) -> None:
    """The cache's own counts agree with the tables of all live sequences:
    used + free = total, the blocks with a count above 0 are the blocks the
    tables hold, and the counts sum to the table entries (a block shared by
    ``m`` sequences counts ``m``). Raises ``AssertionError`` otherwise."""
    counts = cache.ref_counts()
    used, free = cache.num_used_blocks, cache.num_free_blocks
    if used + free != cache.num_blocks:
        raise AssertionError(f"used {used} + free {free} != {cache.num_blocks} blocks")
    if int(np.count_nonzero(counts)) != used or every.blocks_held != used:
        raise AssertionError(
            f"{used} blocks used, {np.count_nonzero(counts)} with a count, "
            f"{every.blocks_held} in the live tables"
        )
    if int(counts.sum()) != every.table_entries:
        raise AssertionError(f"counts sum to {counts.sum()}, tables hold {every.table_entries}")


@dataclass
class Tally:
    """Sums over the steps of a run, so fractions are memory-time weighted:
    a step holding twice the memory counts twice."""

    live_slots: int = 0
    allocated_slots: int = 0
    contiguous_slots: int = 0
    tokens: int = 0
    blocks_held: int = 0
    table_entries: int = 0
    peak_blocks: int = 0
    peak_contiguous_slots: int = 0

    def add(self, s: Snapshot, max_len: int) -> None:
        self.live_slots += s.live_slots
        self.allocated_slots += s.allocated_slots
        self.contiguous_slots += s.sequences * max_len
        self.tokens += s.tokens
        self.blocks_held += s.blocks_held
        self.table_entries += s.table_entries
        self.peak_blocks = max(self.peak_blocks, s.blocks_held)
        self.peak_contiguous_slots = max(self.peak_contiguous_slots, s.sequences * max_len)

    def summary(self, block_size: int) -> dict:
        return {
            "peak_blocks": self.peak_blocks,
            "peak_paged_slots": self.peak_blocks * block_size,
            "peak_contiguous_slots": self.peak_contiguous_slots,
            "paged_live_fraction": self.live_slots / max(self.allocated_slots, 1),
            "contiguous_live_fraction": self.tokens / max(self.contiguous_slots, 1),
            "sharing_saved": 1 - self.blocks_held / max(self.table_entries, 1),
        }
