"""``python -m flashport bench dask --split``: its clocks count every task of
the graph once (a task function called by another is part of it), put the
flashport calls inside the tasks, and leave flashport and flashport.dask as
they were."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("dask.array")

import flashport
from flashport._bench import dask_split as split
from flashport.dask import _tasks


def _args(**kw) -> argparse.Namespace:
    base = {
        "shape": [1, 2, 256, 16],
        "dtype": "float16",
        "chunks": 4,
        "causal": True,
        "schedule": "tree",
        "device": "cpu",
        "cluster": False,
        "repeat": 1,
    }
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("schedule", ["tree", "ring"])
def test_every_task_is_counted_once_and_the_wrappers_are_removed(schedule):
    before = {name: getattr(_tasks, name) for name in split.TASKS}
    calls = {name: getattr(flashport, name) for name in split.CALLS}
    m = split.measure(_args(schedule=schedule))
    clocks = m["clocks"]
    blocks = "forward_block" if schedule == "tree" else "forward_ring_block"
    backward = "backward_block" if schedule == "tree" else "backward_ring_block"
    # Causal 4 x 4 equal chunks: 10 visible blocks each way.
    assert clocks[blocks][0] == 10 and clocks[backward][0] == 10
    # The ring merges inside its blocks: no merge task (merge is called,
    # and counted as part of the block).
    assert ("merge" in clocks) == (schedule == "tree")
    for _, task_s, call_s, _, _ in clocks.values():
        assert 0 <= call_s <= task_s
    assert clocks[backward][2] > 0
    assert sum(v[1] for v in clocks.values()) <= m["wall"]
    assert m["replayed"] is None and m["single_resident"] is None
    assert {name: getattr(_tasks, name) for name in split.TASKS} == before
    assert {name: getattr(flashport, name) for name in split.CALLS} == calls


def test_the_report_names_every_task_kind_and_the_rest():
    args = _args(causal=False, chunks=2)
    m = split.measure(args)
    text = split.report(args, m)
    for kind in m["clocks"]:
        assert kind in text
    assert "all tasks" in text and "outside the tasks" in text


@pytest.mark.parametrize("cluster", [False, True], ids=["threads", "gpu_cluster"])
def test_on_a_gpu_every_attention_call_is_replayed_on_device_arrays(gpu, cluster):
    if cluster:
        pytest.importorskip("distributed")
    m = split.measure(_args(device=gpu, cluster=cluster))
    replayed = m["replayed"]
    # Every block's one attention (or attention_backward) call, and no
    # merge: merge_states runs on the CPU in a task.
    assert replayed["forward_block"][4] == 10 and replayed["backward_block"][4] == 10
    assert replayed.get("merge", [0] * 5)[4] == 0
    assert replayed["backward_block"][3] > 0 and m["single_resident"] > 0
