"""Mappings of files, and the read lease that makes the trainer's own file safe to map.

A file captured by hard link is the trainer's inode. Mapped without more, a truncate by
the trainer would end the agent with SIGBUS at its next touch of a page past the new
end. A read lease (`F_SETLEASE`, F_RDLCK) closes that door: the kernel refuses it while
any process has the file open for writing, and once it is held a later open for writing
or a truncate waits until the holder lets go (or until `fs.lease-break-time` seconds have
passed, when the kernel takes the lease back). While it waits the lease reads F_UNLCK
(`held` is False): every reader checks `held` before it touches a piece of the mapping,
and the capture lets go of a lease it sees broken as soon as no piece of it is being
Put. So the trainer's rewrite waits at most the time of one piece, the agent never
touches a page the trainer may truncate, and the capture reads the rest with `read`
(which a truncate only shortens) and finds the rewrite by the file's changed identity.

A lease break is announced with SIGIO, whose default action ends the process: leases are
used only once `prepare` (the agent's main thread, at start) has set it to be ignored.
They are not used where the kernel gives a holder too little time to notice a break
(`fs.lease-break-time` under `MIN_BREAK`), where leases are off (`fs.leases-enable`), or
where the file system refuses them (NFS, Lustre without `flock`): the file is read.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import signal
import threading
from pathlib import Path

import numpy as np

POPULATE = getattr(mmap, "MAP_POPULATE", 0)     # Linux; elsewhere faults per page
#: the least lease-break time (seconds) at which a piece is sure to be Put or hashed
#: between the check of `held` and the kernel taking the lease back
MIN_BREAK = 10
_PROC = Path("/proc/sys/fs")


def map_piece(fd: int, offset: int, length: int) -> np.ndarray:
    """Bytes [offset, offset+length) of the file, mapped read-only and populated in one
    call (one fault per piece, not per page). A mapping must start on an allocation
    boundary: map from the one below `offset`. The mapping goes with the last view of it.
    `length` > 0 (an empty file has no piece; mmap refuses 0 bytes)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, offset + length - start, flags=mmap.MAP_SHARED | POPULATE,
                            prot=mmap.PROT_READ, offset=start)
    except ValueError as exc:       # mmap's word for "past the end of the file"
        raise OSError(errno.EIO, f"shorter than its manifest ({exc})") from None
    return np.frombuffer(mapping, dtype=np.uint8, count=length, offset=offset - start)


def _sigio_ends_us() -> bool:
    return signal.getsignal(signal.SIGIO) == signal.SIG_DFL


def prepare() -> None:
    """Main thread, before any capture: a lease break's SIGIO is ignored (its default
    would end the agent), so that leases may be used. A handler already set is kept."""
    if _sigio_ends_us():
        signal.signal(signal.SIGIO, signal.SIG_IGN)


def unusable() -> str:
    """Why no read lease is taken in this process ('' when they may be)."""
    if _sigio_ends_us():
        return "SIGIO would end the agent (mapped.prepare not called)"
    try:
        enabled = (_PROC / "leases-enable").read_text().strip()
        break_time = int((_PROC / "lease-break-time").read_text())
    except (OSError, ValueError):
        return "fs.leases-enable or fs.lease-break-time unreadable"
    if enabled != "1":
        return "fs.leases-enable is off"
    if break_time < MIN_BREAK:
        return f"fs.lease-break-time is {break_time} s (under {MIN_BREAK} s)"
    return ""


class ReadLease:
    """A read lease on one file, open read-only, whose pieces may be mapped while `held`.
    Thread-safe: the capture takes and releases it, the main thread asks `held`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def take(cls, path: Path, inode: int, size: int) -> ReadLease | None:
        """A lease on `path` if it is still that inode of that size; None when refused
        (a writer has it open, another user's file, a file system without leases), and
        always while a break's SIGIO would end the process (`prepare`)."""
        if _sigio_ends_us():
            return None
        try:
            # non-blocking: a file under another process's write lease is refused, not
            # waited for until that lease is broken
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError:
            os.close(fd)
            return None
        lease = cls(fd)
        st = os.fstat(fd)
        if (st.st_ino, st.st_size) != (inode, size):
            lease.release()     # rewritten before the lease: the caller finds it changed
            return None
        return lease

    def held(self) -> bool:
        """Nobody waits to write or truncate the file: its pieces may be touched now."""
        with self._lock:
            if self._fd < 0:
                return False
            try:
                return fcntl.fcntl(self._fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK
            except OSError:
                return False

    def piece(self, offset: int, length: int) -> np.ndarray:
        """Bytes [offset, offset+length), mapped: touch them only while `held`."""
        with self._lock:
            if self._fd < 0:
                raise OSError(errno.EBADF, "read lease already released")
            return map_piece(self._fd, offset, length)

    def release(self) -> None:
        """Let go (a waiting writer goes on); idempotent. Pieces mapped under the lease
        must no longer be touched (their mappings outlive it, untouched, until dropped)."""
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass        # the kernel took it back (a break outlived lease-break-time)
            finally:
                os.close(fd)
