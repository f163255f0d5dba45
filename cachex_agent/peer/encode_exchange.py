"""Encode a group's parts over MPI: each member ends up holding its M parity chunks.

The group's communicator has one rank per member, in member order (groups.py). The
members first share their local manifests (small, pickled) to agree on the chunk length;
then, segment by segment, every member reads its K data chunks' segments from its staged
files and sends each, as a numpy buffer (Isend, never pickled), to the M members that hold
a parity of its codeword; every member receives the K data segments of each codeword it
holds a parity of and computes that parity (erasure.Scheme.encode). The receives of the
next segment are posted before the current one is encoded, and two sets of buffers
alternate, so transfer and encoding overlap; memory is 2 x (K + K x M) segments.

Traffic: each member sends M x its padded part (XOR: one part, as a full copy does) and
stores M/K of it. Every wait has a deadline (`timeout`, as agent.timeout bounds every
other wait for a peer). Parity chunks are written to temporaries, renamed once every
member succeeded (collective.agree), and the parity manifest last.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import hasher
from ..collective import agree, arrive, wait
from ..errors import OperationError, describe
from ..fsutil import commit_rename, create_file, fsync_dir, makedirs, temp_name
from ..layout import parity_chunk_path, parity_dir, parity_manifest_path
from ..manifest import LocalManifest
from .erasure import PartReader, Scheme, chunk_length, pwrite_all, scheme_of, segments
from .parity import ParityManifest

ENCODE_TAG = 1000           # + codeword: a pair of members can share several codewords
SEGMENT = 1024 * 1024       # bytes of a chunk encoded at once


def encode_part(comm: Any, group: list[int], scheme: str, manifest: LocalManifest,
                source: Path, root: Path, timeout: float, segment: int = SEGMENT
                ) -> ParityManifest:
    """Encode this member's part (`manifest`'s files under `source`) with the group on
    `comm`; write the parity chunks this member holds and its parity manifest under
    `root` (NodePaths.parity). Every member raises the same error if any fails."""
    step = f"erasure encode of {manifest.ckpt}"
    arrive(comm, step, timeout)
    parts = [LocalManifest.from_json(p, f"member {i}'s manifest")
             for i, p in enumerate(comm.allgather(manifest.to_json()))]
    code = scheme_of(scheme, comm.Get_size())
    chunk = chunk_length(max(p.bytes for p in parts), code.k)
    _forget(root, manifest.ckpt)
    exchange = _Exchange(comm, code, chunk, segment, timeout, step)
    temps, sums, parity_sums = agree(
        comm, step, lambda: exchange.run(manifest, source, root), timeout)
    every = comm.allgather((sums, parity_sums))     # everyone arrived at agree: no wait
    for temp, final in temps:
        commit_rename(temp, final)
    result = ParityManifest(
        ckpt=manifest.ckpt, scheme=code.name, k=code.k, m=code.m, chunk=chunk,
        member=comm.Get_rank(), group=list(group), parts=parts,
        chunks=[s for s, _ in every], parity=[p for _, p in every])
    result.save(root)
    return result


def _forget(root: Path, ckpt: str) -> None:
    """A manifest of an earlier encoding must not describe the chunks about to replace
    its own: it goes first."""
    path = parity_manifest_path(root, ckpt)
    if path.exists():
        path.unlink()
        fsync_dir(path.parent)


class _Exchange:
    """One member's side of the segment loop."""

    def __init__(self, comm: Any, code: Scheme, chunk: int, segment: int, timeout: float,
                 step: str) -> None:
        self.comm, self.code, self.chunk, self.timeout = comm, code, chunk, timeout
        self.me = comm.Get_rank()
        self.name = step
        self.rounds = segments(chunk, segment)
        size = min(segment, chunk) or 1
        k, m = code.k, code.m
        # two alternating sets: my K data segments, and K for each of my M codewords
        self.send = [[np.empty(size, np.uint8) for _ in range(k)] for _ in range(2)]
        self.recv = [[[np.empty(size, np.uint8) for _ in range(k)] for _ in range(m)]
                     for _ in range(2)]
        self.sending: list[deque[Any]] = [deque(), deque()]
        self.receiving: list[list[Any]] = [[], []]
        self.mine = code.parities_of(self.me)       # (codeword, parity index)
        self.problem: str | None = None             # the first part read that failed

    def run(self, manifest: LocalManifest, source: Path, root: Path
            ) -> tuple[list[tuple[Path, Path]], list[str], list[str]]:
        finals = [parity_chunk_path(root, manifest.ckpt, c, q)
                  for c, q in self.mine]
        makedirs(parity_dir(root, manifest.ckpt))
        temps = [temp_name(final) for final in finals]
        fds = [create_file(temp) for temp in temps]
        data_sums = [hasher() for _ in range(self.code.k)]
        parity_sums = [hasher() for _ in self.mine]
        try:
            with PartReader(source, manifest.files) as reader:
                self._loop(reader, fds, data_sums, parity_sums)
        except BaseException:
            self._cancel()
            for fd, temp in zip(fds, temps, strict=True):
                _close(fd)
                temp.unlink(missing_ok=True)
            raise
        for fd in fds:
            _close(fd)
        if self.problem:
            for temp in temps:
                temp.unlink(missing_ok=True)
            raise OperationError(f"{self.name}: {self.problem}")
        return (list(zip(temps, finals, strict=True)), [d.hexdigest() for d in data_sums],
                [d.hexdigest() for d in parity_sums])

    def _loop(self, reader: PartReader, fds: list[int], data_sums: list[Any],
              parity_sums: list[Any]) -> None:
        if self.rounds:
            self._post_receives(0)
        for turn, (offset, length) in enumerate(self.rounds):
            side = turn % 2
            self._send_data(reader, side, offset, length, data_sums)
            if turn + 1 < len(self.rounds):
                self._post_receives(turn + 1)
            for request in self.receiving[side]:
                wait(request, self.timeout, self.name)
            self._encode(side, offset, length, fds, parity_sums)
        for side in (0, 1):
            self._drain(side)

    def _send_data(self, reader: PartReader, side: int, offset: int, length: int,
                   sums: list[Any]) -> None:
        self._drain(side)       # this set's sends of two rounds ago are done
        for j, buffer in enumerate(self.send[side]):
            piece = buffer[:length]
            try:
                reader.read_into(j * self.chunk + offset, piece)
            except (OSError, OperationError) as exc:
                # zeros keep every member's stream in step to its end; the encoding
                # then fails on this member, so on all (collective.agree)
                piece[:] = 0
                self.problem = self.problem or describe(exc)
            sums[j].update(piece)
            codeword = self.code.codeword_of_chunk(self.me, j)
            for holder in self.code.parity_holders(codeword):
                self.sending[side].append(self.comm.Isend([piece, MPI.BYTE], holder,
                                                          ENCODE_TAG + codeword))

    def _post_receives(self, turn: int) -> None:
        side = turn % 2
        length = self.rounds[turn][1]
        self.receiving[side] = [
            self.comm.Irecv([self.recv[side][slot][p][:length], MPI.BYTE], member,
                            ENCODE_TAG + codeword)
            for slot, (codeword, _) in enumerate(self.mine)
            for p, member in enumerate(self.code.contributors(codeword))]

    def _encode(self, side: int, offset: int, length: int, fds: list[int],
                sums: list[Any]) -> None:
        for slot, (_codeword, parity) in enumerate(self.mine):
            data = [buffer[:length] for buffer in self.recv[side][slot]]
            block = self.code.encode(data, [parity])[0]
            sums[slot].update(block)
            pwrite_all(fds[slot], block, offset)

    def _drain(self, side: int) -> None:
        while self.sending[side]:
            wait(self.sending[side].popleft(), self.timeout, self.name)

    def _cancel(self) -> None:
        for side in (0, 1):
            for request in list(self.sending[side]) + self.receiving[side]:
                if not request.Test():
                    request.Cancel()


def _close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
