"""Manifests: what a node captured (local) and what a checkpoint is (global).

A manifest is written last, after the data it describes is durable, and readers trust
only renamed manifests (fsutil.write_json). Formats are versioned.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from dataclasses import dataclass, field, is_dataclass
from json.encoder import encode_basestring_ascii as _quoted
from pathlib import Path
from typing import Any

from .checksum import ALGORITHM, hasher
from .errors import OperationError
from .fsutil import compact_json, read_json, write_bytes, write_json
from .safepath import UnsafeInput, checkpoint_id, component, index, relative_path

LOCAL_FORMAT = "cachex-local-manifest"
GLOBAL_FORMAT = "cachex-global-manifest"
VERSION = 1


def _plain(value: Any) -> Any:
    """dataclasses.asdict without its deep copy of every leaf: manifests go into every
    message and journal write, and asdict was a good part of an agent's CPU per
    checkpoint."""
    if is_dataclass(value):
        return {name: _plain(item) for name, item in vars(value).items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {name: _plain(item) for name, item in value.items()}
    return value


#: the checksum of a file streamed to a partner while it is still being hashed (a
#: linked file fed to the replication, stage/capture.py and peer/feed.py): the final
#: manifest carries the real one
PENDING = ""


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
        return {"format": LOCAL_FORMAT, "version": VERSION, **_plain(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: object = "local manifest",
                  directory: str | None = None) -> LocalManifest:
        """Parse and check every name that ends up in a path (safepath.py); `source`
        names the file or message in errors, `directory` is the checkpoint id it is
        stored under, if any."""
        _check_format(data, LOCAL_FORMAT, source)
        fields = _fields(data, source)
        checkpoint_id(fields.get("ckpt"), source, directory)
        index(fields.get("node"), source)
        index(fields.get("rank"), source, "rank")
        component(fields.get("host"), source, "host")
        fields["files"] = [_file_entry(entry, source) for entry in _list(data, "files", source)]
        return _build(cls, fields, source)

    @classmethod
    def check_json(cls, data: dict[str, Any], source: object = "local manifest",
                   directory: str | None = None) -> None:
        """from_json's checks without building the objects: the coordinator checks every
        node's report this way (at 10,000 nodes the objects were most of the cost)."""
        _check_format(data, LOCAL_FORMAT, source)
        _check_keys(cls, data, source)
        checkpoint_id(data.get("ckpt"), source, directory)
        index(data.get("node"), source)
        index(data.get("rank"), source, "rank")
        component(data.get("host"), source, "host")
        _scalars(data, source)
        for entry in _list(data, "files", source):
            if type(entry) is not dict or entry.keys() != _FILE_KEYS:
                _file_entry(entry, source)      # raises, naming what is wrong
                raise UnsafeInput(f"{source}: file entry {entry!r:.80}")
            relative_path(entry["path"], source)
            for key in ("size", "mode"):
                if type(entry[key]) is not int or entry[key] < 0:
                    index(entry[key], source, f"{key} of {entry['path']!r}")
            if not isinstance(entry["checksum"], str):
                raise UnsafeInput(f"{source}: checksum of {entry['path']!r} is not text")

    def save(self, path: Path) -> int:
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: Path, directory: str | None = None) -> LocalManifest:
        return cls.from_json(read_json(path), path, directory)


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
    # the O(nodes) lists as compact JSON, with the ids of the lists they encode: a copy
    # that `dataclasses.replace` made with other times shares both (the finalize's)
    lists_text: tuple[tuple[int, ...], str] | None = field(default=None, repr=False,
                                                           compare=False)

    @property
    def bytes(self) -> int:
        return sum(entry["size"] for entry in self.files)

    def encoded(self) -> bytes:
        """`to_json` as compact sorted JSON (what `save` writes, what the holders get):
        the lists are encoded once per manifest and its copies, not once per write, send
        and copy (at 10,000 nodes each encoding was a tenth of the coordinator's CPU)."""
        key = (id(self.nodes), id(self.files), id(self.global_files))
        if self.lists_text is None or self.lists_text[0] != key:
            self.lists_text = (key, f'"files":{_files_text(self.files)},'
                               f'"global_files":{compact_json(self.global_files)},'
                               f'"nodes":{_nodes_text(self.nodes)}')
        data = self.to_json()
        small = {k: v for k, v in data.items() if k not in ("files", "global_files", "nodes")}
        head = compact_json(small)      # algorithm, ckpt, committed_at, format, run, ... sorted
        return f"{head[:-1]},{self.lists_text[1]}}}\n".encode()

    def save(self, path: Path) -> int:
        return write_bytes(path, self.encoded())

    def to_json(self) -> dict[str, Any]:
        """Shares the lists of flat dicts (a manifest is not changed once built): at
        10,000 nodes a deep copy was most of the coordinator's CPU per checkpoint."""
        return {"format": GLOBAL_FORMAT, "version": VERSION, "run": self.run,
                "ckpt": self.ckpt, "seq": self.seq, "nodes": self.nodes, "files": self.files,
                "global_files": self.global_files, "times": self.times,
                "committed_at": self.committed_at, "algorithm": self.algorithm}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: object = "global manifest",
                  directory: str | None = None) -> GlobalManifest:
        """Parse and check every name that ends up in a path, as LocalManifest does;
        nodes are numbered 0..N-1 and every file belongs to one of them."""
        _check_format(data, GLOBAL_FORMAT, source)
        fields = _fields(data, source)
        checkpoint_id(fields.get("ckpt"), source, directory)
        numbers = [_node(part, source) for part in _list(data, "nodes", source)]
        if sorted(numbers) != list(range(len(numbers))):
            raise UnsafeInput(f"{source}: nodes {numbers} are not numbered 0..{len(numbers) - 1}")
        known = set(numbers)    # a list here made parsing O(files x nodes)
        for entry in _list(data, "files", source):
            _file_entry({k: v for k, v in _dict(entry, source).items() if k != "node"}, source)
            if entry.get("node") not in known:
                raise UnsafeInput(f"{source}: file {entry.get('path')!r} of node"
                                  f" {entry.get('node')!r}, not a node of this checkpoint")
        for path in _list(data, "global_files", source):
            relative_path(path, source, "global file path")
        if "lists_text" in fields:          # this process's cache, never read from outside
            raise UnsafeInput(f"{source}: unknown key 'lists_text'")
        return _build(cls, fields, source)

    @classmethod
    def load(cls, path: Path, directory: str | None = None) -> GlobalManifest:
        return cls.from_json(read_json(path), path, directory)

    @classmethod
    def build(cls, parts: list[LocalManifest], global_files: list[str],
              times: dict[str, float], bundles: dict[int, str],
              committed_at: float | None = None) -> GlobalManifest:
        """`committed_at`: when it is built (now if not given)."""
        return cls.from_parts([p.to_json() for p in parts], global_files, times, bundles,
                              committed_at)

    @classmethod
    def from_parts(cls, parts: list[dict[str, Any]], global_files: list[str],
                   times: dict[str, float], bundles: dict[int, str],
                   committed_at: float | None = None) -> GlobalManifest:
        """`build` from the local manifests' JSON forms, already checked (the coordinator
        holds them so, as they arrived): no object per file of every node."""
        parts = sorted(parts, key=lambda part: part["node"])
        first = parts[0]
        nodes = [{"node": p["node"], "host": p["host"], "rank": p["rank"],
                  "bundle": bundles[p["node"]], "bytes": sum(e["size"] for e in p["files"]),
                  "files": len(p["files"])} for p in parts]
        files = [{"node": p["node"], "path": e["path"], "size": e["size"], "mode": e["mode"],
                  "checksum": e["checksum"]} for p in parts for e in p["files"]]
        # a candidate several nodes wrote (HF's `save_on_each_node`) is each one's own
        holders = Counter(entry["path"] for entry in files)
        return cls(run=first["run"], ckpt=first["ckpt"], seq=first["seq"], nodes=nodes,
                   files=files,
                   global_files=sorted(p for p in set(global_files) if holders[p] <= 1),
                   times=dict(times),
                   committed_at=time.time() if committed_at is None else committed_at)

    def node_files(self, node: int) -> list[FileEntry]:
        return [FileEntry(**{k: v for k, v in entry.items() if k != "node"})
                for entry in self.files if entry["node"] == node]

    def digest(self) -> ManifestDigest:
        return ManifestDigest(self.ckpt, self.seq, len(self.nodes), len(self.files),
                              self.bytes, files_hash(self.files),
                              [e for e in self.files if e["path"] in self.global_files])


