"""One owner class for the agent's receive window (MPI one-sided RMA).

Every agent exposes `regions x slots x slot` bytes: one region per owner that replicates
to it, `slots` slots each. Owners `put` into a partner's slot with `Put` + `Flush`
inside one passive-target epoch opened at construction (`Lock_all`): per-transfer
`Lock`/`Unlock` would wait for the partner to enter MPI (MPICH progresses passive-target
RMA at the target only inside the target's MPI calls). Signals (slot full, slot free)
are small two-sided messages, so no software atomics are needed.

Collective: construct and `free()` on every rank of the communicator, in the same order.
Construction first checks, on every rank, that the memory can be had: a rank that cannot
allocate inside the collective `Allocate` would leave the others waiting in it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import COPY_CHUNK, RunningHash
from ..collective import agree
from ..errors import OperationError


class ReceiveWindow:
    def __init__(self, comm: Any, regions: int, slots: int, slot: int) -> None:
        self.slots, self.slot = slots, slot
        size = max(regions, 0) * slots * slot
        agree(comm, "receive window", lambda: _check_memory(size))
        self.win = MPI.Win.Allocate(max(size, 1), disp_unit=1, comm=comm)
        self.memory = np.frombuffer(self.win.tomemory(), dtype=np.uint8)[:size]
        self.win.Lock_all()
        self._open = True

    def displacement(self, region: int, slot: int) -> int:
        return (region * self.slots + slot) * self.slot

    def put(self, data: np.ndarray, target: int, region: int, slot: int,
            running: RunningHash | None = None) -> None:
        """Copy `data` (<= one slot) into the target's slot; complete at the target on
        return. `running`: also hash `data` into it, each COPY_CHUNK just before it is
        Put, so that the Put reads it from the cache the hash brought it into (hash and
        copy cost about one pass over memory, where a hash now and a Put later cost two)."""
        self._check()
        count, at = data.nbytes, self.displacement(region, slot)
        if running is None:
            self.win.Put([data, count, MPI.BYTE], target, [at, count, MPI.BYTE])
        else:
            for start in range(0, count, COPY_CHUNK):
                chunk = data[start:start + COPY_CHUNK]
                running.update(chunk)
                self.win.Put([chunk, chunk.nbytes, MPI.BYTE], target,
                             [at + start, chunk.nbytes, MPI.BYTE])
        self.win.Flush(target)

    def view(self, region: int, slot: int, length: int) -> memoryview:
        """A local slot's bytes; call `sync()` first after hearing that it was filled."""
        self._check()
        start = self.displacement(region, slot)
        return memoryview(self.memory[start:start + length])

    def sync(self) -> None:
        """Make remote Puts visible to this process's loads (separate/unified models)."""
        self._check()
        self.win.Sync()

    def free(self) -> None:
        """Collective. Later use is an error."""
        if self._open:
            self._open = False
            self.win.Unlock_all()
            self.win.Free()

    def _check(self) -> None:
        if not self._open:
            raise RuntimeError("the receive window was freed")


def _check_memory(size: int) -> None:
    """Take and give back the window's memory outside the collective call."""
    try:
        MPI.Free_mem(MPI.Alloc_mem(max(size, 1)))
    except (MPI.Exception, MemoryError, OverflowError) as exc:
        raise OperationError(f"cannot allocate the receive window ({size} bytes):"
                             f" {exc}") from None
