"""This node's own saves under each reused name, counted (versions.py, docs/levels.md).

A version of a name is one save of every node that saves it: this node's n-th save of
the name is its part of version n, whatever the order of the nodes' saves within a
round. The count is a local counter of the saves the spool watcher saw settle (never a
clock); a copy the mirror put into the spool is not a save of this node's. Each version
captured here records the count and the rule's generation of the save it took (the
journal entry's `save`), so that a restarted agent counts on from there and takes a
different save it finds at start as a new one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..journal import JournalEntry
from ..versions import split

__all__ = ["OwnSaves", "generation_json", "save_record", "taken"]

UNKNOWN = object()      # the generation of a save a journal of before the counts captured
                        # here: the first save seen at start is taken as that one

def generation_json(generation: object) -> Any:
    """A rule's generation as the journal keeps it (tuples as lists): comparable with a
    generation read back."""
    return None if generation is None else json.loads(json.dumps(generation))


def save_record(count: int, generation: object) -> dict[str, Any]:
    """The journal entry's `save`: this node's count and the save its capture took."""
    return {"count": count, "generation": generation_json(generation)}


def taken(entry: JournalEntry) -> Any:
    """The generation of the save the capture of `entry` took here (None: none known)."""
    return entry.save.get("generation") if isinstance(entry.save, dict) else None


class OwnSaves:
    """Per name: how many of its own saves this node saw, and the newest one's
    generation. Thread-safe: the watcher counts, the capture waits and reads."""

    def __init__(self, entries: Iterable[JournalEntry] = ()) -> None:
        """`entries`: the journal's, oldest first (the newest of a name counts)."""
        self._changed = threading.Condition()
        self._count: dict[str, int] = {}
        self._generation: dict[str, Any] = {}
        # a journal of before the counts: the version its newest capture of a name took
        self._base: dict[str, int] = {}
        newest: dict[str, JournalEntry] = {}
        for entry in entries:
            if entry.captured:
                newest[split(entry.ckpt)[0]] = entry
        for name, entry in newest.items():
            self._seed(name, entry)

    def _seed(self, name: str, entry: JournalEntry) -> None:
        if entry.save is None:
            # not counted as a save of this node's yet: a node that never saves (its part
            # empty) must not wait for one; its next save is the version after
            self._base[name], self._generation[name] = split(entry.ckpt)[1], UNKNOWN
            return
        count = entry.save.get("count") if isinstance(entry.save, dict) else None
        if type(count) is int and count > 0:
            self._count[name], self._generation[name] = count, taken(entry)

    def note(self, name: str, generation: object, newest: int) -> int:
        """A save under `name` settled here with `generation`: its count (the newest
        save's again when it is the one counted last; 0 for the save a journal of before
        the counts captured). `newest`: the newest version of the name this node knows;
        a first save of this node's that comes after that version was committed is its
        part of that version (late within its round), not of version 1."""
        now = generation_json(generation)
        with self._changed:
            before = self._generation.get(name)
            if before is UNKNOWN:
                self._generation[name] = now
                return 0
            count = self._count.get(name, 0)
            if now == before:
                return count
            if count:
                count += 1
            else:
                count = self._base.pop(name) + 1 if name in self._base else max(1, newest)
            self._count[name], self._generation[name] = count, now
            self._changed.notify_all()
            return count

    def count(self, name: str) -> int:
        with self._changed:
            return self._count.get(name, 0)

    def generation(self, name: str) -> Any:
        """The generation of this node's newest counted save (JSON form)."""
        with self._changed:
            found = self._generation.get(name)
            return None if found is UNKNOWN else found

    def wait(self, name: str, count: int, timeout: float, cancelled: threading.Event
             ) -> bool:
        """Wait until this node counted `count` saves of `name`; False on timeout or
        cancel."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._count.get(name, 0) < count:
                left = deadline - time.monotonic()
                if left <= 0 or cancelled.is_set():
                    return False
                self._changed.wait(min(left, 0.05))
            return True

