"""The agent's inbox: how worker threads (and signal handlers) reach the main thread,
which alone calls MPI; and the watchdog that bounds the agent's exit."""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
from typing import Any

log = logging.getLogger(__name__)


class Inbox(queue.Queue):  # type: ignore[type-arg]
    """The worker threads' messages to the main thread. A put wakes the main loop at
    once, through a pipe: the signal handler puts too, and a pipe write is safe there.
    The pipe lives as long as the process (a late put from a worker must not write to a
    descriptor reused since)."""

    def __init__(self) -> None:
        super().__init__()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.wake()

    def wake(self) -> None:
        """End the main loop's sleep (also from another thread)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass                # full of wake-ups already

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, less if something is put meanwhile; True if
        woken (a wake-up that came before the call ends it at once)."""
        if not select.select([self._wake_r], [], [], timeout)[0]:
            return False
        try:
            os.read(self._wake_r, 1 << 16)     # a pipe's worth: every wake-up so far
        except BlockingIOError:
            pass
        return True


def exit_watchdog(bound: float) -> threading.Timer:
    """End the process if leaving takes longer than `bound` seconds: the collective
    calls of leaving (window free, MPI finalize) wait on every agent, and one may be gone
    or stuck. Cancel it once out."""
    def leave() -> None:
        log.error("exit not complete after %.0fs (another agent gone?): leaving", bound)
        os._exit(1)
    timer = threading.Timer(bound, leave)
    timer.daemon = True
    timer.start()
    return timer
