"""What a recovery would replace in a spool is set aside, never removed or overwritten.

A recovery puts one checkpoint's files back under the trainer's names. Whatever already
stands under such a name and differs from what is restored (a newer save under a reused
name, a file the trainer rewrote, a corrupt or partial copy) may be the only copy of the
user's data left: it is renamed to `<spool>/.cachex-unrecoverable-<name>` (a free name:
`.2`, `.3`, ... when an earlier recovery left one, which stays), and each move is named
in the summary. What equals the restored bytes (size and checksum) is simply replaced:
nothing is lost. A file inside a checkpoint directory kept in place goes to the same
path below `.cachex-unrecoverable-<ckpt>/`, so the set-aside files keep their layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..checksum import file_problem
from ..fsutil import fsync_dir, makedirs
from ..layout import set_aside_dir
from ..manifest import FileEntry


def differs(path: Path, entry: FileEntry) -> bool:
    """True when `path` exists and is not `entry`'s bytes (a directory always differs)."""
    if not os.path.lexists(path):
        return False
    if path.is_dir() or path.is_symlink():
        return True
    return file_problem(path, entry.size, entry.checksum) is not None


def names_the_same(tracker: Path, text: str) -> bool:
    """The tracker at `tracker` already says `text` (its trailing newline aside)."""
    try:
        return tracker.is_file() and tracker.read_text().strip() == text.strip()
    except (OSError, UnicodeDecodeError):
        return False


def tree_matches(directory: Path, expected: list[FileEntry]) -> bool:
    """`directory` holds exactly `expected`'s files, each with its bytes."""
    found = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                   if not p.is_dir() or p.is_symlink())
    return found == sorted(e.path for e in expected) and not any(
        differs(directory / e.path, e) for e in expected)


@dataclass
class Aside:
    """One node's set-aside moves during one recovery, in its spool (or `--to` DIR)."""

    spool: Path
    node: int
    moved: list[str] = field(default_factory=list)       # for the summary
    _dirs: dict[str, Path] = field(default_factory=dict)     # per checkpoint, made once

    def entry(self, name: str, why: str) -> Path:
        """Rename the spool entry `name` (a directory or a file) to a free set-aside name."""
        target = _free(self.spool, name)
        os.rename(self.spool / name, target)
        fsync_dir(self.spool)
        self._said(name, target, why)
        return target

    def inside(self, ckpt: str, relpath: str, why: str) -> Path:
        """Move one file of the checkpoint directory `ckpt` below its set-aside directory."""
        if ckpt not in self._dirs:
            self._dirs[ckpt] = _free(self.spool, ckpt)
        target = self._dirs[ckpt] / relpath
        makedirs(target.parent)
        source = self.spool / ckpt / relpath
        os.rename(source, target)
        fsync_dir(source.parent)
        fsync_dir(target.parent)
        self._said(f"{ckpt}/{relpath}", target, why)
        return target

    def _said(self, name: str, target: Path, why: str) -> None:
        self.moved.append(f"node {self.node}: {name} set aside as"
                          f" {target.relative_to(self.spool)} ({why})")


def _free(spool: Path, name: str) -> Path:
    attempt = 1
    while os.path.lexists(set_aside_dir(spool, name, attempt)):
        attempt += 1
    return set_aside_dir(spool, name, attempt)
