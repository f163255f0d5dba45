"""`orbax`: JAX Orbax `CheckpointManager` (docs/levels.md, Frameworks: Orbax)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from .base import CommitRule, listdir

_STEP_DIR = re.compile(r"(\D*_)?\d+")


class OrbaxRule(CommitRule):
    """A step directory under its final name is committed once it holds
    `commit_success.txt`, or a `_CHECKPOINT_METADATA` with `commit_timestamp_nsecs`
    (both written by `finalize`, after every host's writes and a barrier). On
    node-local spools (`primary_host=None`) every host writes its full step: nothing is
    mirrored."""

    name = "orbax"
    priority = 60
    brief = "Orbax's renamed step directory or `commit_success.txt`"
    doc = ("JAX",
           "the step directory, under its final name (each finalizing host renames its own"
           " once every host finished), holds `commit_success.txt`, or a"
           " `_CHECKPOINT_METADATA` with its commit time (in-place saves get both last)",
           "yes", "none: on node-local spools (`primary_host=None`) every host writes all"
           " of its step")
    marker_implies_complete = True      # finalize runs after a barrier of every host
    new_files = True    # the step directory is final once renamed or committed
    commit_file = "commit_success.txt"
    step_metadata = "_CHECKPOINT_METADATA"

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        return bool({cls.commit_file, cls.step_metadata} & top
                    or _STEP_DIR.fullmatch(ckpt_dir.name)
                    and any(_is_item(ckpt_dir / n) for n in top))

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if self._finalized(spool / n)]

    def _finalized(self, step_dir: Path) -> bool:
        if (step_dir / self.commit_file).is_file():
            return True
        try:
            meta = json.loads((step_dir / self.step_metadata).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False    # missing, or rewritten right now: its next change comes back
        return isinstance(meta, dict) and meta.get("commit_timestamp_nsecs") is not None


def _is_item(path: Path) -> bool:
    return bool({"_METADATA", "manifest.ocdbt", "_sharding"} & set(listdir(path)))
