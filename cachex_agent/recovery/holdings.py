"""What one node holds: the input of a recovery plan (recovery/plan.py).

Global manifests come from the node's journal (every agent keeps them from the moment
a checkpoint is captured everywhere) and, on rank 0, from the PFS. A copy is reported
when every file of it is present with the size of the manifest; checksums are not read
here but as the files are moved (recovery/transfer.py), once, and a file that turns out
corrupt is taken from the next copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

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


def local_copies(paths: NodePaths, node: int, manifests: dict[str, GlobalManifest],
                 exclude: frozenset[str], host: str = "") -> list[Copy]:
    """The node's own parts (spool, stage), global files (journal), partners' replicas."""
    copies = []
    for ckpt, manifest in manifests.items():
        owner = written_by(manifest, node, host)
        own = manifest.node_files(owner) if owner < len(manifest.nodes) else []
        for kind, directory in (("spool", paths.spool_dir(ckpt)),
                                ("stage", paths.stage_dir(ckpt))):
            if kind not in exclude and own and _intact(directory, own):
                copies.append(Copy(ckpt, owner, kind, node, _paths(own)))
        copies += _journal_globals(paths, node, manifest, exclude)
    if "replica" not in exclude:
        copies += _replicas(paths, node, manifests)
    if "parity" not in exclude:
        copies += parity_holdings(paths, node, manifests)
    return copies


def parity_holdings(paths: NodePaths, node: int, manifests: dict[str, GlobalManifest]
                    ) -> list[Copy]:
    """This node's share of its erasure group's parity (no files of a part: the parity
    rebuilds a lost member, recovery/erasure_recover.py), where its manifest loads and
    every parity chunk it lists is there with its size."""
    held = []
    for ckpt in manifests:
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


def written_by(manifest: GlobalManifest, node: int, host: str) -> int:
    """Whose part this node's spool and stage hold: the node the manifest names this
    host for. With `topology.domain = "node"` the index is the host's place among the
    sorted hostnames of the job, so a replacement whose name sorts elsewhere than the lost
    node's shifts the survivors' indices: each still holds the part it wrote, which
    recovery then moves to the host now at that index. On one host (`domain = "rank"`)
    every node has the same name: its part is its own index's."""
    named = [entry["node"] for entry in manifest.nodes if entry.get("host") == host]
    return named[0] if len(named) == 1 else node


def _journal_globals(paths: NodePaths, node: int, manifest: GlobalManifest,
                     exclude: frozenset[str]) -> list[Copy]:
    if "journal" in exclude or not manifest.global_files:
        return []
    entries = [FileEntry(e["path"], e["size"], e["mode"], e["checksum"])
               for e in manifest.files if e["path"] in manifest.global_files]
    owners = {e["node"] for e in manifest.files if e["path"] in manifest.global_files}
    if len(owners) != 1 or not _intact(
            layout.global_files_dir(paths.journal, manifest.ckpt), entries):
        return []
    return [Copy(manifest.ckpt, owners.pop(), "journal", node, _paths(entries))]


def _replicas(paths: NodePaths, node: int, manifests: dict[str, GlobalManifest]) -> list[Copy]:
    copies = []
    for owner, held in held_replicas(paths.replicas).items():
        for replica in held:
            manifest = manifests.get(replica.ckpt)
            if manifest is None or owner >= len(manifest.nodes):
                continue
            expected = manifest.node_files(owner)
            if replica.files == expected and _intact(
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


def to_json(manifests: dict[str, GlobalManifest]) -> str:
    return json.dumps({k: m.to_json() for k, m in manifests.items()})


def from_json(text: str, source: str) -> dict[str, GlobalManifest]:
    return {k: GlobalManifest.from_json(v, source, k) for k, v in json.loads(text).items()}
