"""Mirroring (`commit.mirror`): once every node captured a checkpoint (the coordinator's
digest of it names its global files) and those files reached this node's journal
(peer/globals.py), put them into this node's spool too, so loaders that read only their
own node's directory (DCP's `load`) find them."""

from __future__ import annotations

import logging
from pathlib import Path

from ..checksum import same_bytes
from ..errors import CachexError, describe
from ..events import EventLog
from ..journal import Journal
from ..layout import NodePaths, global_files_dir, spool_root_name
from ..rules import natural_key, tracker_names, tracker_text
from ..versions import split
from .globals import mirror_file

log = logging.getLogger(__name__)


class Mirror:
    def __init__(self, journal: Journal, paths: NodePaths, node: int, events: EventLog,
                 enabled: bool) -> None:
        self.journal, self.paths, self.node = journal, paths, node
        self.events, self.enabled = events, enabled

    def mirror(self, ckpt: str) -> None:
        """Mirror what has arrived; called again as more arrives (idempotent)."""
        digest = self.journal.digest(ckpt)
        if not self.enabled or digest is None:
            return
        target = self.paths.spool_dir(ckpt)
        held = global_files_dir(self.paths.journal, ckpt)
        for entry in digest.globals:
            path = entry["path"]
            into = self._target(ckpt, target, path, entry["node"])
            if into is None:
                continue
            if not (held / path).is_file():
                return                          # not arrived yet: the next call does it
            try:
                mirror_file(held / path, into, entry["checksum"], entry["mode"])
            except (OSError, CachexError) as exc:
                log.warning("mirror of %s/%s failed: %s", ckpt, path, describe(exc))
                return
            self.events.emit("mirrored", ckpt=ckpt, path=path)

    def _target(self, ckpt: str, ckpt_dir: Path, path: str, owner: int) -> Path | None:
        """Where this node's spool gets a global file (None: nowhere, or there already).
        A spool-root file (tracker, single-file checkpoint) goes to the spool root of
        the other nodes; a tracker is replaced when it names an older save."""
        name = spool_root_name(path)
        if name is None:
            into = ckpt_dir / path
            return into if ckpt_dir.is_dir() and self._free(ckpt, path, into) else None
        into = self.paths.spool / name
        if owner == self.node:
            return None
        if tracker_text(name, ckpt) is not None:
            named = tracker_names(into, name)
            return into if named is None or natural_key(named) < natural_key(ckpt) else None
        return into if self._free(ckpt, path, into) else None

    def _free(self, ckpt: str, path: str, into: Path) -> bool:
        """Nothing at `into`, or this node's mirrored copy of an earlier version (a
        reused name: the trainer loads the newest save from it)."""
        return not into.exists() or mirrored_before(
            self.journal, self.node, ckpt, path, into)


def mirrored_before(journal: Journal, node: int, ckpt: str, path: str, found: Path
                    ) -> bool:
    """`found`, where node `node`'s spool has the global file `path` of `ckpt`, holds
    the bytes another node saved as `path` in an earlier version, which this node's
    journal keeps: what the mirror put there, not a new save of this node's
    (versions.py). Always False for the first version; reads the files only when an
    earlier version's global file came from another node."""
    name, version = split(ckpt)
    for entry in journal.typed():
        other, other_version = split(entry.ckpt)
        if other != name or other_version >= version:
            continue
        digest = journal.digest(entry.ckpt)
        held = global_files_dir(journal.root, entry.ckpt) / path
        if digest is not None and any(g["path"] == path and g["node"] != node
                                      for g in digest.globals) \
                and held.is_file() and same_bytes(found, held):
            return True
    return False
