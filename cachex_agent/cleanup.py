"""What an earlier life of this node's agent left half-written, removed at start-up.

An agent killed mid-capture, mid-replica or mid-flush leaves temporaries behind (named
by fsutil's one scheme, recognised by `fsutil.is_temporary`). A restarted agent removes
those of its own node, and only under its own roots: everything temporary in its stage
and its cache (journal, replicas it holds); on the shared PFS only the temporaries of
its own node's bundles, since other nodes' may be live; the coordinator also those of
the run's index, status and global manifests, which only it writes. In the spool (the
trainer's, possibly /dev/shm) only the hidden `.<ckpt>.tmp-cachex-partial` directories a
killed `cachex recover` left, never the trainer's own files.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .errors import describe
from .fsutil import TEMP_MARK, is_temporary, remove_temporaries
from .layout import INDEX, MANIFEST, STATUS, NodePaths, bundle_name, pfs_ckpts_dir

log = logging.getLogger(__name__)


def remove_stale(paths: NodePaths, node: int, coordinator: bool) -> list[str]:
    """Remove this node's stale temporaries; return their paths."""
    bundles = frozenset({bundle_name(node), *([MANIFEST] if coordinator else [])})
    work: list[tuple[Path, bool, frozenset[str] | None]] = [
        (paths.stage, True, None), (paths.cache, True, None),
        *((directory, False, bundles) for directory in _subdirs(pfs_ckpts_dir(paths.pfs)))]
    work += [(paths.spool, False, frozenset(_partial_stems(paths.spool)))]
    if coordinator:
        work.append((paths.pfs, False, frozenset({INDEX, STATUS})))
    removed: list[Path] = []
    for directory, recursive, only_of in work:
        try:
            removed += remove_temporaries(directory, recursive, only_of)
        except OSError as exc:      # e.g. the PFS is down: the next start tries again
            log.warning("stale temporaries under %s not removed: %s", directory, describe(exc))
    return [str(path) for path in removed]


def _partial_stems(spool: Path) -> list[str]:
    """The final names of the spool's recover partial directories (fsutil's scheme)."""
    try:
        with os.scandir(spool) as entries:
            return [e.name[1:].rsplit(TEMP_MARK, 1)[0] for e in entries
                    if e.name.endswith(f"{TEMP_MARK}partial") and is_temporary(e.name)
                    and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _subdirs(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as entries:
            return [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
