"""Peer replication end to end: 4 virtual nodes, real agents and trainer, a real full
tmpfs, a real stopped partner (SIGSTOP)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from harness import BIN, MPIEXEC, Cluster, files_of, finish, wait_for

from cachex_agent.layout import pfs_manifest_path
from cachex_agent.manifest import GlobalManifest
from cachex_agent.priority import cpu_list

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]


def replica(c: Cluster, partner: int, owner: int, ckpt: str):
    return c.root / f"node{partner}" / "nvme" / "t" / "replicas" / f"node-{owner:05d}" / ckpt


def own_files(c: Cluster, node: int, ckpt: str) -> dict[str, bytes]:
    """A node's part of a checkpoint, without the global file mirrored into its spool."""
    files = files_of(c.spool(node) / ckpt)
    if node:
        files.pop(".metadata", None)
    return files


def events(c: Cluster, node: int, kind: str) -> list[dict]:
    return [e for e in c.events(node) if e["event"] == kind]


def test_replicated_beside_flushed_and_replicas_identical(cluster):
    c = cluster()
    c.start_agents()
    finish(c.trainer("--steps", "8", "--every", "4", *TRAIN))
    steps = ("step_00004", "step_00008")
    for step in steps:
        c.wait_level(step, "flushed")
    # the flush starts beside the replication once a part is captured (either may end
    # first; the replication of a copied part may begin before its capture ends), and a
    # part is replicated only once it is captured whole
    for node in range(4):
        for step in steps:
            times = {e["event"]: e["t"] for e in c.events(node) if e.get("ckpt") == step}
            assert times["captured"] <= times["replicated"]
            assert times["captured"] <= times["flush_start"]
            partner = (node + 1) % 4
            assert files_of(replica(c, partner, node, step)) == own_files(c, node, step)
    assert c.cachex("verify", "step_00008").returncode == 0

    # a replica changed after the fact is caught, naming the replica's path
    shard = replica(c, 2, 1, "step_00008") / "__3_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = c.cachex("verify", "step_00008")
    assert result.returncode == 1 and str(shard) in result.stdout, result.stdout
    assert c.stop() == 0


def test_full_replica_disk_evicts_only_superseded_replicas(cluster, tmpfs):
    c = cluster(extra="[keep]\nreplica = 0\n")
    # node 2 keeps node 1's replicas: room for two checkpoints of node 1, not three
    tmpfs(c.root / "node2" / "nvme" / "t" / "replicas", "1300k")
    c.start_agents()
    finish(c.trainer("--steps", "12", "--every", "4", *TRAIN))
    c.wait_level("step_00012", "flushed")
    levels = c.levels()
    assert all(levels[s] == "flushed" for s in ("step_00004", "step_00008", "step_00012"))
    evicted = [e for e in events(c, 2, "evicted") if e.get("reason") == "disk full"]
    assert [e["ckpt"] for e in evicted] == ["step_00004"] and evicted[0]["owner"] == 1
    for step in ("step_00008", "step_00012"):
        assert files_of(replica(c, 2, 1, step)) == own_files(c, 1, step)
    assert not events(c, 1, "replicate_failed")
    assert c.stop() == 0


def test_replica_disk_too_small_reports_and_goes_on_to_the_pfs(cluster, tmpfs):
    c = cluster()
    tmpfs(c.root / "node2" / "nvme" / "t" / "replicas", "300k")    # < one checkpoint
    c.start_agents()
    finish(c.trainer("--steps", "8", "--every", "4", *TRAIN))
    for step in ("step_00004", "step_00008"):
        c.wait_level(step, "flushed")
    failed = events(c, 1, "replicate_failed")
    assert [e["ckpt"] for e in failed] == ["step_00004", "step_00008"]
    assert "No space left" in json.dumps(failed[0]["errors"])
    assert not replica(c, 2, 1, "step_00004").exists()           # the partial copy is gone
    # the others' copies may finish after the flush (node 1's failure lets it go on)
    def row():
        return [r for r in c.status()["checkpoints"] if r["id"] == "step_00008"][0]
    wait_for(lambda: row()["nodes_replicated"] == 3, 30, "three nodes replicated")
    assert row()["level"] == "flushed"
    assert c.stop() == 0


def test_dead_partner_is_detected_and_the_owner_flushes(cluster):
    """Silent past agent.timeout a partner is only suspect; past agent.dead_after the
    owner gives up on it (tests/integration/test_stalls.py: one that comes back)."""
    c = cluster(agent_timeout="4s", extra='dead_after = "8s"')
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    pid = [e for e in c.events(2) if e["event"] == "agent_start"][-1]["pid"]
    os.kill(pid, signal.SIGSTOP)                 # node 2 hangs: partner of node 1
    try:
        finish(c.trainer("--steps", "12", "--every", "4", "--resume", *TRAIN))
        failed = wait_for(lambda: events(c, 1, "replicate_failed"), 60,
                          "node 1 to give up on its partner")
        assert "partner node 2" in json.dumps(failed[0]["errors"])
        assert "did not answer" in json.dumps(failed[0]["errors"])
        flushed = wait_for(lambda: [e for e in events(c, 1, "flushed")
                                    if e["ckpt"] == "step_00008"], 60, "node 1's flush")
        assert (c.pfs / "ckpt" / "step_00008" / "node-00001.h5").exists(), flushed
        # capture never waited for the partner: node 1 took the next checkpoint as well
        wait_for(lambda: [e for e in events(c, 1, "captured") if e["ckpt"] == "step_00012"],
                 60, "node 1 to capture step_00012")
        assert c.agents.poll() is None
    finally:
        os.kill(pid, signal.SIGCONT)


