"""The node's per-checkpoint policy, as pure functions: `decide(state, event) -> effects`.

What the agent does with a checkpoint when the coordinator commits, announces, finalizes
or fails it, when its capture ends, when the job drains and when an agent starts again:
which stages run, which are reported as done already (a restart never runs a stage that
is done again), what is flushed and what is kept. The agent (agent.py) builds the
`CkptState` from its journal and what the coordinator announced, calls `decide`, and
executes the effects in order; it owns the threads and MPI, this module owns the choices
(tests/unit/test_node_policy.py). Like the coordinator's decisions.py, nothing here does
I/O or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .handles import ENDED, Stage, State
from .journal import JournalEntry
from .manifest import FileEntry, LocalManifest
from .messages import (
    Captured,
    Commit,
    Drain,
    Failed,
    FileCaptured,
    Finalized,
    ManifestReady,
    Marker,
    Protected,
)
from .names import natural_key


@dataclass(frozen=True, slots=True)
class Announced:
    """What the coordinator said of a checkpoint in its commit (and later drain)."""

    seq: int = 0
    path: str = "peer"          # the write path it chose: peer | pfs
    flush: bool = False         # it wants this checkpoint on the PFS
    global_files: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CkptState:
    """What this node knows of one checkpoint when an event about it comes."""

    ckpt: str
    entry: JournalEntry | None = None
    manifest: LocalManifest | None = None   # this node's part's, from the journal
    held: bool = False          # the captured copy (stage or spool) is still there
    announced: Announced | None = None
    capturing: bool = False     # its capture is queued or running
    protects: bool = False      # a redundancy scheme protects this node's parts

    @property
    def peer_path(self) -> bool:
        """Protected on partners: the scheme is there and the path is `peer` (until the
        coordinator says otherwise)."""
        return self.protects and (self.announced or Announced()).path == "peer"


# ------------------------------------------------------------------ effects
@dataclass(frozen=True, slots=True)
class Announce:
    ckpt: str
    announced: Announced


@dataclass(frozen=True, slots=True)
class Capture:
    ckpt: str


@dataclass(frozen=True, slots=True)
class Post:
    """A message into the agent's own inbox, handled as a worker's would be: a stage
    found done already (a restart) is reported the way its worker reports it."""
    message: Any


@dataclass(frozen=True, slots=True)
class Report:
    """A report to the coordinator (messages.REPORTS)."""
    report: Any


# the part's manifest and journal entry ride with the effects that hand the part to a
# worker: the state they were decided on already holds them, read once
@dataclass(frozen=True, slots=True)
class Protect:
    ckpt: str
    manifest: LocalManifest
    entry: JournalEntry
    fed_wait: float = 0.0


@dataclass(frozen=True, slots=True)
class GroupReady:
    ckpt: str
    manifest: LocalManifest
    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class ResumeProtection:
    ckpt: str
    manifest: LocalManifest
    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class StreamFile:
    message: FileCaptured


@dataclass(frozen=True, slots=True)
class Flush:
    ckpt: str
    manifest: LocalManifest
    entry: JournalEntry


@dataclass(frozen=True, slots=True)
class FlushedAlready:
    ckpt: str
    bundle: str | None      # None: the bundle's default name


@dataclass(frozen=True, slots=True)
class ReplicatedAlready:
    ckpt: str


@dataclass(frozen=True, slots=True)
class ShareGlobals:
    ckpt: str
    entry: JournalEntry
    files: tuple[FileEntry, ...]


@dataclass(frozen=True, slots=True)
class Remember:
    """Fields for the checkpoint's journal entry."""
    ckpt: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Mirror:
    ckpt: str


@dataclass(frozen=True, slots=True)
class Finalize:
    """The global manifest is on the PFS: the checkpoint's reports and counters end
    here; `record`: its commit stage is recorded done (not again after a restart)."""
    ckpt: str
    seq: int | None
    digest: dict[str, Any]
    record: bool


@dataclass(frozen=True, slots=True)
class Abandon:
    """Every stage of the checkpoint stops; `discard`: its stage copy goes too."""
    ckpt: str
    seq: int | None
    reason: str
    discard: bool


@dataclass(frozen=True, slots=True)
class LeaveUnprotected:
    """Checkpoints in the spool older than the newest known: said, not captured."""
    ckpts: list[str]
    note: str


