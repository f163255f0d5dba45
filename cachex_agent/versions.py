"""Versions: a checkpoint saved again under a name already seen (issue 44).

`torch.save(state, "ckpt.pt")` every N steps, Lightning's `last.ckpt`, a `latest/`
directory refilled and re-marked: each committed save under the same trainer's name is
a checkpoint of its own, a *version* of that name, with an id of its own everywhere
cachex keeps it (journal, stage, replicas, PFS, index): the first save keeps the
name, save n >= 2 is `<name>@v<n>`. The spool only ever has the trainer's name
(`trainer_name`), which is where captures read and recoveries write.
"""

from __future__ import annotations

from collections.abc import Iterable

MARK = "@v"


def versioned(name: str, version: int) -> str:
    """The id of save `version` (1, 2, ...) of the trainer's `name`."""
    return name if version <= 1 else f"{name}{MARK}{version}"


def split(ckpt: str) -> tuple[str, int]:
    """(the trainer's name, the version) of a checkpoint id."""
    head, mark, tail = ckpt.rpartition(MARK)
    if mark and head and tail.isdigit() and not tail.startswith("0") and int(tail) >= 2:
        return head, int(tail)
    return ckpt, 1


def trainer_name(ckpt: str) -> str:
    """The name in the trainer's spool of the checkpoint `ckpt` (any version)."""
    return split(ckpt)[0]


def next_version(name: str, known: Iterable[str]) -> str:
    """The id of the next save of `name`, after every version of it in `known`."""
    newest = max((version for other, version in map(split, known) if other == name),
                 default=0)
    return versioned(name, newest + 1)
