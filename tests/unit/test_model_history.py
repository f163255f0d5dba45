"""Stage and level samples read back from the agents' events.jsonl files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachex_agent.config import load
from cachex_agent.errors import OperationError
from cachex_agent.model.history import (
    LevelSample,
    StageSample,
    config_event_files,
    event_files,
    load_history,
)

RUN = "r"
T0 = 1_700_000_000.0
MB = 1_000_000


class Log:
    """Lines shaped as cachex_agent.events.EventLog writes them for one agent."""

    def __init__(self, path: Path, node: int) -> None:
        self.path, self.node, self.lines = path, node, []

    def emit(self, t: float, event: str, **fields) -> None:
        record = {"t": T0 + t, "event": event, "run": RUN, "node": self.node,
                  "rank": self.node, "host": f"h{self.node}", **fields}
        self.lines.append(json.dumps(record, sort_keys=True))

    def write(self, torn: str = "") -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(line + "\n" for line in self.lines) + torn)
        return self.path


def agent_events(log: Log, ckpt: str, seq: int, t: float, part: int, *, capture: float,
                 write: float | None, replicate: float | None, flush: float | None,
                 adopted: bool = False) -> None:
    """One node's life of a checkpoint, as agent.py, replicator.py and flusher.py emit it.

    t is when the commit reached the agent; capture, replicate and flush follow in turn."""
    log.emit(t, "capture_start", ckpt=ckpt, seq=seq)
    log.emit(t + capture, "captured", ckpt=ckpt, seq=seq, bytes=part, files=2, mode="copy",
             duration=capture, write_start=None if write is None else T0 + t - write,
             committed_at=T0 + t)
    end = t + capture
    if replicate is not None:
        log.emit(end, "replicate_start", ckpt=ckpt, seq=seq, bytes=part, partners=[1 - log.node])
        end += replicate
        log.emit(end, "replicated", ckpt=ckpt, seq=seq, bytes=part, partners=[1 - log.node],
                 duration=replicate)
    if flush is not None:
        if not adopted:
            log.emit(end, "flush_start", ckpt=ckpt, seq=seq, bytes=part, target="/pfs/x")
        end += flush
        log.emit(end, "flushed", ckpt=ckpt, seq=seq, bytes=part, duration=flush,
                 adopted=adopted, target="/pfs/x")


def two_nodes(tmp_path: Path) -> tuple[Path, Path]:
    """Node 0 (also the coordinator) and node 1; three checkpoints:

    s1  peer, both nodes capture, replicate and flush
    s2  direct (no replication)
    s3  peer; node 1's bundle was found already on the PFS (adopted): no flush sample
    and a level_flushed of s0 whose commit was in an older file; node 1's last line torn."""
    n0 = Log(tmp_path / "n0" / "events.jsonl", 0)
    n1 = Log(tmp_path / "n1" / "events.jsonl", 1)
    for log in (n0, n1):
        log.emit(0.0, "agent_start", spool="/s", pfs="/p", nodes=2, pid=1, partners=[])
    n0.emit(0.5, "level_flushed", ckpt="s0", seq=9, bytes=5 * MB, path="peer", latency=3.0)

    n0.emit(10.0, "committed", ckpt="s1", seq=1, marker_node=0, nodes=2, path="peer",
            reason="learning", loss=None)
    agent_events(n0, "s1", 1, 10.0, 3 * MB, capture=0.25, write=2.0, replicate=0.5, flush=4.0)
    agent_events(n1, "s1", 1, 10.1, 5 * MB, capture=0.75, write=2.5, replicate=1.5, flush=6.0)
    n0.emit(10.9, "level_captured", ckpt="s1", seq=1, bytes=8 * MB, path="peer", latency=0.9)
    n0.emit(12.5, "level_replicated", ckpt="s1", seq=1, bytes=8 * MB, path="peer",
            latency=2.5)
    n0.emit(18.5, "level_flushed", ckpt="s1", seq=1, bytes=8 * MB, path="peer", latency=8.5)
    n0.emit(18.6, "level_flushed", ckpt="s1", seq=1, bytes=8 * MB, path="peer", latency=8.6)

    n0.emit(70.0, "committed", ckpt="s2", seq=2, marker_node=0, nodes=2, path="direct",
            reason="expected loss ...", loss={"peer": 2.0, "direct": 1.0})
    agent_events(n0, "s2", 2, 70.0, 3 * MB, capture=0.5, write=None, replicate=None, flush=2.0)
    agent_events(n1, "s2", 2, 70.0, 5 * MB, capture=1.0, write=None, replicate=None, flush=3.0)
    n0.emit(71.0, "level_captured", ckpt="s2", seq=2, bytes=8 * MB, path="direct", latency=1.0)
    n0.emit(74.25, "level_flushed", ckpt="s2", seq=2, bytes=8 * MB, path="direct",
            latency=4.25)

    n0.emit(130.0, "committed", ckpt="s3", seq=3, marker_node=0, nodes=2, path="peer",
            reason="...", loss=None)
    agent_events(n0, "s3", 3, 130.0, 3 * MB, capture=0.5, write=1.0, replicate=0.5, flush=5.0)
    agent_events(n1, "s3", 3, 130.0, 5 * MB, capture=1.0, write=1.0, replicate=1.0, flush=0.01,
                 adopted=True)
    return n0.write(), n1.write(torn='{"t": 1700000200.0, "event": "captured", "ckpt": "s4"')


