"""The coordinator's decisions, driven by messages in one process (no MPI)."""

from __future__ import annotations

import json

import pytest

from cachex_agent.config import load
from cachex_agent.coordinator import Coordinator
from cachex_agent.events import EventLog, read_events
from cachex_agent.journal import Journal
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import Captured
from cachex_agent.status import format_status

NODES = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world(tmp_path):
    def make(extra: str = "", journal_dir=None):
        (tmp_path / "cfg.toml").write_text(
            f'run = "r"\n[paths]\nspool = "{tmp_path}/s"\npfs = "{tmp_path}/pfs"\n{extra}')
        cfg = load(tmp_path / "cfg.toml", environ={})
        sent: list[tuple[int, dict]] = []
        clock = Clock()
        journal = Journal(journal_dir or tmp_path / "journal")
        events = EventLog(tmp_path / "events.jsonl")
        coord = Coordinator(cfg, list(range(NODES)), journal, tmp_path / "pfs" / "r", events,
                            lambda rank, msg: sent.append((rank, msg)), clock=clock)
        return coord, sent, clock
    return make


def manifest(ckpt: str, node: int, seq: int = 1) -> dict:
    files = [FileEntry(f"__{node}_0.distcp", 100 + node, 0o644, f"{node:032x}")]
    return LocalManifest(run="r", ckpt=ckpt, seq=seq, node=node, host="h", rank=node,
                         files=files).to_json()


def types(sent, kind):
    return [(rank, msg) for rank, msg in sent if msg["type"] == kind]


def commit_all(coord, ckpt, flushed=True):
    coord.handle(0, {"type": "marker", "ckpt": ckpt, "global_files": [".metadata"]})
    for node in range(NODES):
        coord.handle(node, Captured(node=node, ckpt=ckpt, manifest=manifest(ckpt, node)))
    if flushed:     # the peer path: flushed is recorded after replicated
        replicate_all(coord, ckpt)
        for node in range(NODES):
            coord.handle(node, {"type": "flushed", "ckpt": ckpt, "bundle": f"node-{node:05d}.h5"})


def test_marker_announces_commit_to_every_agent_once(world):
    coord, sent, _ = world()
    coord.handle(2, {"type": "marker", "ckpt": "step_1", "global_files": [".metadata"]})
    commits = types(sent, "commit")
    assert sorted(rank for rank, _ in commits) == [0, 1, 2, 3]
    assert {msg["seq"] for _, msg in commits} == {1}
    coord.handle(2, {"type": "marker", "ckpt": "step_1", "global_files": []})
    assert {msg["seq"] for _, msg in types(sent, "commit")} == {1}      # no new sequence number
    coord.handle(0, {"type": "marker", "ckpt": "step_2", "global_files": []})
    assert types(sent, "commit")[-1][1]["seq"] == 2


def test_levels_need_every_node(world, tmp_path):
    coord, sent, _ = world()
    coord.handle(0, {"type": "marker", "ckpt": "s1", "global_files": [".metadata"]})
    for node in range(NODES - 1):
        coord.handle(node, Captured(node=node, ckpt="s1", manifest=manifest("s1", node)))
    assert coord.ckpts["s1"].level == "written"
    coord.handle(3, Captured(node=3, ckpt="s1", manifest=manifest("s1", 3)))
    assert coord.ckpts["s1"].level == "captured"
    for node in range(NODES):
        coord.handle(node, {"type": "flushed", "ckpt": "s1", "bundle": f"node-{node:05d}.h5"})
    # every bundle is in, yet flushed waits for replicated (the peer path: levels in order)
    assert coord.ckpts["s1"].level == "captured"
    assert not (tmp_path / "pfs/r/ckpt/s1/manifest.json").exists()
    replicate_all(coord, "s1")
    assert coord.ckpts["s1"].level == "flushed"
    gm = json.loads((tmp_path / "pfs/r/ckpt/s1/manifest.json").read_text())
    assert gm["format"] == "cachex-global-manifest" and len(gm["files"]) == NODES
    assert gm["global_files"] == [".metadata"] and len(gm["nodes"]) == NODES
    index = json.loads((tmp_path / "pfs/r/index.json").read_text())
    assert index["current"] == "s1" and index["checkpoints"][0]["state"] == "valid"
    assert len(types(sent, "finalized")) == NODES