def test_global_metadata_reaches_every_journal_the_whole_manifest_only_the_holders(cluster):
    """Down a tree of two children per agent (node 0 -> 1, 2; node 1 -> 3): every journal
    gets the global files and the manifest's digest, the whole manifest only node 0 and
    the metadata holders (nodes 1 and 3 of 4: peer.partners.metadata_holders). The
    reports go back up the same tree."""
    c = cluster(extra="fanout = 2")        # in [agent]
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    metadata = (c.spool(0) / "step_00004" / ".metadata").read_bytes()
    pfs = json.loads(pfs_manifest_path(c.pfs, "step_00004").read_text())
    digest = GlobalManifest.from_json(pfs).digest().to_json()
    for node in range(4):
        kept = c.journal(node) / "global" / "step_00004" / "files" / ".metadata"
        wait_for(kept.exists, 30, f"{kept}")
        assert kept.read_bytes() == metadata
        entry = json.loads((c.journal(node) / "state.json").read_text())["ckpts"]["step_00004"]
        assert entry["global"] == digest, node
        whole = c.journal(node) / "global" / "step_00004.json"
        assert whole.exists() == (node in (0, 1, 3)), node
        if whole.exists():
            assert GlobalManifest.from_json(json.loads(whole.read_text())).digest().hash \
                == digest["hash"]
        # node 3's reports reached the coordinator only through node 1 (uplink.py); each
        # agent counted what the checkpoint's metadata cost it
        spent = wait_for(lambda n=node: [e for e in c.events(n) if e["event"] == "counters"
                                         and e["ckpt"] == "step_00004"], 30, "counters")
        tag = "COORDINATOR" if node == 0 else "RELAY"      # node 0 is the tree's root
        assert spent[0]["received"][tag] > 0 and spent[0]["journal_written"] > 0
        assert spent[0]["cpu"] > 0 and spent[0]["turns"] > 0
    assert c.stop() == 0


@pytest.mark.timeout(120)
def test_an_agent_leaves_within_a_bound_when_another_hangs(cluster):
    """Leaving frees the window (collective): with node 1 stopped it would wait forever;
    the exit watchdog ends node 0's agent 2 x agent.timeout after it starts to leave."""
    c = cluster(nodes=2, agent_timeout="3s", extra='[flush]\ndrain_timeout = "2s"')
    c.start_agents()
    pids = [[e for e in c.events(n) if e["event"] == "agent_start"][-1]["pid"] for n in (0, 1)]
    os.kill(pids[1], signal.SIGSTOP)
    try:
        (c.journal(0) / "stop").write_text("")
        wait_for(lambda: any(e["event"] == "agent_exit" for e in c.events(0)), 30,
                 "node 0's agent to start leaving")
        left = time.monotonic()
        wait_for(lambda: not _running(pids[0]), 30, "node 0's agent to end")
        assert time.monotonic() - left < 2 * 3 + 5
    finally:
        with contextlib.suppress(ProcessLookupError):    # mpiexec may have ended it
            os.kill(pids[1], signal.SIGCONT)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_agent_cpus_binds_every_agent_thread_and_a_cpu_outside_the_binding_ends_the_start(
        cluster):
    """`agent.cpus`: every thread of every agent (MPI's, the writer's, the capture's) runs
    on the CPU named, the start event says so, and a checkpoint still replicates; a CPU
    the job step was not given is refused at start-up, one line naming the key, exit 2."""
    cpu = max(os.sched_getaffinity(0))
    c = cluster(nodes=2, extra=f'cpus = "{cpu}"')      # in [agent]
    c.start_agents()
    finish(c.trainer("--steps", "2", "--every", "2", *TRAIN, ranks=4))
    c.wait_level("step_00002", "replicated", "flushed")
    for node in (0, 1):
        start = events(c, node, "agent_start")[-1]
        assert (start["cpus"], start["streams"]) == (str(cpu), 1)
        threads = [t.id for t in psutil.Process(start["pid"]).threads()]
        assert len(threads) > 3 and all(os.sched_getaffinity(t) == {cpu} for t in threads)
    assert c.stop() == 0

    binding = cpu_list(os.sched_getaffinity(0))
    outside = max(os.sched_getaffinity(0)) + 1
    c.config.write_text(c.config.read_text().replace(f'cpus = "{cpu}"', f'cpus = "{outside}"'))
    proc = subprocess.run([str(MPIEXEC), "-n", "2", str(BIN / "cachex-agent"), "--config",
                           str(c.config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"agent.cpus: CPU {outside} is not in this job step's binding ({binding})" \
        in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
