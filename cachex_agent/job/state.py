"""What the job's supervisor reads of a run between its steps: one line of words
`cachex job state`, computed here from the status rather than parsed in a shell."""

from __future__ import annotations

from typing import Any

from ..names import LEVELS as HELD


def state_words(status: dict[str, Any]) -> list[str]:
    """STATE LIFE NEWEST LEVEL USABLE FLUSHED: the agents' state (blanks as `-`), the
    coordinator's life token, the newest checkpoint still held and its level, how many
    are usable (captured or better) and how many flushed; `-` where unknown."""
    rows = sorted(status.get("checkpoints") or [], key=lambda r: r.get("seq", 0))
    held = [r for r in rows if r.get("level") in HELD]
    newest = held[-1] if held else {"id": "-", "level": "-"}
    life = str((status.get("heartbeat") or {}).get("life") or "-").split()[0]
    return [str(status.get("state") or "-").replace(" ", "-"), life, str(newest["id"]),
            str(newest["level"]), str(sum(r["level"] != "written" for r in held)),
            str(sum(r["level"] == "flushed" for r in held))]
