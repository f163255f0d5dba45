"""Issue 11, point 4: replication of a part starts while later files of it are still
being captured. Two virtual nodes, real agents; node 0's capture is paused after its
first file (CACHEX_TEST_CAPTURE_PAUSE) so that the order is certain, not a race: the
partner hears of the part before the owner has captured it, and the replica it keeps is
the final capture byte for byte, also when the part changed during the capture."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, files_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CKPT = "step_00001"
SHARDS = {f"__0_{i}.distcp": os.urandom(4 << 20) for i in range(4)}


def write_checkpoint(c: Cluster) -> None:
    """A DCP save: node 1's shard, node 0's shards, then node 0's `.metadata` last."""
    (c.spool(1) / CKPT).mkdir(parents=True)
    (c.spool(1) / CKPT / "__1_0.distcp").write_bytes(os.urandom(1 << 20))
    for name, data in SHARDS.items():
        (c.spool(0) / CKPT).mkdir(parents=True, exist_ok=True)
        (c.spool(0) / CKPT / name).write_bytes(data)
    temp = c.spool(0) / CKPT / ".metadata.tmp"
    temp.write_bytes(b"dcp metadata\n")
    temp.rename(c.spool(0) / CKPT / ".metadata")


def named(c: Cluster, node: int, event: str) -> list[dict[str, Any]]:
    return [e for e in c.events(node) if e["event"] == event and e.get("ckpt") == CKPT]


def replica(c: Cluster, partner: int, owner: int) -> Path:
    return c.root / f"node{partner}" / "nvme" / "t" / "replicas" / f"node-{owner:05d}" / CKPT


def paused_after_first_file(c: Cluster, pause: Path) -> None:
    """Start the agents, write the checkpoint; return once node 0's capture is paused
    after its first file and node 1 has begun storing the stream of node 0's part."""
    pause.mkdir()
    c.start_agents(env={"CACHEX_TEST_CAPTURE_PAUSE": f"0:{pause}"})
    write_checkpoint(c)
    wait_for(lambda: (pause / f"paused-{CKPT}").exists(), 90, "node 0's capture to pause")
    wait_for(lambda: [e for e in named(c, 1, "replica_start") if e["owner"] == 0], 90,
             "node 1 to begin node 0's replica")


def resume_until_flushed(c: Cluster, pause: Path) -> None:
    (pause / f"resume-{CKPT}").touch()
    c.wait_level(CKPT, "flushed", timeout=120)
    assert files_of(replica(c, 1, 0)) == files_of(c.spool(0) / CKPT)   # byte for byte
    assert c.cachex("verify", CKPT).returncode == 0


def test_replication_of_a_part_starts_before_its_capture_ends(cluster, tmp_path):
    c = cluster(nodes=2)
    pause = tmp_path / "pause"
    paused_after_first_file(c, pause)
    # the capture is still running (paused), and the partner already stores the stream
    assert named(c, 0, "captured") == []
    assert [e["streamed"] for e in named(c, 1, "replica_start") if e["owner"] == 0] == [True]
    assert named(c, 0, "replicate_start")
    resume_until_flushed(c, pause)
    order = [e["event"] for e in c.events(0) if e.get("ckpt") == CKPT]
    assert order.index("replicate_start") < order.index("captured") < order.index("replicated")
    assert named(c, 0, "replicate_restart") == []          # nothing sent twice
    assert [e["event"] for e in c.events(1) if e.get("owner") == 0
            and e["event"].startswith("replica_")] == ["replica_start", "replica_done"]
    assert c.stop() == 0


def test_a_part_changed_during_its_capture_is_replicated_as_finally_captured(cluster,
                                                                             tmp_path):
    c = cluster(nodes=2)
    pause = tmp_path / "pause"
    paused_after_first_file(c, pause)
    # the trainer replaces a shard while the capture is paused: the capture sees the part
    # change and starts over; what was streamed of the first attempt must not be kept
    changed = c.spool(0) / CKPT / "__0_1.distcp"
    temp = changed.with_suffix(".tmp")
    temp.write_bytes(os.urandom(4 << 20))
    temp.rename(changed)
    resume_until_flushed(c, pause)
    assert named(c, 0, "capture_retry")
    assert named(c, 0, "replicate_restart")
    assert files_of(replica(c, 1, 0))["__0_1.distcp"] == changed.read_bytes()
    # node 1 dropped the stream, then stored the whole part
    stored = [(e["event"], e.get("streamed")) for e in c.events(1) if e.get("owner") == 0
              and e["event"] in ("replica_start", "replica_failed", "replica_done")]
    assert stored == [("replica_start", True), ("replica_failed", None),
                      ("replica_start", False), ("replica_done", None)], stored
    assert c.stop() == 0