def by_key(samples):
    return {(s.ckpt, s.node, s.stage): s for s in samples}


def test_stage_samples_of_two_nodes(tmp_path):
    history = load_history(two_nodes(tmp_path))
    got = by_key(history.stages)
    # every sample: run, node count of agent_start, bytes of the node's part, the path of
    # the checkpoint's commit (in node 0's file even for node 1's samples)
    assert got[("s1", 1, "capture")] == StageSample(RUN, "s1", 1, 2, "capture", 5 * MB, 0.75,
                                                    T0 + 10.85, "peer")
    expected = {
        # write = committed_at - write_start; replicate = t(replicated) - t(replicate_start)
        ("s1", 0, "write"): 2.0, ("s1", 0, "capture"): 0.25, ("s1", 0, "replicate"): 0.5,
        ("s1", 0, "flush"): 4.0,
        ("s1", 1, "write"): 2.5, ("s1", 1, "capture"): 0.75, ("s1", 1, "replicate"): 1.5,
        ("s1", 1, "flush"): 6.0,
        ("s2", 0, "capture"): 0.5, ("s2", 0, "flush"): 2.0,
        ("s2", 1, "capture"): 1.0, ("s2", 1, "flush"): 3.0,
        ("s3", 0, "write"): 1.0, ("s3", 0, "capture"): 0.5, ("s3", 0, "replicate"): 0.5,
        ("s3", 0, "flush"): 5.0,
        ("s3", 1, "write"): 1.0, ("s3", 1, "capture"): 1.0, ("s3", 1, "replicate"): 1.0,
        # no ("s3", 1, "flush"): adopted; no s4: its only line is torn
    }
    # each node's own level times, from the commit: "<level>:<path>", stages and waits
    node_levels = {
        ("s1", 0, "captured:peer"): 0.25, ("s1", 0, "replicated:peer"): 0.75,
        ("s1", 0, "flushed:peer"): 4.75,
        ("s1", 1, "captured:peer"): 0.85, ("s1", 1, "replicated:peer"): 2.35,
        ("s1", 1, "flushed:peer"): 8.35,
        ("s2", 0, "captured:direct"): 0.5, ("s2", 0, "flushed:direct"): 2.5,
        ("s2", 1, "captured:direct"): 1.0, ("s2", 1, "flushed:direct"): 4.0,
        ("s3", 0, "captured:peer"): 0.5, ("s3", 0, "replicated:peer"): 1.0,
        ("s3", 0, "flushed:peer"): 6.0,
        ("s3", 1, "captured:peer"): 1.0, ("s3", 1, "replicated:peer"): 2.0,
        # no ("s3", 1, "flushed:peer"): adopted
    }
    assert set(got) == set(expected) | set(node_levels)
    for key, seconds in node_levels.items():
        assert got[key].seconds == pytest.approx(seconds, abs=1e-6), key
        assert got[key].bytes == (3 * MB if key[1] == 0 else 5 * MB)
        assert got[key].end == pytest.approx(T0 + {"s1": 10.0, "s2": 70.0, "s3": 130.0}[
            key[0]] + seconds)
    for key, seconds in expected.items():
        sample = got[key]
        assert sample.seconds == pytest.approx(seconds, abs=1e-6), key
        assert sample.bytes == (3 * MB if sample.node == 0 else 5 * MB)
        assert sample.nodes == 2 and sample.run == RUN
        assert sample.path == ("direct" if sample.ckpt == "s2" else "peer")
    assert {s.ckpt for s in history.stage("flush", "direct")} == {"s2"}
    assert len(history.stage("flush", "peer")) == 3
    assert {(s.node, s.stage) for s in history.of(RUN, "s2")} == {
        (node, stage) for node in (0, 1)
        for stage in ("capture", "flush", "captured:direct", "flushed:direct")}
    assert [p.name for p in history.sources] == ["events.jsonl", "events.jsonl"]


