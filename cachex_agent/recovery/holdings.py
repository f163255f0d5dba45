"""What one node holds: the input of a recovery plan (recovery/plan.py).

A node looks for what rank 0 tells it (`Wanted`, built from the merged manifests by
`wanted`), never the whole manifest: its part's files, the global files, the parts of
the replicas it holds.

Global manifests come from the node's journal (every agent keeps them from the moment
a checkpoint is captured everywhere) and, on rank 0, from the PFS. A copy is reported
when every file of it is present with the size of the manifest; checksums are not read
here but as the files are moved (recovery/transfer.py), once, and a file that turns out
corrupt is taken from the next copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import layout
from ..config import Config
from ..errors import OperationError
from ..flush.bundle import is_complete, read_manifest
from ..layout import NodePaths, bundle_path, replica_dir
from ..manifest import FileEntry, GlobalManifest
from ..peer.parity import ParityManifest
from ..peer.store import held_replicas
from ..safepath import UnsafeInput
from .plan import Copy


def journal_manifests(paths: NodePaths) -> dict[str, GlobalManifest]:
    return _manifests(lambda: layout.journal_global_manifest_paths(paths.journal),
                      lambda ckpt: layout.journal_global_manifest_path(paths.journal, ckpt))


def pfs_manifests(pfs_run: Path) -> dict[str, GlobalManifest]:
    return _manifests(lambda: layout.pfs_manifest_paths(pfs_run),
                      lambda ckpt: layout.pfs_manifest_path(pfs_run, ckpt))


def _manifests(listing: Callable[[], list[Path]], stored_at: Callable[[str], Path]
               ) -> dict[str, GlobalManifest]:
    """Every readable global manifest; an unreadable place (PFS down) gives none. A
    manifest with an unsafe name, or not stored where its name says (`stored_at`),
    raises UnsafeInput."""
    found = {}
    try:
        candidates = listing()
    except OSError:
        return found
    for path in candidates:
        try:
            manifest = GlobalManifest.load(path)
        except (OSError, ValueError):
            continue
        if stored_at(manifest.ckpt) != path:
            raise UnsafeInput(f"{path}: checkpoint id {manifest.ckpt!r} is not the one"
                              " stored here")
        found[manifest.ckpt] = manifest
    return found


@dataclass
class Wanted:
    """One checkpoint's files a node may hold, as rank 0 tells it (`wanted`): the part
    its spool and stage would hold, the global files its journal would, and the parts
    of the replicas it reported. A node is told these, never the whole manifest."""

    owner: int                                  # whose part its spool and stage hold
    own: list[FileEntry] = field(default_factory=list)
    globals_owner: int = -1                     # -1: no global files in one node's part
    globals: list[FileEntry] = field(default_factory=list)
    parts: dict[int, list[FileEntry]] = field(default_factory=dict)  # replica owner ->


class Parts:
    """One manifest indexed once (rank 0): its files by node, its nodes by host."""

    def __init__(self, manifest: GlobalManifest) -> None:
        self.count = len(manifest.nodes)
        self.files: dict[int, list[FileEntry]] = {}
        for e in manifest.files:
            self.files.setdefault(e["node"], []).append(_file(e))
        self.nodes = {entry["node"]: entry for entry in manifest.nodes}
        self.by_host: dict[str, list[int]] = {}
        for entry in manifest.nodes:
            self.by_host.setdefault(entry.get("host"), []).append(entry["node"])
        shared = set(manifest.global_files)
        self.globals = [_file(e) for e in manifest.files if e["path"] in shared]
        owners = {e["node"] for e in manifest.files if e["path"] in shared}
        self.globals_owner = owners.pop() if len(owners) == 1 else -1

    def written_by(self, node: int, host: str) -> int:
        """Whose part node `node` on `host` holds in its spool and stage: the node the
        manifest names this host for. With `topology.domain = "node"` the index is the
        host's place among the sorted hostnames of the job, so a replacement whose name
        sorts elsewhere than the lost node's shifts the survivors' indices: each still
        holds the part it wrote, which recovery then moves to the host now at that index.
        On one host (`domain = "rank"`) every node has the same name: its part is its own
        index's."""
        named = self.by_host.get(host, [])
        return named[0] if len(named) == 1 else node

    def of(self, owner: int) -> list[FileEntry]:
        return self.files.get(owner, [])


