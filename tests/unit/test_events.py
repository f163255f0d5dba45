"""Structured event log: real file, real threads."""

from __future__ import annotations

import json
import stat
import threading
import time

import pytest

from cachex_agent.events import EventCopy, EventLog, read_events
from cachex_agent.layout import pfs_events_old_path, pfs_events_path


@pytest.mark.timeout(10)
def test_lines_are_json_with_time_event_and_context(tmp_path):
    path = tmp_path / "journal" / "events.jsonl"         # parent is created
    log = EventLog(path, node=3, host="nid0003")
    before = time.time()
    record = log.emit("captured", ckpt="step_00100", bytes=4096, where=tmp_path)
    log.emit("flushed", ckpt="step_00100", adopted=False)
    log.close()

    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""                         # every line is terminated
    parsed = [json.loads(line) for line in lines[:-1]]
    assert len(parsed) == 2
    first = parsed[0]
    assert first["event"] == "captured"
    assert first["node"] == 3 and first["host"] == "nid0003"
    assert first["ckpt"] == "step_00100" and first["bytes"] == 4096
    assert first["where"] == str(tmp_path)          # non-JSON values become strings
    assert isinstance(first["t"], float) and before - 1 <= first["t"] <= time.time() + 1
    assert record["event"] == "captured" and record["t"] == first["t"]
    assert parsed[1]["adopted"] is False and parsed[1]["node"] == 3
    assert read_events(path) == parsed


@pytest.mark.timeout(10)
def test_appends_across_instances_and_ignores_emits_after_close(tmp_path):
    path = tmp_path / "events.jsonl"
    first = EventLog(path, node=0)
    first.emit("start")
    first.close()
    first.emit("after-close")                       # no-op, no error
    first.close()                                   # idempotent
    second = EventLog(path, node=0)                 # a restarted agent appends
    second.emit("restart")
    second.close()
    assert [e["event"] for e in read_events(path)] == ["start", "restart"]


@pytest.mark.timeout(30)
def test_concurrent_emits_produce_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, node=1)
    threads_n, per_thread = 8, 150
    payload = "x" * 9000                    # lines larger than PIPE_BUF and a page
    barrier = threading.Barrier(threads_n)

    def work(thread: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            log.emit("progress", thread=thread, i=i, pad=payload[: (i * 61) % 9000])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=25)
    log.close()

    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert len(lines) == threads_n * per_thread
    records = [json.loads(line) for line in lines]          # each line is one whole object
    seen = {(r["thread"], r["i"]) for r in records}
    assert seen == {(t, i) for t in range(threads_n) for i in range(per_thread)}
    for r in records:
        assert r["pad"] == payload[: (r["i"] * 61) % 9000]
    # Per thread, the order of emission is kept.
    for t in range(threads_n):
        assert [r["i"] for r in records if r["thread"] == t] == list(range(per_thread))
    assert len(read_events(path)) == threads_n * per_thread


@pytest.mark.timeout(10)
def test_read_events_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, node=2)
    log.emit("captured", ckpt="step_00100")
    log.emit("flush_start", ckpt="step_00100")
    log.close()
    with open(path, "ab") as handle:                # the agent was killed mid-write
        handle.write(b'{"t": 1700000000.5, "event": "flush')
    events = read_events(path)
    assert [e["event"] for e in events] == ["captured", "flush_start"]
    assert all(e["node"] == 2 for e in events)


@pytest.mark.timeout(10)
def test_restart_after_a_torn_line_keeps_the_new_events(tmp_path):
    """A restarted agent must not glue its first event to the torn bytes of the killed
    one (read_events would drop both)."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path, node=2)
    log.emit("captured", ckpt="step_00100")
    log.close()
    with open(path, "ab") as handle:                # the agent was killed mid-write
        handle.write(b'{"t": 1700000000.5, "event": "flush')

    restarted = EventLog(path, node=2)
    restarted.emit("flushed", ckpt="step_00100", adopted=True)
    restarted.emit("drained")
    restarted.close()
    names = [e["event"] for e in read_events(path)]
    assert names == ["captured", "flushed", "drained"], (
        "the restarted agent's first event was lost: EventLog appends after a torn last"
        f" line without starting a new line (read back: {names})")


def test_copy_appends_only_new_complete_lines_durably(tmp_path):
    """Each copy adds what the source gained; a line still being written waits."""
    log = EventLog(tmp_path / "journal" / "events.jsonl", node=0)
    target = tmp_path / "pfs" / "events" / "node-00000.jsonl"
    copy = EventCopy(log.path, target)
    log.emit("a")
    assert copy.copy() > 0
    assert copy.copy() == 0                     # nothing new: nothing appended
    log.emit("b")
    with open(log.path, "ab") as handle:        # another thread mid-write
        handle.write(b'{"t": 1, "event": "half')
    copy.copy()
    assert [r["event"] for r in read_events(target)] == ["a", "b"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_copy_after_a_torn_target_and_past_the_cap(tmp_path):
    """A copy killed mid-append left half a line: the next starts on a new line. Past
    the cap the log is moved aside once (one older generation: bounded)."""
    log = EventLog(tmp_path / "events.jsonl", node=3)
    target = pfs_events_path(tmp_path / "pfs", 3)
    target.parent.mkdir(parents=True)
    target.write_bytes(b'{"t": 0, "event": "torn')
    copy = EventCopy(log.path, target, cap=400)
    log.emit("first")
    copy.copy()
    assert [r["event"] for r in read_events(target)] == ["first"]
    for i in range(6):
        log.emit(f"e{i}", padding="x" * 100)
        copy.copy()
    old = pfs_events_old_path(target)
    kept = [r["event"] for path in (old, target) for r in read_events(path)]
    assert kept[-1] == "e5" and "first" not in kept
    assert target.stat().st_size <= 400 and old.stat().st_size <= 400
    assert {p.name for p in target.parent.iterdir()} == {old.name, target.name}
