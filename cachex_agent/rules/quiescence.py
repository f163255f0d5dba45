"""Is anybody still writing these files?

No training framework writes its data files atomically, so "the marker exists" only
says the trainer *thinks* it is done; an agent captures a node's files only after no
process holds them open for writing and (optionally) their sizes and mtimes have stopped
changing for a settle time.

Limits worth knowing: /proc shows the descriptors of the processes this user may
inspect (everything when run as root, the user's own processes otherwise), and a writer
that uses a shared writable mmap without an open descriptor is invisible. The settle
time covers both. Linux only (/proc), like the watcher's inotify.

The walk costs a stat per descriptor of every process on the host (about 15 us each
here, 5 ms for 8 files with 110 processes). So a file is first offered a read lease
(mapped.py), which the kernel grants only while nobody has it open for writing: a file
proved free that way is not looked for in the walk; the walk runs for the rest (a
writer, or no lease to be had: another user's file, NFS, a process whose SIGIO would
end it). Processes known never to write a checkpoint (this job's agents on the host,
`skip_processes`) are not walked: on one host running many virtual nodes they would
otherwise make each agent's check grow with the job.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..errors import OperationError
from ..mapped import ReadLease

__all__ = [
    "DirectoryTimeout",
    "FileState",
    "QuiescenceStopped",
    "QuiescenceTimeout",
    "open_for_write",
    "skip_processes",
    "snapshot",
    "wait_for_directory",
    "wait_quiescent",
    "wait_settled",
]

#: (size, mtime_ns, inode) of one regular file; the inode catches a rename-over that
#: keeps size and mtime.
FileState = tuple[int, int, int]

_PID_NAMESPACE = "/proc/self/ns/pid"
_skipped: frozenset[str] = frozenset()


def pid_namespace() -> int:
    """This process's PID namespace (pids name the same processes only within one)."""
    return os.stat(_PID_NAMESPACE).st_ino


def skip_processes(pids: Iterable[int]) -> None:
    """From now on `open_for_write` does not look at these processes (of this PID
    namespace): processes that never write a checkpoint, such as this job's agents."""
    global _skipped
    _skipped = frozenset(str(pid) for pid in pids)

_PROC = "/proc"


class QuiescenceTimeout(OperationError):
    """Files of a checkpoint were still being written when the wait ran out."""

    def __init__(self, directory: Path, timeout: float, still_open: Iterable[Path],
                 changing: bool) -> None:
        self.directory = Path(directory)
        self.timeout = timeout
        self.still_open = sorted(still_open)
        if self.still_open:
            names = ", ".join(str(p) for p in self.still_open[:10])
            more = len(self.still_open) - 10
            detail = f"still open for writing: {names}" + (f" (+{more} more)" if more > 0 else "")
        elif changing:
            detail = "files still changing (size or mtime)"
        else:
            detail = "not settled"
        super().__init__(f"{directory}: not quiescent after {timeout:g}s; {detail}")


class QuiescenceStopped(OperationError):
    """The wait was abandoned because the caller's stop event was set."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        super().__init__(f"{directory}: stopped while waiting for writers to finish")


class DirectoryTimeout(OperationError):
    """A checkpoint directory did not appear in this node's spool in time."""

    def __init__(self, directory: Path, timeout: float) -> None:
        self.directory = Path(directory)
        super().__init__(f"{directory}: checkpoint directory did not appear within"
                         f" {timeout:g}s")


def open_for_write(paths: Iterable[str | os.PathLike[str]]) -> set[Path]:
    """The subset of `paths` that some process currently holds open for writing.

    One pass over /proc. A descriptor is matched by the device and inode its link in
    /proc/<pid>/fd reaches, so a writer that knows the file by another name (symlinks,
    hard links, bind mounts, another mount namespace) matches too; only a match's
    access mode is read. Processes and descriptors that vanish or deny access are
    skipped.
    """
    wanted: dict[tuple[int, int], list[Path]] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue        # gone: nobody writes it under this name any more
        if _no_writer(Path(path), st):
            continue
        wanted.setdefault((st.st_dev, st.st_ino), []).append(Path(path))
    found: set[Path] = set()
    if not wanted:
        return found
    for pid in _pids():
        for fd, key in _descriptors(pid):
            if key in wanted and _writes(pid, fd):
                found.update(wanted.pop(key))
                if not wanted:
                    return found
    return found


def _no_writer(path: Path, st: os.stat_result) -> bool:
    """True when no process has `path` open for writing, proved in a few system calls:
    the kernel grants a read lease (mapped.ReadLease) only then, and it is let go at
    once. False says nothing (a writer, another user's file, a file system without
    leases, a process whose SIGIO would end it): the walk decides, with its skipped
    processes. The walk of every descriptor on the host was about a fifth of an agent's
    CPU per checkpoint."""
    lease = ReadLease.take(path, st.st_ino, st.st_size)
    if lease is None:
        return False
    lease.release()
    return True


