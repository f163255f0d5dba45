"""Moving one source's files into a spool, each checksummed as it is moved, once.

Every function returns the files that did not arrive intact, `{path: reason}`, instead of
raising: the recovery (rebuild.py) takes each of them from the next copy. A file that
arrived lands atomically (temp, fsync, rename) with the trainer's permission bits; one
that did not leaves nothing behind.

Over MPI the holder sends every file's bytes in CHUNK messages in manifest order (a file
it cannot read whole is padded with zeros, so the stream stays in step, and reported by
both sides); the target hashes what it receives. Two chunks are in flight on each side:
the target posts the receive of the next chunk before it hashes and writes the current
one, the holder sends straight from a mapping of the file. Given `stop`, the two ends
agree before each file whether to go on (`_Ends`): a signal on either rank stops both
within one file, every wait bounded, and the files not moved are reported as problems.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import CHUNK, copy_with_checksum, file_problem, hasher
from ..collective import wait
from ..fsutil import makedirs, open_private, temp_name, trainer_mode
from ..handles import Handle, Point
from ..manifest import FileEntry
from ..messages import Tag
from ..progress import Done

#: files moved at once on one node (local copies, checks in place): reads and writes
#: release the GIL, so two files overlap one's hashing with the other's kernel copies
WORKERS = 2
Problems = dict[str, str]
Stop = Callable[[], bool]       # True: this rank was asked to stop (a signal)
_ZEROS = np.zeros(CHUNK, np.uint8)      # what stands for a file its holder cannot send


# ------------------------------------------------------------------------ local
def copy_local(directory: Path, files: list[FileEntry], dest: Path,
               trainer_modes: bool = True, done: Done | None = None) -> Problems:
    """Copy files of a copy on this node (its stage, journal, a replica it holds)."""
    return _each(files, lambda e: _copy_one(directory / e.path, dest / e.path, e,
                                            trainer_modes), done)


def check_in_place(directory: Path, files: list[FileEntry], done: Done | None = None
                   ) -> Problems:
    """The node's own spool copy, kept where it is: read once, hashed."""
    return _each(files, lambda e: file_problem(directory / e.path, e.size, e.checksum), done)


def _each(files: list[FileEntry], action: Callable[[FileEntry], str | None],
          done: Done | None = None) -> Problems:
    def counted(entry: FileEntry) -> str | None:
        why = action(entry)
        if done is not None:
            done(entry.size)
        return why
    with ThreadPoolExecutor(WORKERS) as pool:
        found = list(pool.map(counted, files))
    return {e.path: why for e, why in zip(files, found, strict=True) if why}


def _copy_one(source: Path, target: Path, entry: FileEntry, trainer_modes: bool
              ) -> str | None:
    makedirs(target.parent)
    temp = temp_name(target)
    try:
        size, checksum = copy_with_checksum(source, temp)
        return _finish(temp, target, entry, size, checksum, trainer_modes)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        return f"unreadable ({exc.strerror or exc})"


def _finish(temp: Path, target: Path, entry: FileEntry, size: int, checksum: str,
            trainer_modes: bool) -> str | None:
    """Rename a complete, matching temp into place; else remove it and say why."""
    why = (f"size {size}, expected {entry.size}" if size != entry.size
           else "checksum mismatch" if checksum != entry.checksum else None)
    if why:
        temp.unlink(missing_ok=True)
        return why
    if trainer_modes:
        os.chmod(temp, trainer_mode(entry.mode))
    os.replace(temp, target)
    return None


# -------------------------------------------------------------------------- MPI
def send_files(comm: Any, directory: Path, files: list[FileEntry], dest: int,
               timeout: float, name: str, stop: Stop | None = None,
               handle: Handle | None = None,
               locate: Callable[[str], Path] | None = None) -> Problems:
    """`stop`: before each file, both ends say whether they stop (`_Ends`); the
    receiver must be given one too. `handle`: the work this transfer is part of (the
    restore), asked between two files (a test's fault hook may slow it there, so that
    a signal lands midway). `locate`: where a file is, when not `directory / path` (a
    restored spool, whose spool-root files are at its root)."""
    locate = locate or (lambda path: directory / path)
    problems: Problems = {}
    stream = _Sender(comm, dest, timeout, name)
    ends = _Ends(comm, dest, timeout, name, stop)
    for k, entry in enumerate(files):
        if k and handle is not None:
            handle.at(Point.FILE)
        if ends.stopped():
            problems.update(_not_moved(files[k:], name))
            break
        with _mapped(locate(entry.path), entry) as (data, why):
            if why:
                problems[entry.path] = why
            for start in range(0, entry.size, CHUNK):
                n = min(CHUNK, entry.size - start)
                stream.send(_ZEROS[:n] if data is None else data[start:start + n])
    stream.drain()
    return problems


