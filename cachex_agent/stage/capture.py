"""Capture: one node's files of a committed checkpoint, from the spool into the stage.

Each file is copied, or hard-linked where the `Plan` allows it (`capture_method`: the
framework writes every save into new files, and spool and stage share a file system):
a link reads the file once, for its checksum, and the bytes live once in memory. A
linked file is the trainer's inode: a later rewrite in place changes the staged bytes,
which every reader then finds differing from the captured checksum (never served); so
nothing here writes, truncates or chmods a staged file, and a linked one keeps the
trainer's permission bits (the stage directory, 0700, keeps it private).

A copy computes its checksum in the same pass as the copy. The captured directory appears
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
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np

from ..checksum import (
    COPY_CHUNK,
    RunningHash,
    copy_buffer,
    copy_range_with_checksum,
    copy_with_checksum,
    file_checksum,
    read_hashing,
)
from ..errors import OperationError
from ..fsutil import (
    fsync_dir,
    fsync_file,
    fsync_tree,
    makedirs,
    partial_path,
    remove_under,
    trainer_mode,
)
from ..manifest import PENDING, FileEntry
from ..mapped import ReadLease
from ..rules.quiescence import FileState


class PieceSink(Protocol):
    """Where a linked file's pieces go as they are hashed (peer/feed.py's `Feed`): the
    capture of a part calls `begin`, then `take`/`give` per piece, `stop` at its end;
    `waited`: the seconds `take` kept this part's capture waiting for a buffer. A piece
    given `mapped` under a read lease is out until Put (which hashes it into `running`);
    `settle` before letting go of the lease."""
    piece: int
    wait: float
    waited: float

    def begin(self, ckpt: str) -> None: ...

    def take(self) -> np.ndarray | None: ...

    def stop(self) -> None: ...

    def give(self, file: int, offset: int, buffer: np.ndarray, length: int,
             mapped: np.ndarray | None = None, lease: ReadLease | None = None,
             running: RunningHash | None = None) -> None: ...

    def settle(self, lease: ReadLease, wait: float = 0.0) -> None: ...


OnFile = Callable[[int, FileEntry, Path], None]     # a file copied (or linked): stream it


class CaptureError(OperationError):
    """The checkpoint could not be captured whole (deleted, rewritten, unreadable)."""


class PartChanged(CaptureError):
    """A file of the part changed while it was read: its writer is still at work."""


#: errors of a full stage: capture by reference instead of failing
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_stage_full(exc: OSError) -> bool:
    return exc.errno in _FULL


#: os.link's refusals that a copy gets past: another mount (a bind mount of the same
#: file system too), another owner's file (fs.protected_hardlinks), too many links, a
#: file system without hard links
_LINK_REFUSED = frozenset({errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK,
                           errno.EOPNOTSUPP, errno.ENOTSUP})
#: copy_file_range's refusals (another file system, an old kernel, a special file)
_RANGE_REFUSED = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                            errno.ENOTSUP})
#: file systems in memory: a copy through user space, hashed in the same pass, took
#: less CPU there than copy_file_range and a read (docs/benchmarks.md, capture)
_IN_MEMORY = frozenset({"tmpfs", "ramfs"})


@dataclass
class Plan:
    """Which files of one capture may be hard-linked (the others are copied), and what
    the capture did: the files it linked, why a link fell back to a copy."""

    link: frozenset[str] = frozenset()
    ranged: bool = False    # copy by copy_file_range (until the kernel refuses it once)
    lease: bool = False     # a fed linked file is hashed and Put from a leased mapping
    linked: list[str] = field(default_factory=list)
    leased: list[str] = field(default_factory=list)     # those hashed from a mapping
    refused: str = ""       # why a link asked for was not made (the first refusal)


def same_file_system(a: Path, b: Path) -> bool:
    """Both exist on one file system (a hard link between them may still meet EXDEV:
    two mounts of one file system)."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def file_system_type(path: Path) -> str:
    """The type of the file system holding `path` (`tmpfs`, `ext4`...), '' if unknown:
    the mount whose device is the file's, in /proc/self/mountinfo."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
            lines = mounts.read().splitlines()
    except OSError:
        return ""
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in lines:
        fields, _, rest = line.partition(" - ")
        if fields.split()[2:3] == [wanted] and rest:
            return rest.split()[0]
    return ""


def copies_in_kernel(spool: Path, stage: Path) -> bool:
    """Copies go through copy_file_range: spool and stage share a file system on disk."""
    return same_file_system(spool, stage) and file_system_type(stage) not in _IN_MEMORY


def capture_method(setting: str, new_files: bool, spool: Path, stage: Path
                   ) -> tuple[str, str]:
    """("link" or "copy", why) for the files of one part. `setting`: stage.capture;
    `new_files`: the rule knows its framework writes every save into new files."""
    if setting == "copy":
        return "copy", "stage.capture = copy"
    if setting == "auto" and not new_files:
        return "copy", "the framework may rewrite its files in place"
    if not same_file_system(spool, stage):
        return "copy", f"{spool} and {stage} are on different file systems"
    return "link", ""


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
                 on_file: OnFile | None = None, plan: Plan | None = None,
                 sink: PieceSink | None = None) -> list[FileEntry]:
    """Copy `relpaths` from `src` into the new directory `dst`; return their entries.
    `sources` names the file read for a relpath that does not live under `src` (a
    tracker or single-file checkpoint at the spool root). `on_file(i, entry, partial)`:
    file i is copied, fsynced and checked unchanged, in `partial` (renamed to `dst` at
    the end); a later failure or retry of the part may still discard it. `plan`: the
    files to hard-link instead (it records those linked). `sink`: a linked file's pieces
    go there as they are hashed, announced first by `on_file` with a PENDING checksum."""
    sources = sources or {}
    plan = plan or Plan()
    partial = partial_path(dst)
    remove_under(dst.parent, partial)
    makedirs(partial)
    buffer = copy_buffer(chunk)
    try:
        entries = []
        for i, rel in enumerate(relpaths):
            source = sources.get(rel, src / rel)
            announce = (lambda e, i=i: on_file(i, e, partial)) if on_file and sink else None
            linked = (_link_one(source, partial, rel, plan, on_bytes,
                                _Feeding(i, sink, announce) if announce and sink else None)
                      if rel in plan.link else None)
            entries.append(linked or _copy_one(source, partial, rel, buffer, on_bytes, plan))
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
              on_bytes: Callable[[int], None] | None, plan: Plan) -> FileEntry:
    target = dst / rel
    makedirs(target.parent)
    before = _identity(source)
    size, checksum = _copy(source, target, buffer, on_bytes, plan)
    _check_unchanged(source, before)
    if size != before[1]:
        raise PartChanged(f"{source}: size changed during capture ({before[1]} -> {size})")
    return FileEntry(rel, size, before[3], checksum)


def _copy(source: Path, target: Path, buffer: mmap.mmap,
          on_bytes: Callable[[int], None] | None, plan: Plan) -> tuple[int, str]:
    if plan.ranged:
        try:
            return copy_range_with_checksum(source, target, on_bytes=on_bytes)
        except OSError as exc:
            if exc.errno not in _RANGE_REFUSED:
                raise
            plan.ranged = False         # the kernel said no: through user space from now
    return copy_with_checksum(source, target, on_bytes=on_bytes, buffer=buffer)


@dataclass
class _Feeding:
    index: int
    sink: PieceSink
    announce: Callable[[FileEntry], None]


def _link_one(source: Path, dst: Path, rel: str, plan: Plan,
              on_bytes: Callable[[int], None] | None, feeding: _Feeding | None = None
              ) -> FileEntry | None:
    """Hard-link `source` as `dst/rel` and checksum it in one read; None when the file
    system refuses the link (`plan.refused` says why) or the file is setuid, setgid or
    sticky (no such file under cachex's directories): the caller copies it."""
    target = dst / rel
    makedirs(target.parent)
    before = _identity(source)
    if _special_bits(source):
        return None
    try:
        os.link(source, target, follow_symlinks=False)
    except FileNotFoundError:
        raise PartChanged(f"{source}: deleted during capture") from None
    except OSError as exc:
        if exc.errno not in _LINK_REFUSED:
            raise
        plan.refused = plan.refused or f"{source}: not linked ({exc.strerror}); copied"
        return None
    if target.stat().st_ino != before[0]:
        raise PartChanged(f"{source}: replaced during capture")
    fsync_file(target)      # durable before recorded, as a copy is (free on tmpfs)
    if feeding is None or not before[1]:    # an empty file has no piece to feed
        checksum = file_checksum(target)
    else:
        feeding.announce(FileEntry(rel, before[1], before[3], PENDING))
        checksum = _checksum_feeding(target, rel, before, feeding, plan)
    _check_unchanged(source, before)    # the same inode: a write while hashing shows here
    plan.linked.append(rel)
    if on_bytes:
        on_bytes(before[1])
    return FileEntry(rel, before[1], before[3], checksum)


def _checksum_feeding(path: Path, rel: str, before: tuple[int, int, int, int],
                      feeding: _Feeding, plan: Plan) -> str:
    """The file's checksum, each piece given to the sink: a view of the file mapped under
    a read lease while the lease is held (no copy; the Put hashes it as it sends it, so
    the owner goes over those bytes once), else read into one of the sink's buffers and
    hashed there; without a buffer (the sink stopped) the rest is read and hashed alone."""
    sink, size, running, offset = feeding.sink, before[1], RunningHash(), 0
    lease = ReadLease.take(path, before[0], size) if plan.lease else None
    if lease is not None:
        plan.leased.append(rel)
    with open(path, "rb", buffering=0) as handle:
        try:
            while offset < size and (buffer := sink.take()) is not None:
                length = min(sink.piece, size - offset)
                if lease is not None and lease.held():
                    sink.give(feeding.index, offset, buffer, length,
                              mapped=lease.piece(offset, length), lease=lease,
                              running=running)
                    offset += length
                    continue
                if lease is not None:       # a writer waits: let go, read from here on
                    _let_go(lease, sink, 0.0, running, handle, offset)
                    lease = None
                handle.seek(offset)
                n = read_hashing(handle, memoryview(buffer)[:length], running)
                sink.give(feeding.index, offset, buffer, n)
                offset += n
                if n < length:
                    break           # shorter than it was: _check_unchanged says so
        finally:
            if lease is not None:
                _let_go(lease, sink, sink.wait, running, handle, offset)
        _hash_from(handle, running)
    return running.hexdigest()


def _let_go(lease: ReadLease, sink: PieceSink, wait: float, running: RunningHash,
            handle: BinaryIO, until: int) -> None:
    """Release `lease` once no piece under it is out (waited for while they are Put, up
    to `wait` without progress), having hashed what the Puts did not, up to `until`, by
    reading (a waiting trainer goes on only after)."""
    try:
        sink.settle(lease, wait)
        _hash_from(handle, running, until)
    finally:
        lease.release()


def _hash_from(handle: BinaryIO, running: RunningHash, until: int | None = None) -> None:
    """Read and hash the file from where `running` got to, up to `until` (the end)."""
    handle.seek(running.end)
    with copy_buffer(COPY_CHUNK) as own, memoryview(own) as view:
        while until is None or running.end < until:
            left = len(view) if until is None else min(len(view), until - running.end)
            if not read_hashing(handle, view[:left], running):
                break


def _special_bits(path: Path) -> bool:
    try:
        return bool(path.stat().st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX))
    except FileNotFoundError:
        raise PartChanged(f"{path}: deleted during capture") from None


def _identity(path: Path) -> tuple[int, int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise PartChanged(f"{path}: deleted during capture") from None
    return st.st_ino, st.st_size, st.st_mtime_ns, trainer_mode(st.st_mode)


def _check_unchanged(path: Path, before: tuple[int, int, int, int]) -> None:
    if _identity(path)[:3] != before[:3]:
        raise PartChanged(f"{path}: rewritten during capture (inode, size or mtime changed)")

