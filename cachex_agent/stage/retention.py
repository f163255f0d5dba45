"""Stage retention (`keep.stage`): the newest captures stay in the stage; an older one
goes once no stage of it still reads it (replication, a flush it needs)."""

from __future__ import annotations

from collections.abc import Callable

from ..events import EventLog
from ..fsutil import remove_under
from ..handles import Stage, is_done, is_failed
from ..journal import Journal
from ..layout import NodePaths


def retain_stage(keep: int, journal: Journal, paths: NodePaths, in_use: set[str],
                 flush_wanted: Callable[[str], bool], events: EventLog) -> list[str]:
    """Evict the stage copies beyond the newest `keep` (0: keep all) that nothing in
    `in_use` reads and no flush still needs; return the evicted ones not committed yet
    (the coordinator must hear that this node no longer holds them)."""
    held = sorted(((e["seq"], c) for c, e in journal.entries.items()
                   if is_done(e, Stage.CAPTURE) and not is_failed(e) and e.get("mode") == "copy"),
                  reverse=True)
    if keep == 0 or len(held) <= keep:
        return []
    evicted = []
    for _seq, ckpt in held[keep:]:
        entry = journal.entries[ckpt]
        committed = is_done(entry, Stage.COMMIT)
        if ckpt in in_use or (flush_wanted(ckpt) and not committed):
            continue
        remove_under(paths.stage, paths.stage_dir(ckpt))
        journal.update(ckpt, mode="evicted")
        events.emit("evicted", ckpt=ckpt, seq=entry["seq"], level="stage")
        if not committed:
            evicted.append(ckpt)
    return evicted
