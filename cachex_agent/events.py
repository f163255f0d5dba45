"""Structured events: one JSON object per line, one file per agent.

Every stage transition is an event with a wall-clock timestamp `t` (seconds since the
epoch); the durability model (issue: model) reads these files.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .fsutil import create_file, makedirs


class EventLog:
    """Append-only, line-buffered, safe to call from several threads."""

    def __init__(self, path: Path, **context: Any) -> None:
        makedirs(path.parent)
        self.path = path
        self._context = context
        self._lock = threading.Lock()
        self._fd = create_file(path, os.O_RDWR | os.O_APPEND)
        self._end_torn_line()

    def _end_torn_line(self) -> None:
        """An agent killed mid-write left half a line: close it so the next one is whole."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time(), "event": event, **self._context, **fields}
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, line)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_events(path: Path) -> list[dict[str, Any]]:
    """All complete lines; a torn last line (agent killed mid-write) is skipped."""
    records = []
    with open(path, "rb") as handle:
        for line in handle:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records
