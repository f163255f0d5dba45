"""One read of a linked file for both its checksum and its replication.

A file captured by hard link is still the trainer's inode, so it is read, never mapped
(a mapping the trainer truncated would end the agent with SIGBUS). Without a feed it is
read twice: by the capture thread for its checksum, then by the replication into its
send buffer. With one, the capture thread reads each piece of `peer.slot` bytes into one
of the feed's buffers, hashes it there and hands it on (`give`), and the main thread
Puts that buffer into the partner's window (`serve`, then `release`): the owner reads
every byte once, and a file's first slot leaves as soon as it is hashed, not after the
whole file.

The capture never waits long on the feed. When no buffer comes back within `wait` (a
slow or dead partner), it stops feeding that part and hashes the rest in its own
buffer; the replication then reads what the feed did not bring from the file itself, as
it does for a part whose capture fed nothing. One part is fed at a time (captures run
one after another): `begin` takes back whatever an earlier part left unsent. The feed
serves one partner (`peer.copies = 1`): with several, the buffers would wait for the
slowest of them.

The time the capture spends waiting for a buffer (`waited`) is the replication's, not
the capture's: with the feed the two move at the pace of the slower, and the model must
not take a replication that holds the capture back for a slow capture (it would then
see no gain in the direct path, whose capture nothing holds back). The capture reports
its duration without it, and the replication's duration counts it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

#: how long the capture waits for a buffer before it hashes on without the feed (the
#: main thread Puts a piece in a few ms; longer means the replication is behind)
WAIT = 0.1
READ, WAIT_FOR_IT = "read", "wait"


class Feed:
    """The buffers between the capture thread and the main thread (see the module)."""

    def __init__(self, piece: int, count: int = 2, wait: float = WAIT,
                 wake: Callable[[], None] = lambda: None) -> None:
        """`piece`: bytes per buffer (the slot); `wake`: ends the main loop's sleep."""
        self.piece, self.wait, self.wake = piece, wait, wake
        self._free = [np.empty(piece, dtype=np.uint8) for _ in range(count)]
        self._ready: dict[tuple[int, int], np.ndarray] = {}
        self._ckpt: str | None = None
        self._feeding = False
        self._cond = threading.Condition()
        self.served = 0     # pieces the replication took from the feed (not read again)
        self.waited = 0.0   # seconds this part's capture waited for a buffer

    # ------------------------------------------------------------ capture thread
    def begin(self, ckpt: str) -> None:
        """A capture (attempt) of `ckpt` starts: earlier parts' unsent pieces come back."""
        with self._cond:
            self._reclaim()
            self._ckpt, self._feeding, self.waited = ckpt, True, 0.0

    def take(self) -> np.ndarray | None:
        """A buffer to read the next piece into; None once the feed has stopped for this
        part (no buffer came back within `wait`: hash on without it)."""
        with self._cond:
            if self._feeding and not self._free:
                began = time.monotonic()
                if not self._cond.wait_for(lambda: self._free, self.wait):
                    self._feeding = False
                self.waited += time.monotonic() - began
            buffer = self._free.pop() if self._feeding else None
        if buffer is None:
            self.wake()     # a replication waiting for the next piece reads it itself
        return buffer

    def give(self, file: int, offset: int, buffer: np.ndarray, length: int) -> None:
        """`buffer[:length]` holds bytes [offset, offset+length) of file `file`, hashed."""
        with self._cond:
            if self._feeding:
                self._ready[(file, offset)] = buffer[:length]
            else:
                self._free.append(buffer)
        self.wake()

    def stop(self) -> None:
        """The capture of this part feeds nothing more (it ended, failed or gave up)."""
        with self._cond:
            self._feeding = False
        self.wake()

    # --------------------------------------------------------------- main thread
    def serve(self, ckpt: str, file: int, offset: int, length: int, pending: bool
              ) -> np.ndarray | str:
        """The fed bytes of that piece (Put them, then `release`), or READ (read it from
        the file: never fed, or the feed stopped) or WAIT_FOR_IT (`pending`: the capture
        is still hashing that file, and feeding)."""
        with self._cond:
            if ckpt == self._ckpt:
                data = self._ready.pop((file, offset), None)
                if data is not None and data.nbytes == length:
                    self.served += 1
                    return data
                if data is not None:
                    self._free.append(data.base if data.base is not None else data)
                    self._cond.notify()
                elif pending and self._feeding:
                    return WAIT_FOR_IT
        return READ

    def release(self, data: np.ndarray) -> None:
        """A piece from `serve` was Put: its buffer may be filled again."""
        with self._cond:
            self._free.append(data.base if data.base is not None else data)
            self._cond.notify()

    def drop(self, ckpt: str) -> None:
        """The replication of `ckpt` will take no more pieces (ended, abandoned)."""
        with self._cond:
            if ckpt == self._ckpt:
                self._reclaim()
                self._feeding = False
                self._cond.notify_all()

    def _reclaim(self) -> None:
        for data in self._ready.values():
            self._free.append(data.base if data.base is not None else data)
        self._ready.clear()