def test_level_samples_need_their_commit_in_the_same_file(tmp_path):
    history = load_history(two_nodes(tmp_path))
    levels = {(s.ckpt, s.level): s for s in history.levels}
    # s0 has no commit in the file: no reference time; s1's repeated level_flushed counts once
    assert set(levels) == {("s1", "captured"), ("s1", "replicated"), ("s1", "flushed"),
                           ("s2", "captured"), ("s2", "flushed")}
    assert len(history.levels) == 5
    assert levels[("s1", "flushed")] == LevelSample(RUN, "s1", 1, 2, "flushed", 8 * MB, 8.5,
                                                    T0 + 10.0, "peer")
    assert levels[("s2", "flushed")].path == "direct"
    assert levels[("s2", "flushed")].latency == 4.25
    assert levels[("s2", "captured")].committed == T0 + 70.0
    assert [s.ckpt for s in history.level("flushed", "direct")] == ["s2"]


def test_a_level_needs_its_commit_in_the_same_file(tmp_path):
    """The coordinator moved (another node's file has the commit): the level is left out."""
    a, b = Log(tmp_path / "a.jsonl", 0), Log(tmp_path / "b.jsonl", 1)
    a.emit(0.0, "committed", ckpt="s1", seq=1, nodes=2, path="peer")
    b.emit(1.0, "level_captured", ckpt="s1", seq=1, bytes=MB, path="peer", latency=1.0)
    history = load_history([a.write(), b.write()])
    assert history.levels == []


def test_torn_last_line_is_ignored(tmp_path):
    log = Log(tmp_path / "events.jsonl", 0)
    log.emit(0.0, "agent_start", nodes=4)
    log.emit(1.0, "captured", ckpt="s1", seq=1, bytes=MB, duration=0.5, write_start=None,
             committed_at=None)
    whole = log.write()
    log.path.write_text(whole.read_text() + log.lines[-1][:-9])     # killed mid-write
    history = load_history([log.path])
    # (no commit in the file: no node level either)
    assert [(s.stage, s.seconds, s.nodes) for s in history.stages] == [("capture", 0.5, 4)]


def test_event_files_from_files_and_directories(tmp_path):
    n0, n1 = two_nodes(tmp_path)
    (tmp_path / "n1" / "other.jsonl").write_text("")
    assert event_files([tmp_path]) == [n0, n1]
    assert event_files([n1, tmp_path / "n0"]) == [n1, n0]
    with pytest.raises(OperationError, match="no such file"):
        event_files([tmp_path / "missing"])


def test_config_event_files_finds_every_node(tmp_path):
    cfg = load(None, {"run": RUN, "paths.spool": "/x", "paths.pfs": "/y",
                      "paths.cache": f"{tmp_path}/cache/{{host}}-{{node}}"}, environ={})
    found = []
    for node in range(3):
        path = cfg.node_paths(node, host=f"h{node}").journal / "events.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("")
        found.append(path)
    other = tmp_path / "cache" / "h0-0" / "another-run" / "journal" / "events.jsonl"
    other.parent.mkdir(parents=True)
    other.write_text("")
    assert config_event_files(cfg) == found
    assert config_event_files(load(None, {"run": "nothing", "paths.spool": "/x",
                                          "paths.pfs": "/y", "paths.cache":
                                          f"{tmp_path}/cache/{{node}}"}, environ={})) == []


def test_a_nodes_local_file_and_its_pfs_copies_are_one_stream(tmp_path):
    """The loader sees each event once whether it is in the node's own file, its PFS log
    or both (a restarted agent copies its file again), and a lost node's PFS log alone
    gives the same samples."""
    n0, n1 = two_nodes(tmp_path)
    whole = load_history([n0, n1])
    pfs = tmp_path / "pfs" / "r" / "events"
    pfs.mkdir(parents=True)
    copy0, copy1 = pfs / "node-00000.jsonl", pfs / "node-00001.jsonl"
    lines = n0.read_text().splitlines(keepends=True)
    copy0.write_text("".join(lines[: len(lines) // 2] + lines))     # copied twice
    copy1.write_text(n1.read_text())
    assert event_files([tmp_path]) == [n0, n1, copy0, copy1]
    both = load_history([n0, n1, copy0, copy1])
    n0.unlink()
    lost = load_history([copy0, n1])
    for history in (both, lost):
        assert sorted(history.stages, key=repr) == sorted(whole.stages, key=repr)
        assert sorted(history.levels, key=repr) == sorted(whole.levels, key=repr)