@dataclass(frozen=True, slots=True)
class Retain:
    """Stage and journal retention (keep.stage, keep.replica) run again."""


@dataclass(frozen=True, slots=True)
class StartDrain:
    """The job ends: stop watching the spool; say `drained` when the work is done."""


@dataclass(frozen=True, slots=True)
class WantFlush:
    """The coordinator wants `ckpt` on the PFS after all (the drain)."""
    ckpt: str


# ------------------------------------------------------------------ decisions
def decide(state: CkptState, event: Any) -> list[Any]:
    """The effects of one event about `state.ckpt`, in the order to carry them out."""
    return _DECISIONS[type(event)](state, event)


def on_commit(state: CkptState, msg: Commit) -> list[Any]:
    """The coordinator committed the checkpoint: capture it, unless it is being captured
    or was captured already (a repeated announcement, after a restart: report it)."""
    before = state.announced
    announced = Announced(msg.seq, msg.path, msg.flush or bool(before and before.flush),
                          tuple(msg.global_files))
    effects: list[Any] = [Announce(msg.ckpt, announced)]
    entry = state.entry
    if state.capturing:
        return effects
    if entry is not None and entry.captured and state.manifest is not None and state.held:
        return [*effects, Post(Captured(
            ckpt=msg.ckpt, manifest=state.manifest.to_json(), mode=entry.mode or "copy",
            reason=entry.mode_reason, global_files=list(entry.global_files)))]
    return [*effects, Capture(msg.ckpt)]


def on_captured(state: CkptState, msg: Captured) -> list[Any]:
    """Captured: the stages not done yet, replicate and flush side by side."""
    entry = state.entry or JournalEntry(msg.ckpt)
    manifest = LocalManifest.from_json(msg.manifest)
    effects: list[Any] = share_globals(state, manifest)
    if state.peer_path:
        # a restart: done here, but the coordinator's state may predate the report
        # (it records `flushed` only after `replicated`): report it again
        effects.append(ReplicatedAlready(msg.ckpt) if entry.done(Stage.REPLICATE)
                       else Protect(msg.ckpt, manifest, entry, msg.fed_wait))
    return [*effects, *flush_if_wanted(state), Retain()]


def share_globals(state: CkptState, manifest: LocalManifest) -> list[Any]:
    """This node wrote the checkpoint's global files: every journal gets a copy."""
    entry = state.entry or JournalEntry(state.ckpt)
    names = {*(state.announced.global_files if state.announced else ()), *entry.global_files}
    held = tuple(f for f in manifest.files if f.path in names)
    return [ShareGlobals(state.ckpt, entry, held)] if held and not entry.globals_shared else []


def flush_if_wanted(state: CkptState) -> list[Any]:
    """Flush a captured checkpoint the coordinator wants on the PFS, unless its flush
    is done already (a restart: the coordinator hears of the bundle again)."""
    entry = state.entry
    if (state.announced is None or not state.announced.flush or state.manifest is None
            or entry is None or not entry.captured):
        return []
    if entry.done(Stage.FLUSH):
        return [FlushedAlready(state.ckpt, entry.bundle)]
    return [Flush(state.ckpt, state.manifest, entry)]


def on_file_captured(state: CkptState, msg: FileCaptured) -> list[Any]:
    """A file copied while its part is still being captured: replicated now (the
    replicator keeps it only if the final manifest agrees)."""
    replicate = state.entry.state(Stage.REPLICATE) if state.entry else None
    return [StreamFile(msg)] if state.peer_path and replicate not in ENDED else []


def on_manifest(state: CkptState, msg: ManifestReady) -> list[Any]:
    """The global manifest is complete: kept, mirrored, and an erasure group's encoding
    may start (it needs every member's part)."""
    effects: list[Any] = []
    if state.entry is not None:         # else: forgotten since
        effects.append(Remember(msg.ckpt, {"global": msg.digest.to_json()}))
    effects.append(Mirror(msg.ckpt))
    if state.peer_path and state.entry is not None and state.manifest is not None:
        effects.append(GroupReady(msg.ckpt, state.manifest, state.entry))
    return effects


def on_finalized(state: CkptState, msg: Finalized) -> list[Any]:
    entry = state.entry or JournalEntry(msg.ckpt)
    return [Finalize(msg.ckpt, entry.seq, msg.digest.to_json(),
                     record=entry.state(Stage.COMMIT) not in ENDED), Retain()]


