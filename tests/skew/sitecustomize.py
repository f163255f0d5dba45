"""Tests only: a process whose wall clock is off by the seconds written in the file that
$CACHEX_TEST_CLOCK_FILE names (harness.skewed). Put this directory first on PYTHONPATH
of the process to skew; Python imports this module at start-up, before any other code
reads the clock. The file is read again at most every 0.2 s (on the monotonic clock,
which stays true): a test steps the clock mid-run by rewriting it. Only `time.time` and
`time.time_ns` move, as they do when NTP or `date -s` steps a host's clock; file times
(set by the kernel) and the monotonic clock do not.

Not libfaketime: it would skew MPI's launcher and every library's C calls too."""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("CACHEX_TEST_CLOCK_FILE")
_EVERY = 0.2


def _install(path: str) -> None:
    real_time, real_time_ns, monotonic = time.time, time.time_ns, time.monotonic
    state = {"read": float("-inf"), "offset": 0.0}

    def offset() -> float:
        now = monotonic()
        if now - state["read"] >= _EVERY:
            state["read"] = now
            try:
                with open(path) as handle:
                    state["offset"] = float(handle.read())
            except (OSError, ValueError):
                pass            # being rewritten (harness.step_clock renames): the last holds
        return state["offset"]

    time.time = lambda: real_time() + offset()
    time.time_ns = lambda: real_time_ns() + int(offset() * 1e9)


if _FILE:
    _install(_FILE)
