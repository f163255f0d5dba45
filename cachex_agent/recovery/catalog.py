"""Where the copies of a checkpoint are: global manifest, local manifests, stage dirs.

Used by `cachex verify` and `cachex export` without MPI: node paths are rendered from
the configuration for every node the manifests name, and a copy that is not visible
from this machine is reported as such, never as good.
"""

from __future__ import annotations

import json

from ..config import Config
from ..errors import OperationError
from ..fsutil import read_json
from ..layout import (
    journal_global_manifest_path,
    local_manifest_path,
    pfs_manifest_path,
    status_paths,
)
from ..manifest import GlobalManifest, LocalManifest


def global_manifest(config: Config, ckpt: str) -> GlobalManifest | None:
    """From the PFS, else from the coordinator's journal."""
    node0 = config.node_paths(0)
    for path in (pfs_manifest_path(node0.pfs, ckpt),
                 journal_global_manifest_path(node0.journal, ckpt)):
        try:
            return GlobalManifest.load(path, ckpt)
        except (OSError, json.JSONDecodeError):
            continue
    return None


def local_manifests(config: Config, ckpt: str, nodes: int) -> dict[int, LocalManifest]:
    found = {}
    for node in range(nodes):
        path = local_manifest_path(config.node_paths(node).journal, ckpt)
        try:
            found[node] = LocalManifest.load(path, ckpt)
        except (OSError, json.JSONDecodeError):
            continue
    return found


def node_count(config: Config) -> int:
    for path in status_paths(config.node_paths(0)):
        try:
            return int(read_json(path)["nodes"])
        except (OSError, KeyError, ValueError, json.JSONDecodeError):
            continue
    return 1


def require_global(config: Config, ckpt: str) -> GlobalManifest:
    manifest = global_manifest(config, ckpt)
    if manifest is None:
        where = pfs_manifest_path(config.node_paths(0).pfs, ckpt)
        raise OperationError(f"{ckpt}: no global manifest at {where} (not flushed, or not"
                             " this run: see `cachex ls`)")
    return manifest
