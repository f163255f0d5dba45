"""A trainer that keeps only its newest few checkpoints can delete a committed one before
a busy agent's turn to capture it. That checkpoint fails at once, named, and the agent
goes on; it does not wait `commit.timeout` for a directory that is gone (found in the
heavy-tail CoV benchmark: seven removed checkpoints waited 60 s each, in turn, and the
drain outlasted its bound)."""

from __future__ import annotations

import os
import shutil

import pytest
from harness import Cluster, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def write_dcp(c: Cluster, ckpt: str, size: int = 1 << 20) -> None:
    """Both nodes' shards, then node 0's `.metadata` last."""
    for node in range(c.nodes):
        (c.spool(node) / ckpt).mkdir(parents=True)
        for i in range(3):
            (c.spool(node) / ckpt / f"__{node}_{i}.distcp").write_bytes(os.urandom(size))
    temp = c.spool(0) / ckpt / ".metadata.tmp"
    temp.write_bytes(b"dcp metadata\n")
    temp.rename(c.spool(0) / ckpt / ".metadata")


def test_a_checkpoint_deleted_before_its_capture_fails_at_once(cluster, tmp_path):
    # commit.timeout far beyond the waits below: only the new check can end the capture
    c = cluster(nodes=2, commit='timeout = "600s"')
    pause = tmp_path / "pause"
    pause.mkdir()
    c.start_agents(env={"CACHEX_TEST_CAPTURE_PAUSE": f"0:{pause}"})
    write_dcp(c, "step_00001")
    wait_for(lambda: (pause / "paused-step_00001").exists(), 90, "node 0's capture to pause")
    write_dcp(c, "step_00002")
    wait_for(lambda: any(e["event"] == "capture_queued" and e.get("ckpt") == "step_00002"
                         for e in c.events(0)), 60, "node 0 to queue step_00002")
    shutil.rmtree(c.spool(0) / "step_00002")        # the trainer's retention
    (pause / "resume-step_00001").touch()
    c.wait_level("step_00001", "flushed", timeout=120)
    c.wait_level("step_00002", "failed", timeout=60)
    failed = [e for e in c.events(0) if e["event"] == "capture_failed"]
    assert [e["ckpt"] for e in failed] == ["step_00002"]
    assert "removed from the spool before its capture" in failed[0]["error"], failed
    assert not any(e["event"] == "capture_waiting" and e.get("ckpt") == "step_00002"
                   for e in c.events(0))
    (pause / "resume-step_00003").touch()           # the test's pause holds each once
    write_dcp(c, "step_00003")                       # the agents go on
    c.wait_level("step_00003", "flushed", timeout=120)
    assert c.stop() == 0