def test_capture_failure_fails_the_checkpoint(world, tmp_path):
    coord, sent, _ = world()
    coord.handle(0, {"type": "marker", "ckpt": "s1", "global_files": []})
    coord.handle(1, {"type": "capture_failed", "ckpt": "s1", "error": "gone"})
    assert coord.ckpts["s1"].level == "failed"
    assert "node 1: gone" in coord.ckpts["s1"].reason
    assert len(types(sent, "failed")) == NODES
    index = json.loads((tmp_path / "pfs/r/index.json").read_text())
    assert index["current"] is None and index["checkpoints"][0]["state"] == "failed"
    coord.handle(2, Captured(node=2, ckpt="s1", manifest=manifest("s1", 2)))
    assert coord.ckpts["s1"].level == "failed"           # never resurrected


def test_capture_deadline_names_missing_nodes(world):
    coord, _, clock = world('[commit]\ntimeout = "10s"\n[agent]\ntimeout = "5s"\n')
    coord.handle(0, {"type": "marker", "ckpt": "s1", "global_files": []})
    coord.handle(0, Captured(node=0, ckpt="s1", manifest=manifest("s1", 0)))
    clock.now += 14
    coord.tick()
    assert coord.ckpts["s1"].level == "written"
    clock.now += 2
    coord.tick()
    assert coord.ckpts["s1"].level == "failed"
    assert "[1, 2, 3]" in coord.ckpts["s1"].reason


def test_flush_every_k(world):
    coord, sent, _ = world("[flush]\nevery = 2\n")
    for i in range(1, 5):
        coord.handle(0, {"type": "marker", "ckpt": f"s{i}", "global_files": []})
    flags = [msg["flush"] for rank, msg in types(sent, "commit") if rank == 0]
    assert flags == [True, False, True, False]


def test_pfs_retention_keeps_newest(world, tmp_path):
    coord, _, _ = world("[keep]\npfs = 1\n")
    for ckpt in ("s1", "s2"):
        (tmp_path / "pfs/r/ckpt" / ckpt).mkdir(parents=True)
        commit_all(coord, ckpt)
    assert coord.ckpts["s1"].level == "purged" and coord.ckpts["s2"].level == "flushed"
    assert not (tmp_path / "pfs/r/ckpt/s1").exists()
    assert (tmp_path / "pfs/r/ckpt/s2/manifest.json").exists()


def test_finalize_waits_for_a_writable_pfs(world, tmp_path):
    coord, _, _ = world()
    (tmp_path / "pfs/r").mkdir(parents=True)
    (tmp_path / "pfs/r/ckpt").write_text("not a directory")    # root ignores chmod: use ENOTDIR
    commit_all(coord, "s1")
    record = coord.ckpts["s1"]
    assert record.level == "replicated" and "coordinator" in record.errors
    (tmp_path / "pfs/r/ckpt").unlink()
    (tmp_path / "pfs/r/ckpt/s1").mkdir(parents=True)
    coord.tick()
    assert record.level == "flushed" and "coordinator" not in record.errors


def test_drain_flushes_newest_and_exits_when_all_drained(world):
    coord, sent, _ = world("[flush]\nevery = 3\n")
    commit_all(coord, "s1")
    commit_all(coord, "s2", flushed=False)           # flush=False under every=3
    coord.handle(1, {"type": "stop"})
    drains = types(sent, "drain")
    assert len(drains) == NODES and drains[0][1]["flush"] == ["s2"]
    coord.handle(0, {"type": "marker", "ckpt": "s3", "global_files": []})
    assert "s3" not in coord.ckpts                   # nothing new once draining
    for node in range(NODES):
        assert not types(sent, "exit")
        coord.handle(node, {"type": "drained"})
    assert len(types(sent, "exit")) == NODES and coord.status()["state"] == "stopped"


def test_restart_keeps_levels_and_sequence(world, tmp_path):
    coord, _, _ = world()
    commit_all(coord, "s1")
    coord.handle(0, {"type": "marker", "ckpt": "s2", "global_files": []})
    again, sent, _ = world()
    assert again.ckpts["s1"].level == "flushed" and again.next_seq == 3
    again.handle(0, {"type": "marker", "ckpt": "s2", "global_files": []})
    assert types(sent, "commit")[0][1]["seq"] == 2             # re-announced, same seq


