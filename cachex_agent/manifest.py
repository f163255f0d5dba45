"""Manifests: what a node captured (local) and what a checkpoint is (global).

A manifest is written last, after the data it describes is durable, and readers trust
only renamed manifests (fsutil.write_json). Formats are versioned.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .checksum import ALGORITHM
from .errors import OperationError
from .fsutil import read_json, write_json

LOCAL_FORMAT = "cachex-local-manifest"
GLOBAL_FORMAT = "cachex-global-manifest"
VERSION = 1


@dataclass(frozen=True)
class FileEntry:
    path: str           # relative to the checkpoint directory, '/'-separated
    size: int
    mode: int
    checksum: str


@dataclass
class LocalManifest:
    """One node's part of one checkpoint, as captured into the stage."""

    run: str
    ckpt: str
    seq: int
    node: int
    host: str
    rank: int
    files: list[FileEntry]
    captured_at: float = field(default_factory=time.time)
    algorithm: str = ALGORITHM

    @property
    def bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"format": LOCAL_FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalManifest:
        _check_format(data, LOCAL_FORMAT)
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        fields["files"] = [FileEntry(**entry) for entry in fields["files"]]
        return cls(**fields)

    def save(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> LocalManifest:
        return cls.from_json(read_json(path))


@dataclass
class GlobalManifest:
    """A whole checkpoint: every node's files, written last by the coordinator."""

    run: str
    ckpt: str
    seq: int
    nodes: list[dict[str, Any]]         # node, host, rank, bundle, bytes, files
    files: list[dict[str, Any]]         # node, path, size, mode, checksum
    global_files: list[str]             # paths that only one node wrote (e.g. .metadata)
    times: dict[str, float]             # written, captured, flushed (coordinator clock)
    committed_at: float = field(default_factory=time.time)
    algorithm: str = ALGORITHM

    @property
    def bytes(self) -> int:
        return sum(entry["size"] for entry in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"format": GLOBAL_FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GlobalManifest:
        _check_format(data, GLOBAL_FORMAT)
        return cls(**{k: v for k, v in data.items() if k not in ("format", "version")})

    @classmethod
    def build(cls, parts: list[LocalManifest], global_files: list[str],
              times: dict[str, float], bundles: dict[int, str]) -> GlobalManifest:
        parts = sorted(parts, key=lambda part: part.node)
        first = parts[0]
        nodes = [{"node": p.node, "host": p.host, "rank": p.rank, "bundle": bundles[p.node],
                  "bytes": p.bytes, "files": len(p.files)} for p in parts]
        files = [{"node": p.node, **asdict(entry)} for p in parts for entry in p.files]
        return cls(run=first.run, ckpt=first.ckpt, seq=first.seq, nodes=nodes, files=files,
                   global_files=sorted(global_files), times=dict(times))

    def node_files(self, node: int) -> list[FileEntry]:
        return [FileEntry(**{k: v for k, v in entry.items() if k != "node"})
                for entry in self.files if entry["node"] == node]


def _check_format(data: dict[str, Any], expected: str) -> None:
    if data.get("format") != expected:
        raise OperationError(f"not a {expected}: format={data.get('format')!r}")
    if data.get("version") != VERSION:
        raise OperationError(f"{expected} version {data.get('version')!r} is not supported"
                             f" (this cachex reads version {VERSION})")
