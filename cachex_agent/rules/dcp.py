"""`dcp`: PyTorch Distributed Checkpoint (docs/levels.md, Frameworks)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .base import CommitRule


class DcpRule(CommitRule):
    """`<id>/.metadata`, renamed into place last by the coordinator rank. `extra_global`
    adds coordinator-only files, e.g. `__0_0.distcp` when saving with
    `DefaultSavePlanner(dedup_save_to_lowest_rank=True)`."""

    name = "dcp"
    priority = 20
    brief = "PyTorch DCP `.metadata`"
    doc = ("PyTorch DCP", "`<ckpt>/.metadata` exists",
           "yes: the coordinator rank writes it after a gather",
           "`.metadata`, plus `commit.globals`")
    marker = ".metadata"
    marker_implies_complete = True      # the coordinator rank writes it after a gather
    new_files = True    # FileSystemWriter: new `__R_0.distcp` files per checkpoint_id

    def __init__(self, extra_global: Sequence[str] = ()) -> None:
        self.extra_global = tuple(extra_global)

    @classmethod
    def build(cls, settle: float, extra_global: Sequence[str],
              clock: Callable[[], float]) -> CommitRule:
        return cls(extra_global)

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        return any(n in (".metadata", ".metadata.tmp") or n.endswith(".distcp") for n in top)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if (spool / n / self.marker).is_file()]

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [f for f in (self.marker, *self.extra_global) if (Path(ckpt_dir) / f).is_file()]
