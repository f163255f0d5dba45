"""This node's directories at start-up: checked, created, and tried with a real write,
so a bad path is a one-line configuration error naming its key (exit 2)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from .config import Config, check_paths
from .errors import ConfigError
from .fsutil import create_file, makedirs
from .layout import NodePaths
from .topology import Placement


def probe_writable(directory: Path, key: str) -> None:
    """Root passes every permission check, so try a real write. The name is unique across
    nodes: on the shared PFS, thread ids alone collide between hosts (another node's
    agent would remove this one's probe between its creation and its removal)."""
    probe = directory / (f".cachex-probe-{socket.gethostname()}-{os.getpid()}"
                         f"-{threading.get_native_id()}")
    try:
        os.close(create_file(probe))
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{key}: {directory}: not writable ({exc.strerror})") from None


def prepare_dirs(config: Config, placement: Placement) -> NodePaths:
    """Check and create this node's directories; ConfigError names the key and path."""
    paths = config.node_paths(placement.node, placement.rank, placement.host)
    check_paths(paths)      # `load` checked node 0's; {node} or {host} may differ here
    if not paths.spool.is_dir():
        if not paths.spool.parent.is_dir():
            raise ConfigError(f"paths.spool: {paths.spool}: no such directory")
        makedirs(paths.spool)
    pfs_root = paths.pfs.parent
    if not pfs_root.is_dir():
        raise ConfigError(f"paths.pfs: {pfs_root}: no such directory")
    for key, directory in (("paths.stage", paths.stage), ("paths.cache", paths.cache),
                           ("paths.pfs", paths.pfs)):
        try:
            makedirs(directory)
        except OSError as exc:
            raise ConfigError(f"{key}: {directory}: cannot create ({exc.strerror})") from None
        probe_writable(directory, key)
    return paths
