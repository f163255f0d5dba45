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
    it: on resuming it does not take its own node for dead (the skip list that every
    agent refused wedged the run), node 3 waits for it (suspect, not dead), and every
    checkpoint after goes through. (That a resumed sender does not blame its partner for
    its own stall is liveness.OwnClock's, tests/unit/test_slow_not_dead.py.)"""
    c = cluster(agent_timeout=f"{TIMEOUT:g}s")
    c.start_agents(env=paused(c, 3))
    partners = [e for e in c.events(3) if e["event"] == "agent_start"][-1]["partners"]
    assert partners == [0], partners
    trainer = c.trainer("--steps", "4", "--every", "4", *TRAIN)
    wait_paused(c, "step_00004")        # node 3's stream to node 0 is open
    with stopped(c, 0):
        began = time.monotonic()
        resume(c, "step_00004")         # node 3's slots go to a stopped partner
        # status, on this host, tells a stalled coordinator from one that is gone
        # (it reads the heartbeat until it has stood still for 5 periods)
        text = text_status(c)
        assert "agents not running" in text and "stalled, not gone" in text, text
        time.sleep(max(0.0, 3 * TIMEOUT - (time.monotonic() - began)))
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


def test_a_stalled_relay_is_named_and_its_subtree_reports_around_it(cluster):
    """8 nodes, two children per agent: node 1 relays for 3 and 4 (and 7 below 3).
    Stopped while its own capture is paused, past agent.timeout: its parent finds it
    silent from the tree's own beats, status names it and what waits on it within 2x
    agent.timeout, and the flushed reports of its subtree reach the coordinator around
    it during the stall. After SIGCONT the checkpoint completes and node 1 is back."""
    c = cluster(nodes=8, agent_timeout=f"{TIMEOUT:g}s", extra="fanout = 2")
    c.start_agents(env=paused(c, 1))
    trainer = c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=8, ranks_per_node=1)
    wait_paused(c, "step_00004")
    with stopped(c, 1):
        began = time.monotonic()
        resume(c, "step_00004")             # node 1 sees it only after SIGCONT
        row = silent_named(c, 1)
        assert time.monotonic() - began < 2 * TIMEOUT + 4, row
        assert (row["state"], row["relays_for"], row["subtree"]) == ("suspect", [3, 4], 3)
        assert "step_00004 captured" in row["waiting"], row
        text = text_status(c)
        assert "silent: node 1 suspect for " in text, text
        assert "children 3, 4" in text, text

        def subtree_flushed():
            rows = {r["id"]: r for r in c.status()["checkpoints"]}
            return rows.get("step_00004", {}).get("nodes_flushed") == 7
        wait_for(subtree_flushed, 30, "the flushed reports of 3, 4 and 7 around node 1")
    finish(trainer)
    all_flushed_and_verified(c, "step_00004")
    back = [e for e in c.events(0) if e["event"] == "node_back"]
    assert [e["node"] for e in back] == [1], back
    finish(c.trainer("--steps", "8", "--every", "4", "--resume", *TRAIN, ranks=8,
                     ranks_per_node=1))
    resume(c, "step_00008")
    all_flushed_and_verified(c, "step_00008")
    no_one_blamed(c, *range(8))
    assert c.stop(timeout=30) == 0


# (who is stopped, in which phase, for how many agent.timeouts): a leaf in its capture
# and in its flush, a replication partner while an owner streams to it; one stall
# shorter than agent.timeout, which nobody may even suspect
PHASES = [("leaf", "capture", 3.0), ("leaf", "flush", 3.0), ("partner", "replication", 3.0),
          ("partner", "replication", 0.5)]


@pytest.mark.parametrize("role,phase,length", PHASES,
                         ids=[f"{r}-{p}-{'long' if n > 1 else 'short'}" for r, p, n in PHASES])
def test_a_stalled_node_is_suspect_only_past_the_timeout_and_the_run_completes(
        cluster, role, phase, length):
    """Node 2 stopped for `length` x agent.timeout: past the timeout status names it and
    what it holds up (found by the one who waited); under it nobody suspects it. After
    SIGCONT every checkpoint is flushed and verifies, no partner was given up on."""
    # the flush: 2 MiB a node at 256 KiB/s after the throttle's 1 MiB burst, 4 s to stop in
    flush = '\n[flush]\nbandwidth = "256KiB"' if phase == "flush" else ""
    train = [*TRAIN, "--shard-size", "1MiB"] if phase == "flush" else TRAIN
    c = cluster(agent_timeout=f"{TIMEOUT:g}s", extra=flush)
    owner = {"capture": 2, "flush": None, "replication": 1}[phase]
    c.start_agents(env=paused(c, owner) if owner is not None else None)
    assert [e for e in c.events(1) if e["event"] == "agent_start"][-1]["partners"] == [2]
    trainer = c.trainer("--steps", "4", "--every", "4", *train)
    if owner is not None:
        wait_paused(c, "step_00004")
    else:
        wait_for(lambda: [e for e in c.events(2) if e["event"] == "flush_start"], 60,
                 "node 2's flush")
    if phase == "replication":      # node 2 has its own part: it stalls as a partner
        def others_captured() -> bool:
            rows = {r["id"]: r for r in c.status()["checkpoints"]}
            return rows.get("step_00004", {}).get("nodes_captured") == 3
        wait_for(others_captured, 60, "every node but node 1 to report its capture")
    with stopped(c, 2):
        if owner is not None:
            resume(c, "step_00004")
        if length > 1:
            row = silent_named(c, 2)
            # the next level the checkpoint needs of node 2 (its flush runs beside its
            # own replication: either may be the one missing)
            # as a partner, its own part may be done already: node 1's waits on it
            held = {"capture": ["step_00004 captured"],
                    "flush": ["step_00004 replicated", "step_00004 flushed"]}.get(phase)
            assert held is None or set(row["waiting"]) & set(held), row
            if phase == "replication":      # the owner that waited says so too
                wait_for(lambda: "replication" in silent_named(c, 2)["holds"], 3 * TIMEOUT,
                         "node 1 to find its partner silent")
                assert 1 in silent_named(c, 2)["by"]
        time.sleep(length * TIMEOUT)
    finish(trainer)
    all_flushed_and_verified(c, "step_00004")
    suspects = [e for e in c.events(0) if e["event"] == "node_suspect"]
    if length > 1:
        assert {e["node"] for e in suspects} == {2}, suspects
        assert [e["node"] for e in c.events(0) if e["event"] == "node_back"] == [2]
    else:
        assert suspects == []
    rows = {r["id"]: r for r in c.status()["checkpoints"]}
    assert rows["step_00004"]["nodes_replicated"] == 4, rows["step_00004"]
    no_one_blamed(c, 0, 1, 2, 3)
    # the stalled agent found its own stop, and counted it against no one
    stall = [e["seconds"] for e in c.events(2) if e["event"] == "stalled"]
    assert stall and max(stall) >= 0.9 * length * TIMEOUT, stall
    assert c.stop(timeout=30) == 0


