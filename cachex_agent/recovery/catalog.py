"""Where the copies of a checkpoint are: global manifest, local manifests, stage dirs.

Used by `cachex verify` and `cachex export` without MPI: node paths are rendered from
the configuration for every node the manifests name, and a copy that is not visible
from this machine is reported as such, never as good.

With `topology.domain = "node"` the journal path of every node renders to this machine's
own journal: a journal is read only for what it holds of its own node (a local manifest
counts for the node it records) and for what reached it over MPI (every agent keeps the
global manifests the coordinator sent it). Other nodes' parts come from the PFS.
"""

from __future__ import annotations

import json

from ..config import Config
from ..errors import OperationError
from ..index import NotAnIndex, read_index
from ..layout import (
    journal_global_manifest_path,
    local_manifest_path,
    pfs_manifest_path,
)
from ..manifest import GlobalManifest, LocalManifest
from ..status import coordinator_statuses, order


def global_manifest(config: Config, ckpt: str) -> GlobalManifest | None:
    """From the PFS, else from the journal visible here: node 0's (shared host), or this
    node's own, which holds the copy the coordinator sent to every agent."""
    node0 = config.node_paths(0)
    for path in (pfs_manifest_path(node0.pfs, ckpt),
                 journal_global_manifest_path(node0.journal, ckpt)):
        try:
            return GlobalManifest.load(path, ckpt)
        except (OSError, json.JSONDecodeError):
            continue
    return None


def local_manifests(config: Config, ckpt: str, nodes: int) -> dict[int, LocalManifest]:
    """The local manifests of the journals visible here, each for the node it records:
    rendered for node k, a path may be this machine's own journal (no `{node}` in it),
    which holds this node's manifest, not node k's."""
    found: dict[int, LocalManifest] = {}
    for journal in dict.fromkeys(config.node_paths(node).journal for node in range(nodes)):
        try:
            manifest = LocalManifest.load(local_manifest_path(journal, ckpt), ckpt)
        except (OSError, json.JSONDecodeError):
            continue
        found.setdefault(manifest.node, manifest)
    return found


def level_of(config: Config, ckpt: str) -> str | None:
    """The checkpoint's level: the coordinator's newest status visible here, else the PFS
    index, else `flushed` when its global manifest is on the PFS (written last); None
    when none of them knows it. Never a journal's global manifest: that is kept by some
    nodes from the coordinator's commit, before anything reached the PFS."""
    statuses = sorted(coordinator_statuses(config), key=order)
    for status in reversed(statuses):
        for row in status.get("checkpoints") or []:
            if isinstance(row, dict) and row.get("id") == ckpt and row.get("level"):
                return str(row["level"])
    pfs = config.node_paths(0).pfs
    try:
        return next(r.level for r in read_index(pfs).checkpoints if r.id == ckpt)
    except (OSError, NotAnIndex, StopIteration):
        pass
    return "flushed" if pfs_manifest_path(pfs, ckpt).is_file() else None


def node_count(config: Config) -> int:
    for status in coordinator_statuses(config):
        try:
            return int(status["nodes"])
        except (KeyError, TypeError, ValueError):
            continue
    return 1


def require_global(config: Config, ckpt: str) -> GlobalManifest:
    manifest = global_manifest(config, ckpt)
    if manifest is None:
        where = pfs_manifest_path(config.node_paths(0).pfs, ckpt)
        raise OperationError(f"{ckpt}: no global manifest at {where} (not flushed, or not"
                             " this run: see `cachex ls`)")
    return manifest
