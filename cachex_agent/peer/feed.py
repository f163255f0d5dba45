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

A piece may also be a view of a mapping of the linked file under a read lease
(mapped.py), given unhashed with the file's `RunningHash`: the main thread hashes it as
it Puts it (window.py: each MiB just before its Put, which then reads it from the cache),
so the owner goes over those bytes once. One of the feed's buffers stays with such a
piece only as the count of pieces in flight. `serve` hands it out only while its lease is
`held` (once a trainer waits to write the file, the piece is read from the file instead)
and only where the hash has got to (`running.end`): the hash stays in the file's order.
Before the capture lets go of a lease it calls `settle`: the pieces not yet served are
taken back and the one being Put is waited for, so no mapping is touched after its lease
is gone, and `running.end` then says how far the Puts hashed; the capture hashes the rest.

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
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..checksum import RunningHash

#: how long the capture waits for a buffer before it hashes on without the feed (the
#: main thread Puts a piece in a few ms; longer means the replication is behind)
WAIT = 0.1
READ, WAIT_FOR_IT = "read", "wait"
#: how often `settle` looks whether the lease it waits on is broken
LOOK = 0.005


class Lease(Protocol):
    def held(self) -> bool: ...


@dataclass
class Piece:
    """A piece the capture gave: Put `data`, hashing it into `running` if that is set."""
    data: np.ndarray            # the buffer's first bytes, or a mapped view
    buffer: np.ndarray          # the feed's buffer it counts against
    offset: int = 0
    lease: Lease | None = None  # a mapped view's: touch it only while held
    running: RunningHash | None = None  # unhashed: the Put hashes it (in the file's order)


class Feed:
    """The buffers between the capture thread and the main thread (see the module)."""

    def __init__(self, piece: int, count: int = 2, wait: float = WAIT,
                 wake: Callable[[], None] = lambda: None) -> None:
        """`piece`: bytes per buffer (the slot); `wake`: ends the main loop's sleep."""
        self.piece, self.wait, self.wake = piece, wait, wake
        self._free = [np.empty(piece, dtype=np.uint8) for _ in range(count)]
        self._ready: dict[tuple[int, int], Piece] = {}
        self._lent: dict[int, Piece] = {}       # by id, served until released
        self._progress = 0.0                    # when a piece was last Put
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

    def give(self, file: int, offset: int, buffer: np.ndarray, length: int,
             mapped: np.ndarray | None = None, lease: Lease | None = None,
             running: RunningHash | None = None) -> None:
        """`buffer[:length]` holds bytes [offset, offset+length) of file `file`, hashed;
        or `mapped` does, a view under `lease` (`buffer` then only counts the piece),
        hashed by its Put into `running` if given."""
        data = buffer[:length] if mapped is None else mapped
        with self._cond:
            if self._feeding:
                self._ready[(file, offset)] = Piece(data, buffer, offset, lease, running)
            else:
                self._free.append(buffer)
        self.wake()

    def stop(self) -> None:
        """The capture of this part feeds nothing more (it ended, failed or gave up)."""
        with self._cond:
            self._feeding = False
        self.wake()

    def settle(self, lease: Lease, wait: float = 0.0) -> None:
        """No piece under `lease` is out once this returns (let go of the lease then):
        they are waited for while the lease is held and a piece was Put within `wait`,
        then those not served are taken back (the replication reads them from the file)
        and the one being Put is waited for (the main thread's Put of one piece)."""
        began = time.monotonic()
        with self._cond:
            while (self._out(lease) and lease.held()
                   and (left := max(began, self._progress) + wait - time.monotonic()) > 0):
                self._cond.wait(min(left, LOOK))
            for key in [k for k, p in self._ready.items() if p.lease is lease]:
                self._free.append(self._ready.pop(key).buffer)
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._out(lease))

    def _out(self, lease: Lease) -> bool:
        return any(p.lease is lease for p in (*self._ready.values(), *self._lent.values()))

    # --------------------------------------------------------------- main thread
    def serve(self, ckpt: str, file: int, offset: int, length: int, pending: bool
              ) -> Piece | str:
        """That piece (Put it, hashing it into its `running` if set, then `release`), or
        READ (read it from the file: never fed, the feed stopped, or a trainer waits to
        write the mapped file) or WAIT_FOR_IT (`pending`: the capture is still hashing
        that file, and feeding)."""
        with self._cond:
            if ckpt == self._ckpt:
                piece = self._ready.pop((file, offset), None)
                if piece is not None and self._servable(piece, length):
                    self.served += 1
                    self._lent[id(piece)] = piece
                    return piece
                if piece is not None:
                    self._free.append(piece.buffer)
                    self._cond.notify_all()
                elif pending and self._feeding:
                    return WAIT_FOR_IT
        return READ

    @staticmethod
    def _servable(piece: Piece, length: int) -> bool:
        return (piece.data.nbytes == length
                and (piece.lease is None or piece.lease.held())
                and (piece.running is None or piece.running.end == piece.offset))

    def release(self, piece: Piece) -> None:
        """A piece from `serve` was Put: its buffer may be filled again."""
        with self._cond:
            self._free.append(self._lent.pop(id(piece)).buffer)
            self._progress = time.monotonic()
            self._cond.notify_all()

    def drop(self, ckpt: str) -> None:
        """The replication of `ckpt` will take no more pieces (ended, abandoned)."""
        with self._cond:
            if ckpt == self._ckpt:
                self._reclaim()
                self._feeding = False
                self._cond.notify_all()

    def _reclaim(self) -> None:
        self._free.extend(piece.buffer for piece in self._ready.values())
        self._ready.clear()
