"""What ``python -m flashport generate`` prints: a progress line on a
terminal, and a table per run."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    """One line on ``stream``, rewritten in place, when it is a terminal;
    nothing otherwise (a log or a pipe gets the table alone)."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.label = label
        self.active = self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if self.active:
            self.stream.write(f"\r  {self.label}: step {done}/{total}")
            self.stream.flush()

    def close(self) -> None:
        if self.active:
            # Clears the line so the table starts clean.
            self.stream.write("\r\033[K")
            self.stream.flush()


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def table(r: dict, label: str) -> str:
    """The run's numbers: speed, memory against contiguous per-request
    caches (each reserving prompt + new tokens), sharing, and the check."""
    lines = [
        f"{label}: {r['sequences']} sequences (beam search 4 + parallel sampling 8) from one "
        f"{r['prompt_len']}-token prompt, {r['new_tokens']} new tokens each, {r['layers']} "
        f"layers, block size {r['block_size']}, pool {r['num_blocks']} blocks",
        f"  decode: {r['tokens_decoded']} tokens in {r['steps']} steps, "
        f"{r['decode_seconds']:.2f} s = {r['tokens_per_s']:.0f} tokens/s "
        f"(prefill of the prompt: {1e3 * r['prefill_seconds']:.1f} ms)",
        f"  {'KV memory':<22}{'peak paged':>12}{'contiguous':>12}{'live: paged':>13}"
        f"{'contiguous':>12}{'saved by sharing':>18}",
    ]
    names = {
        "all": "all sequences",
        "beam_search": "beam search",
        "parallel_sampling": "parallel sampling",
    }
    for key, name in names.items():
        m = r["memory"][key]
        lines.append(
            f"  {name:<22}{m['peak_paged_slots']:>7} pos.{m['peak_contiguous_slots']:>8} pos."
            f"{_pct(m['paged_live_fraction']):>13}{_pct(m['contiguous_live_fraction']):>12}"
            f"{_pct(m['sharing_saved']):>18}"
        )
    peak = r["memory"]["all"]
    lines += [
        f"  peak blocks used: {peak['peak_blocks']} of {r['num_blocks']} "
        f"({peak['peak_paged_slots'] / peak['peak_contiguous_slots']:.0%} of what contiguous "
        f"per-request caches reserve); live = positions written / positions allocated, "
        f"summed over the steps; positions span every layer's keys and values",
        f"  logits vs recomputing each whole sequence without a cache (float64): "
        f"{r['positions_checked']} positions, max |deviation| {r['max_abs_deviation']:.2e} = "
        f"{r['max_rel_deviation']:.2e} of the largest |logit| "
        f"(tolerance {r['tolerance']:.0e}): {'PASS' if r['ok'] else 'FAIL'}",
    ]
    return "\n".join(lines)
