"""xxh3-128 checksums, computed in the same pass that moves the bytes (or, for a copy
made inside the kernel, in one read of the copy)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any, BinaryIO

import xxhash

from .fsutil import open_private

ALGORITHM = "xxh3-128"
CHUNK = 8 * 1024 * 1024
#: the copy's buffer: small enough to stay in a core's cache between the read that fills
#: it, the hash and the write that empties it (8 MiB went through memory three times and
#: cost a third more CPU than 1 MiB when copying tmpfs to tmpfs)
COPY_CHUNK = 1024 * 1024
#: bytes asked of one copy_file_range call (progress is reported per call)
RANGE_CHUNK = 64 * 1024 * 1024


class RunningHash:
    """A file's checksum being computed from its start, and how far it got (`end`): the
    bytes may be hashed by more than one thread in turn (the capture, then the Put of a
    fed piece), each continuing where the last stopped, never two at once."""

    def __init__(self) -> None:
        self.digest = hasher()
        self.end = 0

    def update(self, data: Any) -> None:
        self.digest.update(data)
        self.end += len(memoryview(data))

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def copy_buffer(size: int = COPY_CHUNK) -> mmap.mmap:
    """A page-aligned buffer for copies: the kernel's copies into and out of it cost
    about a third less CPU than with a bytearray, whose bytes start 16 bytes into a
    page (measured tmpfs to tmpfs)."""
    return mmap.mmap(-1, size)


def hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def file_checksum(path: str | os.PathLike[str], chunk: int = COPY_CHUNK) -> str:
    """xxh3-128 of the file, read through one `chunk` buffer unmapped on return (a
    reference capture or a recovery check of a 4 GiB part holds `chunk`, not the part;
    1 MiB hashes faster than 8 MiB, as in the copy)."""
    digest = hasher()
    with copy_buffer(chunk) as buffer, memoryview(buffer) as view, \
            open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()


def read_hashing(handle: BinaryIO, view: memoryview, digest: Any,
                 chunk: int = COPY_CHUNK) -> int:
    """Fill `view` from `handle` (until it is full or the file ends), hashing each
    `chunk` as it arrives, while it is still in the cache; the bytes read."""
    done = 0
    while done < len(view):
        n = handle.readinto(view[done:done + chunk])
        if not n:
            break
        digest.update(view[done:done + n])
        done += n
    return done


def same_bytes(path: str | os.PathLike[str], other: str | os.PathLike[str]) -> bool:
    """`path` is a regular file with the bytes of `other` (read whole, both)."""
    try:
        if not os.path.isfile(path) or os.path.islink(path) or \
                os.stat(path).st_size != os.stat(other).st_size:
            return False
        return file_checksum(path) == file_checksum(other)
    except OSError:
        return False


def file_problem(path: str | os.PathLike[str], size: int, checksum: str) -> str | None:
    """Why the file at `path` is not the one of `size` bytes and `checksum`; None when it
    is (checked in place: the size first, then one read for the checksum)."""
    try:
        found = os.stat(path).st_size
        if found != size:
            return f"size {found}, expected {size}"
        return None if file_checksum(path) == checksum else "checksum mismatch"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"


def copy_with_checksum(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                       chunk: int = COPY_CHUNK,
                       on_bytes: Callable[[int], None] | None = None,
                       buffer: mmap.mmap | None = None) -> tuple[int, str]:
    """Copy `src` to `dst` (created 0600, fsynced), return (bytes, checksum) of what was
    read. `buffer` (`copy_buffer`, reused across files) saves mapping a new one."""
    digest = hasher()
    buffer = copy_buffer(chunk) if buffer is None else buffer
    view = memoryview(buffer)
    total = 0
    with open(src, "rb", buffering=0) as fin, open_private(dst, buffering=0) as fout:
        while n := fin.readinto(buffer):
            digest.update(view[:n])
            written = 0
            while written < n:
                written += fout.write(view[written:n])
            total += n
            if on_bytes:
                on_bytes(n)
        os.fsync(fout.fileno())
    return total, digest.hexdigest()


def copy_range_with_checksum(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                             on_bytes: Callable[[int], None] | None = None
                             ) -> tuple[int, str]:
    """`copy_with_checksum` by copy_file_range: the bytes never enter user space (a
    reflink or a server-side copy where the file system has one), so the checksum takes
    one read of the copy. OSError EXDEV, EINVAL, ENOSYS... where the kernel cannot:
    copy with `copy_with_checksum` then. On disk (ext4) this took 28-64% less CPU than
    the copy through user space, on tmpfs 4-21% more (docs/benchmarks.md, capture
    methods): the capture uses it on disk only."""
    total = 0
    with open(src, "rb", buffering=0) as fin, open_private(dst, buffering=0) as fout:
        while n := os.copy_file_range(fin.fileno(), fout.fileno(), RANGE_CHUNK):
            total += n
            if on_bytes:
                on_bytes(n)
        os.fsync(fout.fileno())
    return total, file_checksum(dst)