def _pids() -> list[str]:
    return [name for name in os.listdir(_PROC) if name.isdigit() and name not in _skipped]


def _descriptors(pid: str) -> Iterator[tuple[str, tuple[int, int]]]:
    """(fd, (device, inode)) of each open descriptor of `pid` this user may see."""
    directory = f"{_PROC}/{pid}/fd"
    try:
        fds = os.listdir(directory)
    except OSError:         # gone, or another user's process
        return
    for fd in fds:
        try:
            st = os.stat(f"{directory}/{fd}")
        except OSError:     # closed since listed
            continue
        yield fd, (st.st_dev, st.st_ino)


def _writes(pid: str, fd: str) -> bool:
    """Was descriptor `fd` of `pid` opened for writing? (fdinfo's octal `flags`)"""
    try:
        with open(f"{_PROC}/{pid}/fdinfo/{fd}", "rb") as handle:
            info = handle.read()
    except OSError:
        return False
    for line in info.splitlines():
        if line.startswith(b"flags:"):
            return (int(line.split()[1], 8) & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)
    return False


def snapshot(directory: str | os.PathLike[str],
             ignore: Callable[[str], bool] | None = None) -> dict[Path, FileState]:
    """Every regular file under `directory` (recursive, symlinks not followed).

    `ignore` gets the '/'-separated path relative to `directory`. Raises
    FileNotFoundError when `directory` itself does not exist; entries that vanish while
    walking are skipped (the next snapshot differs, which is what callers look for).
    """
    root = Path(directory)
    files: dict[Path, FileState] = {}
    pending: list[tuple[Path, str]] = [(root, "")]
    while pending:
        path, prefix = pending.pop()
        try:
            with os.scandir(path) as entries:
                listing = list(entries)
        except (FileNotFoundError, NotADirectoryError):
            if path == root:
                raise FileNotFoundError(errno.ENOENT, "directory not found", str(root)) from None
            continue
        for entry in listing:
            relpath = prefix + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((Path(entry.path), relpath + "/"))
                    continue
                if not entry.is_file(follow_symlinks=False) or (ignore and ignore(relpath)):
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            files[Path(entry.path)] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return files


def wait_for_directory(directory: str | os.PathLike[str], timeout: float,
                       stop: threading.Event | None = None, poll: float = 0.1) -> bool:
    """Wait until `directory` exists; True when it was not there at the first look.

    Raises DirectoryTimeout after `timeout` seconds, QuiescenceStopped when `stop` is set.
    """
    directory = Path(directory)
    deadline = time.monotonic() + timeout
    waited = False
    while not directory.is_dir():
        now = time.monotonic()
        if now >= deadline:
            raise DirectoryTimeout(directory, timeout)
        waited = True
        _pause(directory, min(poll, deadline - now), stop)
    return waited


def wait_quiescent(directory: str | os.PathLike[str], settle: float, timeout: float,
                   stop: threading.Event | None = None, poll: float = 0.1, *,
                   ignore: Callable[[str], bool] | None = None) -> list[Path]:
    """Wait until nobody writes under `directory`; return its regular files, sorted.

    See `wait_settled`, which this is with the states dropped.
    """
    return sorted(wait_settled(directory, settle, timeout, stop, poll, ignore=ignore))


def wait_settled(directory: str | os.PathLike[str], settle: float, timeout: float,
                 stop: threading.Event | None = None, poll: float = 0.1, *,
                 ignore: Callable[[str], bool] | None = None) -> dict[Path, FileState]:
    """Wait until nobody writes under `directory`; return the state of its regular files.

    Quiescent means: no file is open for writing by any process, and (when `settle` > 0)
    the set of (path, size, mtime, inode) has not changed for `settle` seconds, the last
    time measured with no writer present. Files for which `ignore(relpath)` is true are
    neither checked nor returned.

    Raises QuiescenceTimeout after `timeout` seconds, QuiescenceStopped when `stop` is
    set, FileNotFoundError when `directory` disappears.
    """
    directory = Path(directory)
    deadline = time.monotonic() + timeout
    last: dict[Path, FileState] | None = None
    stable_since = time.monotonic()
    while True:
        files = snapshot(directory, ignore)
        now = time.monotonic()
        changed = files != last
        # Asking every process is the expensive part (thousands of files, every poll):
        # a change already restarts the settle clock, so ask only once files hold still.
        busy = open_for_write(files) if files and not (changed and settle > 0) else set()
        if changed or busy:
            # A change or a writer restarts the settle clock: bytes may still be coming.
            stable_since, last = now, files
        if not busy and now - stable_since >= settle:
            return files
        if now >= deadline:
            raise QuiescenceTimeout(directory, timeout, busy, changing=not busy)
        _pause(directory, max(0.0, min(poll, deadline - now)), stop)


def _pause(directory: Path, seconds: float, stop: threading.Event | None) -> None:
    if stop is None:
        time.sleep(seconds)
    elif stop.wait(seconds):
        raise QuiescenceStopped(directory)
