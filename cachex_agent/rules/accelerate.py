"""`accelerate`: Hugging Face Accelerate's `Accelerator.save_state`
(docs/levels.md, Frameworks: Accelerate)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from .base import files_under, holds_match
from .settle import SettledRule

_DIR = re.compile(r"checkpoint_\d+")      # ProjectConfiguration(automatic_checkpoint_naming)
_RNG = re.compile(r"random_states_\d+\.pkl")
RNG_GLOB = "random_states_*.pkl"


class AccelerateRule(SettledRule):
    """`checkpoint_N/` (or any `save_state` directory): the main process writes the
    weights, optimizer, scheduler, sampler and scaler states, every process its own
    `random_states_<process>.pkl` (the main process's after its other files), and no
    marker comes last, no barrier after. A directory is committed once it holds an RNG
    state and settled (nothing open for writing, unchanged for `commit.settle`); a node
    that holds the main process's files waits for an RNG state of its own
    (`own_marker`) and then for its own part to settle. Every file but the RNG states is
    read by every process on `load_state`: those one node alone holds are mirrored."""

    name = "accelerate"
    priority = 40
    brief = "Accelerate `save_state`'s `checkpoint_N/` with its RNG states, once settled"
    doc = ("Accelerate `save_state`",
           "`checkpoint_N/` holds a `random_states_*.pkl` and settled for `commit.settle`",
           "no: nothing is written last; each node waits for its own RNG state and for its"
           " files to settle", "every file but `random_states_*.pkl` that one node alone"
           " holds (the main process writes them)")
    new_files = True    # `checkpoint_N/` per save; save_state refuses an existing one

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        return bool(_DIR.fullmatch(ckpt_dir.name)) or any(_RNG.fullmatch(n) for n in top)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return self._quiet._select(spool, [n for n in names
                                           if holds_match(spool / n, RNG_GLOB)])

    def own_marker(self, ckpt_dir: Path) -> str | None:
        saves = any(not _RNG.fullmatch(rel) for rel in files_under(Path(ckpt_dir))
                    if not self.ignore(rel))
        return RNG_GLOB if saves else None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [rel for rel in files_under(Path(ckpt_dir))
                if not _RNG.fullmatch(rel) and not self.ignore(rel)]