def wanted(parts: Parts, node: int, host: str, replicas: set[int]) -> Wanted:
    """What node `node` on `host` looks for of one checkpoint: `replicas`, the owners
    of the replica manifests it reported (discover.Found.parts)."""
    owner = parts.written_by(node, host)
    return Wanted(owner, parts.of(owner) if owner < parts.count else [],
                  parts.globals_owner, parts.globals if parts.globals_owner >= 0 else [],
                  {o: parts.of(o) for o in sorted(replicas) if o < parts.count})


def local_copies(paths: NodePaths, node: int, wants: dict[str, Wanted],
                 exclude: frozenset[str]) -> list[Copy]:
    """The node's own parts (spool, stage), global files (journal), partners' replicas."""
    copies = []
    for ckpt, want in wants.items():
        for kind, directory in (("spool", paths.spool_dir(ckpt)),
                                ("stage", paths.stage_dir(ckpt))):
            if kind not in exclude and want.own and _intact(directory, want.own):
                copies.append(Copy(ckpt, want.owner, kind, node, _paths(want.own)))
        if "journal" not in exclude and want.globals and _intact(
                layout.global_files_dir(paths.journal, ckpt), want.globals):
            copies.append(Copy(ckpt, want.globals_owner, "journal", node,
                               _paths(want.globals)))
    if "replica" not in exclude:
        copies += _replicas(paths, node, wants)
    if "parity" not in exclude:
        copies += parity_holdings(paths, node, list(wants))
    return copies


def parity_holdings(paths: NodePaths, node: int, ckpts: list[str]) -> list[Copy]:
    """This node's share of its erasure group's parity (no files of a part: the parity
    rebuilds a lost member, recovery/erasure_recover.py), where its manifest loads and
    every parity chunk it lists is there with its size."""
    held = []
    for ckpt in ckpts:
        try:
            parity = ParityManifest.load(paths.parity, ckpt)
        except UnsafeInput:
            raise
        except (OSError, ValueError, OperationError):   # none, or unreadable: no holding
            continue
        chunks = [parity.parity_path(paths.parity, parity.member, slot)
                  for slot in range(parity.m)]
        if parity.group[parity.member] == node and all(
                _size(path) == parity.chunk for path in chunks):
            held.append(Copy(ckpt, node, "parity", node, ()))
    return held


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _replicas(paths: NodePaths, node: int, wants: dict[str, Wanted]) -> list[Copy]:
    copies = []
    for owner, held in held_replicas(paths.replicas).items():
        for replica in held:
            want = wants.get(replica.ckpt)
            expected = want.parts.get(owner) if want is not None else None
            if expected is not None and replica.files == expected and _intact(
                    replica_dir(paths.replicas, owner, replica.ckpt), expected):
                copies.append(Copy(replica.ckpt, owner, "replica", node, _paths(expected)))
    return copies


def pfs_copies(pfs_run: Path, manifests: dict[str, GlobalManifest]) -> list[Copy]:
    """Complete bundles whose manifest matches (checksums are checked as extracted)."""
    copies = []
    for ckpt, manifest in manifests.items():
        for node in range(len(manifest.nodes)):
            path = bundle_path(pfs_run, ckpt, node)
            try:
                if is_complete(path) and read_manifest(path).files == manifest.node_files(node):
                    copies.append(Copy(ckpt, node, "pfs", -1,
                                       _paths(manifest.node_files(node))))
            except (OSError, ValueError):
                continue
    return copies


def source_dir(config: Config, copy: Copy, host: str | None = None) -> Path:
    """Where a non-PFS copy's files are, on its holder."""
    paths = config.node_paths(copy.holder, host=host)
    return {"spool": paths.spool_dir(copy.ckpt), "stage": paths.stage_dir(copy.ckpt),
            "replica": replica_dir(paths.replicas, copy.owner, copy.ckpt),
            "journal": layout.global_files_dir(paths.journal, copy.ckpt)}[copy.kind]


def _intact(directory: Path, entries: list[FileEntry]) -> bool:
    """Every file there with its size (a cheap test; the checksums come with the move)."""
    try:
        return all((directory / e.path).stat().st_size == e.size
                   and (directory / e.path).is_file() for e in entries)
    except OSError:
        return False


def _paths(entries: list[FileEntry]) -> tuple[str, ...]:
    return tuple(e.path for e in entries)


def _file(entry: dict[str, Any]) -> FileEntry:
    return FileEntry(entry["path"], entry["size"], entry["mode"], entry["checksum"])


def to_json(manifests: dict[str, GlobalManifest]) -> str:
    return json.dumps({k: m.to_json() for k, m in manifests.items()})


def from_json(text: str, source: str) -> dict[str, GlobalManifest]:
    return {k: GlobalManifest.from_json(v, source, k) for k, v in json.loads(text).items()}