def on_protected(state: CkptState, msg: Protected) -> list[Any]:
    """On every node: older unflushed stage copies may go now."""
    if state.entry is None:
        return []
    return [Remember(msg.ckpt, {"protected": True}), Retain()]


def on_failed(state: CkptState, msg: Failed) -> list[Any]:
    """The coordinator gave up on the checkpoint: every stage of it here stops."""
    entry = state.entry
    return [Abandon(msg.ckpt, entry.seq if entry else None, msg.reason,
                    discard=bool(entry and entry.staged))]


def on_want_flush(state: CkptState, msg: WantFlush) -> list[Any]:
    if state.announced is None:
        return []
    flushed = replace(state.announced, flush=True)
    return [Announce(msg.ckpt, flushed), *flush_if_wanted(replace(state, announced=flushed))]


def on_drain(msg: Drain) -> list[Any]:
    """The job ends: flush what the coordinator names, then say drained."""
    return [StartDrain(), *(WantFlush(ckpt) for ckpt in msg.flush)]


_DECISIONS: dict[type, Any] = {
    Commit: on_commit, Captured: on_captured, FileCaptured: on_file_captured,
    ManifestReady: on_manifest, Finalized: on_finalized, Protected: on_protected,
    Failed: on_failed, WantFlush: on_want_flush,
}


# ------------------------------------------------------------------ start-up
def marker_wanted(entry: JournalEntry | None, preexisting: bool, force: bool) -> bool:
    """The watcher saw `ckpt` committed: tell the coordinator? Not a checkpoint that
    was in the spool before this agent started (start-up adopts those), nor one under
    way (e.g. a mirrored `.metadata`), unless forced."""
    if force:
        return True
    return not preexisting and (entry is None or entry.failed)


def resume(entries: list[CkptState], preexisting: set[str], known: set[str]
           ) -> tuple[list[Any], list[str], list[str]]:
    """A starting agent's effects for what its journal holds (`entries` oldest first),
    the captures cut short to start again, and the spool's checkpoints to adopt (for
    both, markers forced, oldest first).

    Captured, not committed: the coordinator hears of it again (a marker) and announces
    it again; the stages not done then run, a stage done never runs again. A capture
    queued or running when the agent ended is captured again. Committed, replication
    cut short (the flush runs beside it and may finish first): protected again from the
    captured copy, while it is held."""
    effects: list[Any] = []
    for state in entries:
        entry = state.entry
        assert entry is not None
        if entry.captured and not entry.done(Stage.COMMIT):
            effects.append(Report(Marker(ckpt=state.ckpt,
                                         global_files=list(entry.global_files))))
        elif entry.done(Stage.COMMIT) and state.protects and state.held:
            replicating = entry.state(Stage.REPLICATE) in (State.QUEUED, State.RUNNING)
            if replicating and state.manifest is not None:
                effects.append(ResumeProtection(state.ckpt, state.manifest, entry))
    cut_short = [s.ckpt for s in entries if s.ckpt in preexisting and s.entry is not None
                 and s.entry.state(Stage.CAPTURE) in (State.QUEUED, State.RUNNING)]
    adopt, skipped = catch_up(preexisting, known)
    if skipped:
        note = (f"{', '.join(skipped)} in the spool, not protected: older than"
                f" {adopt[-1] if adopt else max(known, key=natural_key)}")
        effects.append(LeaveUnprotected(skipped, note))
    return effects, cut_short, adopt


def catch_up(committed: set[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Which of the spool's committed checkpoints an agent starting now adopts: every
    one newer than the newest it knows of (a node that knows none: the newest), oldest
    first; and the unknown older ones it leaves unprotected (said in status)."""
    unknown = sorted(committed - known, key=natural_key)
    if not unknown:
        return [], []
    if known:
        newest = max(known, key=natural_key)
        adopt = [c for c in unknown if natural_key(c) > natural_key(newest)]
    else:
        adopt = unknown[-1:]
    return adopt, [c for c in unknown if c not in adopt]


def drained(busy: bool, past_deadline: bool, sent: bool) -> bool:
    """Say `drained` now: nothing of the drain is left (or its time is up), once."""
    return not sent and (not busy or past_deadline)
