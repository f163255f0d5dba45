"""Rebuild lost members of an erasure group from the survivors' data and parity.

The group's communicator has one rank per member, in member order; the ranks of the lost
members are their replacements (an empty cache, the same place in the group). One
survivor's parity manifest, broadcast, says everything: the code, the chunk length,
every part's files and the checksum of every chunk. For each data chunk of each lost
member, the survivors holding K symbols of its codeword (erasure.Scheme.survivors) send
them segment by segment, as numpy buffers; the replacement decodes the chunk, checks it
against the manifest, and writes it into the lost part's files, which are renamed into
place only after each file's checksum matches its local manifest entry.

More lost members than the code tolerates (M) is refused by every rank alike, before any
transfer, naming the group and the lost nodes: the caller takes the checkpoint from the
PFS or an older one. After a rebuild the replacement holds no parity: encode the group
again (peer/encode_exchange.py).
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import file_checksum, hasher
from ..collective import agree, wait
from ..errors import OperationError, describe
from ..fsutil import commit_rename, create_file, makedirs, temp_name, trainer_mode
from ..manifest import FileEntry, LocalManifest
from ..peer.encode_exchange import SEGMENT
from ..peer.erasure import PartReader, PartWriter, Scheme, segments
from ..peer.parity import ParityManifest

REBUILD_TAG = 1300          # + codeword
IN_FLIGHT = 4               # segments a survivor has on the wire at once


def rebuild_parts(comm: Any, lost: list[int], root: Path, source: Path | None, dest: Path,
                  ckpt: str, timeout: float, segment: int = SEGMENT,
                  trainer_modes: bool = False) -> LocalManifest | None:
    """Rebuild the parts of the members `lost` (ranks of `comm`, the same list on every
    rank). A survivor serves from its parity store `root` and its part's files under
    `source`; a lost member's replacement writes its part's files under `dest` and gets
    its local manifest back (None on survivors). `trainer_modes`: the files get the
    trainer's permission bits (a spool), else stay private (a stage)."""
    me, lost_set = comm.Get_rank(), set(lost)
    step = f"erasure rebuild of {ckpt}"
    held = agree(comm, f"{step} (parity manifests)",
                 lambda: None if me in lost_set else ParityManifest.load(root, ckpt), timeout)
    first = min(set(range(comm.Get_size())) - lost_set, default=None)
    if first is None:
        raise OperationError(f"{step}: every member of the group is lost")
    manifest = ParityManifest.from_json(
        comm.bcast(held.to_json() if me == first else None, root=first), f"{step} manifest")
    _check_tolerated(manifest, lost_set, comm.Get_size())
    code = manifest.code
    if me in lost_set:
        return agree(comm, step, lambda: _Target(comm, manifest, lost_set, segment, timeout,
                                                 step).run(dest, trainer_modes), timeout)
    agree(comm, step, lambda: _serve(comm, manifest, code, lost_set, root, source, segment,
                                     timeout, step), timeout)
    return None


def _check_tolerated(manifest: ParityManifest, lost: set[int], size: int) -> None:
    if size != manifest.k + manifest.m:
        raise OperationError(f"erasure group of nodes {manifest.group}: {size} ranks, the"
                             f" group has {manifest.k + manifest.m} members")
    if len(lost) > manifest.m:
        nodes = ", ".join(str(manifest.group[i]) for i in sorted(lost))
        raise OperationError(f"erasure group of nodes {manifest.group} ({manifest.scheme})"
                             f" lost nodes {nodes}: it rebuilds at most {manifest.m};"
                             f" take {manifest.ckpt} from the PFS or an older checkpoint")


def _symbol_plan(code: Scheme, lost: set[int]) -> list[tuple[int, int, int, list[int]]]:
    """(lost member, its chunk, codeword, the K positions to decode from), in the order
    every rank walks them."""
    plan = []
    for member in sorted(lost):
        for j in range(code.k):
            codeword = code.codeword_of_chunk(member, j)
            plan.append((member, j, codeword, code.survivors(codeword, lost)))
    return plan


def _serve(comm: Any, manifest: ParityManifest, code: Scheme, lost: set[int], root: Path,
           source: Path | None, segment: int, timeout: float, step: str) -> None:
    """Send each symbol this survivor holds of every codeword a lost member needs."""
    me, chunk = comm.Get_rank(), manifest.chunk
    size = min(segment, chunk) or 1
    pool = [np.empty(size, np.uint8) for _ in range(IN_FLIGHT)]
    flight: deque[Any] = deque()
    sent = 0
    problems: list[str] = []
    with PartReader(source or Path("."), manifest.parts[me].files) as reader:
        for member, _j, codeword, positions in _symbol_plan(code, lost):
            mine = [p for p in positions if code.holder(codeword, p) == me]
            if not mine:
                continue
            symbol = _symbol_reader(manifest, me, root, reader, codeword, mine[0])
            try:
                for offset, length in segments(chunk, segment):
                    if len(flight) == IN_FLIGHT:
                        wait(flight.popleft(), timeout, step)
                    piece = pool[sent % IN_FLIGHT][:length]
                    sent += 1
                    _read_or_zeros(symbol, offset, piece, problems)
                    flight.append(comm.Isend([piece, MPI.BYTE], member,
                                             REBUILD_TAG + codeword))
            finally:
                symbol.close()
    while flight:
        wait(flight.popleft(), timeout, step)
    if problems:
        raise OperationError(f"{step}: {problems[0]}")


