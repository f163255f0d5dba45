"""Handles resume after SIGKILL (issue 11, point 2): real agents are killed while one
stage of a checkpoint is `running` on node 1 (held there by CACHEX_TEST_HOLD, found in
the journal), restarted, and the checkpoint reaches `flushed` byte for byte; the events
show that no stage that had finished ran again, and that the one cut short did."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, files_of, kill_tree, wait_for

from cachex_agent.flush.bundle import extract
from cachex_agent.handles import EVENTS, Stage, State

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CKPT = "step_00001"
PARTS = {0: {".metadata": b"dcp metadata\n", "__0_0.distcp": os.urandom(3 << 20)},
         1: {"__1_0.distcp": os.urandom(3 << 20), "sub/__1_1.distcp": os.urandom(100_000)}}


def write_checkpoint(c: Cluster) -> None:
    """A DCP save: every node's files, then node 0's `.metadata` renamed in last."""
    for node in (1, 0):
        for rel, data in PARTS[node].items():
            if rel != ".metadata":
                (c.spool(node) / CKPT / rel).parent.mkdir(parents=True, exist_ok=True)
                (c.spool(node) / CKPT / rel).write_bytes(data)
    temp = c.spool(0) / CKPT / ".metadata.tmp"
    temp.write_bytes(PARTS[0][".metadata"])
    temp.rename(c.spool(0) / CKPT / ".metadata")


def stages(c: Cluster, node: int) -> dict[str, str]:
    try:
        doc = json.loads((c.journal(node) / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc["ckpts"].get(CKPT, {}).get("stages", {})


def named(c: Cluster, node: int, event: str) -> list[dict[str, Any]]:
    return [e for e in c.events(node) if e["event"] == event and e.get("ckpt") == CKPT]


def kill_while_running(c: Cluster, stage: str, done_on_0: str) -> None:
    """Start the agents holding `stage` on node 1; SIGKILL them once node 1's journal
    says it is running and node 0's says `done_on_0` is done."""
    c.start_agents(env={"CACHEX_TEST_HOLD": f"{stage}:1"})
    write_checkpoint(c)
    # replication starts while the capture runs: a held one waits for node 1's capture
    before = {"capture": "done"} if stage == "replicate" else {}
    # node 0's event too: the journal says done first, and a kill between the two would
    # leave a done stage that no event names (a restart does not name it again)
    done_event = EVENTS[(Stage(done_on_0), State.DONE)]
    wait_for(lambda: stages(c, 1).get(stage) == "running"
             and stages(c, 0).get(done_on_0) == "done" and named(c, 0, done_event)
             and all(stages(c, 1).get(s) == v for s, v in before.items()), 90,
             f"{stage} running on node 1, {done_on_0} done on node 0")
    kill_tree(c.agents)
    assert stages(c, 1)[stage] == "running"


def restart_until_flushed(c: Cluster, tmp_path: Path) -> None:
    c.start_agents()
    c.wait_level(CKPT, "flushed", timeout=120)
    assert c.cachex("verify", CKPT).returncode == 0
    for node, part in PARTS.items():
        out = tmp_path / f"extracted{node}"
        extract(c.pfs / "ckpt" / CKPT / f"node-{node:05d}.h5", out)
        assert files_of(out) == part                       # byte for byte
        # the flush runs beside the replication: `flushed` may come before `replicated`
        wait_for(lambda n=node: set(stages(c, n).values()) == {"done"}, 60,
                 f"every stage of node {node} done (now {stages(c, node)})")
    assert c.stop() == 0


def stage_events_follow_the_schema(c: Cluster, node: int) -> None:
    for e in c.events(node):
        if e.get("stage") is not None:
            assert {"stage", "state", "ckpt", "seq"} <= set(e), e


@pytest.fixture
def two_nodes(cluster):
    return cluster(nodes=2)


def test_killed_while_capturing_captures_again_and_nothing_else_twice(two_nodes, tmp_path):
    c = two_nodes
    kill_while_running(c, "capture", "capture")
    assert named(c, 1, "captured") == []
    restart_until_flushed(c, tmp_path)
    assert len(named(c, 1, "capture_start")) == 2           # cut short, then again
    assert len(named(c, 1, "captured")) == 1
    assert len(named(c, 0, "captured")) == 1                # node 0's was done: kept
    stage_events_follow_the_schema(c, 1)


@pytest.mark.parametrize("extra", ["", '[peer]\nstreams = 3\n[stage]\ncapture = "copy"'],
                         ids=["1-stream", "3-streams-copied"])
def test_killed_while_replicating_replicates_again_not_capture(cluster, tmp_path, extra):
    """Also with 3 files in flight to the partner (a copied part streams its files as
    they are captured, and the restart sends the staged part whole, its files in turn)."""
    c = cluster(nodes=2, extra=extra)
    kill_while_running(c, "replicate", "replicate")
    restart_until_flushed(c, tmp_path)
    for node in (0, 1):
        assert len(named(c, node, "captured")) == 1         # never captured twice
        assert len(named(c, node, "replicated")) == 1
    assert len(named(c, 1, "replicate_start")) == 2          # cut short, then again
    assert len(named(c, 0, "replicate_start")) == 1          # done: not again
    stage_events_follow_the_schema(c, 0)
    starts = [e["streams"] for n in (0, 1) for e in c.events(n) if e["event"] == "agent_start"]
    assert starts == [3 if extra else starts[0]] * 4, starts


def test_killed_while_flushing_flushes_again_and_keeps_the_finished_ones(two_nodes, tmp_path):
    c = two_nodes
    kill_while_running(c, "flush", "flush")
    restart_until_flushed(c, tmp_path)
    for node in (0, 1):
        assert len(named(c, node, "captured")) == 1
        assert len(named(c, node, "replicated")) == 1
        assert len(named(c, node, "flushed")) == 1
    assert len(named(c, 1, "flush_start")) == 2              # cut short, then again
    assert len(named(c, 0, "flush_start")) == 1              # done: its bundle reported
    assert [e["state"] for e in named(c, 1, "flushed")] == ["done"]
