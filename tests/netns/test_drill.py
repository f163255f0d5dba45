"""The integration drills with every node in namespaces of its own (nsharness.py): the
agents find their node by hostname, replicate over TCP between veths, flush to the one
shared directory, and recover a lost node on a replacement with another hostname."""

from __future__ import annotations

import json
import re

import pytest
from harness import files_of, finish, kill_tree
from test_recover import TRAIN as RECOVER_TRAIN
from test_recover import (
    committed_since,
    expected_after,
    reference_hash,
    snapshot,
    unreadable_pfs,
)

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
    sent = [node.sent() for node in c.live]
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
    # ...having gone through the veths: each node sent at least its part
    for node in range(2):
        assert c.live[node].sent() - sent[node] >= sum(map(len, parts[node].values()))

    out = tmp_path / "out"
    result = c.cachex("export", "step_00008", str(out), "--per-node", node=1)
    assert result.returncode == 0, result.stderr
    for node in range(2):
        assert files_of(out / f"node-{node:05d}") == parts[node]
    # `cachex verify` on node 1 checks what node 1 can see, and says what it cannot
    verify = c.cachex("verify", "step_00008", node=1)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    states = {tuple(line.split()[1:4]) for line in verify.stdout.splitlines()[:-1]}
    assert states == {("stage", "node", "0"), ("stage", "node", "1"), ("replica", "node", "0"),
                      ("replica", "node", "1"), ("pfs", "node", "0"), ("pfs", "node", "1")}
    assert re.search(r"stage +node 0 +not visible here", verify.stdout), verify.stdout
    assert re.search(r"stage +node 1 +ok", verify.stdout), verify.stdout
    assert re.search(r"replica node 0 +ok .* \(on node 1\)", verify.stdout), verify.stdout
    assert re.search(r"replica node 1 +not visible here", verify.stdout), verify.stdout
    status = c.cachex("status", "--json", node=1)
    assert json.loads(status.stdout)["nodes"] == 2, status.stdout
    assert c.stop() == 0
    assert c.status()["state"] == "stopped"


def test_drill_node_0_namespace_destroyed_pfs_gone_recovered_on_a_spare(ns_cluster, tmp_path):
    """8 ranks on 4 nodes, 32 shards + `.metadata`; node 0's namespace is destroyed, the
    PFS moved away; `cachex recover` on a spare with another hostname and the 3 others."""
    c = ns_cluster(nodes=4)
    c.start_agents()
    trainer = c.trainer("--steps", "200", *RECOVER_TRAIN, ranks=8)
    c.wait_level("step_00008", "replicated", "flushed", timeout=90)
    kill_tree(trainer)                       # node 0's loss ends the trainer and the agents
    kill_tree(c.agents)
    levels = c.levels()
    newest = max((ckpt for ckpt, level in levels.items()
                  if level in ("replicated", "flushed")), key=lambda k: int(k[5:]))
    assert sum(len(files) for files in snapshot(c, newest).values()) == 33
    candidates = {ckpt: snapshot(c, ckpt) for ckpt in committed_since(c, newest)}
    lost = c.live[0]
    c.lose(lost)
    assert not lost.path("/").exists()
    unreadable_pfs(c)
    spare = c.add_node("cx-node0-spare")     # sorts where cx-node0 was: node 0
    assert c.live[0] is spare and spare.run("mkdir", "-p", str(c.local / "spool")).returncode == 0

    proc = c.mpiexec(str(c.bin / "cachex"), "recover", "--config", str(c.config))
    out = proc.communicate(timeout=180)[0].decode()
    assert proc.returncode == 0, out
    recovered = re.search(r"recovered (step_\d+)", out)
    assert recovered and recovered.group(1) in candidates, out
    newest = recovered.group(1)
    assert "replica on node 1" in out, out
    for node, files in expected_after(candidates[newest]).items():
        assert files_of(c.spool(node) / newest) == files
    # redundancy is back: the spare's part is again on its partner, with a manifest
    replica = c.replicas(1) / "node-00000"
    assert (replica / f"{newest}.manifest.json").exists()
    assert files_of(replica / newest) == candidates[newest][0]

    out = finish(c.trainer("--steps", "16", "--resume", *RECOVER_TRAIN, ranks=8))
    assert f"resumed from {newest}" in out
    assert out.strip().splitlines()[-1].split()[-1] == reference_hash(tmp_path, 16)
