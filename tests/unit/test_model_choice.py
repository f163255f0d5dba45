"""The online path choice (PathChooser) alone and inside the coordinator."""

from __future__ import annotations

import json

import pytest

from cachex_agent.config import load
from cachex_agent.coordinator import Coordinator
from cachex_agent.events import EventLog, read_events
from cachex_agent.journal import Journal
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import Captured
from cachex_agent.model.choose import MARGIN, PathChooser
from cachex_agent.model.stages import MIN_SAMPLES

GB = 10 ** 9
NODES = 2
WINDOW = 8                  # checkpoints: WINDOW * NODES samples per stage
# node losses matter as much as job losses here, so either path can win:
# excess loss (beyond T/2 per failure, seconds per hour) with fixed stage times c, r, f
#   peer    0.05 c + 0.10 (c + r) + 0.01 (c + r + f)
#   direct  0.05 c + 0.11 (c + f)
RATES = {"model.crash_rate": "0.05", "model.node_rate": "0.05", "model.job_rate": "0.01"}


def chooser(can_replicate: bool = True, **settings: str) -> PathChooser:
    cfg = load(None, {"paths.spool": "/x", "paths.pfs": "/y", "model.window": str(WINDOW),
                      **RATES, **{f"model.{k}": v for k, v in settings.items()}}, environ={})
    return PathChooser(cfg, NODES, can_replicate)


def feed(c: PathChooser, stage: str, seconds: float, count: int = WINDOW * NODES) -> None:
    for i in range(count):
        c.observe(stage, f"k{i // NODES}", i % NODES, GB, seconds)


def excess(c: float, r: float, f: float) -> dict[str, float]:
    return {"peer": 0.05 * c + 0.10 * (c + r) + 0.01 * (c + r + f),
            "direct": 0.05 * c + 0.11 * (c + f)}


def test_learning_until_every_stage_has_samples():
    c = chooser()
    choice = c.choose(NODES * GB, 0.0)
    assert choice.path == "peer" and choice.reason.startswith("learning")
    feed(c, "capture", 1.0, MIN_SAMPLES)
    feed(c, "replicate", 500.0, MIN_SAMPLES)
    feed(c, "flush", 1.0, MIN_SAMPLES - 1)
    choice = c.choose(NODES * GB, 60.0)
    assert choice.path == "peer" and "flush" in choice.reason and choice.loss is None
    c.observe("flush", "k9", 0, 0, 1.0)         # no bytes, no duration: not a sample
    c.observe("flush", "k9", 0, GB, 0.0)
    c.observe("write", "k9", 0, GB, 1.0)        # not a stage the choice learns
    assert len(c.samples["flush"]) == MIN_SAMPLES - 1 and "write" not in c.samples
    assert c.choose(0, 120.0).path == "peer"     # no size known yet
    feed(c, "flush", 1.0, 1)
    assert c.choose(NODES * GB, 180.0).path == "direct"     # replication 500x slower


def test_forced_path_and_flush_only():
    for path in ("peer", "direct"):
        c = chooser(path=path)
        feed(c, "capture", 1.0)
        feed(c, "replicate", 1.0 if path == "direct" else 500.0)
        feed(c, "flush", 500.0 if path == "direct" else 1.0)
        choice = c.choose(NODES * GB, 0.0)
        assert (choice.path, choice.reason) == (path, f"model.path = {path}")
    # auto with a single failure domain (no replicator): direct, even while learning
    lonely = chooser(can_replicate=False)
    assert lonely.choose(NODES * GB, 0.0).path == "direct"
    feed(lonely, "capture", 1.0)
    feed(lonely, "replicate", 1.0)
    feed(lonely, "flush", 500.0)
    assert "flush-only" in lonely.choose(NODES * GB, 60.0).reason


def test_slow_replication_goes_direct_and_a_slow_pfs_brings_peer_back():
    c = chooser()
    feed(c, "capture", 1.0)
    feed(c, "replicate", 60.0)
    feed(c, "flush", 2.0)
    choice = c.choose(NODES * GB, 0.0)
    assert choice.path == "direct" and set(choice.loss) == {"peer", "direct"}
    assert choice.loss["direct"] < choice.loss["peer"]
    assert "period 600 s" in choice.reason        # one commit seen: the default period
    feed(c, "flush", 300.0)                       # the window slides: only slow flushes left
    assert list(c.samples["flush"])[0].seconds == 300.0
    assert len(c.samples["flush"]) == WINDOW * NODES
    choice = c.choose(NODES * GB, 120.0)
    assert choice.path == "peer" and "period 120 s" in choice.reason


