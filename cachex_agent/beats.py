"""Liveness without comparing two hosts' clocks.

A writer that lives rewrites something it owns (the coordinator's status, the run
lock) with a counter that moves at every rewrite. A reader on another host cannot
subtract the writer's timestamp from its own clock: the two clocks may be minutes
apart, and either may step (NTP, `date -s`). It watches the value instead, on its own
monotonic clock: a value seen to change is live; one that stood still for the stale
period is dead. Between the two the reader does not know yet, and says so (`None`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_UNSEEN = object()


class Unchanged:
    """How long, on this process's monotonic clock, a value read again and again has
    stayed the same. Values are compared for equality only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.value: Any = _UNSEEN
        self.since = 0.0
        self.changes = 0        # changes seen after the first sight

    def see(self, value: Any) -> float:
        """Record a reading; the seconds it has stood still (0.0 when it just moved)."""
        now = self.clock()
        if self.value is _UNSEEN or value != self.value:
            self.changes += self.value is not _UNSEEN
            self.value, self.since = value, now
        return now - self.since

    def live(self, still: float, stale: float) -> bool | None:
        """True: seen to move and not still for `stale` s since; False: still for longer
        than `stale`; None: not known yet (watched too briefly)."""
        if still > stale:
            return False
        return True if self.changes else None


class Watch(Generic[T]):
    """`read` again and again (every `poll` s) until the value moves or has stood still
    for `stale` s: whether its writer lives, the last reading, and how long it stood
    still. `sleep` and `clock` are the tests' way in."""

    def __init__(self, read: Callable[[], T], key: Callable[[T], Any], poll: float = 0.2,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.read, self.key, self.poll, self.sleep = read, key, poll, sleep
        self.seen = Unchanged(clock)

    def until_known(self, stale: float) -> tuple[bool, T, float]:
        while True:
            value = self.read()
            still = self.seen.see(self.key(value))
            live = self.seen.live(still, stale)
            if live is not None:
                return live, value, still
            self.sleep(min(self.poll, stale - still + 1e-3))
