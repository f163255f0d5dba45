"""Structured events: one JSON object per line, one file per agent.

Every stage transition is an event with a wall-clock timestamp `t` (seconds since the
epoch) and the node's load per core `load`; the durability model (issue: model) reads
these files. `EventCopy` appends what a node's file gained to that node's log on the
PFS (layout.pfs_events_path), so the history outlives the node's disk.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from .fsutil import create_file, fsync_dir, makedirs
from .layout import pfs_events_old_path

#: a node's PFS event log is moved aside (one older generation kept) past this size:
#: some ten thousand checkpoints of events, so the PFS holds at most twice this per node
PFS_EVENTS_CAP = 64 * 1024 * 1024


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
        end_torn_line(self._fd)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time(), "event": event, "load": load_per_core(), **self._context,
                  **fields}
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


def load_per_core() -> float:
    """The 1-minute load average over the cores: what the model takes as the node's CPU
    contention at the event (model/stages.py). /proc/loadavg, one read."""
    return round(os.getloadavg()[0] / (os.cpu_count() or 1), 3)


def end_torn_line(fd: int) -> None:
    """A writer killed mid-line left half a line: close it so the next one is whole."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        os.write(fd, b"\n")


class EventCopy:
    """Appends the complete lines `source` gained since the last call to `target` (a
    node's log on the PFS), fsynced before `copy` returns. Thread-safe: the flush
    workers and the coordinator's PFS lane share a node's one copier.

    What a failed copy did not append is appended by the next one. A restarted agent
    starts from the beginning of its file again: the loader drops the repeated lines
    (model/history.py), and the cap bounds what they cost."""

    def __init__(self, source: Path, target: Path, cap: int = PFS_EVENTS_CAP) -> None:
        self.source, self.target, self.cap = source, target, cap
        self._offset = 0
        self._lock = threading.Lock()

    def copy(self) -> int:
        """Bytes appended (0: nothing new). Raises OSError; the next call retries."""
        with self._lock:
            chunk = self._new_lines()
            if chunk:
                self._append(chunk)
                self._offset += len(chunk)
            return len(chunk)

    def _new_lines(self) -> bytes:
        with open(self.source, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        return chunk[: chunk.rfind(b"\n") + 1]     # a line being written waits

    def _append(self, chunk: bytes) -> None:
        makedirs(self.target.parent)
        created = not self.target.exists()
        if not created and self.target.stat().st_size + len(chunk) > self.cap:
            os.replace(self.target, pfs_events_old_path(self.target))
            created = True
        fd = create_file(self.target, os.O_RDWR | os.O_APPEND)
        try:
            end_torn_line(fd)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            fsync_dir(self.target.parent)


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
