"""`cachex export CKPT DEST`: the trainer's files rebuilt from the PFS bundles, no MPI."""

from __future__ import annotations

from pathlib import Path

from ..errors import OperationError
from ..flush.bundle import extract, read_manifest
from ..fsutil import makedirs, remove_under
from ..layout import bundle_path, node_dir_name
from ..manifest import GlobalManifest
from ..progress import Progress, quiet
from ..status import human_size
from .plan import Collision, paths_once


def export(manifest: GlobalManifest, pfs_run: Path, dest: Path, per_node: bool = False,
           progress: Progress | None = None) -> int:
    """Extract every node's bundle into `dest` (or `dest/node-NNNNN`); return bytes.

    Merged (the default), a path held by two nodes must have the same checksum there
    (a global file mirrored to every node); different contents are an error.
    """
    progress = progress or quiet()
    wanted = _wanted(manifest, per_node)
    for node in manifest.nodes:     # every name in every bundle checked before any write
        read_manifest(bundle_path(pfs_run, manifest.ckpt, node["node"]))
    created = _first_missing(dest)
    new = [_target(dest, index, path, per_node) for index, paths in wanted.items()
           for path in paths if not _target(dest, index, path, per_node).exists()]
    makedirs(dest)
    try:
        return _extract_all(manifest, pfs_run, dest, per_node, wanted, progress)
    except BaseException:
        _undo(created, new)
        raise


def _extract_all(manifest: GlobalManifest, pfs_run: Path, dest: Path, per_node: bool,
                 wanted: dict[int, set[str]], progress: Progress) -> int:
    progress.start(f"export {manifest.ckpt}", sum(
        e.size for index, paths in wanted.items() for e in manifest.node_files(index)
        if e.path in paths))
    total = 0
    for index, paths in wanted.items():
        target = dest / node_dir_name(index) if per_node else dest
        entries = extract(bundle_path(pfs_run, manifest.ckpt, index), target, only=paths,
                          done=progress.advance)
        total += sum(e.size for e in entries)
        progress.step(f"node {index}: {len(entries)} files,"
                      f" {human_size(sum(e.size for e in entries))}")
    progress.finish()
    return total


def _target(dest: Path, index: int, path: str, per_node: bool) -> Path:
    return (dest / node_dir_name(index) if per_node else dest) / path


def _first_missing(dest: Path) -> Path | None:
    """The outermost directory of `dest` that export is about to create, if any."""
    missing = None
    for directory in (dest, *dest.parents):
        if directory.exists():
            return missing
        missing = directory
    return missing


def _undo(created: Path | None, new: list[Path]) -> None:
    """A failed export removes what it wrote: the directories it made, else the files
    that were not there before (a file it replaced stays replaced)."""
    if created is not None:
        remove_under(created.parent, created)
        return
    for path in new:
        path.unlink(missing_ok=True)


def _wanted(manifest: GlobalManifest, per_node: bool) -> dict[int, set[str]]:
    """The paths taken from each node's bundle: merged, a path held by several nodes
    (a global file) comes from the first (plan.paths_once, as `recover --to` does)."""
    if per_node:
        return {n["node"]: {e.path for e in manifest.node_files(n["node"])}
                for n in manifest.nodes}
    try:
        first = paths_once(manifest)
    except Collision as exc:
        raise OperationError(f"{exc}; use --per-node") from None
    return {n["node"]: {p for p, node in first.items() if node == n["node"]}
            for n in manifest.nodes}
