"""A lane: one worker thread that carries out work off the caller's thread, in order.

Work is offered under a key; work offered under a key still pending replaces it and
moves to the end (latest wins): a snapshot of status or index offered ten times while
the file system hangs is written once when it answers, not ten times, and the lane
holds at most one item per key, never a backlog. Keys are bounded by their owner (one
per file, one per checkpoint in flight); `MAX_PENDING` guards against a bug that is not.

A lane made with `threaded=False` does the work at once on the caller's thread: what
the tests and the simulation of 10,000 nodes use, so their results do not depend on
thread timing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

MAX_PENDING = 4096

Work = Callable[[], None]


class Lane:
    def __init__(self, name: str, threaded: bool = True) -> None:
        self.name = name
        self._pending: dict[Hashable, Work] = {}
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name=f"lane-{name}",
                                            daemon=True)
            self._thread.start()

    def offer(self, key: Hashable, work: Work) -> bool:
        """Queue `work` (replacing what is pending under `key`); False if refused (full
        or closed). Never blocks."""
        if self._thread is None:
            work()
            return True
        with self._cond:
            if self._closed or (key not in self._pending and len(self._pending) >= MAX_PENDING):
                return False
            self._pending.pop(key, None)
            self._pending[key] = work
            self._cond.notify()
        return True

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + self._busy

    def close(self, timeout: float) -> bool:
        """Finish what is pending, up to `timeout` seconds; True if all was done. A lane
        stuck in a hung file system is left behind (its thread is a daemon)."""
        if self._thread is None:
            return True
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)
        self._thread.join(timeout=0 if not done else max(0.0, timeout))
        return done

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return                  # closed and nothing left
                key = next(iter(self._pending))
                work = self._pending.pop(key)
                self._busy = True
            work()          # an unexpected error ends the agent (threading.excepthook)

