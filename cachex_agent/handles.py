"""Handles: every unit of asynchronous work on a checkpoint, with one verb set and one
state enum.

    stage      capture | replicate | flush | commit | restore
    state      queued -> running -> done | failed | cancelled
    verbs      submit()  test()  wait(timeout)  cancel()

A transition is written to the journal (state.json: `stages`, per checkpoint, per
stage; fsynced) before its event is written and before anyone is told, so what a
restarted agent reads is never behind what the coordinator heard. Every stage event
carries `stage`, `state`, `ckpt` and `seq`; its name comes from EVENTS (the names the
model reads: capture_start, captured, replicate_start, replicated, flush_start,
flushed...); the journal's typed entries read them back (`journal.JournalEntry`). A
restarted agent resumes each checkpoint from these states (`node_policy.resume`):
capture not done -> capture again; replicate not done -> replicate again; flush not done
-> flush again (a finished bundle is adopted); done -> never again.

Tests inject faults into real agents through one hook, `Handle.faults` (faults.py
installs one from the environment at start-up; production has none): the work asks its
handle at a few points (`held`, `hold`, `at`) and, with no hook, that is one attribute
check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, ClassVar, Protocol


class Stage(StrEnum):
    CAPTURE = "capture"
    REPLICATE = "replicate"
    FLUSH = "flush"
    COMMIT = "commit"       # the global manifest on the PFS: this node hears `finalized`
    RESTORE = "restore"


class State(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Point(StrEnum):
    """Where the work asks its handle for a test's fault (`Handle.at`)."""
    START = "start"     # the work's thread takes it up, before `running`
    FILE = "file"       # between two files of the work


ENDED = frozenset({State.DONE, State.FAILED, State.CANCELLED})

# the one events schema: (stage, state) -> event name
EVENTS: dict[tuple[Stage, State], str] = {
    **{(stage, State.QUEUED): f"{stage.value}_queued" for stage in Stage},
    **{(stage, State.RUNNING): f"{stage.value}_start" for stage in Stage},
    **{(stage, State.FAILED): f"{stage.value}_failed" for stage in Stage},
    **{(stage, State.CANCELLED): f"{stage.value}_cancelled" for stage in Stage},
    (Stage.CAPTURE, State.DONE): "captured",
    (Stage.REPLICATE, State.DONE): "replicated",
    (Stage.FLUSH, State.DONE): "flushed",
    (Stage.FLUSH, State.FAILED): "flush_error",     # final=True; a retry is final=False
    (Stage.COMMIT, State.DONE): "finalized",
    (Stage.RESTORE, State.DONE): "restored",
}


class Emitter(Protocol):
    def emit(self, event: str, **fields: Any) -> dict[str, Any]: ...


class Persister(Protocol):
    def set_stage(self, ckpt: str, stage: str, state: str, **fields: Any) -> None: ...


class StageLog:
    """Persist, then name: the journal first (when there is one), then the event."""

    def __init__(self, events: Emitter, journal: Persister | None = None) -> None:
        self.events, self.journal = events, journal

    def record(self, stage: Stage, state: State, ckpt: str, seq: int | None,
               persist: dict[str, Any] | None = None, **fields: Any) -> None:
        """`persist`: fields the journal keeps with the state (what resuming needs)."""
        if self.journal is not None:
            self.journal.set_stage(ckpt, stage.value, state.value, **(persist or {}))
        self.note(EVENTS[(stage, state)], stage, state, ckpt, seq, **fields)

    def note(self, event: str, stage: Stage, state: State, ckpt: str, seq: int | None,
             **fields: Any) -> None:
        """An event within a state (a retry, progress): named, not a transition."""
        self.events.emit(event, stage=stage.value, state=state.value, ckpt=ckpt, seq=seq,
                         **fields)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Events that are not about one stage of one checkpoint."""
        return self.events.emit(event, **fields)


class FaultHook(Protocol):
    """A test's faults, asked by the work through its handle."""

    def held(self, stage: Stage, node: int) -> bool:
        """`stage` stays `running` on `node`."""
        ...

    def at(self, handle: Handle, point: Point, **context: Any) -> None:
        """Act at `point` of `handle`'s work, on its thread: raise, or wait (bounded)."""
        ...


HOLD_POLL = 0.05    # a held worker looks this often whether it may go on


class Handle:
    """One stage of one checkpoint. Subclasses start the work in `_start` and stop it
    in `_cancel`; the work reports through `set` (any thread)."""

    stage: Stage
    # one per process (faults.install), shared by every handle: None in production
    faults: ClassVar[FaultHook | None] = None

    def __init__(self, ckpt: str, seq: int | None, log: StageLog) -> None:
        self.ckpt, self.seq, self.log = ckpt, seq, log
        self.state: State | None = None
        self.error: str | None = None
        self.cancelled = threading.Event()      # the work looks at it between steps
        self._ended = threading.Event()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- verbs
    def submit(self, **fields: Any) -> Handle:
        """Queue the work (persisted as queued first); returns self."""
        self.set(State.QUEUED, **fields)
        self._start()
        return self

    def test(self) -> bool:
        """Ended (done, failed or cancelled)? Never blocks."""
        return self.state in ENDED

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds for the end; True if it ended."""
        return self._ended.wait(timeout)

    def cancel(self) -> bool:
        """Ask the work to stop; True if it had not ended. Queued work ends cancelled at
        once; running work ends when it next looks (or finishes first)."""
        if self.test():
            return False
        self.cancelled.set()
        self._cancel()
        if self.state == State.QUEUED:
            self.set(State.CANCELLED)
        return True

    # ---------------------------------------------------------- transitions
    def set(self, state: State, persist: dict[str, Any] | None = None, **fields: Any
            ) -> bool:
        """Record a transition; True if recorded as asked (False: the handle had ended,
        or a cancel turned a start into `cancelled`)."""
        with self._lock:
            if self.state in ENDED:
                return False
            if state == State.RUNNING and self.cancelled.is_set():
                state = State.CANCELLED
            if state == State.FAILED:
                self.error = str(fields.get("error", ""))
            self.log.record(self.stage, state, self.ckpt, self.seq, persist, **fields)
            self.state = state
        if state in ENDED:
            self._ended.set()
        return state != State.CANCELLED

    def note(self, event: str, **fields: Any) -> None:
        assert self.state is not None
        self.log.note(event, self.stage, self.state, self.ckpt, self.seq, **fields)

    # --------------------------------------------------------- test faults
    @classmethod
    def held(cls, node: int) -> bool:
        """A test keeps this stage `running` on `node` (long enough to kill the agent
        there). Never blocks: a caller that must not wait (the main loop) just does not
        move the work on."""
        return cls.faults is not None and cls.faults.held(cls.stage, node)

    def hold(self, node: int, until: Iterable[threading.Event] | None = None) -> None:
        """Block this worker's thread while `held(node)`, until any of `until` is set
        (default: this handle cancelled; empty: until the process ends)."""
        if not self.held(node):
            return
        ends = (self.cancelled,) if until is None else tuple(until)
        while self.held(node) and not any(end.is_set() for end in ends):
            time.sleep(HOLD_POLL)

    def at(self, point: Point, **context: Any) -> None:
        """A test's fault at `point` of this work (`context`: what the hook matches on,
        such as `node` or `rank`); nothing in production."""
        if self.faults is not None:
            self.faults.at(self, point, **context)

    def _start(self) -> None:
        """Hand the work to whoever runs it (a thread, a pool, the main loop)."""

    def _cancel(self) -> None:
        """Tell whoever runs the work; the default relies on `cancelled`."""
