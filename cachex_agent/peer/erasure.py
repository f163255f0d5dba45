"""Erasure coding of a group's parts: the layout, XOR and Reed-Solomon. Pure, no MPI.

A group has n = K + M members. Member i's part is its staged files concatenated in
manifest order, padded with zeros to `padded_length` (the group's largest part rounded up
to a multiple of K) and cut into K chunks of `chunk_length` bytes. Codewords rotate, as
in SCR's XOR sets generalised to Reed-Solomon: codeword c (c = 0..n-1) has n symbols at
positions p = 0..n-1, position p on member (c + p) mod n; positions p < K are data chunk p
of that member, positions p >= K parity chunk p - K, which that member stores. Every
member so contributes each of its K chunks to one codeword and stores M parity chunks of
L/K bytes (the storage is M/K of the part), and M lost members lose at most M symbols of
any codeword, which the K others decode.

Encoding and decoding work on segments of the chunks (`peer/encode_exchange.py`,
`recovery/erasure_rebuild.py` choose the size): memory is a few segments, never a part.
XOR is numpy over uint64 words; Reed-Solomon is zfec (systematic: its primary blocks are
the data, so only the parities are computed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import OperationError
from ..manifest import FileEntry

DATA, PARITY = "data", "parity"


@dataclass(frozen=True)
class Scheme:
    """One group's code: K data symbols and M parities per codeword."""

    k: int
    m: int

    @property
    def n(self) -> int:
        return self.k + self.m

    @property
    def name(self) -> str:
        return "xor" if self.m == 1 else f"rs:{self.k}+{self.m}"

    # ------------------------------------------------------------------ layout
    def holder(self, codeword: int, position: int) -> int:
        """The member holding symbol `position` of `codeword`."""
        return (codeword + position) % self.n

    def position(self, member: int, codeword: int) -> int:
        """Where `member`'s symbol sits in `codeword`."""
        return (member - codeword) % self.n

    def symbol(self, codeword: int, position: int) -> tuple[int, str, int]:
        """(member, DATA or PARITY, chunk or parity index) of one symbol."""
        member = self.holder(codeword, position)
        if position < self.k:
            return member, DATA, position
        return member, PARITY, position - self.k

    def codeword_of_chunk(self, member: int, chunk: int) -> int:
        """The codeword that data chunk `chunk` of `member` belongs to."""
        return (member - chunk) % self.n

    def parities_of(self, member: int) -> list[tuple[int, int]]:
        """(codeword, parity index) of the M parity chunks `member` stores."""
        return [((member - p) % self.n, p - self.k) for p in range(self.k, self.n)]

    def parity_holders(self, codeword: int) -> list[int]:
        return [self.holder(codeword, p) for p in range(self.k, self.n)]

    def contributors(self, codeword: int) -> list[int]:
        """The members whose data chunks 0..K-1 make up `codeword`."""
        return [self.holder(codeword, p) for p in range(self.k)]

    def survivors(self, codeword: int, lost: set[int]) -> list[int]:
        """K positions of `codeword` held by members not in `lost`, data before parity
        (zfec decodes faster the more primary blocks it gets). Raises when fewer than K
        remain."""
        alive = [p for p in range(self.n) if self.holder(codeword, p) not in lost]
        if len(alive) < self.k:
            raise OperationError(f"codeword {codeword}: {len(alive)} of {self.n} symbols"
                                 f" survive, {self.k} are needed")
        return alive[:self.k]

    # ----------------------------------------------------------------- coding
    def encode(self, data: Sequence[np.ndarray], parities: Sequence[int] | None = None
               ) -> list[np.ndarray]:
        """Parity segments `parities` (default: all M) of K equal-length data segments.
        A member holds one parity of a codeword: computing only that one saves M-1."""
        wanted = range(self.m) if parities is None else parities
        if self.m == 1:
            return [_xor(data) for _ in wanted]
        blocks = _rs_encoder(self.k, self.n).encode(list(data), [self.k + q for q in wanted])
        return [np.frombuffer(block, np.uint8) for block in blocks]

    def decode(self, symbols: Sequence[np.ndarray], positions: Sequence[int]) -> list[np.ndarray]:
        """The K data segments of a codeword from K of its segments at `positions`."""
        if len(positions) != self.k or len(set(positions)) != self.k:
            raise ValueError(f"decode needs {self.k} distinct positions, got {positions}")
        if self.m == 1:
            return _xor_decode(symbols, positions, self.k)
        blocks = _rs_decoder(self.k, self.n).decode(list(symbols), list(positions))
        return [np.frombuffer(block, np.uint8) for block in blocks]


