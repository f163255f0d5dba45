"""Global metadata files (written by one node only, e.g. DCP's `.metadata`) to every agent.

Every agent keeps them in its journal (`journal/global/<ckpt>/files/<path>`), so any
surviving node can lead a recovery when the node that wrote them is gone. A small header
(PEER tag) announces each file; the bytes follow as a raw buffer on their own tag (no
pickling), received with `Irecv` and checked against the owner's checksum. A transfer
not complete within `timeout` seconds (a peer gone or stuck) is cancelled and logged, so
neither a drain nor a recovery waits on it forever.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import copy_with_checksum, hasher
from ..errors import OperationError
from ..fsutil import atomic_open, fsync_dir, makedirs, temp_name, trainer_mode
from ..layout import global_files_dir
from ..manifest import FileEntry
from ..messages import GlobalFile, Tag

log = logging.getLogger(__name__)


class GlobalFiles:
    def __init__(self, comm: Any, journal: Path, send_header: Any, timeout: float) -> None:
        self.comm, self.journal, self.send_header = comm, journal, send_header
        self.timeout = timeout
        # (request, buffer, peer rank, deadline); headers for the incoming ones
        self._outgoing: list[tuple[Any, np.ndarray, int, float]] = []
        self._incoming: list[tuple[Any, np.ndarray, int, float, GlobalFile]] = []
        self._abandoned: list[tuple[Any, np.ndarray]] = []   # MPI may still touch these

    def share(self, ckpt: str, source: Path, entries: list[FileEntry], ranks: list[int]
              ) -> None:
        """Send each file of `entries` (read from `source`) to every rank in `ranks`."""
        for entry in entries:
            data = np.fromfile(source / entry.path, dtype=np.uint8)
            header = GlobalFile(ckpt, entry.path, entry.size, entry.checksum)
            self.keep(ckpt, entry, data)
            for rank in ranks:
                self.send_header(rank, header)
                request = self.comm.Isend([data, MPI.BYTE], rank, Tag.GLOBAL_DATA)
                self._outgoing.append((request, data, rank, self._deadline()))

    def on_header(self, source: int, header: GlobalFile) -> None:
        buffer = np.empty(header.size, dtype=np.uint8)
        request = self.comm.Irecv([buffer, MPI.BYTE], source, Tag.GLOBAL_DATA)
        self._incoming.append((request, buffer, source, self._deadline(), header))

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def poll(self) -> list[GlobalFile]:
        """Complete what arrived; return the headers of files now in the journal."""
        now = time.monotonic()
        self._outgoing = [t for t in self._outgoing
                          if not t[0].Test() and not self._expired(t[:4], now, "to")]
        self._abandoned = [(r, d) for r, d in self._abandoned if not r.Test()]
        done, waiting = [], []
        for request, buffer, source, deadline, header in self._incoming:
            if not request.Test():
                if not self._expired((request, buffer, source, deadline), now, "from",
                                     f" ({header.ckpt}/{header.path})"):
                    waiting.append((request, buffer, source, deadline, header))
                continue
            entry = FileEntry(header.path, header.size, 0o644, header.checksum)
            if _checksum(buffer) != entry.checksum:
                log.error("global file %s of %s: checksum mismatch", entry.path, header.ckpt)
                continue
            self.keep(header.ckpt, entry, buffer)
            done.append(header)
        self._incoming = waiting
        return done

    def _expired(self, transfer: tuple[Any, np.ndarray, int, float], now: float,
                 direction: str, what: str = "") -> bool:
        request, buffer, rank, deadline = transfer
        if now < deadline:
            return False
        log.error("global file transfer %s rank %d%s: not complete within %.0fs; cancelled",
                  direction, rank, what, self.timeout)
        request.Cancel()
        self._abandoned.append((request, buffer))
        return True

    def keep(self, ckpt: str, entry: FileEntry, data: np.ndarray) -> None:
        target = global_files_dir(self.journal, ckpt) / entry.path
        makedirs(target.parent)
        with atomic_open(target) as handle:
            handle.write(memoryview(data))

    def busy(self) -> bool:
        return bool(self._outgoing or self._incoming)


def mirror_file(source: Path, target: Path, checksum: str, mode: int) -> None:
    """Copy a kept global file into a spool, atomically, only if its checksum holds."""
    temp = temp_name(target)
    try:
        _size, found = copy_with_checksum(source, temp)
        if found != checksum:
            raise OperationError(f"{source}: checksum differs from the manifest")
        os.chmod(temp, trainer_mode(mode))
        os.replace(temp, target)
        fsync_dir(target.parent)
    finally:
        temp.unlink(missing_ok=True)


def _checksum(data: np.ndarray) -> str:
    digest = hasher()
    digest.update(memoryview(data))
    return digest.hexdigest()
