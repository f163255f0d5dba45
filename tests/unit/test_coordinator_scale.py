"""The coordinator at two node counts (benchmarks/coordinator_scale.py, small N): what it
writes and sends per checkpoint grows with the nodes at most linearly, and its status,
index and journal files stop growing with the checkpoints. Counts and sizes, no timing."""

from __future__ import annotations

import pytest
from coordinator_scale import FILES_MEASURED, KEEP_PFS, run

from cachex_agent.coordinator import HISTORY

SMALL, LARGE = 30, 300
CHECKPOINTS = 8


@pytest.fixture(scope="module")
def runs():
    return {n: run(n, CHECKPOINTS, files=2, path="peer") for n in (SMALL, LARGE)}


def test_file_writes_per_checkpoint_do_not_grow_with_nodes(runs):
    for small, large in zip(runs[SMALL]["rows"], runs[LARGE]["rows"], strict=True):
        assert small["fate"] == large["fate"] and small["level"] == large["level"]
        assert small["writes"] == large["writes"], small["seq"]


def test_messages_per_checkpoint_are_linear_in_nodes(runs):
    for n, result in runs.items():
        for row in result["rows"]:
            # every broadcast once per node; the duplicate markers, crossing the commit
            # on their way, are not answered (once a broadcast each: quadratic; then a
            # send each: a send per node per checkpoint)
            assert row["sent"]["commit"] == n
            # and a reroute when a node is first found dead (uplink.py)
            rerouted = row["sent"].get("reroute", 0)
            assert rerouted in (0, n)
            assert sum(row["sent"].values()) <= 3 * n + rerouted


def test_global_manifest_is_linear_in_nodes(runs):
    small, large = (runs[n]["sizes"]["global manifest"] for n in (SMALL, LARGE))
    assert 0.9 * LARGE / SMALL <= large / small <= 1.1 * LARGE / SMALL


def test_status_index_and_journal_stop_growing_with_checkpoints():
    # retention and history in force after KEEP_PFS + HISTORY checkpoints
    result = run(12, KEEP_PFS + HISTORY + 6, files=2, path="peer")
    rows = result["rows"]
    steady = rows[KEEP_PFS + HISTORY:]
    for name in FILES_MEASURED:
        sizes = [row["sizes"][name] for row in steady]
        assert max(sizes) - min(sizes) <= 16, (name, sizes)     # a digit of a timestamp


def test_finished_checkpoints_keep_totals_not_every_nodes_manifest(runs):
    # coordinator.json after the last checkpoint finished holds no node's manifest: it is
    # about as large at 300 nodes as at 30
    small, large = (runs[n]["sizes"]["coordinator.json"] for n in (SMALL, LARGE))
    assert large < 1.5 * small
