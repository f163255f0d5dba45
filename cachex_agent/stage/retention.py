"""Stage retention (`keep.stage`): the newest captures stay in the stage; an older one
goes once no stage of it still reads it (replication, a flush it needs). The journal
forgets ended checkpoints beyond the newest max(HISTORY, keep.replica) that it no longer holds."""

from __future__ import annotations

from collections.abc import Callable

from ..events import EventLog
from ..handles import Stage
from ..journal import Journal, JournalEntry
from ..layout import NodePaths
from .remover import Remover

#: ended checkpoints a journal remembers beyond those it still holds in the stage (at
#: least `keep.replica`: the checkpoints a partner can still rebuild from)
HISTORY = 4


def evictable(entries: list[JournalEntry], keep: int, in_use: set[str],
              flush_wanted: Callable[[str], bool]) -> list[JournalEntry]:
    """Which stage copies go (pure; `entries` oldest first): those beyond the newest
    `keep` (0: keep all) that nothing in `in_use` reads and no flush still needs.

    A copy that flush.every leaves out of the flush holds the checkpoint's `replicated`
    level (the owner's copy is one of the two, and an erasure scheme's data): it goes
    only once a newer checkpoint is flushed or protected (`replicated` on every node),
    so a node loss while the next one replicates does not fall back to the PFS."""
    held = [e for e in reversed(entries) if e.captured and e.staged]
    if keep == 0 or len(held) <= keep:
        return []
    safe = max((e.seq or 0 for e in entries if e.protected or e.done(Stage.COMMIT)),
               default=0)
    return [e for e in held[keep:] if e.ckpt not in in_use and (
        e.done(Stage.COMMIT) or (not flush_wanted(e.ckpt) and (e.seq or 0) < safe))]


def forgettable(entries: list[JournalEntry], in_use: set[str], keep_replica: int
                ) -> list[str]:
    """The ended checkpoints (finalized, or failed) the journal forgets (pure; `entries`
    oldest first): beyond the newest max(HISTORY, `keep_replica`), holding no stage copy
    and read by nothing. state.json is rewritten at every stage of every checkpoint, and
    kept whole it grew with the run's length (5x the bytes per checkpoint at 40
    checkpoints as at 6). The newest stay: a restart's catch-up compares the spool with
    the newest known, recovery reads their digests. `keep_replica` 0 (every replica
    kept) forgets nothing."""
    if keep_replica == 0:
        return []
    ended = [e.ckpt for e in reversed(entries) if (e.done(Stage.COMMIT) or e.failed)
             and not e.staged and e.ckpt not in in_use]
    return ended[max(HISTORY, keep_replica):]


def retain_stage(keep: int, journal: Journal, paths: NodePaths, in_use: set[str],
                 flush_wanted: Callable[[str], bool], events: EventLog,
                 remover: Remover) -> list[str]:
    """Evict the stage copies `evictable` names (`remover` deletes them off the caller's
    thread); return the evicted ones not committed yet (the coordinator must hear that
    this node no longer holds them)."""
    evicted = []
    for entry in evictable(journal.typed(), keep, in_use, flush_wanted):
        remover.discard(paths.stage, paths.stage_dir(entry.ckpt))
        journal.update(entry.ckpt, mode="evicted")
        events.emit("evicted", ckpt=entry.ckpt, seq=entry.seq, level="stage")
        if not entry.done(Stage.COMMIT):
            evicted.append(entry.ckpt)
    return evicted


def forget_ended(journal: Journal, in_use: set[str], keep_replica: int) -> list[str]:
    """Forget what `forgettable` names; return it."""
    gone = forgettable(journal.typed(), in_use, keep_replica)
    journal.forget(*gone)
    return gone
