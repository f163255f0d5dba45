"""The integration drills with every node in namespaces of its own (nsharness.py): the
agents find their node by hostname, replicate over TCP between veths, flush to the one
shared directory, and recover a lost node on a replacement with another hostname."""

from __future__ import annotations

import json
import re

import pytest
from harness import files_of, finish
from test_recover import TRAIN as RECOVER_TRAIN
from test_recover import (
    expected_after,
    killed_after_a_replica,
    reference_hash,
    unreadable_pfs,
)

from cachex_agent.config import load
from cachex_agent.events import read_events
from cachex_agent.layout import events_path, journal_global_manifest_path
from cachex_agent.peer.partners import replication_map

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
    PFS moved away; `cachex recover` on a spare with another hostname and the 3 others.
    The spare's name sorts after the survivors': node k is now the host that was node
    k + 1 (the node index is the place in the sorted hostnames, as the trainer's ranks
    are), so every part moves to the host now at its index."""
    c = ns_cluster(nodes=4)
    c.start_agents()
    candidates = killed_after_a_replica(c, c.trainer("--steps", "200", *RECOVER_TRAIN,
                                                     ranks=8))
    lost = c.live[0]
    c.lose(lost)
    assert not lost.path("/").exists()
    unreadable_pfs(c)
    spare = c.add_node("cx-node9")
    assert c.live[-1] is spare and spare.run("mkdir", "-p", str(c.local / "spool")).returncode == 0
    assert [n.hostname for n in c.live] == ["cx-node1", "cx-node2", "cx-node3", "cx-node9"]

    proc = c.mpiexec(str(c.bin / "cachex"), "recover", "--config", str(c.config))
    out = proc.communicate(timeout=180)[0].decode()
    assert proc.returncode == 0, out
    recovered = re.search(r"recovered (step_\d+)", out)
    assert recovered and recovered.group(1) in candidates, out
    newest = recovered.group(1)
    assert re.search(r"from replica on node \d", out), out
    for node, files in expected_after(candidates[newest]).items():
        assert files_of(c.spool(node) / newest) == files
    # redundancy is back: every part on its partners of the new numbering, with a manifest
    pmap = replication_map(load(c.config), [n.hostname for n in c.live])
    assert pmap is not None
    for part, partners in enumerate(pmap):
        for partner in partners:
            replica = c.replicas(partner) / f"node-{part:05d}"
            assert (replica / f"{newest}.manifest.json").exists(), (part, partner)
            assert files_of(replica / newest) == candidates[newest][part]

    out = finish(c.trainer("--steps", "16", "--resume", *RECOVER_TRAIN, ranks=8))
    assert f"resumed from {newest}" in out
    assert out.strip().splitlines()[-1].split()[-1] == reference_hash(tmp_path, 16)


def test_node_1_stops_the_agents_without_the_pfs_and_verifies_its_own_part(ns_cluster):
    """`cachex stop` on node 1, which cannot write to the PFS, reaches the agents through
    node 1's agent. Then, with the PFS down and no global manifest: node 0's journal path
    is node 1's own journal, whose manifest is node 1's, never node 0's."""
    c = ns_cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")

    unreachable = c.root / "pfs-unreachable"          # a file: no stop request goes there
    unreachable.write_text("not the PFS")
    stop = c.cachex("stop", "--no-wait", "--set", f"paths.pfs={unreachable}", node=1)
    assert stop.returncode == 0, stop.stderr
    assert "in this node's journal, for its agent" in stop.stdout, stop.stdout
    assert "on the PFS" not in stop.stdout, stop.stdout
    assert c.agents is not None and c.agents.wait(timeout=90) == 0
    assert [e["requested_by"] for e in read_events(events_path(c.journal(0)))
            if e["event"] == "drain"] == [1]

    unreadable_pfs(c)
    journal_global_manifest_path(c.journal(1), "step_00004").unlink()
    verify = c.cachex("verify", "step_00004", node=1)
    assert re.search(r"stage +node 1 +ok", verify.stdout), verify.stdout + verify.stderr
    assert not re.search(r"stage +node 0", verify.stdout), verify.stdout
    status = c.cachex("status", node=1)         # node 0's status is on node 0 only
    assert status.returncode == 1 and "not visible from another node" in status.stderr, \
        status.stdout + status.stderr
