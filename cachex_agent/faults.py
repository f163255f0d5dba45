"""Faults the integration tests inject into real agents, read in this module alone.

A test starts real agents (separate processes under mpiexec) with one of these in their
environment; nothing else of the package reads a test switch. None is ever set in
production: unset, every function here says "no fault".

    CACHEX_TEST_HOLD=<stage>:<node>     that stage stays `running` on that node (long
                                        enough to kill the agent there)
    CACHEX_TEST_FAIL_CAPTURE=<rank>     that rank's capture thread raises (an unexpected
                                        error must end the agent job)
    CACHEX_TEST_CAPTURE_PAUSE=<node>:<dir>  after a checkpoint's first file, that node's
                                        capture writes <dir>/paused-<ckpt> and waits for
                                        <dir>/resume-<ckpt> (once per checkpoint)
    CACHEX_TEST_PACE=<seconds>          a recovery transfer waits this long before each
                                        file after the first (a signal lands midway)
"""

from __future__ import annotations

import os
from pathlib import Path

HOLD = "CACHEX_TEST_HOLD"
FAIL_CAPTURE = "CACHEX_TEST_FAIL_CAPTURE"
CAPTURE_PAUSE = "CACHEX_TEST_CAPTURE_PAUSE"
PACE = "CACHEX_TEST_PACE"


def held(stage: str, node: int) -> bool:
    """`stage` (a handles.Stage value) is held `running` on `node`."""
    return os.environ.get(HOLD) == f"{stage}:{node}"


def capture_fails(rank: int) -> bool:
    return os.environ.get(FAIL_CAPTURE) == str(rank)


def capture_pause(node: int) -> Path | None:
    """The directory where `node`'s capture pauses, or None."""
    paused, _, where = os.environ.get(CAPTURE_PAUSE, "").partition(":")
    return Path(where) if where and paused == str(node) else None


def pace() -> float:
    """Seconds between the files of a recovery transfer (0: none)."""
    return float(os.environ.get(PACE) or 0)
