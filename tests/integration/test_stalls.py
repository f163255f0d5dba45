"""Processes that stall rather than die (issue 43): real agents stopped with SIGSTOP and
resumed with SIGCONT. Slow is not dead: a node silent past `agent.timeout` is suspect,
routed around and named in status, and taken back when it speaks; the one who waited
judges, net of its own stalls; the run is never wedged.

Each stall starts at a known point: a node's capture is paused after its first file
(CACHEX_TEST_CAPTURE_PAUSE) and the stalled agent is stopped there, or once a level is
reached. After SIGCONT every checkpoint reaches `flushed` and verifies, and a stop ends
the job."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from harness import Cluster, finish, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TIMEOUT = 3.0           # agent.timeout of these runs, seconds
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--files-per-rank", "2"]


def agent_pid(c: Cluster, node: int) -> int:
    return [e for e in c.events(node) if e["event"] == "agent_start"][-1]["pid"]


@contextmanager
def stopped(c: Cluster, node: int) -> Iterator[int]:
    """Node `node`'s agent stopped (SIGSTOP) for the block; SIGCONT whatever happens."""
    pid = agent_pid(c, node)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def paused(c: Cluster, node: int) -> dict[str, str]:
    """The environment that pauses `node`'s capture after each checkpoint's first file."""
    return {"CACHEX_TEST_CAPTURE_PAUSE": f"{node}:{c.root}"}


def wait_paused(c: Cluster, ckpt: str) -> None:
    wait_for(lambda: (c.root / f"paused-{ckpt}").exists(), 60, f"the capture of {ckpt} paused")


def resume(c: Cluster, ckpt: str) -> None:
    (c.root / f"resume-{ckpt}").touch()


def silent_named(c: Cluster, node: int) -> dict:
    """Until the coordinator's status names `node` silent; its row."""
    def row():
        return next((r for r in c.status().get("silent", []) if r["node"] == node), None)
    return wait_for(row, 4 * TIMEOUT + 10, f"status to name node {node} silent")


def text_status(c: Cluster) -> str:
    result = c.cachex("status")
    assert result.returncode == 0, result.stderr
    return result.stdout


def all_flushed_and_verified(c: Cluster, *ckpts: str) -> None:
    for ckpt in ckpts:
        c.wait_level(ckpt, "flushed", timeout=90)
        result = c.cachex("verify", ckpt)
        assert result.returncode == 0, result.stdout + result.stderr
    assert not c.status().get("silent"), c.status()["silent"]


def no_one_blamed(c: Cluster, *nodes: int) -> None:
    """No agent took a partner for dead, and no frame was refused."""
    for node in nodes:
        events = c.events(node)
        assert not [e for e in events if e["event"] == "refused"], node
        failed = [e for e in events if e["event"] == "replicate_failed"]
        assert not failed, failed


def test_a_stalled_coordinator_blames_no_one_and_the_run_goes_on(cluster):
    """Node 0 (the coordinator) stopped for 3x agent.timeout while node 3 replicates to
    it: on resuming it neither takes its own node for dead nor blames node 1, node 3
    waits for it (suspect, not dead), and every checkpoint after goes through."""
    c = cluster(agent_timeout=f"{TIMEOUT:g}s")
    c.start_agents(env=paused(c, 3))
    partners = [e for e in c.events(3) if e["event"] == "agent_start"][-1]["partners"]
    assert partners == [0], partners
    trainer = c.trainer("--steps", "4", "--every", "4", *TRAIN)
    wait_paused(c, "step_00004")        # node 3's stream to node 0 is open
    with stopped(c, 0):
        resume(c, "step_00004")         # node 3's slots go to a stopped partner
        time.sleep(3 * TIMEOUT)
    finish(trainer)
    all_flushed_and_verified(c, "step_00004")
    finish(c.trainer("--steps", "8", "--every", "4", "--resume", *TRAIN))
    resume(c, "step_00008")
    all_flushed_and_verified(c, "step_00008")
    rows = {r["id"]: r for r in c.status()["checkpoints"]}
    assert rows["step_00004"]["nodes_replicated"] == 4, rows["step_00004"]
    no_one_blamed(c, 0, 1, 2, 3)
    assert c.stop(timeout=30) == 0
    log = (c.root / "agents.log").read_text()
    assert "skips the root" not in log and "did not answer" not in log, log[-3000:]
    assert json.dumps(c.status()).count('"dead"') == 0
    stall = [e for e in c.events(0) if e["event"] == "stalled"]
    assert stall and stall[-1]["seconds"] >= 3 * TIMEOUT, stall
