"""`deepspeed`: the tracker `latest` (docs/levels.md, Frameworks: DeepSpeed)."""

from __future__ import annotations

import re
from pathlib import Path

from .base import present
from .tracker import TrackerRule

_DIR = re.compile(r"global_step\d+")


class DeepSpeedRule(TrackerRule):
    """`<spool>/latest` names the tag of the last complete save. Rank 0 writes it after
    its own files and before DeepSpeed's barrier, so it vouches for rank 0's files only:
    every node checks its own part. `mp_rank_*_model_states.pt` (data-parallel rank 0's,
    read by every rank) is mirrored."""

    name = "deepspeed"
    priority = 30
    brief = "DeepSpeed's tracker `latest`"
    doc = ("DeepSpeed", "the tracker `latest` names the tag",
           "no: rank 0 writes it after its own files, before the barrier",
           "`mp_rank_*_model_states.pt`, `latest`")
    tracker = "latest"
    marker_implies_complete = False     # the barrier comes after `latest`
    _GLOBAL = ("mp_rank_*_model_states.pt",)

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        return (cls.tracker in trackers or bool(_DIR.fullmatch(ckpt_dir.name))
                or any(n.endswith(("_model_states.pt", "_optim_states.pt")) for n in top))

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return present(ckpt_dir, self._GLOBAL)