def test_stop_during_a_stall_drains_the_live_agents_and_the_stalled_one_on_resuming(
        cluster):
    """`cachex stop` while node 2, partner of node 1, is stopped with node 1's replica
    half sent: the live agents drain (node 1 does not wait for its suspect partner; its
    part goes to the PFS), the stop waits for node 2, which drains once resumed, and the
    job exits."""
    c = cluster(agent_timeout=f"{TIMEOUT:g}s")
    c.start_agents(env=paused(c, 1))
    trainer = c.trainer("--steps", "4", "--every", "4", *TRAIN)
    wait_paused(c, "step_00004")
    with stopped(c, 2):
        resume(c, "step_00004")
        silent_named(c, 2)
        stop = c.cachex("stop", "--no-wait")
        assert stop.returncode == 0, stop.stderr

        def drained(node: int) -> list[dict]:
            return [e for e in c.events(node) if e["event"] == "drained"]
        wait_for(lambda: all(drained(n) for n in (0, 1, 3)), 60, "the live agents to drain")
        assert all(drained(n)[-1]["unflushed"] == [] for n in (0, 1, 3))
        flushed = [e["ckpt"] for e in c.events(1) if e["event"] == "flushed"]
        assert "step_00004" in flushed
        given_up = [e for e in c.events(1) if e["event"] == "replicate_failed"]
        assert "silent at the drain" in json.dumps(given_up), given_up
        assert c.agents.poll() is None      # the job waits for node 2
    finish(trainer)
    assert c.agents.wait(60) == 0
    assert (c.pfs / "ckpt" / "step_00004" / "node-00002.h5").exists()
    assert c.status()["state"] == "stopped", c.status()


def test_a_commit_reaches_the_subtree_of_a_stalled_relay(cluster):
    """Node 1 relays for 3, 4 and 7 and is stopped before the trainer's next commit:
    whether the commit frame went to node 1 before it was found silent (then its
    subtree finds the gap and asks node 0) or after (then the tree goes around it), the
    7 other nodes capture while node 1 is stopped, and it catches up once resumed."""
    c = cluster(nodes=8, agent_timeout=f"{TIMEOUT:g}s", extra="fanout = 2")
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=8, ranks_per_node=1))
    c.wait_level("step_00004", "flushed")
    with stopped(c, 1):
        trainer = c.trainer("--steps", "8", "--every", "4", "--resume", *TRAIN, ranks=8,
                            ranks_per_node=1)

        def captured() -> int:
            rows = {r["id"]: r for r in c.status()["checkpoints"]}
            return rows.get("step_00008", {}).get("nodes_captured", 0)
        wait_for(lambda: captured() == 7, 4 * TIMEOUT + 20, "7 nodes to capture step_00008")
    finish(trainer)
    all_flushed_and_verified(c, "step_00008")
    no_one_blamed(c, *range(8))
    assert c.stop(timeout=30) == 0


def test_a_drain_a_stalled_relay_held_reaches_its_subtree_around_it(cluster):
    """`cachex stop` right after node 1 (relay for 3, 4 and 7) is stopped: the drain
    goes to node 1 and waits there (the coordinator reads the stop within a second,
    agent.timeout is 5 s). Once node 1 is suspect the next frame takes another route;
    its subtree finds the gap in the frames' numbers, asks node 0 for the drain and
    drains while node 1 is still stopped; node 1 drains once resumed."""
    timeout = 5.0
    c = cluster(nodes=8, agent_timeout=f"{timeout:g}s", extra="fanout = 2")
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=8, ranks_per_node=1))
    c.wait_level("step_00004", "flushed")
    with stopped(c, 1):
        stop = c.cachex("stop", "--no-wait")
        assert stop.returncode == 0, stop.stderr

        def drained(node: int) -> bool:
            return any(e["event"] == "drained" for e in c.events(node))
        wait_for(lambda: all(drained(n) for n in (0, 2, 3, 4, 5, 6, 7)), 4 * timeout + 20,
                 "every live agent to drain")
        asked = [e for n in (3, 4, 7) for e in c.events(n) if e["event"] == "frames_missed"]
        assert asked, "the drain reached node 1's subtree without a gap: held nowhere?"
        assert c.agents.poll() is None
    assert c.agents.wait(60) == 0
    no_one_blamed(c, *range(8))
