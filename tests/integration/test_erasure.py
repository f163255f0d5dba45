"""Erasure-coded redundancy through real agents: 8 virtual nodes under mpiexec encode
each checkpoint in groups (`peer.scheme` xor or rs:K+M) instead of copying it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, finish, kill_tree, wait_for

from cachex_agent.peer.parity import ParityManifest, check_member

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NODES = 8
TRAIN = ["--shard-size", "96KiB", "--chunk-size", "32KiB", "--step-time", "0.02",
         "--files-per-rank", "3", "--every", "4"]


def peer(scheme: str, group: int, flush_every: int = 1, keep: int = 0) -> str:
    return (f'\n[peer]\nscheme = "{scheme}"\ngroup = {group}\n'
            f'\n[flush]\nevery = {flush_every}\n\n[keep]\nreplica = {keep}\n')


def trained(cluster, scheme: str, group: int, steps: int = 8, level: str = "flushed",
            flush_every: int = 1, nodes: int = NODES, keep: int = 0) -> Cluster:
    """Agents (one per virtual node) and a trainer (one rank per node) ran `steps` steps;
    the last checkpoint reached `level`; agents stopped."""
    c = cluster(nodes=nodes, extra=peer(scheme, group, flush_every, keep))
    c.start_agents()
    finish(c.trainer("--steps", str(steps), *TRAIN, ranks=nodes, ranks_per_node=1))
    c.wait_level(f"step_{steps:05d}", level, timeout=120)
    c.last_status = c.status()
    c.shown = {what: c.cachex(*what.split()) for what in ("ls", "status", "ls --json")}
    assert c.stop() == 0
    return c


def parity_root(c: Cluster, node: int):
    return c.root / f"node{node}" / "nvme" / "t" / "parity"


def test_xor_groups_of_four_reach_replicated_and_parity_verifies(cluster):
    # only the first checkpoint is flushed: the second stays at `replicated`
    c = trained(cluster, "xor", 4, level="replicated", flush_every=100, keep=1)
    ckpt = "step_00008"
    row = next(r for r in c.last_status["checkpoints"] if r["id"] == ckpt)
    assert row["nodes_replicated"] == NODES and row["level"] == "replicated", row
    groups = set()
    for node in range(NODES):
        done = [e for e in c.events(node) if e["event"] == "replicated" and e["ckpt"] == ckpt]
        assert len(done) == 1 and len(done[0]["partners"]) == 3, done
        manifest = ParityManifest.load(parity_root(c, node), ckpt)
        assert (manifest.scheme, manifest.k, manifest.m) == ("xor", 3, 1)
        assert manifest.group[manifest.member] == node
        groups.add(tuple(manifest.group))
        source = c.stage(node) / ckpt
        assert check_member(parity_root(c, node), ckpt, source if source.is_dir() else None
                            ) == {}
    assert sorted(n for g in groups for n in g) == list(range(NODES)) and len(groups) == 2
    # no RMA copy was made: no node holds another's replica
    assert not any(any((c.root / f"node{n}" / "nvme" / "t" / "replicas").glob("*/*"))
                   for n in range(NODES))
    text = json.dumps(c.status())
    assert "replicate_failed" not in text
    for node in range(NODES):       # keep.replica = 1: step_00004's parity went, manifest first
        assert sorted(p.name for p in parity_root(c, node).iterdir()) == [
            ckpt, f"{ckpt}.parity.json"]
        assert [e for e in c.events(node) if e["event"] == "evicted"
                and e.get("level") == "parity"][0]["ckpt"] == "step_00004"
    listed = c.shown["ls"]          # while the agents ran (the drain flushes the rest)
    assert listed.returncode == 0, listed.stderr
    assert any(ckpt in line and "replicated (xor 4)" in line
               for line in listed.stdout.splitlines()), listed.stdout
    assert "xor parity over groups of 4 nodes; each group survives 1 lost node" \
        in c.shown["status"].stdout, c.shown["status"].stdout
    assert json.loads(c.shown["ls --json"].stdout)["redundancy"] == {
        "scheme": "xor", "group": 4, "survives": 1, "sizes": [4, 4]}
    model_plan_knows_the_scheme(c)


def model_plan_knows_the_scheme(c: Cluster) -> None:
    """`cachex model plan` on this run's events: node losses survive per group of the
    configured scheme; a larger group (--set) is less likely to stay within tolerance."""
    def plan(*extra: str) -> dict:
        found = c.cachex("model", "plan", "--json", "--period", "600s",
                         "--set", "model.node_rate=0.1", *extra)
        assert found.returncode == 0, found.stderr
        return json.loads(found.stdout)
    fours, eights = plan(), plan("--set", "peer.group=8")
    assert fours["protection"]["scheme"] == "xor"
    assert fours["protection"]["groups"] == [[4, 1], [4, 1]]
    assert eights["protection"]["groups"] == [[8, 1]]
    assert 0 < fours["protection"]["beyond_per_period"] < eights["protection"][
        "beyond_per_period"]
    fallback = {p["name"]: p["node_fallback"] for p in fours["paths"]}
    assert fallback["direct"] == 0 and fallback["peer"] > 0, fallback
    text = c.cachex("model", "plan", "--period", "600s")
    assert "node losses: xor over 2 group(s) of 4 nodes, each rebuilding 1 lost member" \
        in text.stdout, text.stdout + text.stderr


@pytest.mark.parametrize("extra,env,words", [
    (peer("xor", 8), {}, ["peer.group", "8"]),      # 8 nodes per group, the job has 4
    (peer("xor", 2), {"MPI4PY_RC_THREAD_LEVEL": "funneled"},
     ["peer.scheme", "MPI_THREAD_MULTIPLE"]),
], ids=["group larger than the job", "mpi without thread support"])
def test_erasure_start_up_refused_in_one_line(cluster, extra, env, words):
    c = cluster(nodes=4, extra=extra)
    proc = subprocess.run([str(MPIEXEC), "-n", "4", str(BIN / "cachex-agent"), "--config",
                           str(c.config)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert all(word in lines[0] for word in words), lines[0]
    assert not (c.root / "node0" / "nvme" / "t").exists()     # nothing created


def lose(c: Cluster, *nodes: int) -> None:
    """Everything node-local is gone (spool, stage, cache with journal and parity); the
    replacement has an empty spool."""
    for node in nodes:
        shutil.rmtree(c.root / f"node{node}")
        c.spool(node).mkdir(parents=True)


def recover(c: Cluster, nodes: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MPIEXEC), "-n", str(nodes), str(BIN / "cachex"), "recover",
                           "--config", str(c.config)],
                          capture_output=True, text=True, timeout=240)


def spools(c: Cluster, nodes: int, ckpt: str) -> dict[int, dict[str, bytes]]:
    return {n: files_of(c.spool(n) / ckpt) for n in range(nodes)}


def pfs_down(c: Cluster) -> None:
    """Nothing can come from the PFS: only the nodes' data and parity are left."""
    os.rename(c.pfs, c.root / "pfs-gone")
    c.pfs.write_text("the parallel file system is down")