def test_a_prepared_choice_is_the_full_one_for_about_the_same_size():
    full, fast = chooser(), chooser()
    for c in (full, fast):
        feed(c, "capture", 1.0)
        feed(c, "replicate", 60.0)
        feed(c, "flush", 2.0)
    assert fast.choose_prepared(NODES * GB, 0.0) is None           # nothing prepared yet
    fast.prepare(NODES * GB)
    assert fast.choose_prepared(1.5 * NODES * GB, 0.0) is None     # another size waits
    fast.prepare(NODES * GB)
    prepared, computed = fast.choose_prepared(1.05 * NODES * GB, 0.0), full.choose(
        1.05 * NODES * GB, 0.0)
    assert prepared is not None and prepared.path == computed.path == "direct"
    assert prepared.loss == pytest.approx(computed.loss, rel=0.05)
    assert fast.direct_run == 1 and fast.current == "direct"
    assert fast.choose_prepared(NODES * GB, 60.0) is None          # used once
    learning = chooser()
    learning.prepare(NODES * GB)                                    # no model yet: no plans
    assert learning.choose_prepared(NODES * GB, 0.0) is None


def test_nearly_equal_paths_do_not_flip_from_peer():
    c = chooser()
    feed(c, "capture", 1.0)
    feed(c, "replicate", 100.0)
    feed(c, "flush", 104.0)
    e = excess(1.0, 100.0, 104.0)
    assert 1 - MARGIN < e["direct"] / e["peer"] < 0.96        # direct ~5% better
    assert c.choose(NODES * GB, 0.0).path == "peer"
    feed(c, "flush", 90.0)
    e = excess(1.0, 100.0, 90.0)
    assert e["direct"] / e["peer"] < 1 - MARGIN - 0.05         # direct ~17% better
    assert c.choose(NODES * GB, 600.0).path == "direct"


def test_nearly_equal_paths_do_not_flip_from_direct():
    c = chooser()
    c.current = "direct"
    feed(c, "capture", 1.0)
    feed(c, "replicate", 100.0)
    feed(c, "flush", 116.5)
    e = excess(1.0, 100.0, 116.5)
    assert 1 - MARGIN < e["peer"] / e["direct"] < 0.96        # peer ~5% better
    assert c.choose(NODES * GB, 0.0).path == "direct"
    feed(c, "flush", 130.0)
    e = excess(1.0, 100.0, 130.0)
    assert e["peer"] / e["direct"] < 1 - MARGIN - 0.03         # peer ~14% better
    assert c.choose(NODES * GB, 600.0).path == "peer"


def test_explore_one_peer_checkpoint_after_a_run_of_direct():
    c = chooser(explore="1")
    feed(c, "capture", 1.0)
    feed(c, "replicate", 60.0)
    feed(c, "flush", 2.0)
    paths = []
    for k in range(2):
        paths.append(c.choose(NODES * GB, 60.0 * k))
    explored = c.choose(NODES * GB, 120.0)
    assert [p.path for p in paths] == ["direct", "peer"]
    assert paths[1].reason.startswith("exploring") and explored.path == "direct"


def test_explore_zero_never_explores():
    never = chooser(explore="0")
    feed(never, "capture", 1.0)
    feed(never, "replicate", 60.0)
    feed(never, "flush", 2.0)
    never.direct_run = 1000                         # explore = 0: never explores
    assert never.choose(NODES * GB, 0.0).path == "direct"


# ------------------------------------------------------------ inside the coordinator
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def part(ckpt: str, node: int, seq: int) -> dict:
    files = [FileEntry(f"__{node}_0.distcp", GB, 0o644, f"{node:032x}")]
    return LocalManifest(run="r", ckpt=ckpt, seq=seq, node=node, host="h", rank=node,
                         files=files).to_json()


