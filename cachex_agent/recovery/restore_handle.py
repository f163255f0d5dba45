"""The restore of one checkpoint on one node, as a handle (handles.py) like every other
stage: the same verbs, the same states, persisted in the node's journal before its event
(`restore_queued`, `restore_start`, `restored`, `restore_failed`, `restore_cancelled` in
the node's events.jsonl, with `stage`, `state`, `ckpt`, `seq`).

The work itself is collective over the recovery job, so it runs in the recovering rank's
own thread (`run`); a signal cancels it after the file in hand: of a node's own moves
(a check in place, a local copy, a PFS extraction), or of a transfer between ranks,
whose two ends agree before each file to go on or stop (transfer.py), so the other end
stops too without waiting; the round's agreement then fails it on every rank alike.
A recovery that finds its node's restore of the same checkpoint still `queued` or
`running` in the journal says so: the earlier one was cut short (its hidden partial
directory is removed, and the restore runs again from the start).

A node's journal that cannot be read (gone with the node, or hostile) is not trusted:
the restore then keeps its states in the events alone.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ..config import Config
from ..errors import CachexError, OperationError, describe
from ..events import EventLog
from ..handles import Handle, Stage, StageLog, State
from ..journal import Journal
from ..layout import events_path
from ..safepath import UnsafeInput
from ..topology import Placement

log = logging.getLogger(__name__)
T = TypeVar("T")


class RestoreHandle(Handle):
    stage = Stage.RESTORE

    def __init__(self, ckpt: str, seq: int | None, log_: StageLog,
                 journal: Journal | None, node: int) -> None:
        super().__init__(ckpt, seq, log_)
        self.journal, self.node = journal, node

    def interrupted(self) -> bool:
        """An earlier restore of this checkpoint here never ended."""
        entry = self.journal.entry(self.ckpt) if self.journal is not None else None
        return entry is not None and entry.state(Stage.RESTORE) in (State.QUEUED,
                                                                    State.RUNNING)

    def run(self, work: Callable[[], T], **done_fields: Any) -> T:
        """Run `work` as this handle's running state: done when it returns, failed (or
        cancelled) when it raises; the exception goes on to the caller."""
        if not self.set(State.RUNNING):
            raise OperationError(f"restore of {self.ckpt} cancelled before it started")
        try:
            with _cancel_on_signals(self):
                self.hold(self.node)
                result = work()
        except BaseException as exc:
            state = State.CANCELLED if self.cancelled.is_set() else State.FAILED
            self.set(state, persist={"reason": describe(exc)}, error=describe(exc))
            raise
        self.set(State.DONE, **done_fields)
        return result

    def check(self) -> None:
        """After a file of a node's own moves or of a transfer, or between two rounds:
        stop here if a signal asked for it."""
        if self.cancelled.is_set():
            raise OperationError(f"restore of {self.ckpt} cancelled by a signal")


def open_restore(config: Config, placement: Placement, ckpt: str, seq: int | None
                 ) -> RestoreHandle:
    """This node's restore handle of `ckpt`, with its journal when it can be read."""
    paths = config.node_paths(placement.node, placement.rank, placement.host)
    events = EventLog(events_path(paths.journal), run=config.run, node=placement.node,
                      rank=placement.rank, host=placement.host)
    try:
        journal: Journal | None = Journal(paths.journal, (paths.stage, paths.spool))
    except (OSError, ValueError, UnsafeInput, CachexError) as exc:
        log.warning("node %d: journal %s not used for the restore's state: %s",
                    placement.node, paths.journal, describe(exc))
        journal = None
    return RestoreHandle(ckpt, seq, StageLog(events, journal), journal, placement.node)


@contextmanager
def _cancel_on_signals(handle: RestoreHandle) -> Iterator[None]:
    """SIGTERM / SIGINT (a job's end, Ctrl-C through the launcher) cancel the restore at
    the next check instead of killing the rank mid-write; a second one ends it at once."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, _frame: Any) -> None:
        if handle.cancelled.is_set():
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        handle.cancelled.set()

    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)