def test_status_and_events(world, tmp_path):
    coord, _, _ = world()
    commit_all(coord, "s1")
    coord.handle(0, {"type": "marker", "ckpt": "s2", "global_files": []})
    coord.handle(1, {"type": "progress", "ckpt": "s2", "stage": "flush", "done": 5, "total": 10})
    coord.write_status()
    status = json.loads((tmp_path / "journal/status.json").read_text())
    assert [(r["id"], r["level"]) for r in status["checkpoints"]] == [("s1", "flushed"),
                                                                      ("s2", "written")]
    assert status["checkpoints"][1]["progress"]["1"]["done"] == 5
    assert (tmp_path / "pfs/r/status.json").exists()
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert kinds[:4] == ["committed", "level_captured", "level_replicated", "level_flushed"]


def replicate_all(coord, ckpt, failing: int | None = None):
    for node in range(NODES):
        ok = node != failing
        coord.handle(node, {"type": "replicated", "ckpt": ckpt, "ok": ok, "partners": [
            (node + 1) % NODES], "errors": {} if ok else {"2": "partner node 2: gone"},
            "dead": [] if ok else [2]})


def test_replicated_level_needs_every_node(world):
    coord, _, _ = world()
    commit_all(coord, "s1", flushed=False)
    coord.handle(0, {"type": "replicated", "ckpt": "s1", "ok": True, "partners": [1],
                     "errors": {}})
    assert coord.ckpts["s1"].level == "captured"
    replicate_all(coord, "s1")
    assert coord.ckpts["s1"].level == "replicated"
    for node in range(NODES):
        coord.handle(node, {"type": "flushed", "ckpt": "s1", "bundle": f"node-{node:05d}.h5"})
    assert coord.ckpts["s1"].level == "flushed"


def test_failed_replication_skips_to_flushed_and_names_the_dead(world):
    coord, sent, _ = world()
    commit_all(coord, "s1", flushed=False)
    replicate_all(coord, "s1", failing=1)
    record = coord.ckpts["s1"]
    assert record.level == "captured" and "partner node 2" in record.errors["1"]
    for node in range(NODES):
        coord.handle(node, {"type": "flushed", "ckpt": "s1", "bundle": f"node-{node:05d}.h5"})
    assert record.level == "flushed"
    coord.handle(0, {"type": "stop"})
    for node in range(NODES):
        coord.handle(node, {"type": "drained"})
    assert types(sent, "exit")[0][1]["dead"] == [2]


def test_final_flush_error_fails_the_checkpoint(world):
    coord, _, _ = world()
    commit_all(coord, "s1", flushed=False)
    coord.handle(1, {"type": "flush_error", "ckpt": "s1", "error": "checksum differs",
                     "final": False})
    assert coord.ckpts["s1"].level == "captured"
    coord.handle(1, {"type": "flush_error", "ckpt": "s1", "error": "checksum differs",
                     "final": True})
    assert coord.ckpts["s1"].level == "failed"


def test_a_coordinator_without_journal_adopts_the_pfs_index(world, tmp_path):
    coord, _, _ = world()
    commit_all(coord, "s1")
    commit_all(coord, "s2")
    fresh, sent, _ = world(journal_dir=tmp_path / "replacement-journal")
    assert {k: r.level for k, r in fresh.ckpts.items()} == {"s1": "flushed", "s2": "flushed"}
    assert fresh.next_seq == 3 and fresh.status()["checkpoints"][0]["bytes"] > 0
    fresh.handle(0, {"type": "marker", "ckpt": "s2", "global_files": []})
    assert not types(sent, "commit")            # already on the PFS: nothing to redo
    fresh.handle(0, {"type": "marker", "ckpt": "s3", "global_files": []})
    assert types(sent, "commit")[0][1]["seq"] == 3


def test_status_says_which_parts_were_captured_by_reference_and_why(world, tmp_path):
    coord, _, _ = world()
    coord.handle(0, {"type": "marker", "ckpt": "s1", "global_files": []})
    for node in range(NODES):
        mode = {"mode": "reference", "reason": "stage full (No space left on device)"} \
            if node == 2 else {"mode": "copy", "reason": ""}
        coord.handle(node, Captured(node=node, ckpt="s1", manifest=manifest("s1", node), **mode))
    coord.write_status()
    row = json.loads((tmp_path / "journal/status.json").read_text())["checkpoints"][0]
    assert row["level"] == "captured"
    assert row["capture"] == {"2": {"mode": "reference",
                                    "reason": "stage full (No space left on device)"}}
    status = json.loads((tmp_path / "journal/status.json").read_text())
    assert "s1: node 2 captured by reference: stage full" in format_status(status)
