"""The agent: one per node, beside the trainer, in its own MPI job.

Threads and who does what:
  main     every MPI call (pump.py), the coordinator's decisions on rank 0, stop
           requests; ticks every `agent.poll` seconds (IDLE_TICK after IDLE_AFTER
           seconds with nothing to do, PEER_TICK while a peer message is due), and at
           once when a worker thread puts a message into the inbox
  watch    the spool (inotify + rescans): commit markers -> inbox
  capture  one checkpoint at a time: spool -> stage, checksums, local manifest
  flush-*  stage -> PFS bundles (flush/flusher.py), low priority, throttled
  encode   `peer.scheme` xor / rs:K+M: the group's erasure encoding (peer/encoder.py),
           the one thread beside main that calls MPI, on its group's communicator only
  lane-*   rank 0: the coordinator's file writes and model (coordinator.py)
Worker threads never call MPI: they put messages into `inbox` (inbox.py), which the
main thread forwards. An unexpected error in any thread ends the agent at once (`fatal`).

The agent executes; it does not decide. What to do with a checkpoint when an event
about it comes is `node_policy.decide(state, event) -> effects` (pure); `Agent`
builds the state from its journal, runs the effects, and owns the threads and MPI.
Each stage of each checkpoint is a handle (handles.py) whose state the journal keeps;
a restarted agent resumes from those states (`node_policy.resume`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any, NoReturn

from . import mapped, relay
from . import node_policy as policy
from . import node_setup as setup
from .collective import agree
from .config import Config
from .coordinator import Coordinator
from .events import EventCopy
from .executor import Executor
from .flush.flusher import Flusher
from .inbox import Inbox, exit_watchdog
from .layout import pfs_events_path
from .liveness import NodeLiveness
from .messages import (
    PEER,
    TO_COORDINATOR,
    Drain,
    Exit,
    FileCaptured,
    Frames,
    GlobalFile,
    HoldManifest,
    Report,
    Reroute,
    ToNode,
    wire,
)
from .node_dirs import prepare_dirs
from .peer.encoder import erasure_groups, start_encoder
from .peer.globals import GlobalFiles
from .peer.redundancy import Protector
from .priority import bind_cpus, cpu_list
from .pump import MessagePump
from .rules import make_rule
from .stops import StopRequests, abort
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
# a commit another node's marker makes may come soon after this node's trainer wrote into
# the spool (DCP's ranks but the first): a fifth of PEER_TICK's cost, 2.5 ms of latency
COMMIT_TICK = 0.005


def peer_tick(protector: Protector | None) -> float | None:
    """PEER_TICK while a credit, an ack or a slot is due over MPI, else None."""
    return PEER_TICK if protector is not None and protector.waits_on_peer() else None


class Agent:
    def __init__(self, config: Config, comm: Any) -> None:
        self.config, self.comm = config, comm
        self.placement = place = place_checked(comm, config.topology)
        self.rank, self.node = place.rank, place.node
        setup.lower_priority(comm, config)
        self.cpus = agree(comm, "agent.cpus", lambda: bind_cpus(config.agent.cpus))
        groups = erasure_groups(comm, config, list(place.hosts))    # before any dir
        self.paths = paths = agree(comm, "start-up", lambda: prepare_dirs(config, place))
        self.rule = make_rule(config.commit.rule, config.commit.settle, config.commit.globals)
        self.journal, self.stages, self.run_lock = setup.open_state(comm, config, place, paths)
        self.events, self.inbox = self.stages.events, Inbox()
        self.events_copy = EventCopy(self.events.path, pfs_events_path(paths.pfs, self.node))
        self.flusher = Flusher(paths.pfs, config.flush, self.events, self.inbox.put,
                               self.stages, self.events_copy)
        self.exit_now, self._dead_agents, self.turns = False, [], 0
        self._active = time.monotonic()     # when the main loop last had something to do
        self.ranks_by_node = ranks = setup.ranks_by_node(comm, self.node)
        self.node_of_rank = {r: n for n, r in enumerate(ranks)}
        # silence is judged on its clock, net of this process's own stalls
        self.live = NodeLiveness(self.node, len(ranks), config.agent.fanout,
                                 config.agent.timeout)
        self.uplink = Uplink(self.node, len(ranks), config.agent.fanout)
        self.pump = MessagePump(comm, ranks, self.node, self._dispatch, self.events,
                                on_route=self._follow)
        replicator = agree(comm, "peer set-up", lambda: setup.make_replicator(
            comm, config, place, paths, ranks, self.stages, self.pump.send_peer,
            self.inbox.put, self.inbox.wake, len(self.cpus), self.live.clock.now))
        self.protector: Protector | None = replicator or start_encoder(
            comm, config, groups, self.node, paths, self.stages, self.inbox.put)
        self.coordinator = agree(comm, "coordinator", lambda: Coordinator(
            config, ranks, self.journal, paths.pfs, self.events, self.pump.send,
            can_replicate=self.protector is not None, wake=self.inbox.wake,
            events_copy=self.events_copy, forward=self.pump.forward, clock=self.live.clock.now,
            holders=setup.holders(config, place), generation=self.run_lock.generation)
            if self.rank == 0 else None)
        self.globals = GlobalFiles(comm, paths.journal, self.pump.send_peer,
                                   config.agent.timeout)
        self.parts = setup.workers(config, place, paths, self.journal, self.stages, self.rule,
                                   self.inbox, lambda c: self.work.on_marker(c),
                                   lambda name: self.work.on_saved_again(name), self.flusher,
                                   self.protector, self.globals, self.uplink)
        self.work = Executor(config, self.node, paths, self.journal, self.stages, self.rule,
                             self.parts, self.inbox.put, self._report,
                             [r for r in ranks if r != self.rank], self._counters,
                             setup.committed_now(self.rule, paths.spool))
        self.stops = StopRequests(setup.stop_files(paths, self.rank == 0), self.node,
                                  self.inbox.put, lambda: setattr(self, "exit_now", True))

    # --------------------------------------------------------------- lifecycle
    def run(self) -> int:
        self.stops.install()
        mapped.prepare()    # a lease break's SIGIO, ignored: linked files may be mapped
        threading.excepthook = self._thread_failed
        protector = self.protector
        self.events.emit("agent_start", spool=str(self.paths.spool), pfs=str(self.paths.pfs),
                         nodes=self.placement.nodes, pid=os.getpid(),
                         partners=protector.partners if protector else [],
                         cpus=cpu_list(self.cpus), streams=protector.streams if protector else 0)
        log.info("agent node %d/%d: spool %s -> stage %s -> pfs %s", self.node,
                 self.placement.nodes, self.paths.spool, self.paths.stage, self.paths.pfs)
        self.parts.capture.start()
        self.work.resume(setup.known(self.journal, self.paths.pfs))
        self.parts.watcher.start()
        try:
            while not self.exit_now:
                self.turns += 1
                if stall := self.live.tick():
                    self._stalled(stall)
                if self._step():
                    self._active = time.monotonic()
                self.inbox.wait(self._tick())
        finally:
            self._close()
        return 0

    def _close(self) -> None:
        timeout = self.config.agent.timeout
        watchdog = exit_watchdog(2 * timeout)   # the window's free waits on the others
        self.parts.watcher.stop()
        self.parts.capture.stop()
        left = self.flusher.close(timeout=0)
        self.parts.remover.close(timeout / 2)
        self.events.emit("agent_exit", unflushed=left)
        if self.coordinator:     # its last status; a hung PFS is left behind
            self.coordinator.close(timeout / 2)
        self.pump.wait(timeout)
        if self.protector is not None:
            self.protector.close(free=not self._dead_agents, timeout=timeout)
        self.events.close()
        if self.run_lock is not None:
            self.run_lock.release()
        watchdog.cancel()

    def left_behind(self) -> bool:
        """The coordinator's exit named agents dead or stopped: they cannot finalize."""
        return bool(self._dead_agents)

    def _tick(self) -> float:
        """How long the main loop sleeps (a worker's message ends the sleep at once)."""
        now = time.monotonic()
        if peer_tick(self.protector) is not None or self.work.commit_expected(now):
            return PEER_TICK
        if self.work.written_lately(now):
            return COMMIT_TICK
        tick = self.config.agent.poll
        if now - self._active >= IDLE_AFTER:
            tick = max(tick, IDLE_TICK)     # nothing for a while: fewer wake-ups
        held = self.uplink.next_due()       # reports waiting for the rest of a subtree
        return tick if held is None else min(tick, held)

    def _step(self) -> bool:
        """One turn of the main loop; True if it had anything to do."""
        moved = self._drain_inbox() + self.pump.receive()
        if self.protector is not None:
            self.protector.pump()
        for header in self.globals.poll():
            self.events.emit("global_file", ckpt=header.ckpt, path=header.path,
                             bytes=header.size)
            self.parts.mirror.mirror(header.ckpt)
        self._send_up()
        if self.coordinator:
            self.coordinator.tick()
        self.stops.check()
        if self.work.draining:
            if self.protector is not None:
                self.protector.give_up_on_suspects()
            self.work.drained(busy=not self.inbox.empty() or self._replicating())
            if time.monotonic() > self.work.drain_deadline + 2 * self.config.agent.timeout:
                log.error("no exit from the coordinator after the drain; leaving")
                self.exit_now = True
        sending = self.pump.test()
        return (bool(moved) or sending or self.parts.capture.busy() or self.work.draining
                or self._replicating())

    def _stalled(self, seconds: float) -> None:
        """This process stood still: its peers' silence meanwhile is not theirs (the
        clock leaves the stall out); tell the parent at once that it is back."""
        # a busy turn of a second or two is not news; a stop a peer could notice is
        level = logging.WARNING if seconds >= self.config.agent.timeout / 4 else logging.DEBUG
        log.log(level, "node %d: this agent's main loop was stopped for %.1fs; that time"
                " is not counted against its peers", self.node, seconds)
        self.events.emit("stalled", seconds=round(seconds, 3))

    def _follow(self, route: relay.Route) -> bool:
        """Every relay frame's route: the uplink and the watched children follow the
        tree's changes. False for a tree frame read already (a late copy: its route is
        an older tree's); the frames missed before a new one are asked for again."""
        new, missed = self.live.follow(route)
        if missed:
            first, last = missed.start, missed.stop - 1
            log.warning("node %d: relay frames %d-%d did not reach it (a stalled parent"
                        " holds them); asking node 0", self.node, first, last)
            self.events.emit("frames_missed", first=first, last=last)
            self.pump.send(0, Frames(node=self.node, first=first, last=last))
        if new:
            self.uplink.follow(route)
        return new

    def _replicating(self) -> bool:
        return self.globals.busy() or (self.protector is not None and self.protector.busy())

    # -------------------------------------------------------------- messaging
    def _report(self, report: Report) -> None:
        """A report of this node's: a part's manifest straight to node 0, the rest up."""
        report = replace(report, node=self.node)
        if report.TYPE in DIRECT:
            self.pump.send(0, report)
        else:
            self.uplink.add(wire(report))

    def _send_up(self) -> None:
        """The reports due (uplink.py): one batch to this node's parent, an empty one
        every beat if nothing else went (so the parent can tell slow from silent,
        liveness.py); on node 0, to the coordinator in this process."""
        for silence in self.live.watch.silent():
            self._report(silence)
        reports = self.uplink.due()
        if self.coordinator:
            for report in reports:
                self.coordinator.handle(report["node"], report)
        elif self.live.send_up(reports):
            self.pump.send(self.ranks_by_node[self.uplink.parent],
                           {"type": "batch", "node": self.node, "reports": reports})

    def _dispatch(self, source: int, msg: Any) -> None:
        """One message from another agent to the part of this one that takes it."""
        self._heard(self.node_of_rank[source])
        if isinstance(msg, dict) and msg["type"] == "batch":   # a child's, on its way up
            if not all([self.uplink.add(report) for report in msg["reports"]]):
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
        elif isinstance(msg, HoldManifest):     # a metadata holder: for a recovery that
            self.journal.save_global(msg.manifest)  # lost the coordinator's node
        elif isinstance(msg, Exit):
            self._dead_agents, self.exit_now = msg.dead, True
        elif isinstance(msg, Drain):
            self.work.execute(policy.on_drain(msg))
        elif not isinstance(msg, Reroute):      # the frame's route was the news
            self.work.decide(msg)

    def _heard(self, node: int) -> None:
        """Anything from `node` itself shows it runs: a watched child's silence ended."""
        if (back := self.live.watch.heard(node)) is not None:
            self._report(back)
        if self.coordinator:
            self.coordinator.heard(node)

    def _drain_inbox(self) -> int:
        """Forward or handle the worker threads' messages; return how many."""
        count = 0
        while not self.inbox.empty():
            msg = self.inbox.get_nowait()
            count += 1
            if isinstance(msg, ToNode):         # the replica store answers an owner
                self.pump.to_node(msg)
            elif isinstance(msg, FileCaptured):
                self.work.decide(msg, msg.header.ckpt)
            else:
                self._report(self.work.from_worker(msg))
        return count

    def _counters(self) -> dict[str, Any]:
        """What this agent has spent since it started, at each checkpoint's end: the
        metadata's bytes received by tag, the journal's bytes written, turns of the main
        loop, CPU seconds in all and by thread (benchmarks/scale_agents.py)."""
        return {"received": dict(self.pump.received), "journal_written": self.journal.written,
                "turns": self.turns, **usage()}

    # ------------------------------------------------------------------- fatal
    def _thread_failed(self, args: Any) -> None:
        if issubclass(args.exc_type, SystemExit):
            return
        thread = args.thread.name if args.thread is not None else "a thread"
        self.fatal(f"thread {thread}", args.exc_value)

    def fatal(self, where: str, exc: BaseException | None) -> NoReturn:
        """An unexpected error: this agent and its job end (stops.abort)."""
        abort(self.comm, self.events, f"rank {self.rank} (node {self.node},"
              f" {self.placement.host})", where, exc)
