"""The integration drills with every node in namespaces of its own (nsharness.py): the
agents find their node by hostname, replicate over TCP between veths, flush to the one
shared directory, and recover a lost node on a replacement with another hostname."""

from __future__ import annotations

import json

import pytest
from harness import files_of, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--files-per-rank", "2"]


def own_files(c, node: int, ckpt: str) -> dict[str, bytes]:
    """Node `node`'s part in its spool (the global `.metadata` is node 0's)."""
    files = files_of(c.spool(node) / ckpt)
    if node:
        files.pop(".metadata", None)
    return files


def test_capture_replicate_flush_across_namespaces(ns_cluster, tmp_path):
    c = ns_cluster(nodes=2)
    c.start_agents()
    traffic = [node.traffic() for node in c.live]
    finish(c.trainer("--steps", "8", "--every", "4", *TRAIN))
    c.wait_level("step_00008", "flushed")

    listing = c.cachex("ls", "--json", node=1)
    assert listing.returncode == 0, listing.stderr
    assert [(r["id"], r["level"]) for r in json.loads(listing.stdout)["checkpoints"]] == [
        ("step_00004", "flushed"), ("step_00008", "flushed")]
    parts = {node: own_files(c, node, "step_00008") for node in range(2)}
    assert sorted(parts[1]) == ["__2_0.distcp", "__2_1.distcp", "__3_0.distcp",
                                "__3_1.distcp"]
    # each node's part is on its partner's NVMe, read inside the partner's namespace
    for node, partner in ((0, 1), (1, 0)):
        replica = c.replicas(partner) / f"node-{node:05d}" / "step_00008"
        assert files_of(replica) == parts[node]
        assert not (c.replicas(node) / f"node-{node:05d}").exists()
    # ...having gone through the veths: at least both parts, once each way
    sent = sum(node.traffic() - before for node, before in zip(c.live, traffic))
    assert sent >= sum(len(b) for files in parts.values() for b in files.values())

    out = tmp_path / "out"
    result = c.cachex("export", "step_00008", str(out), "--per-node", node=1)
    assert result.returncode == 0, result.stderr
    for node in range(2):
        assert files_of(out / f"node-{node:05d}") == parts[node]
    status = c.cachex("status", "--json", node=1)
    assert json.loads(status.stdout)["nodes"] == 2, status.stdout
    assert c.stop() == 0
    assert c.status()["state"] == "stopped"
