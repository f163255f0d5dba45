"""Progress of the long commands (`recover`, `export`, `verify`), always on stderr so that
`--json` on stdout stays one clean object.

Three modes: on a terminal a bar redrawn in place (bytes done of the total, the rate, the
time left); elsewhere (a log, a pipe, an MPI launcher) one line per step and one line
when the work is done; with `-q` nothing. Callers only say steps and bytes; this module
alone decides how that looks.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from .status import human_size

BAR = "bar"
LINES = "lines"
QUIET = "quiet"
WIDTH = 24                  # characters of the bar itself
REDRAW = 0.1                # seconds between two redraws of the bar
Done = Callable[[int], None]    # told the bytes of each file (or chunk) handled


def mode_for(quiet: bool, stream: TextIO | None = None) -> str:
    if quiet:
        return QUIET
    stream = stream or sys.stderr
    return BAR if stream.isatty() else LINES


class Progress:
    """Bytes done of a total, and the steps of the work, for one command.

    `advance` may be called from worker threads (files copied two at a time)."""

    def __init__(self, prog: str, mode: str, stream: TextIO | None = None) -> None:
        self.prog, self.mode = prog, mode
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.label, self.total, self.done = "", 0, 0
        self.started = self.drawn = 0.0
        self.bar_shown = False

    def step(self, text: str) -> None:
        """One line saying what the command does now (on a terminal too, above the bar)."""
        if self.mode == QUIET:
            return
        with self.lock:
            self._clear_bar()
            self._write(f"{self.prog}: {text}\n")

    def start(self, label: str, total: int) -> None:
        """Bytes to move from now on under `label`; `finish` ends them."""
        with self.lock:
            self.label, self.total, self.done = label, total, 0
            self.started = time.monotonic()
            self.drawn = 0.0

    def add_total(self, more: int) -> None:
        """More bytes than planned (a file taken again from another copy)."""
        with self.lock:
            self.total += more

    def advance(self, count: int) -> None:
        with self.lock:
            self.done += count
            now = time.monotonic()
            if self.mode == BAR and now - self.drawn >= REDRAW:
                self.drawn = now
                self._draw(now)

    def finish(self) -> None:
        """The last state drawn whole, then one line: bytes, time, rate."""
        if self.mode == QUIET:
            return
        with self.lock:
            now = time.monotonic()
            if self.mode == BAR:
                self._draw(now)
                self._write("\n")
                self.bar_shown = False
            else:
                seconds = now - self.started
                self._write(f"{self.prog}: {self.label}: {human_size(self.done)} in"
                            f" {seconds:.1f}s ({human_size(self._rate(now))}/s)\n")

    # ------------------------------------------------------------------ drawing
    def _rate(self, now: float) -> float:
        elapsed = now - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def _draw(self, now: float) -> None:
        rate = self._rate(now)
        share = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(share * WIDTH)
        left = (self.total - self.done) / rate if rate and self.total > self.done else 0.0
        self._write(f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}]"
                    f" {human_size(self.done)}/{human_size(self.total)}"
                    f" {human_size(rate)}/s {_clock(left)} left\x1b[K")
        self.bar_shown = True

    def _clear_bar(self) -> None:
        if self.bar_shown:
            self._write("\r\x1b[K")
            self.bar_shown = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:         # a closed terminal must not fail the recovery
            pass


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def quiet() -> Progress:
    """For the ranks that do not report (every rank but 0 of a recovery)."""
    return Progress("", QUIET)
