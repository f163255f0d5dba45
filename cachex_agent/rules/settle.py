"""`quiescence`: a directory is committed when nothing in it is open for writing and
nothing changed for `commit.settle` (docs/levels.md, Commit rules)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .base import CommitRule
from .quiescence import FileState, open_for_write, snapshot


@dataclass
class _Observation:
    files: dict[Path, FileState]
    since: float            # when this exact file set was first seen (or a writer last seen)
    quiet: bool = False     # verified: no writer, settled


class QuiescenceRule(CommitRule):
    """Generic: a directory is committed when no process holds any of its files open for
    writing and its file set (paths, sizes, mtimes) has not changed for `settle` seconds.
    Empty directories are never committed. Timers live in this object, so it must be
    called repeatedly (`needs_polling`). The settle was measured on one node's files
    only: it vouches for no other node's."""

    name = "quiescence"
    brief = "nothing open for writing and nothing changed for `commit.settle`"
    doc = ("", "no process holds a file open for writing (`/proc/<pid>/fd`, matched by"
           " inode) and nothing changed for `commit.settle`", "no", "none")
    needs_polling = True

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle = float(settle)
        self._clock = clock
        self._seen: dict[str, _Observation] = {}

    @classmethod
    def build(cls, settle: float, extra_global: Sequence[str],
              clock: Callable[[], float]) -> CommitRule:
        return cls(settle, clock)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return self._settled_among(spool, names, self._tree)

    def settled_files(self, spool: Path, names: list[str]) -> list[str]:
        """The single files `names` at the spool root that settled (TorchFileRule)."""
        return self._settled_among(spool, names, _one_file)

    def _settled_among(self, spool: Path, names: list[str],
                       listing: Callable[[Path], dict[Path, FileState]]) -> list[str]:
        now = self._clock()
        for gone in set(self._seen) - set(names):
            del self._seen[gone]
        ready = []
        for name in names:
            try:
                files = listing(spool / name)
            except FileNotFoundError:
                self._seen.pop(name, None)
                continue
            if files and self._settled(name, files, now):
                ready.append(name)
            elif not files:
                self._seen.pop(name, None)
        return ready

    def _tree(self, ckpt_dir: Path) -> dict[Path, FileState]:
        """The files of a directory that count (an empty one is never committed)."""
        files = snapshot(ckpt_dir)
        keep = any(not self.ignore(p.relative_to(ckpt_dir).as_posix()) for p in files)
        return files if keep else {}

    def _settled(self, name: str, files: dict[Path, FileState], now: float) -> bool:
        seen = self._seen.get(name)
        if seen is None or seen.files != files:
            seen = self._seen[name] = _Observation(files, now)
        if seen.quiet:
            return True
        if now - seen.since < self.settle:
            return False
        # Asking every process is the expensive part: only for candidates, once per
        # settle period while a writer holds a file open.
        if open_for_write(files):
            seen.since = now
            return False
        seen.quiet = True
        return True

    def forget(self, ckpt_id: str) -> None:
        self._seen.pop(ckpt_id, None)


def _one_file(path: Path) -> dict[Path, FileState]:
    st = path.stat()
    return {path: (st.st_size, st.st_mtime_ns, st.st_ino)}


class SettledRule(CommitRule):
    """A rule whose commit is its files settling (no marker comes last): a settle
    timer of its own, over what `_select` passes it."""

    needs_polling = True

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle = float(settle)
        self._quiet = QuiescenceRule(settle, clock)

    @classmethod
    def build(cls, settle: float, extra_global: Sequence[str],
              clock: Callable[[], float]) -> CommitRule:
        return cls(settle, clock)

    def forget(self, ckpt_id: str) -> None:
        self._quiet.forget(ckpt_id)