def receive_files(comm: Any, files: list[FileEntry], dest: Path, source: int,
                  timeout: float, name: str, trainer_modes: bool = True,
                  done: Done | None = None, stop: Stop | None = None) -> Problems:
    """`trainer_modes`: the files get the trainer's permission bits (a spool), else they
    stay private (a replica store). `stop`: as send_files's, the sender's too."""
    problems: Problems = {}
    stream = _Receiver(comm, source, [e.size for e in files], timeout, name)
    ends = _Ends(comm, source, timeout, name, stop)
    # hashing on a second thread beside the write measured no faster here (2 cores: the
    # sender's rank, the MPI copy and this loop already share them), so it stays serial
    for k, entry in enumerate(files):
        if ends.stopped():
            stream.cancel()
            problems.update(_not_moved(files[k:], name))
            break
        target = dest / entry.path
        makedirs(target.parent)
        temp = temp_name(target)
        digest = hasher()
        with open_private(temp, buffering=0) as out:
            for view in stream.take(entry.size):
                digest.update(view)
                if done is not None:
                    done(len(view))
                while view:
                    view = view[out.write(view):]
            ends.ahead(k + 1 < len(files))      # the next file's word, before the fsync
            os.fsync(out.fileno())
        why = _finish(temp, target, entry, entry.size, digest.hexdigest(), trainer_modes)
        if why:
            problems[entry.path] = why
    return problems


def _not_moved(files: list[FileEntry], name: str) -> Problems:
    return {e.path: f"not moved: the transfer with {name} was stopped" for e in files}


class _Ends:
    """Both ends of a transfer say, before each file, whether they stop (a signal asked
    this rank to): a 1-byte word each way, its own tag, each wait bounded; either one
    stopping stops both at that file, so neither waits for chunks the other never sends
    or takes. The receiver says its word for the next file as soon as it has taken this
    one's bytes (`ahead`), before its fsync, so the sender waits no longer than that."""

    def __init__(self, comm: Any, peer: int, timeout: float, name: str,
                 stop: Stop | None) -> None:
        self.comm, self.peer, self.timeout, self.name, self.stop = comm, peer, timeout, name, stop
        self.said: bool | None = None

    def ahead(self, more: bool) -> None:
        if more and self.stop is not None:
            self.said = self._exchange()

    def stopped(self) -> bool:
        if self.stop is None:
            return False
        said, self.said = self.said, None
        return said if said is not None else self._exchange()

    def _exchange(self) -> bool:
        assert self.stop is not None
        mine = np.array([self.stop()], np.uint8)
        theirs = np.zeros(1, np.uint8)
        received = self.comm.Irecv([theirs, MPI.BYTE], self.peer, Tag.RECOVERY_STOP)
        sent = self.comm.Isend([mine, MPI.BYTE], self.peer, Tag.RECOVERY_STOP)
        wait(sent, self.timeout, self.name)
        wait(received, self.timeout, self.name)
        return bool(mine[0] or theirs[0])


class _mapped:  # noqa: N801 (a context manager, used like a function)
    """A file's bytes as an array over a read-only mapping; None and the reason when it
    is not there whole (its bytes are then sent as zeros)."""

    def __init__(self, path: Path, entry: FileEntry) -> None:
        self.path, self.entry = path, entry
        self.map: mmap.mmap | None = None

    def __enter__(self) -> tuple[Any, str | None]:
        size = self.entry.size
        try:
            with open(self.path, "rb") as handle:
                found = os.fstat(handle.fileno()).st_size
                if found != size:
                    return None, f"size {found} on its holder, expected {size}"
                if not size:
                    return None, None
                self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                self.map.madvise(mmap.MADV_SEQUENTIAL)
                return np.frombuffer(self.map, np.uint8), None
        except OSError as exc:
            return None, f"unreadable on its holder ({exc.strerror or exc})"

    def __exit__(self, *exc: Any) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:       # a view is still referenced: the GC unmaps it
                pass


class _Sender:
    """Isend of chunks, two in flight (a buffer is reused only once its send is done)."""

    def __init__(self, comm: Any, dest: int, timeout: float, name: str) -> None:
        self.comm, self.dest, self.timeout, self.name = comm, dest, timeout, name
        self.flight: deque[Any] = deque()

    def send(self, data: np.ndarray) -> None:
        if len(self.flight) == 2:
            wait(self.flight.popleft(), self.timeout, self.name)
        self.flight.append(self.comm.Isend([data, MPI.BYTE], self.dest, Tag.RECOVERY))

    def drain(self) -> None:
        while self.flight:
            wait(self.flight.popleft(), self.timeout, self.name)


class _Receiver:
    """Irecv of the chunks of `sizes` (every file's, in order), the next one posted
    before the current one is handed out."""

    def __init__(self, comm: Any, source: int, sizes: list[int], timeout: float,
                 name: str) -> None:
        self.comm, self.source, self.timeout, self.name = comm, source, timeout, name
        self.chunks = deque(min(CHUNK, size - start) for size in sizes
                            for start in range(0, size, CHUNK))
        self.buffers = [np.empty(CHUNK, np.uint8) for _ in range(2)]
        self.turn = 0
        self.posted: deque[tuple[Any, np.ndarray, int]] = deque()
        self._post()
        self._post()

    def _post(self) -> None:
        if self.chunks:
            n = self.chunks.popleft()
            buffer = self.buffers[self.turn]
            self.turn ^= 1
            request = self.comm.Irecv([buffer[:n], MPI.BYTE], self.source, Tag.RECOVERY)
            self.posted.append((request, buffer, n))

    def cancel(self) -> None:
        """The transfer stopped at a file's start: the chunks posted ahead never come."""
        while self.posted:
            request, _buffer, _n = self.posted.popleft()
            request.Cancel()
            wait(request, self.timeout, self.name)
        self.chunks.clear()

    def take(self, size: int) -> Iterator[memoryview]:
        while size:
            request, buffer, n = self.posted.popleft()
            wait(request, self.timeout, self.name)
            yield memoryview(buffer)[:n]
            size -= n
            self._post()        # into the buffer just handed out, now consumed