_FILE_KEYS = {"path", "size", "mode", "checksum"}
DIGEST_FORMAT = "cachex-manifest-digest"
MAX_GLOBAL_ENTRIES = 1024   # a digest's global files: what one node wrote, never per node


def files_hash(files: list[dict[str, Any]]) -> str:
    """The identity of a checkpoint's content: every (node, path, size, mode, checksum),
    in node and path order. A manifest rebuilt from the survivors' local and replica
    manifests is the one the coordinator built when the hashes agree."""
    h = hasher()
    h.update("".join(f"{e['node']}\t{e['path']}\t{e['size']}\t{e['mode']}\t{e['checksum']}\n"
                     for e in sorted(files, key=lambda e: (e["node"], e["path"]))).encode())
    return h.hexdigest()


_GLOBAL_FILE_KEYS = {"node", *_FILE_KEYS}
_NODE_KEYS = {"node", "host", "rank", "bundle", "bytes", "files"}


def _files_text(files: list[dict[str, Any]]) -> str:
    """compact_json(files), the same text at twice its speed: every entry has the keys
    of a global manifest's file, checked (from_json, from_parts), numbers ints; at
    10,000 nodes this list is most of what the coordinator encodes per checkpoint."""
    if not all(type(e) is dict and e.keys() == _GLOBAL_FILE_KEYS for e in files):
        return compact_json(files)
    return "[" + ",".join(
        f'{{"checksum":{_quoted(e["checksum"])},"mode":{e["mode"]:d},"node":{e["node"]:d},'
        f'"path":{_quoted(e["path"])},"size":{e["size"]:d}}}' for e in files) + "]"


