"""`model.path = "auto"`: the agents pick each checkpoint's path from the fitted model.

The PFS is a real ext4 on a loop device; the agents run in a cgroup v1 blkio group that
caps their writes to it (benchmarks/contention.py). The replication is held back by
design, one 16 KiB slot in flight (128 round trips for a 2 MiB part, about a quarter of a
second), so that unthrottled, a flush decisively beats it and `auto` goes direct; throttled
to 1 MiB/s, the flush takes seconds, so `auto` must come back to peer. (With the default
slots the two took the same 0.07-0.1 s here on a slow day: the model, rightly, saw no 10%
margin to switch, and the test failed one fresh run in four.)
"""

from __future__ import annotations

import json

import pytest
from contention import ThrottledPFS, unavailable
from harness import wait_for
from predict import write_checkpoint

from cachex_agent import config as configuration

MiB = 1024 * 1024
MODEL = '''path = "auto"
node_rate = 0.1      # node loss weighs: the choice is between the two lags to safety
window = 4'''
REPLICATION = '''[peer]
slot = "16KiB"
slots = 1'''


def committed(cluster) -> dict[str, dict]:
    return {e["ckpt"]: e for e in cluster.events(0) if e["event"] == "committed"}


def run_until(cluster, cfg, start: int, limit: int, wanted: str) -> str:
    """Write checkpoints one after another (each flushed before the next) until one is
    committed on the `wanted` path by the model's own reasoning; return its id."""
    buffer = bytes(range(256)) * (4096 * 4)
    for i in range(start, start + limit):
        ckpt = f"step_{i:05d}"
        write_checkpoint(cfg, cluster.nodes, ckpt, 2 * MiB, memoryview(buffer))
        cluster.wait_level(ckpt, "flushed", timeout=60)
        event = committed(cluster)[ckpt]
        if event["path"] == wanted and event["reason"].startswith("expected loss"):
            return ckpt
    paths = {c: (e["path"], e["reason"]) for c, e in committed(cluster).items()}
    raise AssertionError(f"no checkpoint went {wanted} in {limit} tries: {paths}")


@pytest.mark.timeout(240)
def test_a_slowed_pfs_flips_the_choice_from_direct_to_peer(cluster, tmp_path):
    assert unavailable() is None, f"this test needs root, loop devices, blkio: {unavailable()}"
    with ThrottledPFS(tmp_path / "mnt", size="512MiB") as pfs:
        (tmp_path / "pfs").symlink_to(pfs.path)
        c = cluster(nodes=2, model=MODEL, extra=REPLICATION)
        cfg = configuration.load(c.config)
        c.start_agents(prefix=tuple(pfs.popen_args_prefix()))

        fast = run_until(c, cfg, 1, 20, "direct")
        events = committed(c)
        learning = [e for e in events.values() if e["reason"].startswith("learning")]
        assert learning and all(e["path"] == "peer" for e in learning)
        levels = [e["event"] for e in c.events(0) if e.get("ckpt") == fast]
        assert "level_flushed" in levels and "level_replicated" not in levels
        start = int(fast.split("_")[1]) + 1

        pfs.set_write_bps(1 * MiB)          # the PFS slows down under someone else's job
        slow = run_until(c, cfg, start, 12, "peer")
        levels = [e["event"] for e in c.events(0) if e.get("ckpt") == slow]
        assert levels.index("level_replicated") < levels.index("level_flushed")
        replica = c.root / "node1" / "nvme" / "t" / "replicas" / "node-00000" / slow
        wait_for(replica.is_dir, 10, f"the replica {replica}")
        pfs.set_write_bps(None)
        running = ls_agrees_with_status(c)
        assert {running[fast]["path"], running[slow]["path"]} == {"direct", "peer"}
        assert c.stop() == 0
        assert ls_agrees_with_status(c) == running      # stopped: the same rows


def ls_agrees_with_status(c) -> dict[str, dict]:
    """`ls --json` says of every checkpoint what `status --json` says: its rows by id."""
    keys = ("id", "seq", "level", "bytes", "path", "rule")
    listed = json.loads(c.cachex("ls", "--json").stdout)
    status = json.loads(c.cachex("status", "--json").stdout)
    rows = [{k: r[k] for k in keys} for r in listed["checkpoints"]]
    assert rows == [{k: r[k] for k in keys} for r in status["checkpoints"]]
    assert listed["unknown"] is None and all(r["path"] and r["rule"] for r in rows), rows
    shown = c.cachex("ls").stdout
    for row in rows:
        line = next(x for x in shown.splitlines() if x.startswith(row["id"] + " "))
        assert line.split()[-2:] == [row["path"], row["rule"]], line
    return {row["id"]: row for row in rows}


def test_status_shows_each_checkpoints_path(cluster):
    c = cluster(nodes=2, model='path = "direct"')
    c.start_agents()
    cfg = configuration.load(c.config)
    write_checkpoint(cfg, 2, "step_00001", 2 * MiB, memoryview(bytes(1 << 20)))
    c.wait_level("step_00001", "flushed", timeout=60)
    rows = {r["id"]: r for r in c.status()["checkpoints"]}
    assert rows["step_00001"]["path"] == "direct"
    assert "direct" in c.cachex("status").stdout
    assert c.stop() == 0
    assert not list((c.root / "node1" / "nvme" / "t").glob("replicas/*/step_00001"))

