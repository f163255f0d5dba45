"""The parity store of one node: what an erasure group encoded, and its check.

Every member of a group writes the same parity manifest but for `member`: the scheme,
the group's nodes, the chunk length, every member's part (its local manifest, so a lost
part can be split back into its files) with the checksum of each of its K data chunks,
and the checksum of every member's M parity chunks. Any one survivor's manifest is thus
enough to rebuild a lost member and to check any member. The manifest is written last,
after the parity chunks are durable (fsutil), and readers trust only a renamed one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checksum import ALGORITHM, COPY_CHUNK, file_problem, hasher
from ..errors import OperationError, describe
from ..fsutil import fsync_dir, read_json, remove_under, write_json
from ..layout import parity_chunk_path, parity_dir, parity_manifest_path, parity_manifest_paths
from ..manifest import LocalManifest
from ..safepath import UnsafeInput, checkpoint_id, index
from .erasure import PartReader, Scheme, segments

FORMAT = "cachex-parity-manifest"
VERSION = 1


@dataclass
class ParityManifest:
    ckpt: str
    scheme: str             # "xor" or "rs:K+M", as the group encoded it
    k: int
    m: int
    chunk: int              # bytes of one chunk (data or parity)
    member: int             # this node's place in `group`
    group: list[int]        # the members' node numbers, in member order
    parts: list[LocalManifest]      # every member's files, in member order
    chunks: list[list[str]]         # checksum of data chunk j of member i: chunks[i][j]
    parity: list[list[str]]         # checksum of parity chunk q stored by member i
    algorithm: str = ALGORITHM

    @property
    def code(self) -> Scheme:
        return Scheme(self.k, self.m)

    def parity_path(self, root: Path, member: int, slot: int) -> Path:
        """Where member `member` keeps its parity chunk number `slot` (0..M-1)."""
        codeword, index_ = self.code.parities_of(member)[slot]
        return parity_chunk_path(root, self.ckpt, codeword, index_)

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["parts"] = [part.to_json() for part in self.parts]
        return {"format": FORMAT, "version": VERSION, **data}

    @classmethod
    def from_json(cls, data: Any, source: object) -> ParityManifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT \
                or data.get("version") != VERSION:
            raise OperationError(f"{source}: not a {FORMAT} version {VERSION}")
        checkpoint_id(data.get("ckpt"), source)
        for key in ("k", "m", "chunk", "member"):
            index(data.get(key), source, key)
        parts = [LocalManifest.from_json(part, source) for part in data.get("parts") or []]
        n = data["k"] + data["m"]
        if len(parts) != n or len(data.get("group") or []) != n or data["member"] >= n:
            raise UnsafeInput(f"{source}: a group of {n} members does not match its parts")
        fields = {name: data.get(name) for name in cls.__dataclass_fields__}
        return cls(**{**fields, "parts": parts})

    def save(self, root: Path) -> None:
        write_json(parity_manifest_path(root, self.ckpt), self.to_json())

    @classmethod
    def load(cls, root: Path, ckpt: str) -> ParityManifest:
        path = parity_manifest_path(root, ckpt)
        try:
            return cls.from_json(read_json(path), path)
        except FileNotFoundError:
            raise OperationError(f"{path}: no parity manifest for {ckpt}") from None


def retain_parity(root: Path, keep: int) -> list[str]:
    """`keep.replica` for parity: the newest `keep` encoded checkpoints stay (0: all);
    each older one loses its manifest first (durably), then its chunks, so no manifest
    ever lists chunks that are gone. Returns the evicted checkpoints, oldest first."""
    held = []
    for path in parity_manifest_paths(root):
        try:
            manifest = ParityManifest.from_json(read_json(path), path)
        except (OSError, ValueError, OperationError):
            continue            # not ours to judge here: verify and recover report it
        held.append((manifest.parts[manifest.member].seq, manifest.ckpt, path))
    held.sort()
    evicted = []
    for _seq, ckpt, path in held[:-keep] if keep else []:
        path.unlink(missing_ok=True)
        fsync_dir(root)
        remove_under(root, parity_dir(root, ckpt))
        evicted.append(ckpt)
    return evicted


def chunk_checksums(reader: PartReader, chunk: int, k: int, segment: int = COPY_CHUNK
                    ) -> list[str]:
    """The checksum of each of a part's K chunks (zero padding included)."""
    buffer = np.empty(min(segment, chunk) or 1, np.uint8)
    sums = []
    for j in range(k):
        digest = hasher()
        for offset, length in segments(chunk, segment):
            reader.read_into(j * chunk + offset, buffer[:length])
            digest.update(buffer[:length])
        sums.append(digest.hexdigest())
    return sums


def check_member(root: Path, ckpt: str, source: Path | None) -> dict[str, str]:
    """Check this node's parity chunks, and its data chunks when `source` (its part's
    directory) is given, against its parity manifest: `{what: why}` of each mismatch."""
    manifest = ParityManifest.load(root, ckpt)
    me = manifest.member
    problems: dict[str, str] = {}
    for slot, want in enumerate(manifest.parity[me]):
        path = manifest.parity_path(root, me, slot)
        why = file_problem(path, manifest.chunk, want)
        if why:
            problems[str(path)] = why
    if source is not None:
        with PartReader(source, manifest.parts[me].files) as reader:
            try:
                found = chunk_checksums(reader, manifest.chunk, manifest.k)
            except (OSError, OperationError) as exc:
                return {**problems, str(source): describe(exc)}
        for j, (have, want) in enumerate(zip(found, manifest.chunks[me], strict=True)):
            if have != want:
                problems[f"{source} data chunk {j}"] = "checksum mismatch"
    return problems


