"""Capture: copy one node's files of a committed checkpoint from the spool into the stage.

Checksums are computed in the same pass as the copy. The captured directory appears
under its final name only when every file is copied and fsynced (rename of a partial
directory, fsutil.partial_path), so a half-captured checkpoint is never mistaken for a
whole one. A source file whose inode, size or mtime changed during the copy was
rewritten in place by the trainer: the capture fails rather than keep a torn copy
(`PartChanged`: the caller may wait for the writer and capture again). After a capture
the caller lists the part again and compares it with what it listed before
(`part_changes`). Staged copies are private (0600); the manifest records the permission
bits the trainer gave each file.

A stage that fills up (ENOSPC, EDQUOT: `is_stage_full`) does not fail a capture: the
caller captures by reference instead (checksums of the spool files, re-verified by every
later reader).
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ..checksum import COPY_CHUNK, copy_buffer, copy_with_checksum, file_checksum
from ..errors import OperationError
from ..fsutil import fsync_dir, fsync_tree, makedirs, partial_path, remove_under, trainer_mode
from ..manifest import FileEntry
from .quiescence import FileState


class CaptureError(OperationError):
    """The checkpoint could not be captured whole (deleted, rewritten, unreadable)."""


class PartChanged(CaptureError):
    """A file of the part changed while it was read: its writer is still at work."""


#: errors of a full stage: capture by reference instead of failing
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_stage_full(exc: OSError) -> bool:
    return exc.errno in _FULL


def part_changes(before: Mapping[Path, FileState], after: Mapping[Path, FileState]) -> str:
    """'' when both listings are equal, else what differs (counts, then a few names)."""
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    parts = [f"{len(paths)} {what}" for what, paths in
             (("added", added), ("removed", removed), ("changed", changed)) if paths]
    if not parts:
        return ""
    names = ", ".join(p.name for p in [*added, *removed, *changed][:3])
    return f"{', '.join(parts)} file(s) since listed (e.g. {names})"


def list_files(ckpt_dir: Path, ignore: Callable[[str], bool] = lambda _: False) -> list[str]:
    """Relative paths of the regular files under `ckpt_dir`, sorted."""
    if not ckpt_dir.is_dir():
        raise CaptureError(f"{ckpt_dir}: checkpoint directory is missing")
    found = []
    for root, _dirs, names in os.walk(ckpt_dir):
        for name in names:
            full = Path(root, name)
            rel = full.relative_to(ckpt_dir).as_posix()
            if full.is_file() and not full.is_symlink() and not ignore(rel):
                found.append(rel)
    return sorted(found)


def capture_copy(src: Path, dst: Path, relpaths: Iterable[str], chunk: int = COPY_CHUNK,
                 on_bytes: Callable[[int], None] | None = None,
                 sources: Mapping[str, Path] | None = None,
                 on_file: Callable[[int, FileEntry, Path], None] | None = None
                 ) -> list[FileEntry]:
    """Copy `relpaths` from `src` into the new directory `dst`; return their entries.
    `sources` names the file read for a relpath that does not live under `src` (a
    tracker or single-file checkpoint at the spool root). `on_file(i, entry, partial)`:
    file i is copied, fsynced and checked unchanged, in `partial` (renamed to `dst` at
    the end); a later failure or retry of the part may still discard it."""
    sources = sources or {}
    partial = partial_path(dst)
    remove_under(dst.parent, partial)
    makedirs(partial)
    buffer = copy_buffer(chunk)
    try:
        entries = []
        for i, rel in enumerate(relpaths):
            entries.append(_copy_one(sources.get(rel, src / rel), partial, rel, buffer,
                                     on_bytes))
            if on_file is not None:
                on_file(i, entries[-1], partial)
        fsync_tree(partial)
        remove_under(dst.parent, dst)
        os.rename(partial, dst)
        fsync_dir(dst.parent)
    except BaseException:
        remove_under(dst.parent, partial)
        raise
    return entries


def capture_reference(src: Path, relpaths: Iterable[str]) -> list[FileEntry]:
    """Checksum the files in place (memory short): later stages re-verify as they read."""
    entries = []
    for rel in relpaths:
        path = src / rel
        before = _identity(path)
        checksum = file_checksum(path)
        _check_unchanged(path, before)
        entries.append(FileEntry(rel, before[1], before[3], checksum))
    return entries


def _copy_one(source: Path, dst: Path, rel: str, buffer: mmap.mmap,
              on_bytes: Callable[[int], None] | None) -> FileEntry:
    target = dst / rel
    makedirs(target.parent)
    before = _identity(source)
    size, checksum = copy_with_checksum(source, target, on_bytes=on_bytes, buffer=buffer)
    _check_unchanged(source, before)
    if size != before[1]:
        raise PartChanged(f"{source}: size changed during capture ({before[1]} -> {size})")
    return FileEntry(rel, size, before[3], checksum)


def _identity(path: Path) -> tuple[int, int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise PartChanged(f"{path}: deleted during capture") from None
    return st.st_ino, st.st_size, st.st_mtime_ns, trainer_mode(st.st_mode)


def _check_unchanged(path: Path, before: tuple[int, int, int, int]) -> None:
    if _identity(path)[:3] != before[:3]:
        raise PartChanged(f"{path}: rewritten during capture (inode, size or mtime changed)")