@pytest.mark.parametrize("lost", [(1, 6), (0, 3)], ids=["nodes 1 and 6", "nodes 0 and 3"])
def test_xor_loses_one_node_per_group_and_recovers_byte_for_byte(cluster, lost):
    c = trained(cluster, "xor", 4)
    ckpt = "step_00008"
    before = spools(c, NODES, ckpt)
    groups = {tuple(ParityManifest.load(parity_root(c, n), ckpt).group) for n in range(NODES)}
    assert all(len(set(lost) & set(g)) == 1 for g in groups), groups   # one per group
    lose(c, *lost)
    pfs_down(c)
    result = recover(c, NODES)
    assert result.returncode == 0, result.stdout + result.stderr
    for node in lost:
        assert re.search(rf"rebuilds node {node} from the survivors", result.stdout), \
            result.stdout
    assert "then encodes the group again" in result.stdout
    assert spools(c, NODES, ckpt) == before
    for node in lost:           # the replacements hold their parity share again
        assert ParityManifest.load(parity_root(c, node), ckpt).group[
            ParityManifest.load(parity_root(c, node), ckpt).member] == node
    c.pfs.unlink()              # the PFS is back: every copy verifies
    os.rename(c.root / "pfs-gone", c.pfs)
    checked = c.cachex("verify", ckpt)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert len(re.findall(rf"{ckpt} parity +node \d+ +ok", checked.stdout)) == NODES


