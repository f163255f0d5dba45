"""`hf`: Hugging Face `transformers.Trainer` (docs/levels.md, Frameworks: Trainer)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from .base import CommitRule, files_under

_DIR = re.compile(r"checkpoint-\d+")
_RNG = re.compile(r"rng_state(_\d+)?\.pth")


class HfRule(CommitRule):
    """`checkpoint-N/`: `trainer_state.json` is each saving node's own marker, written
    last with no barrier before it, so the first one seen commits and each saving node
    waits for its own (`own_marker`). Every file but the RNG states is read by every rank
    on resume: those one node alone holds are mirrored."""

    name = "hf"
    priority = 50
    brief = "transformers `Trainer`'s `trainer_state.json`"
    doc = ("transformers `Trainer`", "`checkpoint-N/trainer_state.json` exists",
           "no: each saving node waits for its own `trainer_state.json`; a node with only"
           " its RNG state waits for its files to settle",
           "every file but `rng_state_*.pth` that one node alone holds")
    marker = "trainer_state.json"
    new_files = True    # `checkpoint-N/` per save, its files written once

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        return cls.marker in top or bool(_DIR.fullmatch(ckpt_dir.name))

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if (spool / n / self.marker).is_file()]

    def own_marker(self, ckpt_dir: Path) -> str | None:
        saves = any(not _RNG.fullmatch(rel.split("/")[-1])
                    for rel in files_under(Path(ckpt_dir)))
        return self.marker if saves else None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [rel for rel in files_under(Path(ckpt_dir))
                if not _RNG.fullmatch(rel.split("/")[-1]) and not self.ignore(rel)]