def _nodes_text(nodes: list[dict[str, Any]]) -> str:
    """compact_json(nodes), as _files_text."""
    if not all(type(n) is dict and n.keys() == _NODE_KEYS for n in nodes):
        return compact_json(nodes)
    return "[" + ",".join(
        f'{{"bundle":{_quoted(n["bundle"])},"bytes":{n["bytes"]:d},"files":{n["files"]:d},'
        f'"host":{_quoted(n["host"])},"node":{n["node"]:d},"rank":{n["rank"]:d}}}'
        for n in nodes) + "]"


@dataclass(frozen=True)
class ManifestDigest:
    """A global manifest in a size that does not grow with the job: what every agent
    hears and keeps (its journal entry's `global`). `globals` are the entries of the
    global files (e.g. `.metadata`), which every node mirrors and recovery restores."""

    ckpt: str
    seq: int
    nodes: int
    files: int
    bytes: int
    hash: str
    globals: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"format": DIGEST_FORMAT, "version": VERSION, **_plain(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: object = "manifest digest",
                  directory: str | None = None) -> ManifestDigest:
        _check_format(data, DIGEST_FORMAT, source)
        fields = _fields(data, source)
        checkpoint_id(fields.get("ckpt"), source, directory)
        for key in ("seq", "nodes", "files", "bytes"):
            index(fields.get(key), source, key)
        if not isinstance(fields.get("hash"), str) or len(fields["hash"]) > 128:
            raise UnsafeInput(f"{source}: hash {fields.get('hash')!r} is not a digest")
        entries = _list(data, "globals", source)
        if len(entries) > MAX_GLOBAL_ENTRIES:
            raise UnsafeInput(f"{source}: {len(entries)} global files, more than"
                              f" {MAX_GLOBAL_ENTRIES}")
        for entry in entries:
            _file_entry({k: v for k, v in _dict(entry, source).items() if k != "node"}, source)
            if index(entry.get("node"), source) >= fields["nodes"]:
                raise UnsafeInput(f"{source}: global file {entry.get('path')!r} of node"
                                  f" {entry['node']}, not a node of this checkpoint")
        return _build(cls, fields, source)

    def matches(self, manifest: GlobalManifest) -> bool:
        return (manifest.ckpt, len(manifest.nodes), len(manifest.files), manifest.bytes,
                files_hash(manifest.files)) == (self.ckpt, self.nodes, self.files,
                                                self.bytes, self.hash)


