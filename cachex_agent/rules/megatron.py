"""`megatron`: Megatron-LM's tracker or Megatron-Core's `metadata.json`
(docs/levels.md, Frameworks: Megatron)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from ..names import natural_key
from .base import present
from .tracker import TrackerRule

_DIR = re.compile(r"iter_\d{7,}")


class MegatronRule(TrackerRule):
    """`iter_NNNNNNN/` (or `release/`) directories: committed when the tracker
    `latest_checkpointed_iteration.txt` (written by rank 0 after a barrier) names the
    iteration, or when the directory holds `metadata.json` (`dist_checkpointing.save`
    writes it last, after a barrier). Rank 0's files that every rank loads are
    mirrored."""

    name = "megatron"
    priority = 10
    brief = "Megatron's tracker or `metadata.json`"
    doc = ("Megatron-LM / Core",
           "`latest_checkpointed_iteration.txt` names `iter_NNNNNNN` (or `release`), or the"
           " directory holds `metadata.json` (`torch_dist`)", "yes",
           "`common.pt`, `metadata.json`, `.metadata`, the tracker; legacy"
           " `mp_rank_*/model_optim_rng.pt` where one node holds it")
    tracker = "latest_checkpointed_iteration.txt"
    marker = "metadata.json"
    _GLOBAL = ("common.pt", "metadata.json", ".metadata", "mp_rank_*/model_optim_rng.pt",
               "mp_rank_*_*/model_optim_rng.pt")

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        name = ckpt_dir.name
        return bool({"common.pt", "metadata.json"} & top or _DIR.fullmatch(name)
                    or name == "release" and cls.tracker in trackers)

    @classmethod
    def names(cls, text: str) -> str | None:
        if text == "release":
            return text
        return f"iter_{int(text):07d}" if text.isdigit() else None

    @classmethod
    def text_for(cls, ckpt_id: str) -> str | None:
        found = re.fullmatch(r"iter_(\d+)", ckpt_id)
        if found:
            return str(int(found.group(1)))
        return "release" if ckpt_id == "release" else None

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        by_tracker = set(super()._select(spool, names))
        return by_tracker | {n for n in names if (spool / n / self.marker).is_file()}

    def tracker_due(self, spool: Path, ckpt_id: str) -> str | None:
        # Megatron-LM writes its tracker after a barrier that follows `metadata.json`,
        # which commits the save first: a capture that started in between would miss
        # the tracker, and the other nodes would keep the one naming the previous save
        named = self.read(Path(spool) / self.tracker)
        if named is not None and natural_key(named) >= natural_key(ckpt_id):
            return None
        return self.tracker if (Path(spool) / ckpt_id / self.marker).is_file() else None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return present(ckpt_dir, self._GLOBAL)
