"""Inputs the caller broadcast (``np.broadcast_to``: stride 0) are read in
place where the kernels can: a mask repeated over some axes is the smaller
mask the kernels broadcast themselves, keys and values repeated over their
heads are one shared head. The result is the same as for a contiguous copy,
and no copy is made (issue #24, item 1)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import flashport
import numpy as np
import pytest

rng = np.random.default_rng(24)
B, H, SQ, SK, D, DV = 2, 4, 37, 70, 16, 12
Q = rng.standard_normal((B, H, SQ, D)).astype(np.float32)
K = rng.standard_normal((B, H, SK, D)).astype(np.float32)
V = rng.standard_normal((B, H, SK, DV)).astype(np.float32)


def _same(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()


MASKS = {
    # (seq_k,) keys repeated over every batch, head and row.
    "keys": lambda: np.broadcast_to(rng.random(SK) < 0.7, (B, H, SQ, SK)),
    # A float (seq_q, seq_k) mask with -inf holes, repeated over heads only.
    "rows-heads": lambda: np.broadcast_to(
        np.where(
            rng.random((B, 1, SQ, SK)) < 0.2, -np.inf, rng.standard_normal((B, 1, SQ, SK))
        ).astype(np.float32),
        (B, H, SQ, SK),
    ),
    # Repeated over the rows of a 2-d mask; one row sees no key.
    "rows": lambda: np.broadcast_to(
        np.where(np.arange(SK) % 3 == 0, False, rng.random(SK) < 0.8), (SQ, SK)
    ),
}


@pytest.mark.parametrize("kind", list(MASKS))
def test_broadcast_mask_gives_what_its_copy_gives(backend, kind):
    mask = MASKS[kind]()
    assert 0 in mask.strides
    copy = mask.copy()
    kw = dict(causal=True, device=backend)
    out, lse = flashport.attention(Q, K, V, mask=mask, return_lse=True, **kw)
    want_out, want_lse = flashport.attention(Q, K, V, mask=copy, return_lse=True, **kw)
    _same((out, lse), (want_out, want_lse))
    ref = flashport.reference.attention(Q, K, V, mask=copy, causal=True)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    do = np.sin(out + 0.5)
    _same(
        flashport.attention_backward(do, Q, K, V, out, lse, mask=mask, **kw),
        flashport.attention_backward(do, Q, K, V, out, lse, mask=copy, **kw),
    )


def test_broadcast_float_mask_gradient_keeps_the_callers_shape(backend):
    # dmask has one entry per element of the caller's mask: its repeated
    # axes are not summed.
    mask = MASKS["rows-heads"]()
    kw = dict(device=backend)
    out, lse = flashport.attention(Q, K, V, mask=mask, return_lse=True, **kw)
    do = np.cos(out)
    got = flashport.attention_backward(do, Q, K, V, out, lse, mask=mask, return_dmask=True, **kw)
    want = flashport.attention_backward(
        do, Q, K, V, out, lse, mask=mask.copy(), return_dmask=True, **kw
    )
    assert got[-1].shape == mask.shape
    _same(got, want)


@pytest.mark.parametrize("ndim", [3, 4])
def test_keys_and_values_repeated_over_heads(backend, ndim):
    k1, v1 = K[:, :1], V[:, :1]
    k, v = np.broadcast_to(k1, K.shape), np.broadcast_to(v1, V.shape)
    q = Q
    if ndim == 3:
        q, k, v, k1, v1 = q[0], k[0], v[0], k1[0], v1[0]
    kw = dict(causal=True, window=(20, 3), device=backend)
    got = flashport.attention(q, k, v, return_lse=True, **kw)
    # The same as the one shared head given as such (MQA), and as the copy.
    _same(got, flashport.attention(q, k1, v1, return_lse=True, **kw))
    _same(got, flashport.attention(q, k.copy(), v.copy(), return_lse=True, **kw))
    # The backward's dk and dv follow the caller's heads: as for the copy.
    out, lse = got
    do = np.cos(out)
    grads = flashport.attention_backward(do, q, k, v, out, lse, **kw)
    assert grads[1].shape == k.shape
    _same(grads, flashport.attention_backward(do, q, k.copy(), v.copy(), out, lse, **kw))


def test_only_keys_repeated_over_heads_still_works(backend):
    k = np.broadcast_to(K[:, :1], K.shape)
    got = flashport.attention(Q, k, V, device=backend)
    _same([got], [flashport.attention(Q, k.copy(), V, device=backend)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_keys_and_values_repeated_over_heads_are_not_copied():
    # Copies of k and v would take 1 GiB each; the call adds next to nothing
    # to the peak. The peak is VmHWM, reset first: a child's getrusage peak
    # starts at its parent's, which a long test run had grown past 2 GiB.
    script = textwrap.dedent(
        """
        import flashport
        import numpy as np

        def peak_mib():
            with open("/proc/self/status") as f:
                line = next(x for x in f if x.startswith("VmHWM:"))
            return int(line.split()[1]) // 1024

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        rng = np.random.default_rng(0)
        heads, seq_k, d = 2**10, 2**16, 4
        q = rng.standard_normal((1, heads, 1, d)).astype(np.float32)
        k = rng.standard_normal((1, 1, seq_k, d)).astype(np.float32)
        v = rng.standard_normal((1, 1, seq_k, d)).astype(np.float32)
        shape = (1, heads, seq_k, d)
        # The same attention with the one head as such first: the peak the
        # broadcast call may not raise (thread pools and buffers differ by
        # machine).
        want = flashport.attention(q, k, v, device="cpu")
        before = peak_mib()
        out = flashport.attention(
            q, np.broadcast_to(k, shape), np.broadcast_to(v, shape), device="cpu"
        )
        assert np.array_equal(out, want)
        print(peak_mib() - before)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    grown_mib = int(done.stdout.split()[-1])
    assert grown_mib < 256, f"peak RSS grew {grown_mib} MiB: the broadcast k and v were copied"
