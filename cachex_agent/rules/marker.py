"""`marker:<glob>`: a file the trainer writes last, named by a glob relative to the
spool (docs/levels.md, Commit rules)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from ..errors import ConfigError
from .base import CommitRule
from .torch_file import file_generation


class MarkerRule(CommitRule):
    """A configured glob relative to the spool (`marker:*/COMMITTED`); the checkpoint is
    the first path component of each match, the matched files are its global files.
    Nothing says who writes the marker or when, so it vouches for no node's files."""

    brief = "a file the trainer writes last, glob relative to the spool"
    doc = ("", "a file matching the glob, relative to the spool (e.g. `*/COMMITTED`)", "no",
           "none")

    def __init__(self, pattern: str) -> None:
        self.pattern = _check_marker(pattern)
        self.name = f"marker:{self.pattern}"
        parts = self.pattern.split("/")
        self._head, self._rest = parts[0], "/".join(parts[1:])

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        if self._head == "**":
            present = set(names)
            return {ckpt for ckpt, rel in self._spool_matches(spool) if ckpt in present}
        return [n for n in names
                if fnmatch.fnmatchcase(n, self._head) and self._inside(spool / n)]

    def _inside(self, ckpt_dir: Path) -> list[str]:
        return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.glob(self._rest)
                      if not self.ignore(p.relative_to(ckpt_dir).as_posix()))

    def _spool_matches(self, spool: Path) -> list[tuple[str, str]]:
        found = []
        for match in spool.glob(self.pattern):
            parts = match.relative_to(spool).parts
            if len(parts) >= 2 and not self.ignore("/".join(parts[1:])):
                found.append((parts[0], "/".join(parts[1:])))
        return found

    def generation(self, spool: Path, ckpt_id: str) -> object | None:
        """A directory refilled and marked again: the marker files, rewritten (or
        removed and written again) by each save, tell saves apart."""
        ckpt_dir = Path(spool) / ckpt_id
        found = tuple((rel, file_generation(ckpt_dir / rel))
                      for rel in self.global_files(ckpt_dir))
        return found or None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        if self._head == "**":
            rels = [rel for ckpt, rel in self._spool_matches(ckpt_dir.parent)
                    if ckpt == ckpt_dir.name]
        elif fnmatch.fnmatchcase(ckpt_dir.name, self._head):
            rels = self._inside(ckpt_dir)
        else:
            rels = []
        return sorted(r for r in rels if (ckpt_dir / r).is_file())


def _check_marker(pattern: str) -> str:
    pattern = pattern.strip()
    parts = PurePosixPath(pattern).parts if pattern else ()
    if not pattern or pattern.startswith("/") or ".." in parts:
        raise ConfigError(f"commit.rule: marker:<glob> needs a glob relative to the spool,"
                          f" like */COMMITTED; got {pattern!r}")
    if len(parts) < 2:
        raise ConfigError(f"commit.rule: marker glob {pattern!r} must name a file inside a"
                          f" checkpoint directory, like */COMMITTED")
    return "/".join(parts)
