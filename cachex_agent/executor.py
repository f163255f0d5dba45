"""Carries out the node policy's effects (node_policy.py) on this node's stage workers.

The agent's main thread hands every event about a checkpoint to `Executor.decide`: the
state is read from the journal and what the coordinator announced, `node_policy.decide`
says what to do, and each effect becomes one call on a worker (capture, protector,
flusher, remover, mirror, global files) or one journal write. Nothing here chooses: a
branch on a checkpoint's state belongs in the policy, where it is a pure function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import node_policy as policy
from .config import Config
from .events import EventLog
from .flush.flusher import Flusher, flushed_report
from .handles import Stage, StageLog, State
from .journal import Journal, JournalEntry
from .layout import NodePaths, bundle_path, spool_file
from .messages import (
    Captured,
    CaptureFailed,
    Drained,
    Evicted,
    Marker,
    Replicated,
    Report,
    Superseded,
    Unprotected,
)
from .peer.globals import GlobalFiles
from .peer.mirror import Mirror, mirrored_before
from .peer.redundancy import Protector, replicated
from .rules import CommitRule
from .stage.remover import Remover
from .stage.retention import forget_ended, retain_stage
from .stage.saves import generation_json, taken
from .stage.watch import SpoolWatcher
from .stage.worker import CaptureWorker, global_candidates
from .uplink import Uplink
from .versions import next_version, split, versioned

log = logging.getLogger(__name__)
# after this node's watcher saw a checkpoint committed, the coordinator's commit follows
# within a few turns: the main loop polls for it at PEER_TICK that long, not at the idle
# tick, which added up to 20 ms to commit -> partner-durable (at most 1 s)
COMMIT_WAIT = 1.0
# after the trainer's last write into the spool: its ranks' writes end together, and the
# commit follows within a barrier
WRITTEN_WAIT = 0.5


@dataclass
class Workers:
    """The parts of a node that work on checkpoints, as the agent built them."""

    capture: CaptureWorker
    watcher: SpoolWatcher
    flusher: Flusher
    remover: Remover
    protector: Protector | None
    globals: GlobalFiles
    mirror: Mirror
    uplink: Uplink


class Executor:
    def __init__(self, config: Config, node: int, paths: NodePaths, journal: Journal,
                 stages: StageLog, rule: CommitRule, workers: Workers,
                 post: Callable[[Any], None], report: Callable[[Report], None],
                 others: list[int], counters: Callable[[], dict[str, Any]],
                 preexisting: set[str]) -> None:
        """`others`: the other agents' ranks; `preexisting`: the checkpoints committed in
        the spool before this agent started (node_setup.committed_now)."""
        self.config, self.node, self.paths, self.journal = config, node, paths, journal
        self.stages, self.rule, self.w = stages, rule, workers
        self.post, self.report, self.others, self.counters = post, report, others, counters
        self.events: EventLog = stages.events
        self.announced: dict[str, policy.Announced] = {}
        self.received_at: dict[str, float] = {}     # ckpt -> commit first heard (wall)
        self.draining, self.drain_deadline, self._drained_sent = False, 0.0, False
        self.preexisting = preexisting
        self._commit_due: dict[str, float] = {}     # ckpt -> polling for its commit until
        self._named: set[str] = set()       # versions on_saved_again named (its thread)

    def state(self, ckpt: str) -> policy.CkptState:
        entry = self.journal.entry(ckpt)
        held = bool(entry and entry.mode in ("copy", "reference") and entry.source
                    and Path(entry.source).is_dir())
        return policy.CkptState(ckpt, entry, self.journal.manifest(ckpt), held,
                                self.announced.get(ckpt), self.w.capture.busy(ckpt),
                                self.w.protector is not None)

    def decide(self, msg: Any, ckpt: str | None = None) -> None:
        self.execute(policy.decide(self.state(ckpt or msg.ckpt), msg))

    def execute(self, effects: list[Any]) -> None:
        for effect in effects:
            getattr(self, f"_{type(effect).__name__}")(effect)

    def resume(self, known: set[str]) -> None:
        """Every checkpoint from its stages' persisted states, then what the trainer
        committed while no agent was watching (node_policy.resume); `known`: the
        checkpoints this node heard of (setup.known)."""
        effects, again, adopt = policy.resume(
            [self.state(e.ckpt) for e in self.journal.typed()], self.preexisting, known)
        self.execute(effects)
        for ckpt in [*again, *adopt]:   # oldest first: the coordinator numbers new ones
            self.on_marker(ckpt, force=True)    # in the order it hears them
        if adopt:
            self.events.emit("catch_up", ckpts=adopt)

    def from_worker(self, msg: Report) -> Report:
        """A worker thread's report: what this node does about it; then it goes to the
        coordinator as returned."""
        if isinstance(msg, Captured):
            self.decide(msg)
        elif isinstance(msg, CaptureFailed) and self.w.protector is not None:
            self.w.protector.cancel(msg.ckpt, f"capture failed: {msg.error}")
        elif isinstance(msg, Marker) and msg.ckpt not in self.announced:
            self._commit_due[msg.ckpt] = time.monotonic() + COMMIT_WAIT
        elif isinstance(msg, Replicated):
            self.retain()
            self.w.flusher.copy_events_soon()
            dead = sorted(self.w.protector.dead) if self.w.protector else []
            return replace(msg, dead=dead)
        return msg

    def commit_expected(self, now: float) -> bool:
        """This node's part of a checkpoint was written less than COMMIT_WAIT ago and
        its commit has not come yet."""
        self._commit_due = {c: t for c, t in self._commit_due.items()
                            if t > now and c not in self.announced}
        return bool(self._commit_due)

    def written_lately(self, now: float) -> bool:
        """The trainer wrote into the spool less than WRITTEN_WAIT ago: a commit may
        follow from another node's marker (DCP's ranks but the first have none), and
        the main loop's slow tick was half of a small checkpoint's time to `replicated`."""
        return now - self.w.watcher.written < WRITTEN_WAIT

    def on_marker(self, ckpt: str, force: bool = False) -> None:
        """The watcher saw `ckpt` committed (its thread; and the start-up's catch-up)."""
        if policy.marker_wanted(self.journal.entry(ckpt), ckpt in self.preexisting, force):
            self.post(Marker(ckpt=ckpt, rule=self.rule.kind(ckpt),
                             global_files=global_candidates(self.rule, self.paths.spool, ckpt)))

    def on_saved_again(self, name: str) -> bool:
        """The watcher saw a save of `name` settle (its thread; the first one too).
        This node's n-th own save is its part of version n (stage/saves.py): version n
        is proposed to the coordinator unless known here; a known one captured here
        without it reports the save superseded. False: ask again once the capture of
        that version here ends (it may be taking this save)."""
        following = next_version(name, [*(e.ckpt for e in self.journal.typed()), *self._named])
        candidates = global_candidates(self.rule, self.paths.spool, name)
        if candidates and all(mirrored_before(self.journal, self.node, following, path, spool_file(
                self.paths.spool, name, path)) for path in candidates):
            return True     # the mirror put another node's save here: none of ours
        generation = self.rule.generation(self.paths.spool, name)
        count = self.w.capture.saves.note(name, generation, split(following)[1] - 1)
        ckpt = versioned(name, count)
        if not count or ckpt in self._named:
            return True
        entry = self.journal.entry(ckpt)
        if entry is None:
            if count > 1:       # the first: on_marker (the watcher's on_commit) posts it
                self._named.add(ckpt)
                self.events.emit("saved_again", ckpt=ckpt, name=name)
                self.post(Marker(ckpt=ckpt, rule=self.rule.kind(name),
                                 global_files=candidates))
            return True
        if self.w.capture.busy(ckpt):
            return False
        if entry.captured and taken(entry) != generation_json(generation):
            log.info("node %d: its save of %s came after that version was captured here",
                     self.node, ckpt)
            self.post(Superseded(ckpt=ckpt, saves=1))
        return True

    def drained(self, busy: bool) -> None:
        """Draining: `drained` to the coordinator once nothing is left (or time is up)."""
        if policy.drained(busy or self.w.capture.busy() or bool(self.w.flusher.pending()),
                          time.monotonic() >= self.drain_deadline, self._drained_sent):
            self._drained_sent = True
            unflushed = self.w.flusher.pending()
            self.events.emit("drained", unflushed=unflushed)
            self.report(Drained(unflushed=unflushed))

    def retain(self) -> None:
        in_use = set(self.w.flusher.pending())
        if self.w.protector is not None:
            in_use |= self.w.protector.pending()
        wanted = lambda c: self.announced.get(c, policy.Announced()).flush  # noqa: E731
        for ckpt in retain_stage(self.config.keep.stage, self.journal, self.paths, in_use,
                                 wanted, self.events, self.w.remover):
            self.report(Evicted(ckpt=ckpt))
        forget_ended(self.journal, in_use, self.config.keep.replica)

    # ------------------------------------------------------------------ effects
    def _Announce(self, e: policy.Announce) -> None:
        self.announced[e.ckpt] = e.announced
        self.received_at.setdefault(e.ckpt, time.time())

    def _Capture(self, e: policy.Capture) -> None:
        a = self.announced[e.ckpt]
        self.w.capture.submit({"ckpt": e.ckpt, "seq": a.seq, "path": a.path, "flush": a.flush,
                               "global_files": list(a.global_files),
                               "received": self.received_at.get(e.ckpt)})

    def _Post(self, e: policy.Post) -> None:
        self.post(e.message)

    def _Protect(self, e: policy.Protect) -> None:
        assert self.w.protector is not None
        self.w.protector.protect(e.manifest, _source(e.entry), e.entry, e.fed_wait)

    def _GroupReady(self, e: policy.GroupReady) -> None:
        assert self.w.protector is not None
        self.w.protector.group_ready(e.manifest, _source(e.entry), e.entry)

    def _ResumeProtection(self, e: policy.ResumeProtection) -> None:
        assert self.w.protector is not None
        self.w.protector.resume(e.manifest, _source(e.entry), e.entry)

    def _StreamFile(self, e: policy.StreamFile) -> None:
        assert self.w.protector is not None
        self.w.protector.file_captured(e.message)

    def _ReplicatedAlready(self, e: policy.ReplicatedAlready) -> None:
        assert self.w.protector is not None
        self.post(replicated(e.ckpt, self.w.protector.partners, adopted=True))

    def _Flush(self, e: policy.Flush) -> None:
        self.w.flusher.submit(e.manifest, _source(e.entry))

    def _FlushedAlready(self, e: policy.FlushedAlready) -> None:
        bundle = e.bundle or bundle_path(self.paths.pfs, e.ckpt, self.node).name
        self.post(flushed_report(e.ckpt, self.node, bundle, 0.0, adopted=True))

    def _ShareGlobals(self, e: policy.ShareGlobals) -> None:
        self.w.globals.share(e.ckpt, _source(e.entry), list(e.files), self.others)
        self.journal.update(e.ckpt, globals_shared=True)

    def _Remember(self, e: policy.Remember) -> None:
        self.journal.update(e.ckpt, **e.fields)

    def _Mirror(self, e: policy.Mirror) -> None:
        self.w.mirror.mirror(e.ckpt)

    def _Finalize(self, e: policy.Finalize) -> None:
        self.w.uplink.forget(e.ckpt)
        self.events.emit("counters", ckpt=e.ckpt, **self.counters())
        if e.record:
            self.stages.record(Stage.COMMIT, State.DONE, e.ckpt, e.seq,
                               persist={"global": e.digest})

    def _Abandon(self, e: policy.Abandon) -> None:
        self.w.uplink.forget(e.ckpt)
        self.w.capture.cancel(e.ckpt)
        self.w.flusher.cancel(e.ckpt)
        if self.w.protector is not None:
            self.w.protector.cancel(e.ckpt)
        if e.discard:
            self.w.remover.discard(self.paths.stage, self.paths.stage_dir(e.ckpt))
        self.stages.record(Stage.COMMIT, State.FAILED, e.ckpt, e.seq,
                           persist={"reason": e.reason}, error=e.reason)
        self.w.watcher.forget(e.ckpt)

    def _Retain(self, _e: policy.Retain) -> None:
        self.retain()

    def _LeaveUnprotected(self, e: policy.LeaveUnprotected) -> None:
        log.warning("node %d: %s", self.node, e.note)
        self.events.emit("catch_up_skipped", ckpts=e.ckpts, reason=e.note)
        self.report(Unprotected(ckpts=e.ckpts, note=e.note))

    def _Report(self, e: policy.Report) -> None:
        self.report(e.report)

    def _StartDrain(self, _e: policy.StartDrain) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.flush.drain_timeout
        self.w.watcher.stop()

    def _WantFlush(self, e: policy.WantFlush) -> None:
        self.decide(e)


def _source(entry: JournalEntry) -> Path:
    """The captured copy an effect hands to a worker (the policy asked for a captured
    checkpoint, whose entry names it)."""
    assert entry.source is not None, entry.ckpt
    return Path(entry.source)