def _read_or_zeros(symbol: PartReader | _Shifted, offset: int, out: np.ndarray,
                   problems: list[str]) -> None:
    """A symbol this survivor cannot read is sent as zeros, so every stream stays in
    step and ends; the survivor and the replacement (its checksum) then both fail."""
    try:
        symbol.read_into(offset, out)
    except (OSError, OperationError) as exc:
        out[:] = 0
        if not problems:
            problems.append(describe(exc))


def _symbol_reader(manifest: ParityManifest, me: int, root: Path, reader: PartReader,
                   codeword: int, position: int) -> PartReader | _Shifted:
    """A reader of one symbol's bytes, from offset 0 of the symbol: a data chunk of this
    member's (`me`) part, or one of its parity chunks (a part of one file). The manifest
    is another member's: its `member` is not `me`."""
    if position < manifest.k:
        return _Shifted(reader, position * manifest.chunk)
    slot = next(slot for slot, (c, _) in enumerate(manifest.code.parities_of(me))
                if c == codeword)
    path = manifest.parity_path(root, me, slot)
    return PartReader(path.parent, [FileEntry(path.name, manifest.chunk, 0, "")])


class _Shifted:
    """A part reader seen from one chunk's start."""

    def __init__(self, reader: PartReader, start: int) -> None:
        self.reader, self.start = reader, start

    def read_into(self, offset: int, out: np.ndarray) -> None:
        self.reader.read_into(self.start + offset, out)

    def close(self) -> None:
        """The part's reader is closed by its owner."""


class _Target:
    """A lost member's replacement: receives K symbols per segment, decodes, writes."""

    def __init__(self, comm: Any, manifest: ParityManifest, lost: set[int], segment: int,
                 timeout: float, step: str) -> None:
        self.comm, self.manifest, self.lost = comm, manifest, lost
        self.me, self.code = comm.Get_rank(), manifest.code
        self.rounds = segments(manifest.chunk, segment)
        size = min(segment, manifest.chunk) or 1
        self.buffers = [[np.empty(size, np.uint8) for _ in range(self.code.k)]
                        for _ in range(2)]
        self.timeout, self.step = timeout, step
        self.part = manifest.parts[self.me]

    def run(self, dest: Path, trainer_modes: bool) -> LocalManifest:
        finals = [dest / entry.path for entry in self.part.files]
        for final in finals:
            makedirs(final.parent)
        temps = [temp_name(final) for final in finals]
        fds = [create_file(temp) for temp in temps]
        try:
            writer = PartWriter(fds, self.part.files)
            # every chunk is received even after one mismatched: the survivors' streams
            # end instead of waiting for the timeout
            bad = [j for member, j, codeword, positions in _symbol_plan(self.code, self.lost)
                   if member == self.me and not self._chunk(writer, j, codeword, positions)]
            if bad:
                raise OperationError(
                    f"{self.step}: data chunk{'s' if len(bad) > 1 else ''}"
                    f" {', '.join(map(str, bad))} of node {self.manifest.group[self.me]}"
                    " decode to other bytes than were encoded (a survivor's data or parity"
                    " changed)")
            for fd in fds:
                os.fsync(fd)
        except BaseException:
            for temp in temps:
                temp.unlink(missing_ok=True)
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self._place(temps, finals, trainer_modes)
        return self.part

    def _chunk(self, writer: PartWriter, j: int, codeword: int, positions: list[int]
               ) -> bool:
        """Receive, decode and write data chunk `j`; True if it matches its checksum."""
        digest = hasher()
        chunk = self.manifest.chunk
        posted = self._post(0, codeword, positions) if self.rounds else []
        for turn, (offset, length) in enumerate(self.rounds):
            current = posted
            if turn + 1 < len(self.rounds):
                posted = self._post(turn + 1, codeword, positions)
            for request in current:
                wait(request, self.timeout, self.step)
            symbols = [buffer[:length] for buffer in self.buffers[turn % 2]]
            data = self.code.decode(symbols, positions)[j]
            digest.update(data)
            writer.write(j * chunk + offset, data)
        return digest.hexdigest() == self.manifest.chunks[self.me][j]

    def _post(self, turn: int, codeword: int, positions: list[int]) -> list[Any]:
        length = self.rounds[turn][1]
        buffers = self.buffers[turn % 2]
        return [self.comm.Irecv([buffers[i][:length], MPI.BYTE], self.code.holder(codeword, p),
                                REBUILD_TAG + codeword) for i, p in enumerate(positions)]

    def _place(self, temps: list[Path], finals: list[Path], trainer_modes: bool) -> None:
        """Each file is checked against its local manifest entry before it is renamed."""
        for temp, final, entry in zip(temps, finals, self.part.files, strict=True):
            if file_checksum(temp) != entry.checksum:
                for leftover in temps:
                    leftover.unlink(missing_ok=True)
                raise OperationError(f"{self.step}: rebuilt {entry.path} does not match"
                                     " its checksum")
            if trainer_modes:
                os.chmod(temp, trainer_mode(entry.mode))
            commit_rename(temp, final)
