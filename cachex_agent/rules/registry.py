"""Every rule by its `commit.rule` name: `make_rule`, the names the configuration
accepts, the trackers `recover` rewrites and the table docs/levels.md shows, all read
from the rules themselves."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .auto import AutoRule
from .base import CommitRule
from .frameworks import FRAMEWORKS
from .marker import MarkerRule
from .settle import QuiescenceRule
from .torch_file import TorchFileRule
from .tracker import TrackerRule

BY_NAME: dict[str, type[CommitRule]] = {
    rule.name: rule for rule in (AutoRule, *FRAMEWORKS, TorchFileRule, QuiescenceRule)}
MARKER = "marker:"
#: what `commit.rule` accepts: these names, or `marker:<glob>`
RULE_NAMES: tuple[str, ...] = tuple(BY_NAME)
RULES = ", ".join([*RULE_NAMES[:-1], f"{MARKER}<glob> or {RULE_NAMES[-1]}"])
#: the rules the configuration reference and docs/levels.md describe, in their order
DOCUMENTED: tuple[type[CommitRule], ...] = (*FRAMEWORKS, TorchFileRule, MarkerRule,
                                            QuiescenceRule)


def shown(rule: type[CommitRule]) -> str:
    """A rule's name as `commit.rule` takes it (`marker:<glob>` for the marker rule)."""
    return f"{MARKER}<glob>" if rule is MarkerRule else rule.name


RULE_MEANING = (
    "How a checkpoint in the spool is known complete: `auto` recognises each of the"
    " others per checkpoint (quiescence for what none recognises); "
    + "; ".join(f"`{shown(rule)}` ({rule.brief})" for rule in DOCUMENTED)
    + ". docs/levels.md has what each one read in its framework's code.")
#: the rules whose commit does not vouch for every node's files (commit.settle's meaning)
SETTLED = ", ".join(f"`{shown(rule)}`" for rule in DOCUMENTED
                    if not rule.marker_implies_complete)
TRACKERS: dict[str, type[TrackerRule]] = {
    rule.tracker: rule for rule in FRAMEWORKS if issubclass(rule, TrackerRule)}


def make_rule(spec: str, settle: float, extra_global: Sequence[str] = ()) -> CommitRule:
    """Build the rule named by `commit.rule`; `extra_global` (`commit.globals`) names
    more coordinator-only files of a DCP checkpoint."""
    spec = str(spec).strip()
    if settle < 0:
        raise ConfigError(f"commit.settle: must be >= 0, got {settle!r}")
    if spec in BY_NAME:
        return BY_NAME[spec].build(settle, extra_global, time.monotonic)
    if spec.startswith(MARKER):
        return MarkerRule(spec[len(MARKER):])
    raise ConfigError(f"commit.rule: unknown rule {spec!r} (expected {RULES})")


def tracker_names(tracker: Path, name: str) -> str | None:
    """The checkpoint directory the tracker file `name` names (None: missing, torn,
    foreign or not a tracker)."""
    rule = TRACKERS.get(name)
    return rule.read(tracker) if rule is not None else None


def tracker_text(name: str, ckpt_id: str) -> str | None:
    """What tracker `name` holds when it names `ckpt_id` (None: not a known tracker, or
    a checkpoint it cannot name): `recover` writes it beside the recovered checkpoint."""
    rule = TRACKERS.get(name)
    return rule.text_for(ckpt_id) if rule is not None else None


def rules_table() -> str:
    """docs/levels.md's table of the rules, one row each (a test keeps the two equal)."""
    rows = ["| rule | committed when | marker vouches for every rank"
            " | written by one node, mirrored to all |", "|---|---|---|---|"]
    for rule in DOCUMENTED:
        framework, committed, vouches, mirrored = rule.doc
        label = f"`{shown(rule)}` ({framework})" if framework else f"`{shown(rule)}`"
        rows.append(f"| {label} | {committed} | {vouches} | {mirrored} |")
    return "\n".join(rows)
