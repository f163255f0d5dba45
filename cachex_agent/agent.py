"""The agent: one per node, beside the trainer, in its own MPI job.

Threads and who does what:
  main     every MPI call (messages to and from the coordinator), the coordinator's
           decisions on rank 0, stop requests; ticks every `agent.poll` seconds
           (IDLE_TICK after IDLE_AFTER seconds with nothing to do, PEER_TICK while a
           peer message is due: `Replicator.waits_on_peer`), and at once when a worker
           thread puts a message into the inbox
  watch    the spool (inotify + rescans): commit markers -> inbox
  capture  one checkpoint at a time: spool -> stage, checksums, local manifest
           (stage/worker.py)
  flush-*  stage -> PFS bundles (flush/flusher.py), low priority, throttled
  encode   `peer.scheme` xor / rs:K+M: the group's erasure encoding (peer/encoder.py),
           the one thread beside main that calls MPI, on its group's communicator only
  lane-*   rank 0: the coordinator's file writes and model (coordinator.py), so a hung
           PFS never holds up this loop
Worker threads never call MPI: they put messages into `inbox` (inbox.py), which the
main thread forwards. That keeps MPI single-threaded in practice and every wait bounded.
The one exception is `fatal`: an unexpected error in any thread ends the agent at once
(one line, an event, then MPI Abort naming the rank), never a thread that silently stops.

Each stage of each checkpoint (capture, replicate, flush, commit) is a handle
(handles.py) whose state the journal keeps; a restarted agent resumes from those states
(`_resume`, docs/architecture.md).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from mpi4py import MPI

from . import relay
from .cleanup import remove_stale
from .collective import agree
from .config import Config
from .coordinator import Coordinator
from .errors import describe
from .events import EventCopy, EventLog
from .flush.flusher import Flusher, flushed_report
from .handles import ENDED, Stage, StageLog, State, is_done, is_failed, stage_state
from .inbox import Inbox, exit_watchdog
from .index import NotAnIndex, read_index
from .journal import Journal
from .layout import (
    bundle_path,
    events_path,
    journal_status_path,
    journal_stop_file,
    pfs_events_path,
    pfs_stop_file,
)
from .manifest import LocalManifest
from .messages import (
    PEER,
    TO_COORDINATOR,
    Captured,
    CaptureFailed,
    Commit,
    Drain,
    Drained,
    Evicted,
    Exit,
    Failed,
    FileCaptured,
    Finalized,
    GlobalFile,
    HoldManifest,
    ManifestReady,
    Marker,
    Protected,
    Replicated,
    Report,
    Reroute,
    Stop,
    Tag,
    ToNode,
    Unprotected,
    decode,
    wire,
)
from .node_dirs import prepare_dirs
from .peer.encoder import erasure_groups, start_encoder
from .peer.feed import Feed
from .peer.globals import GlobalFiles
from .peer.mirror import Mirror
from .peer.partners import domains_of, metadata_holders, replication_map
from .peer.redundancy import Protector, redundancy_of, replicated
from .peer.replicator import Replicator
from .priority import bind_cpus, cpu_list, lower_process, streams
from .rules import make_rule, natural_key
from .rules.quiescence import pid_namespace, skip_processes
from .runlock import RunLock, stale_after
from .safepath import UnsafeInput
from .stage.remover import Remover
from .stage.retention import forget_ended, retain_stage
from .stage.watch import SpoolWatcher
from .stage.worker import CaptureWorker, global_candidates
from .topology import place_checked
from .uplink import DIRECT, Uplink
from .usage import usage

log = logging.getLogger(__name__)
IDLE_AFTER = 2.0    # seconds without a message or work in flight before the loop slows down
IDLE_TICK = 0.1     # the slowed tick: a first message from another agent waits this long
# MPICH moves messages only inside MPI calls, and a thread blocked in one spins (a third
# to a half of a core here at load 8) where a 1 ms Iprobe tick costs 2-3% of one
# (docs/benchmarks.md#the-main-loops-wait): poll this fast only while a peer message is due
PEER_TICK = 0.001
# after this node's watcher saw a checkpoint committed, the coordinator's commit follows
# within a few turns (it commits on the first marker it hears; on node 0 it comes back
# through the loop's own frames): poll for it at PEER_TICK that long, not at the idle
# tick, which added up to 20 ms to commit -> partner-durable (2-3% of a core, at most 1 s)
COMMIT_WAIT = 1.0


def peer_tick(protector: Protector | None) -> float | None:
    """PEER_TICK while a credit, an ack or a slot is due over MPI (poll for it), else
    None: the loop's own tick, which the agent's threads cut short through the inbox."""
    return PEER_TICK if protector is not None and protector.waits_on_peer() else None


class Agent:
    def __init__(self, config: Config, comm: Any) -> None:
        self.config = config
        self.comm = comm
        self.placement = place_checked(comm, config.topology)
        self.rank, self.node = self.placement.rank, self.placement.node
        agents_here = self._agents_on_host()
        skip_processes(agents_here)
        for problem in lower_process(config.agent.nice, config.agent.sched, agents_here):
            log.warning("agent.nice/agent.sched: %s", problem)
        self.cpus = agree(comm, "agent.cpus", lambda: bind_cpus(config.agent.cpus))
        groups = erasure_groups(comm, config, list(self.placement.hosts))   # before any dir
        self.paths = agree(comm, "start-up", lambda: prepare_dirs(config, self.placement))
        self.rule = make_rule(config.commit.rule, config.commit.settle, config.commit.globals)
        self.journal = agree(comm, "journal", lambda: Journal(
            self.paths.journal, (self.paths.stage, self.paths.spool)))
        self.events = EventLog(events_path(self.paths.journal), run=config.run,
                               node=self.node, rank=self.rank, host=self.placement.host)
        self.stages = StageLog(self.events, self.journal)   # journal first, then event
        # before any agent touches the PFS: a second job on this run removes nothing
        self.run_lock = agree(comm, "run lock", lambda: RunLock.acquire(
            self.paths.pfs, stale_after(config.agent.timeout))
            if self.rank == 0 else None)
        if self.rank != 0:
            # a status in this journal says this host is the coordinator (`cachex status`
            # run here reads it): not true for this job, whatever an earlier one left
            journal_status_path(self.paths.journal).unlink(missing_ok=True)
        self._remove_stale()
        self.inbox = Inbox()
        self.announced: dict[str, dict[str, Any]] = {}
        self.events_copy = EventCopy(self.events.path,
                                     pfs_events_path(self.paths.pfs, self.node))
        self.flusher = Flusher(self.paths.pfs, config.flush, self.events, self.inbox.put,
                               self.stages, self.events_copy)
        self.remover = Remover()        # evicted stage copies, off the main loop
        self.draining = False
        self.drain_deadline = 0.0
        self._drained_sent = False
        self._stop_checked = 0.0
        # stop requests already there are an earlier run's: only new tokens are acted on
        self._stale_stops = {path: stop_token(path) for path in self._stop_files()}
        self._active = time.monotonic()     # when the main loop last had something to do
        self._commit_due: dict[str, float] = {}     # ckpt -> polling for its commit until
        self.exit_now = False
        self._requests: list[Any] = []
        self._signals = 0
        self._dead_agents: list[int] = []
        self._own_frames: list[bytes] = []      # the coordinator's, for this node's agent
        self.ranks_by_node = self._ranks_by_node()
        self.uplink = Uplink(self.node, len(self.ranks_by_node), config.agent.fanout)
        self.received: Counter[str] = Counter()     # bytes by tag (`counters` event)
        self.turns = 0                              # of the main loop (`counters` event)
        self.node_of_rank = {r: n for n, r in enumerate(self.ranks_by_node)}
        # collective, both: every rank takes the same decision from the config
        replicator = agree(comm, "peer set-up", self._make_replicator)
        encoder = start_encoder(comm, config, groups, self.node, self.paths, self.stages,
                                self.inbox.put)
        self.protector: Protector | None = replicator or encoder
        self.coordinator = agree(comm, "coordinator", lambda: Coordinator(
            config, self.ranks_by_node, self.journal, self.paths.pfs, self.events, self._send,
            can_replicate=self.protector is not None,
            wake=self.inbox.wake, events_copy=self.events_copy, forward=self._forward,
            holders=self._holders(), generation=self.run_lock.generation)
            if self.rank == 0 else None)
        self.globals = GlobalFiles(comm, self.paths.journal, self._send_peer,
                                   config.agent.timeout)
        self.watcher = SpoolWatcher(self.paths.spool, self.rule, self._on_marker,
                                    scan=config.commit.scan)
        self.capture = CaptureWorker(config, self.paths, self.placement, self.rule,
                                     self.journal, self.stages, self.inbox.put,
                                     self.watcher.first_seen, self.watcher.removed,
                                     self.protector.feed if self.protector else None)
        self.mirror = Mirror(self.journal, self.paths, self.node, self.events,
                             config.commit.mirror)
        self._from_coordinator = {
            Commit: self._on_commit, ManifestReady: self._on_manifest,
            HoldManifest: self._on_hold, Finalized: self._on_finalized,
            Protected: self._on_protected,
            Failed: self._on_failed, Drain: self._on_drain, Exit: self._on_exit,
            Reroute: lambda _msg: None}     # the frame's route was the news (uplink.py)
        self._preexisting = set(self._committed_now())

    def _remove_stale(self) -> None:
        """Before any thread writes: what an earlier life of this node left half-done."""
        removed = remove_stale(self.paths, self.node, coordinator=self.rank == 0)
        if removed:
            log.info("removed %d stale temporaries of an earlier agent", len(removed))
            self.events.emit("stale_removed", count=len(removed), paths=removed)

    def _make_replicator(self) -> Replicator | None:
        """Collective (the window): every rank takes the same decision from the config."""
        pmap = replication_map(self.config, list(self.placement.hosts))
        if pmap is None or not redundancy_of(self.config).replicas:
            return None         # flush-only (asked for, or one failure domain), or erasure
        # one partner: the capture hands a linked file's pieces to the replication as
        # it hashes them (one read of the bytes, peer/feed.py); with more, the feed's
        # buffers would wait for the slowest partner
        one = len(pmap[self.placement.node]) == 1
        feed = Feed(self.config.peer.slot, wake=self.inbox.wake) if one else None
        return Replicator(self.comm, self.placement.node, pmap, self.ranks_by_node,
                          self.config, self.paths, self.events, self._send_peer,
                          self.inbox.put, self.stages, wake=self.inbox.wake, feed=feed,
                          streams=streams(self.config.peer.streams, len(self.cpus)))

    def _holders(self) -> list[int]:
        domains = domains_of(self.config.topology.domain, list(self.placement.hosts))
        return metadata_holders(domains, self.config.peer.copies)

    def _agents_on_host(self) -> list[int]:
        """This job's agents on this host (one, or a test's virtual nodes): they never
        write a checkpoint, so the writer check need not walk their descriptors."""
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            mine = pid_namespace()
            return [pid for ns, pid in local.allgather((mine, os.getpid())) if ns == mine]
        finally:
            local.Free()

    def _ranks_by_node(self) -> list[int]:
        pairs = self.comm.allgather((self.node, self.rank))
        return [rank for _node, rank in sorted(pairs)]

    def _committed_now(self) -> list[str]:
        try:
            return self.rule.committed(self.paths.spool)
        except OSError:
            return []

    # --------------------------------------------------------------- lifecycle
    def run(self) -> int:
        self._install_signals()
        threading.excepthook = self._thread_failed
        self.events.emit("agent_start", spool=str(self.paths.spool), pfs=str(self.paths.pfs),
                         nodes=self.placement.nodes, pid=os.getpid(),
                         partners=self.protector.partners if self.protector else [],
                         cpus=cpu_list(self.cpus),
                         streams=self.protector.streams if self.protector else 0)
        log.info("agent node %d/%d: spool %s -> stage %s -> pfs %s", self.node,
                 self.placement.nodes, self.paths.spool, self.paths.stage, self.paths.pfs)
        self.capture.start()
        self._resume()
        self.watcher.start()
        try:
            while not self.exit_now:
                self.turns += 1
                if self._step():
                    self._active = time.monotonic()
                self.inbox.wait(self._tick())
        finally:
            # leaving waits on the other agents (the window's free is collective)
            watchdog = exit_watchdog(2 * self.config.agent.timeout)
            self.watcher.stop()
            self.capture.stop()
            left = self.flusher.close(timeout=0)
            self.remover.close(self.config.agent.timeout / 2)
            self.events.emit("agent_exit", unflushed=left)
            if self.coordinator:     # its last status; a hung PFS is left behind
                self.coordinator.close(self.config.agent.timeout / 2)
            self._wait_requests(self.config.agent.timeout)
            if self.protector is not None:
                self.protector.close(free=not self._dead_agents,
                                     timeout=self.config.agent.timeout)
            self.events.close()
            if self.run_lock is not None:
                self.run_lock.release()
            watchdog.cancel()
        return 0

    def _tick(self) -> float:
        """How long the main loop sleeps (a worker's message ends the sleep at once)."""
        if (due := peer_tick(self.protector)) is not None:
            return due
        if self._commit_expected():
            return PEER_TICK
        tick = self.config.agent.poll
        if time.monotonic() - self._active >= IDLE_AFTER:
            # nothing for a while: fewer wake-ups, each costs as much as a step
            tick = max(tick, IDLE_TICK)
        held = self.uplink.next_due()       # reports waiting for the rest of a subtree
        return tick if held is None else min(tick, held)

    def _commit_expected(self) -> bool:
        """This node's part of a checkpoint was written less than COMMIT_WAIT ago and
        its commit has not come yet."""
        now = time.monotonic()
        self._commit_due = {c: t for c, t in self._commit_due.items() if t > now}
        return bool(self._commit_due)

    def _busy(self) -> bool:
        """Work in flight that messages from other agents move on."""
        return bool(self._requests or self.capture.busy() or self.draining
                    or self._replicating())

    def _replicating(self) -> bool:
        return self.globals.busy() or (self.protector is not None and self.protector.busy())

    def _step(self) -> bool:
        """One turn of the main loop; True if it had anything to do."""
        moved = self._drain_inbox() + self._receive()
        if self.protector is not None:
            self.protector.pump()
        for header in self.globals.poll():
            self.events.emit("global_file", ckpt=header.ckpt, path=header.path,
                             bytes=header.size)
            self.mirror.mirror(header.ckpt)
        self._send_up()
        if self.coordinator:
            self.coordinator.tick()
        self._check_stop_files()
        if self.draining:
            self._check_drained()
        self._requests = [r for r in self._requests if not r.Test()]
        return bool(moved) or self._busy()

    def _resume(self) -> None:
        """Resume every checkpoint from its stages' persisted states (handles.py), then
        catch up on what the trainer committed while no agent was watching.

        Captured, not committed: the coordinator hears of it again (a marker) and
        announces it again; `_after_capture` then runs the stages not done (replicate
        and flush), a stage done is never run again. A capture queued or
        running when the agent ended is captured again. Committed, replication cut
        short (the flush runs beside it and may finish first): replicated again."""
        in_order = sorted(self.journal.entries.items(), key=lambda kv: kv[1]["seq"])
        for ckpt, entry in in_order:
            if (is_done(entry, Stage.CAPTURE) and not is_failed(entry)
                    and not is_done(entry, Stage.COMMIT)):
                self._to_coordinator(Marker(ckpt=ckpt,
                                            global_files=entry.get("global_files", [])))
            elif is_done(entry, Stage.COMMIT):
                self._replicate_cut_short(ckpt, entry)
        cut_short = [c for c, e in in_order if c in self._preexisting
                     and stage_state(e, Stage.CAPTURE) in (State.QUEUED, State.RUNNING)]
        known = self._known()
        adopt, skipped = catch_up(self._preexisting, known)
        for ckpt in [*cut_short, *adopt]:   # oldest first: the coordinator numbers new
            self._on_marker(ckpt, force=True)   # ones in the order it hears them
        if adopt:
            self.events.emit("catch_up", ckpts=adopt)
        if skipped:
            note = (f"{', '.join(skipped)} in the spool, not protected: older than"
                    f" {adopt[-1] if adopt else max(known, key=natural_key)}")
            log.warning("node %d: %s", self.node, note)
            self.events.emit("catch_up_skipped", ckpts=skipped, reason=note)
            self._to_coordinator(Unprotected(ckpts=skipped, note=note))

    def _replicate_cut_short(self, ckpt: str, entry: dict[str, Any]) -> None:
        """A finalized checkpoint whose replication was under way (so it was asked for):
        from the captured copy again, while it is held; the coordinator has moved on."""
        manifest = self.journal.manifest(ckpt)
        cut_short = stage_state(entry, Stage.REPLICATE) in (State.QUEUED, State.RUNNING)
        if self.protector is not None and cut_short and manifest and _held(entry):
            self.protector.resume(manifest, Path(entry["source"]), entry)

    def _known(self) -> set[str]:
        """Checkpoints this node already heard of: its journal, and for a node without
        one (replaced), those the PFS index lists."""
        known = set(self.journal.entries)
        if not known:
            try:
                known = read_index(self.paths.pfs).ids()
            except (OSError, NotAnIndex):  # none, or not an index: an unsafe one raises
                pass
        return known

    # -------------------------------------------------------------- messaging
    def _send(self, rank: int, msg: Any, tag: Tag = Tag.COORDINATOR) -> None:
        self._requests.append(self.comm.isend(wire(msg), dest=rank, tag=tag))

    def _send_peer(self, rank: int, msg: Any) -> None:
        self._send(rank, msg, Tag.PEER)

    def _to_coordinator(self, report: Report) -> None:
        """A report (messages.REPORTS), this node's: a part's manifest straight to node
        0, the rest up the tree."""
        report = replace(report, node=self.node)
        if report.TYPE in DIRECT:
            self._send(0, report)
        else:
            self.uplink.add(wire(report))

    def _send_up(self) -> None:
        """The reports due (uplink.py): one batch to this node's parent; on node 0, to
        the coordinator in this process."""
        reports = self.uplink.due()
        if not reports:
            return
        if self.coordinator:
            for report in reports:
                self.coordinator.handle(report["node"], report)
        else:
            self._send(self.ranks_by_node[self.uplink.parent],
                       {"type": "batch", "node": self.node, "reports": reports})

    def _forward(self, frame: bytes, nodes: list[int], local: bool = False) -> None:
        """A relay frame's bytes as they are, to the next hops (relay.py)."""
        for node in nodes:
            self._requests.append(self.comm.Isend([frame, MPI.BYTE],
                                                  dest=self.ranks_by_node[node], tag=Tag.RELAY))
        if local:
            self._own_frames.append(frame)

    def _receive(self) -> int:
        """Handle the messages from other agents that arrived; return how many."""
        count = self._receive_frames()
        status = MPI.Status()
        for tag in (Tag.PEER, Tag.COORDINATOR):
            while self._probe(tag, status):
                source = status.Get_source()
                self.received[tag.name] += status.Get_count(MPI.BYTE)
                raw = self.comm.recv(source=source, tag=tag)
                count += 1
                try:
                    msg = decode(raw, f"message from rank {source}", tag)
                except UnsafeInput as exc:
                    log.error("refused: %s", exc)
                    self.events.emit("refused", error=str(exc))
                    continue
                self._dispatch(source, msg)
        return count

    def _receive_frames(self) -> int:
        """The coordinator's messages down the tree or chain: forwarded before they are
        read, so the nodes below hear them as soon as this one does."""
        frames = [(0, frame, False) for frame in self._own_frames]
        self._own_frames = []
        status = MPI.Status()
        while self._probe(Tag.RELAY, status):
            source = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([buf, MPI.BYTE], source=source, tag=Tag.RELAY)
            self.received[Tag.RELAY.name] += len(buf)
            frames.append((source, buf, True))
        for source, frame, onward in frames:
            where = f"relay frame from rank {source}"
            try:
                route, body = relay.parse(frame, len(self.ranks_by_node), where)
                if route.kind == "tree":
                    self.uplink.reroute(route.skip)
                if onward:
                    self._forward(frame, relay.next_hops(route, self.node,
                                                         len(self.ranks_by_node)))
                msg = decode(relay.message(body), where, Tag.RELAY)
            except UnsafeInput as exc:
                log.error("refused: %s", exc)
                self.events.emit("refused", error=str(exc))
                continue
            self._dispatch(source, msg)
        return len(frames)

    def _dispatch(self, source: int, msg: Any) -> None:
        """One message from another agent to the part of this one that takes it."""
        if isinstance(msg, dict) and msg["type"] == "batch":   # a child's, on its way up
            for report in msg["reports"]:
                if not self.uplink.add(report):
                    self.events.emit("refused", error=f"report from rank {source} names"
                                     f" a node beyond {len(self.ranks_by_node)}")
        elif type(msg).TYPE in TO_COORDINATOR:      # a report that came alone (rank 0)
            if self.coordinator:
                self.coordinator.handle(msg.node, msg)
        elif isinstance(msg, GlobalFile):
            self.globals.on_header(source, msg)
        elif type(msg).TYPE in PEER:
            if self.protector is not None:
                self.protector.handle(self.node_of_rank[source], msg)
        else:
            self._from_coordinator[type(msg)](msg)

    def _probe(self, tag: int, status: Any) -> bool:
        # MPICH: the first probe may only drive progress; a message that has already
        # arrived is often seen by the second one (measured: a whole tick saved)
        return any(self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status)
                   for _ in range(2))

    def _drain_inbox(self) -> int:
        """Forward or handle the worker threads' messages; return how many."""
        count = 0
        while self.inbox.queue:     # unlocked look: a put it misses wakes the next tick
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return count
            count += 1
            if isinstance(msg, ToNode):         # the replica store answers an owner
                self._send_peer(self.ranks_by_node[msg.node], msg.message)
                continue
            if isinstance(msg, FileCaptured):
                self._stream_file(msg)
                continue
            if isinstance(msg, Captured):
                self._after_capture(msg)
            elif isinstance(msg, CaptureFailed) and self.protector is not None:
                self.protector.cancel(msg.ckpt, f"capture failed: {msg.error}")
            elif isinstance(msg, Marker) and msg.ckpt not in self.announced:
                self._commit_due[msg.ckpt] = time.monotonic() + COMMIT_WAIT
            elif isinstance(msg, Replicated):
                self._retain_stage()
                self.flusher.copy_events_soon()
                msg = replace(msg, dead=sorted(self.protector.dead) if self.protector else [])
            self._to_coordinator(msg)
        return count

    def _wait_requests(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            self._requests = [r for r in self._requests if not r.Test()]
            time.sleep(0.01)

    # ------------------------------------------------------- from coordinator
    def _on_manifest(self, msg: ManifestReady) -> None:
        if self.journal.get(msg.ckpt) is not None:      # else: forgotten since
            self.journal.update(msg.ckpt, **{"global": msg.digest.to_json()})
        self.mirror.mirror(msg.ckpt)
        entry, manifest = self.journal.get(msg.ckpt), self.journal.manifest(msg.ckpt)
        if self.protector is not None and self._path(msg.ckpt) == "peer" and entry and manifest:
            self.protector.group_ready(manifest, Path(entry["source"]), entry)

    def _on_hold(self, msg: HoldManifest) -> None:
        """This node is a metadata holder: the whole global manifest, for a recovery
        that has lost the coordinator's node."""
        self.journal.save_global(msg.manifest)

    def _on_exit(self, msg: Exit) -> None:
        self._dead_agents = msg.dead
        self.exit_now = True

    def _on_commit(self, msg: Commit) -> None:
        ckpt = msg.ckpt
        self._commit_due.pop(ckpt, None)
        previous = self.announced.get(ckpt)
        flush = msg.flush or bool(previous and previous["flush"])
        self.announced[ckpt] = {**wire(msg), "flush": flush,
                                "received": (previous or {}).get("received", time.time())}
        if self.capture.busy(ckpt):
            return
        entry = self.journal.get(ckpt) or {}
        manifest = self.journal.manifest(ckpt)
        if is_done(entry, Stage.CAPTURE) and not is_failed(entry) and manifest and _held(entry):
            # a repeated announcement (restart): report what is already held
            self.inbox.put(Captured(ckpt=ckpt, manifest=manifest.to_json(),
                                    mode=entry["mode"], reason=entry.get("mode_reason", ""),
                                    global_files=entry.get("global_files", [])))
            return
        self.capture.submit(self.announced[ckpt])

    def _after_capture(self, msg: Captured) -> None:
        """Captured: the stages not done yet, replicate and flush side by side (both
        read the stage; the flush is throttled and has threads of its own)."""
        ckpt = msg.ckpt
        entry = self.journal.get(ckpt) or {}
        manifest = LocalManifest.from_json(msg.manifest)
        self._share_globals(manifest, entry)
        if self.protector is not None and self._path(ckpt) == "peer":
            if is_done(entry, Stage.REPLICATE):
                # a restart: done here, but the coordinator's state may predate the
                # report, and it records `flushed` only after `replicated`: report it
                # again (not a sample for the model)
                self.inbox.put(replicated(ckpt, self.protector.partners, adopted=True))
            else:
                self.protector.protect(manifest, Path(entry["source"]), entry, msg.fed_wait)
        self._flush_if_wanted(ckpt)
        self._retain_stage()

    def _stream_file(self, msg: FileCaptured) -> None:
        """A file copied while its part is still being captured: its replication starts
        now (the replicator keeps it only if the final manifest agrees)."""
        ckpt = msg.header.ckpt
        replicate = stage_state(self.journal.get(ckpt), Stage.REPLICATE)
        if self.protector is not None and self._path(ckpt) == "peer" and replicate not in ENDED:
            self.protector.file_captured(msg)

    def _path(self, ckpt: str) -> str:
        """The write path the coordinator announced for `ckpt` (`peer` until it has)."""
        return self.announced.get(ckpt, {}).get("path", "peer")

    def _share_globals(self, manifest: LocalManifest, entry: dict[str, Any]) -> None:
        """This node wrote the checkpoint's global files: every journal gets a copy."""
        names = {*self.announced.get(manifest.ckpt, {}).get("global_files", []),
                 *entry.get("global_files", [])}
        held = [e for e in manifest.files if e.path in names]
        if held and not entry.get("globals_shared"):
            others = [r for r in self.ranks_by_node if r != self.rank]
            self.globals.share(manifest.ckpt, Path(entry["source"]), held, others)
            self.journal.update(manifest.ckpt, globals_shared=True)

    def _flush_if_wanted(self, ckpt: str) -> None:
        """Flush a captured checkpoint the coordinator wants on the PFS, unless its flush
        is done already (a restart: the coordinator hears of the bundle again)."""
        entry = self.journal.get(ckpt) or {}
        manifest = self.journal.manifest(ckpt)
        if (not self.announced.get(ckpt, {}).get("flush") or manifest is None
                or not is_done(entry, Stage.CAPTURE) or is_failed(entry)):
            return
        if is_done(entry, Stage.FLUSH):
            bundle = entry.get("bundle") or bundle_path(self.paths.pfs, ckpt, self.node).name
            self.inbox.put(flushed_report(ckpt, self.node, bundle, 0.0, adopted=True))
            return
        self.flusher.submit(manifest, Path(entry["source"]))

    def _on_finalized(self, msg: Finalized) -> None:
        self.uplink.forget(msg.ckpt)
        self._emit_counters(msg.ckpt)
        entry = self.journal.get(msg.ckpt) or {}
        if stage_state(entry, Stage.COMMIT) not in ENDED:
            self.stages.record(Stage.COMMIT, State.DONE, msg.ckpt, entry.get("seq"),
                               persist={"global": msg.digest.to_json()})
        self._retain_stage()

    def _on_protected(self, msg: Protected) -> None:
        if msg.ckpt in self.journal.entries:
            self.journal.update(msg.ckpt, protected=True)
            self._retain_stage()

    def _emit_counters(self, ckpt: str) -> None:
        """What this agent has spent since it started, at each checkpoint's end: the
        metadata's bytes received by tag, the journal's bytes written, turns of the main
        loop (each costs CPU whether or not it has work), CPU seconds in all and by
        thread role (usage.py); benchmarks/scale_agents.py takes differences between two."""
        self.events.emit("counters", ckpt=ckpt, received=dict(self.received),
                         journal_written=self.journal.written, turns=self.turns, **usage())

    def _on_failed(self, msg: Failed) -> None:
        """The coordinator gave up on `ckpt`: every stage of it here stops."""
        ckpt = msg.ckpt
        entry = self.journal.get(ckpt)
        self.uplink.forget(ckpt)
        self.capture.cancel(ckpt)
        self.flusher.cancel(ckpt)
        if self.protector is not None:
            self.protector.cancel(ckpt)
        if entry and entry.get("mode") == "copy":
            self.remover.discard(self.paths.stage, self.paths.stage_dir(ckpt))
        self.stages.record(Stage.COMMIT, State.FAILED, ckpt, (entry or {}).get("seq"),
                           persist={"reason": msg.reason}, error=msg.reason)
        self.watcher.forget(ckpt)

    def _on_drain(self, msg: Drain) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.flush.drain_timeout
        for ckpt in msg.flush:
            if ckpt in self.announced:
                self.announced[ckpt]["flush"] = True
                self._flush_if_wanted(ckpt)
        self.watcher.stop()

    def _check_drained(self) -> None:
        busy = (self.capture.busy() or self.flusher.pending() or not self.inbox.empty()
                or self._replicating())
        if busy and time.monotonic() < self.drain_deadline:
            return
        if not self._drained_sent:
            self._drained_sent = True
            self._to_coordinator(Drained(unflushed=self.flusher.pending()))

    def _retain_stage(self) -> None:
        in_use = set(self.flusher.pending())
        if self.protector is not None:
            in_use |= self.protector.pending()
        for ckpt in retain_stage(self.config.keep.stage, self.journal, self.paths, in_use,
                                 lambda c: self.announced.get(c, {}).get("flush", False),
                                 self.events, self.remover):
            self._to_coordinator(Evicted(ckpt=ckpt))
        forget_ended(self.journal, in_use, self.config.keep.replica)

    # ----------------------------------------------------------------- capture
    def _on_marker(self, ckpt: str, force: bool = False) -> None:
        """Called by the watcher thread (and once at start-up)."""
        if ckpt in self._preexisting and not force:
            return
        known = self.journal.get(ckpt)
        if known is not None and not is_failed(known) and not force:
            return          # e.g. a mirrored `.metadata`: this checkpoint is under way
        self.inbox.put(Marker(ckpt=ckpt,
                              global_files=global_candidates(self.rule, self.paths.spool, ckpt),
                              rule=self.rule.kind(ckpt)))

    # ------------------------------------------------------------------- fatal
    def _thread_failed(self, args: Any) -> None:
        if issubclass(args.exc_type, SystemExit):
            return
        thread = args.thread.name if args.thread is not None else "a thread"
        self.fatal(f"thread {thread}", args.exc_value)

    def fatal(self, where: str, exc: BaseException | None) -> NoReturn:
        """An unexpected error: say so in one line and in the events, then end this
        agent and its job (the others would wait on it forever)."""
        error = f"{type(exc).__name__}: {describe(exc)}" if exc else "unknown error"
        log.error("agent rank %d (node %d, %s): %s failed: %s; aborting the agent job",
                  self.rank, self.node, self.placement.host, where, error)
        log.debug("traceback", exc_info=exc)
        try:
            self.events.emit("agent_failed", where=where, error=error)
        finally:
            self.comm.Abort(1)
            os._exit(1)         # Abort does not return; should it, this process ends anyway

    # -------------------------------------------------------------------- stop
    def _install_signals(self) -> None:
        def on_signal(signum: int, _frame: Any) -> None:
            self._signals += 1
            if self._signals > 1:
                self.exit_now = True        # a second signal: leave now
            else:
                log.info("node %d: stop asked by signal %d", self.node, signum)
                self.inbox.put(Stop())
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _check_stop_files(self) -> None:
        now = time.monotonic()
        if now - self._stop_checked < 1.0:
            return
        self._stop_checked = now
        for path in self._stop_files():
            token = stop_token(path)
            if token is None or token == self._stale_stops.get(path):
                continue
            path.unlink(missing_ok=True)
            log.info("node %d: stop asked by %s", self.node, path)
            self.inbox.put(Stop(token=token))
        if self.draining and now > self.drain_deadline + 2 * self.config.agent.timeout:
            log.error("no exit from the coordinator after the drain; leaving")
            self.exit_now = True


    def _stop_files(self) -> list[Path]:
        files = [journal_stop_file(self.paths.journal)]
        if self.rank == 0:
            files.append(pfs_stop_file(self.paths.pfs))
        return files


def stop_token(path: Path) -> str | None:
    """Which stop request `path` holds (None: none): its token, or for a request without
    one (a hand-made file) the file's identity. Compared for equality only: the file's
    time is the clock of whoever wrote it, not this host's."""
    try:
        st = path.stat()
    except OSError:
        return None
    try:
        data = json.loads(path.read_bytes()[:4096])
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = None
    token = data.get("token") if isinstance(data, dict) else None
    if isinstance(token, str) and 0 < len(token) <= 64:
        return token
    return f"file {st.st_ino} {st.st_mtime_ns} {st.st_size}"


def _held(entry: dict[str, Any]) -> bool:
    """The captured copy (stage, or spool when captured by reference) is still there."""
    return entry.get("mode") in ("copy", "reference") and Path(entry["source"]).is_dir()


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
