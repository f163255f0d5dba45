"""Issue 10, points 1 and 8: a level holds every file of every node's part.

Two virtual nodes (`topology.domain = "rank"`), commit rule `marker:*/COMMITTED`: the
marker is written on node 0 only and says nothing about node 1's files, so node 1 must
check its own part (settle), wait for a directory that is not there yet, and, when its
stage is full, capture by reference and flush from the spool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Cluster, files_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
RULE = "marker:*/COMMITTED"
CKPT = "step_1"

# Closed files one after another, each fsynced, with a short pause: a slow node's
# writer that never holds anything open for long.
SLOW_WRITER = """
import os, sys, time
root, count = sys.argv[1], int(sys.argv[2])
os.makedirs(root, exist_ok=True)
for i in range(count):
    with open(os.path.join(root, f"shard_{i:05d}.bin"), "wb") as f:
        f.write(i.to_bytes(4, "little") * 64)
    time.sleep(0.002)
"""


def marker_cluster(cluster, extra: str = "") -> Cluster:
    return cluster(nodes=2, rule=RULE, commit='settle = "2s"\ntimeout = "120s"', extra=extra)


def commit_on_node0(c: Cluster, payload: bytes = b"node 0 data") -> None:
    ckpt = c.spool(0) / CKPT
    ckpt.mkdir()
    (ckpt / "data.bin").write_bytes(payload)
    (ckpt / "COMMITTED").write_bytes(b"")


def pfs_part(c: Cluster, node: int) -> dict[str, int]:
    """Path -> size of `node`'s files in the PFS manifest of CKPT."""
    manifest = json.loads((c.pfs / "ckpt" / CKPT / "manifest.json").read_text())
    return {f["path"]: f["size"] for f in manifest["files"] if f["node"] == node}


def spool_part(c: Cluster, node: int) -> dict[str, int]:
    """Path -> size in `node`'s spool; on node 1 without the marker mirrored there since."""
    files = {path: len(data) for path, data in files_of(c.spool(node) / CKPT).items()}
    if node:
        files.pop("COMMITTED", None)
    return files


def wait_settled(c: Cluster) -> str:
    """The level CKPT ends at: flushed or failed."""
    c.wait_level(CKPT, "flushed", "failed", timeout=150)
    return c.levels()[CKPT]


def test_slow_node_with_thousands_of_closed_files_is_captured_whole(cluster):
    c = marker_cluster(cluster)
    c.start_agents()
    target = c.spool(1) / CKPT
    writer = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(target), "2000"])
    try:
        wait_for(lambda: len(list(target.glob("*.bin"))) >= 50, 60, "node 1 to start writing")
        commit_on_node0(c)          # node 1 is still writing: the marker does not cover it
        assert writer.wait(timeout=120) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
    assert wait_settled(c) == "flushed", c.status()
    assert len(spool_part(c, 1)) == 2000
    assert pfs_part(c, 1) == spool_part(c, 1)
    assert pfs_part(c, 0) == spool_part(c, 0)
    result = c.cachex("verify", CKPT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert c.stop() == 0


def test_node_whose_directory_appears_after_the_commit_is_captured(cluster, tmp_path):
    c = marker_cluster(cluster)
    c.start_agents()
    commit_on_node0(c)
    # node 1 has no directory yet: it must wait (event), not fail the checkpoint
    waiting = wait_for(lambda: _waiting(c) or c.levels().get(CKPT) == "failed", 60,
                       "node 1 to wait for its directory (or the checkpoint to fail)")
    assert waiting is not True, f"failed at once: {c.status()}"
    assert "directory" in waiting["reason"]
    hidden = c.spool(1) / f".{CKPT}.incoming"       # not a checkpoint name: invisible
    hidden.mkdir()
    for i in range(20):
        (hidden / f"part_{i}.bin").write_bytes(bytes([i]) * 4096)
    os.rename(hidden, c.spool(1) / CKPT)
    assert wait_settled(c) == "flushed", c.status()
    assert pfs_part(c, 1) == spool_part(c, 1) and len(pfs_part(c, 1)) == 20
    assert c.cachex("verify", CKPT).returncode == 0
    assert c.stop() == 0


def _waiting(c: Cluster) -> dict | None:
    try:
        events = c.events(1)
    except OSError:
        return None
    return next((e for e in events if e["event"] == "capture_waiting"
                 and e.get("ckpt") == CKPT), None)


def test_full_stage_falls_back_to_flushing_from_the_spool(cluster, tmpfs, tmp_path):
    tmpfs(tmp_path / "node1" / "shm", "1m")         # node 1's stage: 1 MiB
    c = marker_cluster(cluster)
    c.start_agents()
    part = c.spool(1) / CKPT
    part.mkdir()
    for i in range(4):                              # 2 MiB: the copy meets ENOSPC
        (part / f"shard_{i}.bin").write_bytes(os.urandom(512 * 1024))
    commit_on_node0(c)
    assert wait_settled(c) == "flushed", c.status()
    assert pfs_part(c, 1) == spool_part(c, 1)
    result = c.cachex("verify", CKPT)
    assert result.returncode == 0, result.stdout + result.stderr
    export = tmp_path / "out"
    result = c.cachex("export", CKPT, str(export), "--per-node")
    assert result.returncode == 0, result.stderr
    exported = files_of(export / "node-00001")
    assert {path: len(data) for path, data in exported.items()} == spool_part(c, 1)
    assert all(exported[path] == (part / path).read_bytes() for path in exported)

    captured = [e for e in c.events(1) if e["event"] == "captured" and e["ckpt"] == CKPT]
    assert captured[-1]["mode"] == "reference" and "stage full" in captured[-1]["reason"]
    row = next(r for r in c.status()["checkpoints"] if r["id"] == CKPT)
    assert row["capture"]["1"]["mode"] == "reference", row
    assert "stage full" in row["capture"]["1"]["reason"]
    status = c.cachex("status")
    assert "stage full" in status.stdout, status.stdout
    stage = Path(c.stage(1))
    assert sorted(p.name for p in stage.iterdir() if CKPT in p.name) == [], "partial left"
    assert c.stop() == 0