@pytest.mark.parametrize("nodes,lost", [(8, (1, 4)), (8, (0, 7)), (8, (2, 3)), (6, (1, 4))],
                         ids=["8 nodes, 1 and 4", "8 nodes, 0 and 7", "8 nodes, 2 and 3",
                              "6 nodes, 1 and 4"])
def test_rs_4_2_loses_any_two_and_recovers(cluster, nodes, lost):
    """8 nodes make one group of 8 (the 2 left over add to K: K 6, M 2); 6 nodes the
    plain rs:4+2 group. Any two lost members are rebuilt from the others alone."""
    c = trained(cluster, "rs:4+2", 6, nodes=nodes)
    ckpt = "step_00008"
    manifest = ParityManifest.load(parity_root(c, 5), ckpt)
    assert (manifest.scheme, manifest.k, manifest.m) == (f"rs:{nodes - 2}+2", nodes - 2, 2)
    assert sorted(manifest.group) == list(range(nodes))
    before = spools(c, nodes, ckpt)
    lose(c, *lost)
    pfs_down(c)
    result = recover(c, nodes)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"rebuilds nodes {lost[0]}, {lost[1]} from the survivors" in result.stdout, \
        result.stdout
    assert spools(c, nodes, ckpt) == before


def test_rs_4_2_three_losses_fall_back_to_the_pfs(cluster):
    c = trained(cluster, "rs:4+2", 6)
    ckpt = "step_00008"
    before = spools(c, NODES, ckpt)
    lose(c, 0, 2, 5)
    result = recover(c, NODES)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "more than the 2" in line]
    assert len(lines) == 1 and "lost nodes 0, 2, 5" in lines[0], result.stdout
    assert "from the PFS bundle" in result.stdout
    assert spools(c, NODES, ckpt) == before


def test_verify_catches_a_corrupted_parity_byte(cluster):
    c = trained(cluster, "xor", 4)
    ckpt = "step_00008"
    good = c.cachex("verify", ckpt)
    assert good.returncode == 0, good.stdout + good.stderr
    assert len(re.findall(rf"{ckpt} parity +node \d+ +ok", good.stdout)) == NODES, good.stdout
    chunk = sorted((parity_root(c, 5) / ckpt).iterdir())[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    bad = c.cachex("verify", ckpt)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert re.search(rf"{ckpt} parity +node 5 +BAD", bad.stdout), bad.stdout
    assert f"{chunk}: checksum mismatch" in bad.stdout, bad.stdout
    assert "1 bad copies" in bad.stderr, bad.stderr


def test_killed_while_encoding_encodes_again_after_restart(cluster):
    """SIGKILL while node 1 holds its first encoding `running` and the second is queued
    behind it; the restarted agents (whose journals hold the second's global manifest)
    encode the second again, every member. The first was flushed and finalized: a
    finished checkpoint resumes nothing (docs/architecture.md), encoded or not."""
    ckpt = "step_00008"         # seq 2: not flushed (flush.every), so not finalized
    c = cluster(nodes=4, extra=peer("xor", 4, flush_every=100))
    c.start_agents(env={"CACHEX_TEST_HOLD": "replicate:1"})
    finish(c.trainer("--steps", "8", *TRAIN, ranks=4, ranks_per_node=1))

    def replicate_state(node: int, name: str = ckpt) -> str | None:
        try:
            doc = json.loads((c.journal(node) / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return doc["ckpts"].get(name, {}).get("stages", {}).get("replicate")
    wait_for(lambda: replicate_state(1, "step_00004") == "running"
             and replicate_state(1) == "queued", 90, "node 1 encoding, the next queued")
    kill_tree(c.agents)
    assert not (parity_root(c, 1) / f"{ckpt}.parity.json").exists()
    c.start_agents()
    wait_for(lambda: all(replicate_state(n) == "done" for n in range(4)), 120,
             "every member's encoding done after the restart")
    for node in range(4):
        assert check_member(parity_root(c, node), ckpt, c.stage(node) / ckpt) == {}
    assert [e["event"] for e in c.events(1) if e.get("stage") == "replicate"
            and e["ckpt"] == ckpt][-2:] == ["replicate_start", "replicated"]
    assert c.stop() == 0
