"""The coordinator (agent rank 0, the metadata host): global levels of every checkpoint.

It never moves data. It hears small messages from the agents, and `decisions.decide`
(a pure function; the protocol is described there) says what follows. This module
carries the effects out:

  main thread   messages to agents (at once: one agent by `send`, every agent or the
                metadata holders by one frame that the agents forward, relay.py),
                events, log lines
  lane "pfs"    global manifests, index and status on the PFS; purges; the node's
                events appended to its PFS log when a checkpoint ends (flushed or
                failed) and at close, so the level times reach the PFS too
  lane "journal" coordinator.json and status in the journal
  lane "model"  the path choice's Monte Carlo and its stage samples; the forecasts of
                the checkpoints in flight (forecasts.py)

so a hung PFS (or a slow model) never holds up the thread that services MPI: credits,
commits and the levels below `flushed` go on. Status, index and coordinator.json are
snapshots offered latest-wins (lanes.py): a slow PFS coalesces them instead of growing
a backlog. A finalize is a round trip: the `pfs` lane writes the global manifest and
then the index, and only its answer moves the checkpoint to `flushed`.

`status.json` carries a heartbeat (beat, life, time, pid, host, period), rewritten at
least every HEARTBEAT seconds while the coordinator runs, `beat` one higher each time:
readers tell live agents from a status file that dead ones left behind by watching
`beat` move, never by comparing its time with their clock (status.py).

`clock` drives every decision: the agent's monotonic clock net of its own stalls
(liveness.OwnClock), so a coordinator that was stopped neither expires its deadlines
nor blames the agents for its own stall; `wall` is only recorded and shown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from . import layout, relay
from .config import Config
from .decisions import (
    HEARTBEAT,
    HISTORY,
    Broadcast,
    CheckpointRecord,
    Choose,
    CoordinatorState,
    Emit,
    Finalize,
    FinalizeDone,
    Heard,
    Hold,
    Log,
    NodeRecord,
    Observe,
    PathChosen,
    Purge,
    Resend,
    SaveGlobal,
    SaveState,
    Send,
    Settings,
    Tick,
    WriteIndex,
    WriteStatus,
    decide,
    index_rows,
    notes,
    silent_rows,
    skipped,
    state_text,
    status_rows,
)
from .events import EventCopy, EventLog
from .forecasts import Forecasts
from .fsutil import makedirs, remove_under, write_json
from .index import Index, NotAnIndex, read_index, write_index
from .journal import Journal
from .lanes import Lane
from .manifest import GlobalManifest
from .messages import Report, report_of, wire
from .metrics import MetricsFile, metrics_file
from .model.advice_store import load_advice
from .model.choose import LEARNED, PathChooser, fixed_choice
from .peer.redundancy import redundancy_of
from .safepath import UnsafeInput
from .uplink import expand

__all__ = ["HEARTBEAT", "HISTORY", "Coordinator"]
log = logging.getLogger(__name__)
FRAMES_KEPT = 256       # tree frames kept to send again to a node that missed them
ADVICE_EVERY = 30.0     # s: how often the last `cachex advise` is read again (pfs lane)
SendFn = Callable[[int, dict[str, Any]], None]
#: (frame, the nodes to send it to, whether this node's own agent reads it too)
ForwardFn = Callable[[bytes, list[int], bool], None]


class Coordinator:
    """`wake` (called from a lane when it has an answer) makes the lanes threads; without
    it every effect is carried out at once, on the caller's thread (tests, simulation).
    `forward` sends a relay frame to the first hops (the agent's MPI); without it every
    node the route reaches gets the frame's message by `send` (in one process).
    `holders`: the metadata holders, who get every whole global manifest."""

    def __init__(self, config: Config, ranks_by_node: list[int], journal: Journal,
                 pfs_run: Path, events: EventLog, send: SendFn,
                 clock: Callable[[], float] = time.monotonic, can_replicate: bool = True,
                 wake: Callable[[], None] | None = None,
                 events_copy: EventCopy | None = None, forward: ForwardFn | None = None,
                 holders: list[int] | None = None,
                 wall: Callable[[], float] = time.time, generation: int = 0) -> None:
        """`generation`: the run lock's count of this run's coordinators (runlock.py),
        which orders two coordinators' statuses without their clocks."""
        self.config = config
        self.forward = forward or self._deliver_in_process
        self.holders = list(holders or [])
        self.events_copy = events_copy
        self.ranks = ranks_by_node
        self.journal = journal
        self.pfs_run = pfs_run
        self.events = events
        self.send = send
        self.clock, self.wall = clock, wall
        self.life, self.beat = secrets.token_hex(8), 0     # the status's heartbeat
        self.generation = generation
        self.wake = wake or (lambda: None)
        threaded = wake is not None
        self.lanes = {name: Lane(name, threaded) for name in ("pfs", "journal", "model")}
        self.results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.chooser = PathChooser(config, len(ranks_by_node), can_replicate)
        self.forecasts = Forecasts(self.chooser, self.lanes["model"].offer, self._feed_model)
        self.metrics = metrics_file(config)
        self._metrics_due, self._metrics_state = 0.0, ""
        self._observed: deque[Observe] = deque(
            maxlen=config.model.window * len(ranks_by_node) * len(LEARNED))
        self.state = self._restored(can_replicate)
        self._frames: deque[tuple[int, dict[str, Any]]] = deque(maxlen=FRAMES_KEPT)
        self._number = 0        # the newest tree frame's
        # the last `cachex advise` (advice.json on the PFS), read on the pfs lane: the
        # status and the metrics carry it
        self._advice: dict[str, Any] | None = None
        self._advice_due = float("-inf")

    def _restored(self, can_replicate: bool) -> CoordinatorState:
        saved = self.journal.read(layout.COORDINATOR_STATE)
        source = self.journal.root / layout.COORDINATOR_STATE
        if not saved:
            saved, source = self._from_index(), layout.index_path(self.pfs_run)
        ckpts = {key: CheckpointRecord.from_json(data, source, key)
                 for key, data in saved.get("ckpts", {}).items()}
        c = self.config
        now = self.clock()
        for record in ckpts.values():
            if record.level == "written":   # no agent could capture while none ran
                record.deadline = now + c.commit.timeout + c.agent.timeout
        fixed = fixed_choice(c.model.path, can_replicate)
        settings = Settings(c.run, c.commit.timeout, c.agent.timeout, c.flush.every,
                            c.flush.drain_timeout, c.keep.pfs,
                            (fixed.path, fixed.reason) if fixed else None)
        return CoordinatorState(settings, [NodeRecord(rank) for rank in self.ranks], ckpts,
                                saved.get("next_seq", 1), wall_offset=self.wall() - now)

    def _from_index(self) -> dict[str, Any]:
        """A coordinator without a journal (its node was replaced) learns from the PFS
        what was flushed, so it neither re-flushes nor reuses sequence numbers."""
        try:
            rows = read_index(self.pfs_run).checkpoints
        except (OSError, NotAnIndex):      # none, or not an index: an unsafe one raises
            return {}
        ckpts = {row.id: {"id": row.id, "seq": row.seq, "level": row.level,
                          "bytes": row.bytes, "times": {"flushed": row.flushed_at}}
                 for row in rows}
        return {"ckpts": ckpts, "next_seq": max((r.seq for r in rows), default=0) + 1}

    @property
    def nodes(self) -> int:
        return len(self.ranks)

    @property
    def ckpts(self) -> dict[str, CheckpointRecord]:
        return self.state.ckpts

    @property
    def next_seq(self) -> int:
        return self.state.next_seq

    # ------------------------------------------------------------- the loop's calls
    def handle(self, node: int, msg: Report | dict[str, Any]) -> None:
        """A report of node `node`: typed (it came alone: messages.decode), or the dict
        of a batch or of this process's own uplink (checked as it came, typed here)."""
        now = self.clock()
        if not isinstance(msg, dict):
            self._report(dataclasses.replace(msg, now=now))
            return
        if msg["type"] == "reduced":        # a subtree's reports of one level (uplink.py)
            self._apply_all(expand(msg, now))
            return
        try:
            self._report(report_of({**msg, "node": node}, f"report of node {node}", now))
        except UnsafeInput as exc:
            log.warning("coordinator: refused %s", exc)

    def heard(self, node: int) -> None:
        """Node 0's agent received a message from `node` itself: a suspect is back."""
        if 0 <= node < self.nodes and self.state.nodes[node].skipped:
            self._apply(Heard(self.clock(), node))

    def _report(self, report: Report) -> None:
        if self._in_range(report):
            self._apply(report)

    def _in_range(self, report: Report) -> bool:
        if 0 <= report.node < self.nodes:
            return True
        log.warning("coordinator: a %r report names node %d of %d", report.TYPE,
                    report.node, self.nodes)
        return False

    def tick(self) -> None:
        """The lanes' answers, then the timers (capture deadlines, retries, status)."""
        self._answers()
        self._apply(Tick(self.clock(), self.wall()))

    def close(self, timeout: float) -> None:
        """Finish the lanes' work (the final status), up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        self._copy_events()
        for lane in self.lanes.values():
            if not lane.close(max(0.0, deadline - time.monotonic())):
                log.warning("coordinator: %s writes not finished after %.0fs; leaving them",
                            lane.name, timeout)

    def _apply(self, event: Any) -> None:
        self.state, effects = decide(self.state, event)
        for effect in effects:
            self._carry_out(effect)
        self._answers()

    def _apply_all(self, reports: Iterable[Report]) -> None:
        """A subtree's reports of one level: decided one by one, their effects carried
        out after the last (10,000 reports of a level cost 10,000 passes over the lanes'
        answers otherwise)."""
        effects: list[Any] = []
        for report in reports:
            if self._in_range(report):
                self.state, out = decide(self.state, report)
                effects += out
        for effect in effects:
            self._carry_out(effect)
        self._answers()

    def _answers(self) -> None:
        while True:
            try:
                answer = self.results.get_nowait()
            except queue.Empty:
                return
            self._apply(answer)

    def _answer(self, event: Any) -> None:
        """From a lane: the main thread decides on it at its next turn."""
        self.results.put(event)
        self.wake()

    # ------------------------------------------------------------------ effects
    def _carry_out(self, effect: Any) -> None:
        kind = type(effect)
        if kind is Send:
            self.send(effect.rank, wire(effect.msg))
        elif kind is Broadcast:
            # the nodes left out of the tree (dead or silent) get it directly: one that
            # was only slow hears the message, and no subtree hangs below it
            skipped = self._skipped()
            self._number += 1
            msg = wire(effect.msg)
            self._frames.append((self._number, msg))
            self._relay(relay.Route("tree", self.config.agent.fanout, skipped,
                                    number=self._number), msg, local=True, also=skipped)
        elif kind is Hold:
            chain = tuple(n for n in self.holders if not self.state.nodes[n].skipped)
            if chain:
                self._relay(relay.Route("chain", chain=chain), wire(effect.msg))
        elif kind is Observe:
            self._observed.append(effect)
            self.lanes["model"].offer("observe", self._feed_model)
        else:
            self._EFFECTS[kind](self, effect)

    def _relay(self, route: relay.Route, msg: dict[str, Any], local: bool = False,
               also: tuple[int, ...] = ()) -> None:
        """Serialized once, whatever the number of nodes it reaches."""
        self.forward(relay.frame(route, msg),
                     [*relay.next_hops(route, 0, self.nodes), *also], local)

    def _skipped(self) -> tuple[int, ...]:
        return skipped(self.state)

    def _deliver_in_process(self, frame: bytes, hops: list[int], local: bool) -> None:
        route, body = relay.parse(frame, self.nodes, "coordinator")
        msg = relay.message(body)
        todo = [*hops, *([0] if local else [])]
        while todo:
            node = todo.pop()
            self.send(self.ranks[node], msg)
            if node != 0:
                todo += relay.next_hops(route, node, self.nodes)

    def _emit(self, effect: Emit) -> None:
        self.events.emit(effect.event, **effect.fields)
        if effect.event in ("level_flushed", "failed"):
            self._copy_events()

    def _copy_events(self) -> None:
        copy = self.events_copy
        if copy is not None:
            self._offer("pfs", "events", lambda: _copy_events_quietly(copy))

    def _log(self, effect: Log) -> None:
        getattr(log, effect.level)("%s", effect.text)

    def _save_state(self, _effect: SaveState) -> None:
        snapshot = state_text(self.state)
        self._offer("journal", "state", lambda: self.journal.write_bytes(
            layout.COORDINATOR_STATE, snapshot))

    def _write_status(self, _effect: WriteStatus | None = None) -> None:
        self._read_advice()
        status = self.status()
        self._offer("journal", "status", lambda: self.journal.write(layout.STATUS, status))
        self._offer("pfs", "status", lambda: _write_pfs_status(self.pfs_run, status))
        # at once when the agents' state changed (their last word before they exit)
        due = self._metrics_due if status["state"] == self._metrics_state else 0.0
        if self.metrics is not None and self.clock() >= due:
            self._metrics_due = self.clock() + self.config.metrics.period
            self._metrics_state = status["state"]
            pending = {name: lane.pending() for name, lane in self.lanes.items()}
            metrics = self.metrics
            self._offer("journal", "metrics",
                        lambda: _write_metrics_quietly(metrics, status, pending))

    def _write_index(self, _effect: WriteIndex) -> None:
        index = Index.build(self.config.run, index_rows(self.state))
        self._offer("pfs", "index", lambda: _write_index_quietly(self.pfs_run, index))

    def _save_global(self, effect: SaveGlobal) -> None:
        """On this thread: the agent of rank 0 writes the same file when it hears the
        broadcast, and two writers of one file in one process share its temporary."""
        self.journal.save_global(effect.manifest)

    def _finalize(self, effect: Finalize) -> None:
        index = Index.build(self.config.run, effect.index)

        def work() -> None:
            error = _write_finalized(self.pfs_run, effect.manifest, index)
            self._answer(FinalizeDone(self.clock(), effect.ckpt, effect.manifest, error))
        if not self.lanes["pfs"].offer(("finalize", effect.ckpt), work):
            self.results.put(FinalizeDone(self.clock(), effect.ckpt, effect.manifest,
                                          "PFS writes backed up"))

    def _purge(self, effect: Purge) -> None:
        for ckpt in effect.ckpts:
            self._offer("pfs", ("purge", ckpt), lambda c=ckpt: _remove_quietly(self.pfs_run, c))

    def _choose(self, effect: Choose) -> None:
        prepared = self.chooser.choose_prepared(effect.size, effect.now)
        if prepared is not None:        # the agents need not wait for a Monte Carlo
            self.results.put(PathChosen(self.clock(), effect.ckpt, prepared.path,
                                        prepared.reason, prepared.loss))
            self._offer("model", ("prepare", effect.ckpt), lambda: self._prepare(effect.size))
            return

        def work() -> None:
            self._feed_model()
            choice = self.chooser.choose(effect.size, effect.now)
            self._answer(PathChosen(self.clock(), effect.ckpt, choice.path, choice.reason,
                                    choice.loss))
            self.chooser.prepare(effect.size)
        if not self.lanes["model"].offer(("choose", effect.ckpt), work):
            path = self.chooser.current
            self.results.put(PathChosen(self.clock(), effect.ckpt, path,
                                        f"model busy: {path} as the last checkpoint"))

    def _prepare(self, size: float) -> None:
        self._feed_model()
        self.chooser.prepare(size)

    def _feed_model(self) -> None:
        """On the model's lane: the stage samples reported since the last call."""
        while self._observed:
            o = self._observed.popleft()
            self.chooser.observe(o.stage, o.ckpt, o.node, o.nbytes, o.seconds)

    def _read_advice(self) -> None:
        now = self.clock()
        if now < self._advice_due:
            return
        self._advice_due = now + ADVICE_EVERY
        config = self.config

        def work() -> None:
            self._advice = load_advice(config)
        self._offer("pfs", "advice", work)

    def _resend(self, effect: Resend) -> None:
        """The tree frames a node missed (a stalled parent held them), to it directly,
        in order; one older than the FRAMES_KEPT newest is gone (logged)."""
        kept = [msg for n, msg in self._frames if effect.first <= n <= effect.last]
        if len(kept) < effect.last - effect.first + 1:
            log.warning("coordinator: node %d missed frames %d-%d; only %d are kept",
                        effect.node, effect.first, effect.last, len(kept))
        for msg in kept:
            self.send(self.ranks[effect.node], msg)

    def _offer(self, lane: str, key: Any, work: Callable[[], None]) -> None:
        if not self.lanes[lane].offer(key, work):
            log.warning("coordinator: %s lane full; %s not written", lane, key)

    _EFFECTS: dict[type, Callable[[Coordinator, Any], None]] = {
        Emit: _emit, Log: _log, SaveState: _save_state, WriteStatus: _write_status,
        WriteIndex: _write_index, SaveGlobal: _save_global, Finalize: _finalize,
        Purge: _purge, Choose: _choose, Resend: _resend}

    # ------------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        now = self.wall()       # shown, not compared: the reader's clock may differ
        self.beat += 1
        extra = {"stop_ack": self.state.stop_ack} if self.state.stop_ack else {}
        if self._advice is not None:
            extra["advice"] = self._advice
        return {"format": "cachex-status", "version": 1, "run": self.config.run,
                "updated": now, "state": self.state.phase, "nodes": self.nodes,
                "heartbeat": {"beat": self.beat, "life": self.life, "t": now,
                              "generation": self.generation,
                              "pid": os.getpid(), "host": socket.gethostname(),
                              "period": HEARTBEAT}, **extra,
                "redundancy": redundancy_of(self.config).status(self.nodes),
                "notes": notes(self.state),
                "silent": silent_rows(self.state, self.clock(), self.config.agent.fanout),
                "checkpoints": self.forecasts.annotate(status_rows(self.state))}

    def write_status(self) -> None:
        """Into the journal always; onto the PFS when it takes writes."""
        self._write_status()


# --------------------------------------------------------------- on the pfs lane
def _write_finalized(pfs_run: Path, manifest: GlobalManifest, index: Index) -> str | None:
    """The global manifest, then the index that calls it valid; the error, if any."""
    try:
        makedirs(layout.pfs_ckpt_dir(pfs_run, manifest.ckpt))
        manifest.save(layout.pfs_manifest_path(pfs_run, manifest.ckpt))
        write_index(pfs_run, index)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _write_index_quietly(pfs_run: Path, index: Index) -> None:
    try:
        write_index(pfs_run, index)
    except OSError as exc:
        log.warning("index.json not updated: %s", exc)


def _write_pfs_status(pfs_run: Path, status: dict[str, Any]) -> None:
    try:
        makedirs(pfs_run)
        write_json(layout.pfs_status_path(pfs_run), status)
    except OSError:
        pass                # the journal's copy is the one that counts


def _write_metrics_quietly(metrics: MetricsFile, status: dict[str, Any],
                           pending: dict[str, int]) -> None:
    try:
        metrics.write(metrics.text(status, pending))
    except OSError as exc:
        log.warning("metrics file %s not written: %s", metrics.path, exc)


def _copy_events_quietly(copy: EventCopy) -> None:
    try:
        copy.copy()
    except OSError as exc:
        log.warning("events not copied to the PFS (the next checkpoint retries): %s", exc)


def _remove_quietly(pfs_run: Path, ckpt: str) -> None:
    try:
        remove_under(layout.pfs_ckpts_dir(pfs_run), layout.pfs_ckpt_dir(pfs_run, ckpt))
    except OSError as exc:
        log.warning("purge of %s on the PFS failed: %s", ckpt, exc)