def test_the_coordinator_switches_to_direct_after_learning(tmp_path):
    nodes = 4
    (tmp_path / "cfg.toml").write_text(
        f'run = "r"\n[paths]\nspool = "{tmp_path}/s"\npfs = "{tmp_path}/pfs"\n'
        '[flush]\nevery = 3\n[model]\nwindow = 4\n')
    cfg = load(tmp_path / "cfg.toml", environ={})
    sent: list[tuple[int, dict]] = []
    clock = Clock()
    coord = Coordinator(cfg, list(range(nodes)), Journal(tmp_path / "journal"),
                        tmp_path / "pfs" / "r", EventLog(tmp_path / "events.jsonl"),
                        lambda rank, msg: sent.append((rank, msg)), clock=clock)

    def commits():
        return [msg for rank, msg in sent if msg["type"] == "commit" and rank == 0]

    # s1: learning (peer); every node reports its stage durations: replication is slow
    coord.handle(0, {"type": "marker", "ckpt": "s1", "global_files": []})
    assert commits()[-1]["path"] == "peer" and commits()[-1]["flush"] is True
    clock.now += 30
    for node in range(nodes):
        coord.handle(node, Captured(node=node, ckpt="s1", manifest=part("s1", node, 1),
                                    duration=0.5))
    for node in range(nodes):
        coord.handle(node, {"type": "replicated", "ckpt": "s1", "ok": True, "partners": [
            (node + 1) % nodes], "errors": {}, "duration": 120.0})
    for node in range(nodes):
        coord.handle(node, {"type": "flushed", "ckpt": "s1", "bundle": f"node-{node:05d}.h5",
                            "duration": 1.0})
    assert coord.ckpts["s1"].level == "flushed"
    assert {s: len(q) for s, q in coord.chooser.samples.items()} == {
        "capture": nodes, "replicate": nodes, "flush": nodes}
    assert {(s.ckpt, s.bytes) for q in coord.chooser.samples.values() for s in q} == {
        ("s1", GB)}

    # s2 (seq 2; flush.every = 3 would not flush it on the peer path): direct, flushed
    clock.now += 30
    coord.handle(0, {"type": "marker", "ckpt": "s2", "global_files": []})
    announced = commits()[-1]
    assert (announced["ckpt"], announced["seq"]) == ("s2", 2)
    assert announced["path"] == "direct" and announced["flush"] is True
    assert all(msg["path"] == "direct" for rank, msg in sent[-nodes:])
    record = coord.ckpts["s2"]
    assert record.path == "direct" and record.flush is True
    for node in range(nodes):
        coord.handle(node, Captured(node=node, ckpt="s2", manifest=part("s2", node, 2),
                                    duration=0.5))
    assert record.level == "captured"
    coord.handle(1, {"type": "marker", "ckpt": "s2", "global_files": []})   # agent restarted
    assert commits()[-1]["seq"] == 2 and commits()[-1]["path"] == "direct"
    assert commits()[-1]["flush"] is True
    for node in range(nodes):
        coord.handle(node, {"type": "flushed", "ckpt": "s2", "bundle": f"node-{node:05d}.h5",
                            "duration": 1.0})
    assert record.level == "flushed" and "replicated" not in record.times

    events = read_events(tmp_path / "events.jsonl")
    levels = [e["event"] for e in events if e.get("ckpt") == "s2"]
    assert levels == ["committed", "level_captured", "level_flushed"]
    committed = {e["ckpt"]: e for e in events if e["event"] == "committed"}
    assert committed["s1"]["path"] == "peer" and committed["s1"]["reason"].startswith("learn")
    assert committed["s2"]["path"] == "direct" and committed["s2"]["nodes"] == nodes
    assert "expected loss" in committed["s2"]["reason"]
    assert committed["s2"]["loss"]["direct"] < committed["s2"]["loss"]["peer"]
    assert all(e["path"] == "direct" for e in events
               if e.get("ckpt") == "s2" and e["event"].startswith("level_"))

    coord.write_status()
    status = json.loads((tmp_path / "journal" / "status.json").read_text())
    assert [(r["id"], r["path"], r["flush"]) for r in status["checkpoints"]] == [
        ("s1", "peer", True), ("s2", "direct", True)]

    # after s2's choice the model's lane prepared the next: s3's commit goes out at once
    assert coord.chooser._prepared is not None
    clock.now += 30
    coord.handle(0, {"type": "marker", "ckpt": "s3", "global_files": []})
    assert (commits()[-1]["ckpt"], commits()[-1]["path"]) == ("s3", "direct")
    assert coord.chooser.direct_run == 2


@pytest.mark.parametrize("forced", ["peer", "direct"])
def test_the_coordinator_follows_a_forced_path(tmp_path, forced):
    (tmp_path / "cfg.toml").write_text(
        f'run = "r"\n[paths]\nspool = "{tmp_path}/s"\npfs = "{tmp_path}/pfs"\n'
        f'[flush]\nevery = 2\n[model]\npath = "{forced}"\n')
    sent: list[tuple[int, dict]] = []
    coord = Coordinator(load(tmp_path / "cfg.toml", environ={}), [0, 1],
                        Journal(tmp_path / "journal"), tmp_path / "pfs" / "r",
                        EventLog(tmp_path / "events.jsonl"),
                        lambda rank, msg: sent.append((rank, msg)), clock=Clock())
    for k in (1, 2):
        coord.handle(0, {"type": "marker", "ckpt": f"s{k}", "global_files": []})
    flags = [(msg["path"], msg["flush"]) for rank, msg in sent
             if rank == 0 and msg["type"] == "commit"]
    assert flags == [(forced, True), (forced, forced == "direct")]
