"""Leaf helpers every layer shares: checkpoint names, their order, the levels.

Imports nothing of the package, so any module (safepath, status, the job helpers) may
use these without pulling in a stage's code.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The levels a checkpoint reaches, in order; a checkpoint may also end `failed`, be
# `evicted` from node-local storage or `purged` from the PFS (docs/levels.md).
LEVELS = ("written", "captured", "replicated", "flushed")


def natural_key(text: str) -> tuple[tuple[object, ...], str]:
    """Sort key that orders step_9 before step_10 (ties broken by the raw text)."""
    # re.split with a capturing group alternates text/number, so positions compare
    # str with str and int with int.
    parts = tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", text)))
    return parts, text


def natural_sorted(ids: Iterable[str]) -> list[str]:
    return sorted(set(ids), key=natural_key)


def is_temp_dir_name(name: str) -> bool:
    """A directory that is being written under a name it will lose (HF, Orbax, ours)."""
    lowered = name.lower()
    return (lowered.endswith((".tmp", "-tmp")) or lowered.startswith("tmp-")
            or ".orbax-checkpoint-tmp" in lowered)


def is_checkpoint_name(name: str) -> bool:
    """Hidden and temporary top-level directories are never checkpoints."""
    return not (name.startswith(".") or is_temp_dir_name(name) or name == "lost+found")
