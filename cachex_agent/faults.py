"""Faults the integration tests inject into real agents, read in this module alone.

A test starts real agents (separate processes under mpiexec) or `cachex recover` with
one of these in their environment; at start-up the command calls `install`, which puts
an `EnvFaults` on `handles.Handle.faults` when one is set. The work asks its handle at
its fault points (`Handle.held`, `hold`, `at`); nothing else of the package reads a test
switch or imports this module. None is ever set in production: no hook is installed.

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
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .handles import Handle, Point, Stage

HOLD = "CACHEX_TEST_HOLD"
FAIL_CAPTURE = "CACHEX_TEST_FAIL_CAPTURE"
CAPTURE_PAUSE = "CACHEX_TEST_CAPTURE_PAUSE"
PACE = "CACHEX_TEST_PACE"
SWITCHES = (HOLD, FAIL_CAPTURE, CAPTURE_PAUSE, PACE)
PAUSE_POLL = 0.05


class EnvFaults:
    """The faults one environment asks for, read once (a process's environment does not
    change under it)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.hold = env.get(HOLD) or None
        self.fail_rank = env.get(FAIL_CAPTURE) or None
        node, _, where = env.get(CAPTURE_PAUSE, "").partition(":")
        self.pause_node, self.pause_dir = (node, Path(where)) if where else (None, None)
        self.pace = float(env.get(PACE) or 0)
        self._paused: set[tuple[int, str]] = set()     # (node, ckpt): paused once already
        self._lock = threading.Lock()

    def held(self, stage: Stage, node: int) -> bool:
        return self.hold == f"{stage.value}:{node}"

    def at(self, handle: Handle, point: Point, **context: Any) -> None:
        if handle.stage == Stage.CAPTURE and point == Point.START:
            if self.fail_rank is not None and str(context["rank"]) == self.fail_rank:
                raise RuntimeError(f"{FAIL_CAPTURE}={context['rank']}")
        elif handle.stage == Stage.CAPTURE and point == Point.FILE:
            self._pause(handle, context["node"], context["timeout"])
        elif handle.stage == Stage.RESTORE and point == Point.FILE and self.pace:
            time.sleep(self.pace)

    def _pause(self, handle: Handle, node: int, timeout: float) -> None:
        """Once per checkpoint: say so with paused-<ckpt>, then wait for resume-<ckpt>
        (at most `timeout`, the capture's own deadline) unless the capture is cancelled."""
        if self.pause_dir is None or str(node) != self.pause_node:
            return
        with self._lock:
            if (node, handle.ckpt) in self._paused:
                return
            self._paused.add((node, handle.ckpt))
        Path(self.pause_dir, f"paused-{handle.ckpt}").touch()
        resume = Path(self.pause_dir, f"resume-{handle.ckpt}")
        deadline = time.monotonic() + timeout
        while not resume.exists() and time.monotonic() < deadline:
            if handle.cancelled.wait(PAUSE_POLL):
                return


def install(env: Mapping[str, str] | None = None) -> EnvFaults | None:
    """At a command's start-up: the hook on `Handle` if the environment sets any test
    fault, else none (and any earlier one removed). Returns what was installed."""
    env = os.environ if env is None else env
    hook = EnvFaults(env) if any(env.get(name) for name in SWITCHES) else None
    Handle.faults = hook
    return hook
