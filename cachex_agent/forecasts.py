"""When each checkpoint in flight should reach its next levels: the model's median and
95% for the rows of `status.json` (`predicted`), from the stage samples the coordinator
already collects for the path choice.

A forecast is computed on the coordinator's model lane, never on the thread that writes
the status (a fit and a Monte Carlo take tens of milliseconds, more with thousands of
nodes), once per checkpoint and size, and again while there was no model yet each time
new samples came in. The times are the coordinator's (its commit time plus the model's
seconds), so a reader compares them only with the coordinator's own `now` (risk.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from .names import LEVELS

#: (path, size, samples seen): what a forecast was computed for
Key = tuple[str, float, int]


def in_flight(row: dict[str, Any]) -> bool:
    """A checkpoint still on its way to its last level (`flushed`, or `replicated` when
    flush.every leaves it out)."""
    level = row.get("level")
    return level in ("written", "captured") or (level == "replicated" and row.get("flush"))


class Forecaster(Protocol):
    """What a forecast needs of the model (model.choose.PathChooser)."""
    observations: int

    def forecast(self, size: float, path: str) -> dict[str, dict[str, float]] | None: ...


class Forecasts:
    """`offer(key, work)` queues work on the model lane (latest wins per key)."""

    def __init__(self, chooser: Forecaster, offer: Callable[[Any, Callable[[], None]], bool],
                 before: Callable[[], None] = lambda: None) -> None:
        self.chooser = chooser
        self.offer = offer
        self.before = before        # the samples reported so far, into the chooser
        self._lock = threading.Lock()
        self._made: dict[str, tuple[Key, dict[str, dict[str, float]] | None]] = {}

    def annotate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`rows` with `predicted` on each checkpoint in flight: per later level, the
        coordinator's time it should hold by (`median`, `p95`), or None: no prediction
        yet. Asks the model lane for the missing ones."""
        flying = {row["id"] for row in rows if in_flight(row)}
        with self._lock:
            for gone in set(self._made) - flying:
                del self._made[gone]
        size = 0.0
        for row in rows:            # oldest first: a `written` part takes the last size
            if row["level"] != "written" and row["bytes"]:
                size = float(row["bytes"])
            if row["id"] in flying:
                row["predicted"] = self._predicted(row, size)
        return rows

    def _predicted(self, row: dict[str, Any], size: float) -> dict[str, Any] | None:
        written = (row.get("times") or {}).get("written")
        if not row.get("path") or not size or not isinstance(written, (int, float)):
            return None
        key = (row["path"], size, self.chooser.observations)
        with self._lock:
            made = self._made.get(row["id"])
        if made is None or made[0][:2] != key[:2] or (made[1] is None and made[0] != key):
            self.offer(("forecast", row["id"]), lambda: self._make(row["id"], key))
        if made is None or made[1] is None:
            return None
        reached = LEVELS.index(row["level"])
        last = "flushed" if row.get("flush") else "replicated"     # flush.every
        return {level: {q: written + s for q, s in quantiles.items()}
                for level, quantiles in made[1].items()
                if reached < LEVELS.index(level) <= LEVELS.index(last)}

    def _make(self, ckpt: str, key: Key) -> None:
        """On the model lane."""
        self.before()
        forecast = self.chooser.forecast(key[1], key[0])
        with self._lock:
            self._made[ckpt] = ((key[0], key[1], self.chooser.observations), forecast)