def scheme_of(name: str, members: int) -> Scheme:
    """The code of a group of `members` nodes under `peer.scheme` `name` (groups.shape
    says how leftovers raise K)."""
    if name == "xor":
        return Scheme(members - 1, 1)
    if name.startswith("rs:"):
        m = int(name.split("+")[1])
        return Scheme(members - m, m)
    raise ValueError(f"{name!r} is not an erasure scheme")


def chunk_length(largest_part: int, k: int) -> int:
    """Bytes of one chunk: the largest part of the group, rounded up, over K."""
    return -(-largest_part // k)


def segments(chunk: int, segment: int) -> list[tuple[int, int]]:
    """(offset, length) of the segments a chunk is processed in."""
    return [(start, min(segment, chunk - start)) for start in range(0, chunk, segment)]


def _xor(data: Sequence[np.ndarray]) -> np.ndarray:
    out = np.array(data[0], copy=True)
    words = _words(out)
    for segment in data[1:]:
        np.bitwise_xor(words, _words(segment), out=words)
    return out


def _words(array: np.ndarray) -> np.ndarray:
    """A uint64 view when the length allows it (8x fewer operations), else the bytes."""
    return array.view(np.uint64) if array.nbytes % 8 == 0 else array


def _xor_decode(symbols: Sequence[np.ndarray], positions: Sequence[int], k: int
                ) -> list[np.ndarray]:
    """With one parity, the one missing data symbol is the XOR of the K others."""
    by_position = dict(zip(positions, symbols, strict=True))
    missing = [p for p in range(k) if p not in by_position]
    if missing:
        by_position[missing[0]] = _xor(symbols)
    return [np.asarray(by_position[p]) for p in range(k)]


_CODERS: dict[tuple[str, int, int], object] = {}


def _rs_encoder(k: int, n: int):  # noqa: ANN202 (zfec has no type stubs)
    return _coder("encoder", k, n)


def _rs_decoder(k: int, n: int):  # noqa: ANN202
    return _coder("decoder", k, n)


def _coder(kind: str, k: int, n: int):  # noqa: ANN202
    """zfec keeps a table per (k, n): build it once per process."""
    key = (kind, k, n)
    if key not in _CODERS:
        import zfec
        _CODERS[key] = (zfec.Encoder if kind == "encoder" else zfec.Decoder)(k, n)
    return _CODERS[key]


# --------------------------------------------------------------------- parts
class PartReader:
    """Reads byte ranges of a part: its files concatenated in manifest order, zeros past
    the end (the padding to K chunks)."""

    def __init__(self, directory: Path, files: Sequence[FileEntry]) -> None:
        self.files = list(files)
        self.starts = np.cumsum([0] + [e.size for e in self.files]).tolist()
        self.size = self.starts[-1]
        self.fds: list[int | None] = [None] * len(self.files)
        self.directory = directory

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill `out` with the part's bytes from `offset`."""
        for index, start, end in self._overlapping(offset, out.nbytes):
            begin = max(offset, start)
            stop = min(offset + out.nbytes, end)
            self._pread(index, begin - start, out[begin - offset:stop - offset])
        if offset + out.nbytes > self.size:
            out[max(0, self.size - offset):] = 0

    def _overlapping(self, offset: int, length: int) -> list[tuple[int, int, int]]:
        return [(i, self.starts[i], self.starts[i + 1]) for i in range(len(self.files))
                if self.starts[i] < offset + length and self.starts[i + 1] > offset]

    def _pread(self, index: int, at: int, out: np.ndarray) -> None:
        fd = self.fds[index]
        if fd is None:
            fd = self.fds[index] = os.open(self.directory / self.files[index].path, os.O_RDONLY)
        view = memoryview(out).cast("B")
        while view:
            n = os.preadv(fd, [view], at)
            if n == 0:
                raise OperationError(f"{self.directory / self.files[index].path}: shorter"
                                     f" than its manifest's {self.files[index].size} bytes")
            view, at = view[n:], at + n

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.fds = [None] * len(self.files)

    def __enter__(self) -> PartReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PartWriter:
    """Writes byte ranges of a part into its files (open by the caller, in manifest
    order); the padding past the part's end is dropped."""

    def __init__(self, fds: Sequence[int], files: Sequence[FileEntry]) -> None:
        self.fds = list(fds)
        self.starts = np.cumsum([0] + [e.size for e in files]).tolist()

    def write(self, offset: int, data: np.ndarray) -> None:
        length = data.nbytes
        for index, fd in enumerate(self.fds):
            start, end = self.starts[index], self.starts[index + 1]
            begin, stop = max(offset, start), min(offset + length, end)
            if begin < stop:
                pwrite_all(fd, data[begin - offset:stop - offset], begin - start)


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """os.pwrite until every byte of `data` is at `offset` (it may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
