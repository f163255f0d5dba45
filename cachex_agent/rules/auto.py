"""`auto`: per checkpoint, the rule of the framework that wrote it (docs/levels.md,
Commit rules)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..names import natural_sorted
from .base import CommitRule, checkpoint_names, listdir
from .frameworks import FRAMEWORKS
from .settle import QuiescenceRule
from .torch_file import TorchFileRule, checkpoint_files, is_checkpoint_file

GENERIC = QuiescenceRule.name


class AutoRule(CommitRule):
    """Per checkpoint: recognise the framework from its files (`detect_kind`) and apply
    its rule; quiescence for directories nobody recognises; single files at the spool
    root (`*.ckpt`, `*.pt`, `*.pth`, `*.safetensors`) by TorchFileRule.

    A recognized framework never falls back to quiescence: on nodes that do not hold the
    marker (DCP's `.metadata`, DeepSpeed's `latest` live on the coordinator only) the
    checkpoint is committed by the coordinator's announcement, not by a settle timer
    that a slow writer could outlast. `kind` says which rule decided (cachex status).
    """

    name = "auto"

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic,
                 extra_global: Sequence[str] = ()) -> None:
        self.settle = float(settle)
        self._rules: dict[str, CommitRule] = {
            rule.name: rule.build(settle, extra_global, clock) for rule in FRAMEWORKS}
        self._rules[GENERIC] = QuiescenceRule(settle, clock)
        self._files = TorchFileRule(settle, clock)
        self._kind: dict[str, str] = {}

    @classmethod
    def build(cls, settle: float, extra_global: Sequence[str],
              clock: Callable[[], float]) -> CommitRule:
        return cls(settle, clock, extra_global)

    @property
    def needs_polling(self) -> bool:   # type: ignore[override]
        seen = set(self._kind.values())
        return any(self._rule_of(kind).needs_polling for kind in seen)

    @property
    def root_files(self) -> tuple[str, ...]:    # type: ignore[override]
        seen = set(self._kind.values())
        return tuple(rule.tracker for kind, rule in self._rules.items()
                     if rule.tracker and kind in seen)

    def _rule_of(self, kind: str) -> CommitRule:
        return self._files if kind == self._files.name else self._rules[kind]

    def committed(self, spool: Path) -> list[str]:
        spool = Path(spool)
        files = checkpoint_files(spool)
        self._kind.update(dict.fromkeys(files, self._files.name))
        return natural_sorted([*self._select(spool, checkpoint_names(spool)),
                               *self._files._select(spool, files)])

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        trackers = trackers_at(spool)
        for gone in set(self._kind) - set(names) - set(checkpoint_files(spool)):
            del self._kind[gone]
        groups: dict[str, list[str]] = {kind: [] for kind in self._rules}
        for name in names:
            groups[self._classify(spool / name, trackers)].append(name)
        ready: list[str] = []
        for kind, rule in self._rules.items():
            ready.extend(rule._select(spool, groups[kind]))
        return ready

    def _classify(self, ckpt_dir: Path, trackers: frozenset[str]) -> str:
        kind = self._kind.get(ckpt_dir.name)
        # sticky: a framework save never turns generic again; DCP may still turn out
        # to be Megatron's torch_dist (`common.pt`/`metadata.json` come with it)
        if kind not in (None, GENERIC, "dcp"):
            return kind
        kind = detect_kind(ckpt_dir, trackers)
        self._kind[ckpt_dir.name] = kind
        return kind

    def _rule_for(self, spool: Path, ckpt_id: str) -> CommitRule:
        # Classified afresh from this node's files when asked from another thread
        # (`_kind` belongs to the watcher's): the capture thread calls these.
        if is_checkpoint_file(ckpt_id) and not (spool / ckpt_id).is_dir():
            return self._files
        return self._rules[detect_kind(spool / ckpt_id, trackers_at(spool))]

    def kind(self, ckpt_id: str) -> str:
        return self._kind.get(ckpt_id, GENERIC)

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).global_files(ckpt_dir)

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        return self._rule_for(Path(spool), ckpt_id).root_entries(spool, ckpt_id)

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        return self._rule_for(Path(spool), ckpt_id) is self._files

    def own_marker(self, ckpt_dir: Path) -> str | None:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).own_marker(ckpt_dir)

    def forget(self, ckpt_id: str) -> None:
        self._kind.pop(ckpt_id, None)
        self._files.forget(ckpt_id)
        for rule in self._rules.values():
            rule.forget(ckpt_id)

    def vouches_for(self, ckpt_dir: Path) -> bool:
        ckpt_dir = Path(ckpt_dir)
        return self._rule_for(ckpt_dir.parent, ckpt_dir.name).vouches_for(ckpt_dir)

    def tracker_due(self, spool: Path, ckpt_id: str) -> str | None:
        return self._rule_for(Path(spool), ckpt_id).tracker_due(spool, ckpt_id)

    def writes_new_files(self, spool: Path, ckpt_id: str) -> bool:
        return self._rule_for(Path(spool), ckpt_id).writes_new_files(spool, ckpt_id)

    def generation(self, spool: Path, ckpt_id: str) -> object | None:
        return self._rule_for(Path(spool), ckpt_id).generation(spool, ckpt_id)


def trackers_at(spool: Path) -> frozenset[str]:
    """The frameworks' tracker files present at the spool root."""
    return frozenset(rule.tracker for rule in FRAMEWORKS
                     if rule.tracker and (spool / rule.tracker).is_file())


def detect_kind(ckpt_dir: Path, trackers: frozenset[str] = frozenset()) -> str:
    """The framework that wrote `ckpt_dir` (the name of its rule), from the names of its
    files and the trackers at the spool root; `quiescence` when none recognises it. The
    frameworks are asked in the order of their `priority`."""
    top = set(listdir(ckpt_dir))
    for rule in FRAMEWORKS:
        if rule.recognises(ckpt_dir, top, trackers):
            return rule.name
    return GENERIC
