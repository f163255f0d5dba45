"""Handles (handles.py): the verbs, and every state in the journal before its event.
Real journal, real event file, real threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from cachex_agent.events import EventLog, read_events
from cachex_agent.handles import (
    EVENTS,
    Handle,
    Stage,
    StageLog,
    State,
)
from cachex_agent.journal import Journal

CKPT = "step_00007"


class OrderedJournal(Journal):
    """Records, at each persisted state, whether its event was already in the file."""

    def __init__(self, root: Path, events: Path) -> None:
        super().__init__(root)
        self.events_path = events
        self.early: list[str] = []

    def set_stage(self, ckpt: str, stage: str, state: str, **fields: Any) -> None:
        name = EVENTS[(Stage(stage), State(state))]
        if any(e["event"] == name for e in read_events(self.events_path)):
            self.early.append(name)
        super().set_stage(ckpt, stage, state, **fields)


class Work(Handle):
    """A handle run by a thread that waits for `go` (or a cancel) between steps."""

    stage = Stage.CAPTURE

    def __init__(self, log: StageLog) -> None:
        super().__init__(CKPT, 7, log)
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        if not self.set(State.RUNNING, persist={"source": "x"}):
            return
        while not self.go.wait(0.01):
            if self.cancelled.is_set():
                self.set(State.CANCELLED)
                return
        self.set(State.DONE, bytes=3)


@pytest.fixture
def parts(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", node=1)
    journal = OrderedJournal(tmp_path / "journal", events.path)
    yield journal, events, StageLog(events, journal)
    events.close()


@pytest.mark.timeout(20)
def test_submit_test_wait_and_every_state_persisted_before_its_event(parts, tmp_path):
    journal, events, log = parts
    work = Work(log)
    work.go.set()
    assert work.submit(persist={"seq": 7}) is work
    assert work.wait(10) and work.test() and work.state == State.DONE
    work.thread.join(10)
    assert journal.early == []                  # the journal first, every time
    reopened = Journal(tmp_path / "journal")    # what a restarted agent reads
    entry = reopened.entry(CKPT)
    assert entry.state(Stage.CAPTURE) == State.DONE and entry.done(Stage.CAPTURE)
    assert entry.seq == 7 and entry.source == "x" and entry.captured
    evs = [e for e in read_events(events.path) if e.get("ckpt") == CKPT]
    assert [(e["event"], e["stage"], e["state"], e["seq"]) for e in evs] == [
        ("capture_queued", "capture", "queued", 7), ("capture_start", "capture", "running", 7),
        ("captured", "capture", "done", 7)]
    assert evs[-1]["bytes"] == 3
    assert not work.cancel()                    # ended: nothing to cancel
    assert Journal(tmp_path / "journal").entry(CKPT).state(Stage.CAPTURE) == State.DONE


@pytest.mark.timeout(20)
def test_wait_times_out_then_cancel_of_running_work_ends_it_cancelled(parts, tmp_path):
    _journal, events, log = parts
    work = Work(log).submit()
    assert not work.wait(0.05) and not work.test()
    assert work.cancel()
    assert work.wait(10) and work.state == State.CANCELLED
    work.thread.join(10)
    assert not work.set(State.DONE)             # an ended handle records nothing more
    entry = Journal(tmp_path / "journal").entry(CKPT)
    assert entry.state(Stage.CAPTURE) == State.CANCELLED and not entry.failed
    assert [e["event"] for e in read_events(events.path)][-1] == "capture_cancelled"


@pytest.mark.timeout(20)
def test_cancel_of_queued_work_never_starts_it(parts, tmp_path):
    _journal, _events, log = parts

    class Queued(Work):
        def _start(self) -> None:       # nobody runs it yet
            pass

    work = Queued(log).submit()
    assert work.state == State.QUEUED
    assert work.cancel() and work.test() and work.state == State.CANCELLED
    assert not work.set(State.RUNNING)          # a worker that gets it later skips it
    assert Journal(tmp_path / "journal").entry(CKPT).state(Stage.CAPTURE) == State.CANCELLED


@pytest.mark.timeout(20)
def test_failed_capture_or_commit_fails_the_checkpoint_not_a_failed_replication(tmp_path):
    journal = Journal(tmp_path / "journal")
    journal.set_stage("a", "replicate", "failed")
    journal.set_stage("b", "capture", "failed", reason="gone")
    journal.set_stage("c", "commit", "failed")
    journal.set_stage("c", "capture", "done")
    reopened = Journal(tmp_path / "journal")
    assert [reopened.entry(c).failed for c in "abc"] == [False, True, True]
    assert reopened.entry("c").stages == {"commit": "failed", "capture": "done"}
    assert reopened.entry("a").state(Stage.FLUSH) is None
    assert not reopened.entry("c").captured     # captured, then failed: nothing to protect


def test_every_stage_and_state_has_one_event_name():
    assert {(s, t) for s in Stage for t in State} == set(EVENTS)
    # the names the model and the tests read (model/history.py)
    assert EVENTS[(Stage.CAPTURE, State.RUNNING)] == "capture_start"
    assert EVENTS[(Stage.REPLICATE, State.DONE)] == "replicated"
    assert EVENTS[(Stage.FLUSH, State.FAILED)] == "flush_error"
