"""`cachex export CKPT DEST`: the trainer's files rebuilt from the PFS bundles, no MPI."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import OperationError
from ..flush.bundle import extract, read_manifest
from ..fsutil import makedirs
from ..layout import bundle_path, node_dir_name
from ..manifest import GlobalManifest


def export(manifest: GlobalManifest, pfs_run: Path, dest: Path, per_node: bool = False,
           say: Callable[[str], None] = lambda _: None) -> int:
    """Extract every node's bundle into `dest` (or `dest/node-NNNNN`); return bytes.

    Merged (the default), a path held by two nodes must have the same checksum there
    (a global file mirrored to every node); different contents are an error.
    """
    _check_collisions(manifest, per_node)
    for node in manifest.nodes:     # every name in every bundle checked before any write
        read_manifest(bundle_path(pfs_run, manifest.ckpt, node["node"]))
    makedirs(dest)
    seen: set[str] = set()
    total = 0
    for node in manifest.nodes:
        index = node["node"]
        target = dest / node_dir_name(index) if per_node else dest
        wanted = {e.path for e in manifest.node_files(index)} - (set() if per_node else seen)
        seen |= wanted
        entries = extract(bundle_path(pfs_run, manifest.ckpt, index), target, only=wanted)
        total += sum(e.size for e in entries)
        say(f"node {index}: {len(entries)} files, {sum(e.size for e in entries)} bytes")
    return total


def _check_collisions(manifest: GlobalManifest, per_node: bool) -> None:
    if per_node:
        return
    checksums: dict[str, tuple[int, str]] = {}
    for entry in manifest.files:
        first = checksums.setdefault(entry["path"], (entry["node"], entry["checksum"]))
        if first[1] != entry["checksum"]:
            raise OperationError(f"{entry['path']}: nodes {first[0]} and {entry['node']} hold"
                                 " different files under this path; use --per-node")