def _check_format(data: Any, expected: str, source: object) -> None:
    _dict(data, source)
    if data.get("format") != expected:
        raise OperationError(f"{source}: not a {expected}: format={data.get('format')!r}")
    if data.get("version") != VERSION:
        raise OperationError(f"{source}: {expected} version {data.get('version')!r} is not"
                             f" supported (this cachex reads version {VERSION})")


def _scalars(data: dict[str, Any], source: object) -> None:
    """The fields no path is made of, of the types they have (the coordinator keeps a
    node's manifest as the text it sent)."""
    for key in ("run", "algorithm"):
        if not isinstance(data.get(key, ""), str):
            raise UnsafeInput(f"{source}: {key} is not text")
    if type(data.get("seq")) is not int:
        raise UnsafeInput(f"{source}: seq {data.get('seq')!r:.40} is not an integer")
    at = data.get("captured_at")
    if type(at) not in (int, float) or not math.isfinite(at):
        raise UnsafeInput(f"{source}: captured_at {at!r:.40} is not a time")


def _fields(data: dict[str, Any], source: object) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in ("format", "version")}


def _dict(value: Any, source: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UnsafeInput(f"{source}: expected an object, found {type(value).__name__}")
    return value


def _list(data: dict[str, Any], key: str, source: object) -> list[Any]:
    value = data.get(key)
    if not isinstance(value, list):
        raise UnsafeInput(f"{source}: {key!r} is not a list but {type(value).__name__}")
    return value


def _file_entry(entry: Any, source: object) -> FileEntry:
    entry = _dict(entry, source)
    relative_path(entry.get("path"), source)
    index(entry.get("size"), source, f"size of {entry.get('path')!r}")
    index(entry.get("mode"), source, f"mode of {entry.get('path')!r}")
    return _build(FileEntry, entry, source)


def _node(part: Any, source: object) -> int:
    part = _dict(part, source)
    component(part.get("host"), source, "host")
    index(part.get("rank"), source, "rank")
    component(part.get("bundle"), source, "bundle name")
    return index(part.get("node"), source)


@functools.cache
def _keys(cls: Any) -> tuple[frozenset[str], frozenset[str]]:
    """The keys a JSON form of `cls` may have (its fields, its format and version) and
    those it must."""
    known = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return frozenset(known | {"format", "version"}), frozenset(required)


def _check_keys(cls: Any, data: dict[str, Any], source: object) -> None:
    """What `_build` would refuse, without building (LocalManifest.check_json)."""
    known, required = _keys(cls)
    if not data.keys() <= known or not required <= data.keys():
        raise UnsafeInput(f"{source}: keys {sorted(data)}, expected {sorted(known)}"
                          f" with {sorted(required)}")


def _build(cls: Any, fields: dict[str, Any], source: object) -> Any:
    try:
        return cls(**fields)
    except TypeError as exc:            # a missing or unknown key
        raise UnsafeInput(f"{source}: {exc}") from None
