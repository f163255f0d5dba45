"""The agent: one per node, beside the trainer, in its own MPI job.

Threads and who does what:
  main     every MPI call (messages to and from the coordinator), the coordinator's
           decisions on rank 0, stop requests; ticks every `agent.poll` seconds
           (IDLE_TICK after IDLE_AFTER seconds with nothing to do), and at once
           when a worker thread puts a message into the inbox
  watch    the spool (inotify + rescans): commit markers -> inbox
  capture  one checkpoint at a time: spool -> stage, checksums, local manifest
  flush-*  stage -> PFS bundles (flush.flusher), low priority, throttled
Worker threads never call MPI: they put messages into `inbox`, which the main thread
forwards. That keeps MPI single-threaded in practice and every wait bounded. The one
exception is `fatal`: an unexpected error in any thread ends the agent at once (one
line, an event, then MPI Abort naming the rank), never a thread that silently stops.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import psutil
from mpi4py import MPI

from .cleanup import remove_stale
from .collective import agree
from .config import Config, check_paths
from .coordinator import Coordinator
from .errors import CachexError, ConfigError, describe
from .events import EventLog
from .flush.flusher import Flusher
from .fsutil import create_file, makedirs, remove_under
from .index import read_index
from .journal import Journal
from .layout import (
    events_path,
    global_files_dir,
    journal_stop_file,
    pfs_stop_file,
    root_entry,
    spool_root_name,
)
from .manifest import FileEntry, GlobalManifest, LocalManifest
from .peer.globals import GlobalFiles, mirror_file
from .peer.partners import replication_map
from .peer.replicator import Replicator
from .runlock import RunLock
from .safepath import UnsafeInput, checkpoint_id, index, relative_path, relative_paths
from .stage.capture import (
    CaptureError,
    PartChanged,
    capture_copy,
    capture_reference,
    is_stage_full,
    part_changes,
)
from .stage.quiescence import FileState, snapshot, wait_for_directory, wait_settled
from .stage.rules import make_rule, natural_key, tracker_names, tracker_text
from .stage.watch import SpoolWatcher
from .topology import Placement, place_in

log = logging.getLogger(__name__)
TAG = 7           # coordinator protocol
PEER_TAG = 8      # replication protocol (peer/replicator.py)
MEMORY_RESERVE = 1 << 30    # capture by reference when the copy would leave less than this
CAPTURE_ATTEMPTS = 3        # captures of a part that keeps changing before it fails
TEST_FAIL_CAPTURE = "CACHEX_TEST_FAIL_CAPTURE"  # tests: this rank's capture thread raises
IDLE_AFTER = 2.0    # seconds without a message or work in flight before the loop slows down
IDLE_TICK = 0.1     # the slowed tick: a first message from another agent waits this long
RUN_LOCK_STALE = 60.0   # seconds without a refresh before another job takes the run over


class Inbox(queue.Queue):  # type: ignore[type-arg]
    """The worker threads' messages to the main thread. A put wakes the main loop at
    once, through a pipe: the signal handler puts too, and a pipe write is safe there.
    The pipe lives as long as the process (a late put from a worker must not write to a
    descriptor reused since)."""

    def __init__(self) -> None:
        super().__init__()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass                # full of wake-ups already

    def wait(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, less if something is put meanwhile."""
        if select.select([self._wake_r], [], [], timeout)[0]:
            try:
                os.read(self._wake_r, 1 << 16)     # a pipe's worth: every wake-up so far
            except BlockingIOError:
                pass


def exit_watchdog(bound: float) -> threading.Timer:
    """End the process if leaving takes longer than `bound` seconds: the collective
    calls of leaving (window free, MPI finalize) wait on every agent, and one may be gone
    or stuck. Cancel it once out."""
    def leave() -> None:
        log.error("exit not complete after %.0fs (another agent gone?): leaving", bound)
        os._exit(1)
    timer = threading.Timer(bound, leave)
    timer.daemon = True
    timer.start()
    return timer


def probe_writable(directory: Path, key: str) -> None:
    """Root passes every permission check, so try a real write."""
    probe = directory / f".cachex-probe-{threading.get_native_id()}"
    try:
        os.close(create_file(probe))
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{key}: {directory}: not writable ({exc.strerror})") from None


def prepare_dirs(config: Config, placement: Placement) -> Any:
    """Check and create this node's directories; ConfigError names the key and path."""
    paths = config.node_paths(placement.node, placement.rank, placement.host)
    check_paths(paths)      # `load` checked node 0's; {node} or {host} may differ here
    if not paths.spool.is_dir():
        if not paths.spool.parent.is_dir():
            raise ConfigError(f"paths.spool: {paths.spool}: no such directory")
        makedirs(paths.spool)
    pfs_root = paths.pfs.parent
    if not pfs_root.is_dir():
        raise ConfigError(f"paths.pfs: {pfs_root}: no such directory")
    for key, directory in (("paths.stage", paths.stage), ("paths.cache", paths.cache),
                           ("paths.pfs", paths.pfs)):
        try:
            makedirs(directory)
        except OSError as exc:
            raise ConfigError(f"{key}: {directory}: cannot create ({exc.strerror})") from None
        probe_writable(directory, key)
    return paths


class Agent:
    def __init__(self, config: Config, comm: Any) -> None:
        self.config = config
        self.comm = comm
        self.placement = place_in(comm, config.topology.domain)
        self.rank, self.node = self.placement.rank, self.placement.node
        self.paths = agree(comm, "start-up", lambda: prepare_dirs(config, self.placement))
        self.rule = make_rule(config.commit.rule, config.commit.settle, config.commit.globals)
        self.journal = agree(comm, "journal", lambda: Journal(
            self.paths.journal, (self.paths.stage, self.paths.spool)))
        self.events = EventLog(events_path(self.paths.journal), run=config.run,
                               node=self.node, rank=self.rank, host=self.placement.host)
        # before any agent touches the PFS: a second job on this run removes nothing
        self.run_lock = agree(comm, "run lock", lambda: RunLock.acquire(
            self.paths.pfs, max(RUN_LOCK_STALE, 2 * config.agent.timeout))
            if self.rank == 0 else None)
        self._remove_stale()
        self.inbox = Inbox()
        self.captures: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.announced: dict[str, dict[str, Any]] = {}
        self._queued: set[str] = set()        # announced, capture not finished
        self.flusher = Flusher(self.paths.pfs, config.flush, self.events, self.inbox.put)
        self.stop_event = threading.Event()
        self.draining = False
        self.drain_deadline = 0.0
        self._drained_sent = False
        self._stop_checked = 0.0
        self._born = time.time()
        self._active = time.monotonic()     # when the main loop last had something to do
        self.exit_now = False
        self._requests: list[Any] = []
        self._signals = 0
        self._dead_agents: list[int] = []
        self.ranks_by_node = self._ranks_by_node()
        self.node_of_rank = {r: n for n, r in enumerate(self.ranks_by_node)}
        self.replicator = agree(comm, "peer set-up", self._make_replicator)
        self.coordinator = agree(comm, "coordinator", lambda: Coordinator(
            config, self.ranks_by_node, self.journal, self.paths.pfs, self.events, self._send,
            can_replicate=self.replicator is not None) if self.rank == 0 else None)
        self.globals = GlobalFiles(comm, self.paths.journal, self._send_peer,
                                   config.agent.timeout)
        self.watcher = SpoolWatcher(self.paths.spool, self.rule, self._on_marker,
                                    scan=config.commit.scan)
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
        if pmap is None:
            return None         # flush-only: asked for, or no other failure domain
        return Replicator(self.comm, self.placement.node, pmap, self.ranks_by_node,
                          self.config, self.paths, self.events, self._send_peer,
                          self.inbox.put)

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
                         partners=self.replicator.partners if self.replicator else [])
        log.info("agent node %d/%d: spool %s -> stage %s -> pfs %s", self.node,
                 self.placement.nodes, self.paths.spool, self.paths.stage, self.paths.pfs)
        capture_thread = threading.Thread(target=self._capture_loop, name="capture", daemon=True)
        capture_thread.start()
        self._resume()
        self.watcher.start()
        try:
            while not self.exit_now:
                if self._step():
                    self._active = time.monotonic()
                self.inbox.wait(self._tick())
        finally:
            # leaving waits on the other agents (the window's free is collective)
            watchdog = exit_watchdog(2 * self.config.agent.timeout)
            self.watcher.stop()
            self.stop_event.set()
            self.captures.put(None)
            left = self.flusher.close(timeout=0)
            self.events.emit("agent_exit", unflushed=left)
            self._wait_requests(self.config.agent.timeout)
            if self.replicator is not None:
                self.replicator.close(free=not self._dead_agents)
            self.events.close()
            if self.run_lock is not None:
                self.run_lock.release()
            watchdog.cancel()
        return 0

    def _tick(self) -> float:
        """How long the main loop sleeps (a worker's message ends the sleep at once)."""
        if self.replicator is not None and self.replicator.busy():
            return 0.001        # credits and slots: the partner waits on this loop
        if time.monotonic() - self._active < IDLE_AFTER:
            return self.config.agent.poll
        # nothing for a while: fewer wake-ups, each costs as much as a step
        return max(self.config.agent.poll, IDLE_TICK)

    def _busy(self) -> bool:
        """Work in flight that messages from other agents move on."""
        return bool(self._requests or self._queued or self.draining or self.globals.busy()
                    or (self.replicator is not None and self.replicator.busy()))

    def _step(self) -> bool:
        """One turn of the main loop; True if it had anything to do."""
        moved = self._drain_inbox() + self._receive()
        if self.replicator is not None:
            self.replicator.pump()
        for header in self.globals.poll():
            self.events.emit("global_file", ckpt=header["ckpt"], path=header["path"],
                             bytes=header["size"])
            self._mirror(header["ckpt"])
        if self.coordinator:
            self.coordinator.tick()
        self._check_stop_files()
        if self.draining:
            self._check_drained()
        self._requests = [r for r in self._requests if not r.Test()]
        return bool(moved) or self._busy()

    def _resume(self) -> None:
        """Tell the coordinator what the journal says is still in flight, then catch up
        on what the trainer committed while no agent was watching."""
        for ckpt, entry in sorted(self.journal.entries.items(), key=lambda kv: kv[1]["seq"]):
            if entry.get("state") in ("captured", "flushed") and not entry.get("finalized"):
                self._to_coordinator({"type": "marker", "ckpt": ckpt, "t": time.time(),
                                      "global_files": entry.get("global_files", [])})
        # a capture cut short by the agent's end: committed, known, but not yet held
        cut_short = [c for c, e in sorted(self.journal.entries.items(),
                                          key=lambda kv: kv[1]["seq"])
                     if e.get("state") == "capturing" and c in self._preexisting]
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
            self._to_coordinator({"type": "unprotected", "ckpts": skipped, "note": note})

    def _known(self) -> set[str]:
        """Checkpoints this node already heard of: its journal, and for a node without
        one (replaced), those the PFS index lists."""
        known = set(self.journal.entries)
        if not known:
            try:
                known = read_index(self.paths.pfs).ids()
            except (OSError, ValueError):   # none, or not an index: an unsafe one raises
                pass
        return known

    # -------------------------------------------------------------- messaging
    def _send(self, rank: int, msg: dict[str, Any], tag: int = TAG) -> None:
        self._requests.append(self.comm.isend(msg, dest=rank, tag=tag))

    def _send_peer(self, rank: int, msg: dict[str, Any]) -> None:
        self._send(rank, msg, PEER_TAG)

    def _to_coordinator(self, msg: dict[str, Any]) -> None:
        self._send(0, {**msg, "node": self.node})

    def _receive(self) -> int:
        """Handle the messages from other agents that arrived; return how many."""
        status = MPI.Status()
        count = 0
        while self._probe(PEER_TAG, status):
            source = status.Get_source()
            msg = self.comm.recv(source=source, tag=PEER_TAG)
            self._refusing(source, msg, self._on_peer_message)
            count += 1
        while self._probe(TAG, status):
            source = status.Get_source()
            msg = self.comm.recv(source=source, tag=TAG)
            self._refusing(source, msg, self._on_message)
            count += 1
        return count

    def _refusing(self, source: int, msg: Any, handle: Any) -> None:
        """Handle a message whose names are safe; refuse any other with one line."""
        try:
            handle(source, checked_message(msg, f"message from rank {source}"))
        except UnsafeInput as exc:
            log.error("refused: %s", exc)
            self.events.emit("refused", error=str(exc))

    def _on_peer_message(self, source: int, msg: dict[str, Any]) -> None:
        if msg["type"] == "global_file":
            self.globals.on_header(source, msg)
        elif self.replicator is not None:
            self.replicator.handle(self.node_of_rank[source], msg)

    def _on_message(self, _source: int, msg: dict[str, Any]) -> None:
        if "node" in msg and self.coordinator and msg["type"] not in _TO_AGENT:
            self.coordinator.handle(msg["node"], msg)
        else:
            self._handle(msg)

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
            kind = msg["type"]
            if kind in ("credit", "ack"):           # the replica store answers an owner
                self._send_peer(self.ranks_by_node[msg.pop("owner")], msg)
                continue
            if kind == "captured":
                self._after_capture(msg)
            elif kind == "replicated":
                self._after_replicate(msg)
                msg = {**msg, "dead": sorted(self.replicator.dead) if self.replicator else []}
            self._to_coordinator(msg)
        return count

    def _wait_requests(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            self._requests = [r for r in self._requests if not r.Test()]
            time.sleep(0.01)

    # ------------------------------------------------------- from coordinator
    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "commit":
            self._on_commit(msg)
        elif kind == "finalized":
            self._on_finalized(msg)
        elif kind == "manifest":
            self.journal.save_global(GlobalManifest.from_json(msg["manifest"]))
            self._mirror(msg["ckpt"])
        elif kind == "failed":
            self._on_failed(msg)
        elif kind == "drain":
            self._on_drain(msg)
        elif kind == "exit":
            self._dead_agents = msg.get("dead", [])
            self.exit_now = True

    def _on_commit(self, msg: dict[str, Any]) -> None:
        ckpt = msg["ckpt"]
        previous = self.announced.get(ckpt)
        flush = msg["flush"] or bool(previous and previous["flush"])
        self.announced[ckpt] = {**msg, "flush": flush,
                                "received": (previous or {}).get("received", time.time())}
        entry = self.journal.get(ckpt) or {}
        if ckpt in self._queued:
            return
        manifest = self.journal.manifest(ckpt)
        if entry.get("state") in ("captured", "flushed") and manifest and _held(entry):
            # a repeated announcement (restart): report what is already held
            self.inbox.put({"type": "captured", "ckpt": ckpt, "manifest": manifest.to_json(),
                            "mode": entry["mode"], "reason": entry.get("mode_reason", ""),
                            "global_files": entry.get("global_files", [])})
            return
        self.journal.update(ckpt, seq=msg["seq"], state="capturing",
                            global_files=msg["global_files"])
        self._queued.add(ckpt)
        self.captures.put(self.announced[ckpt])

    def _after_capture(self, msg: dict[str, Any]) -> None:
        ckpt = msg["ckpt"]
        entry = self.journal.get(ckpt) or {}
        manifest = LocalManifest.from_json(msg["manifest"])
        self._share_globals(manifest, entry)
        peer = self.announced.get(ckpt, {}).get("path", "peer") == "peer"
        if self.replicator is not None and peer and not entry.get("replicated"):
            self.replicator.replicate(manifest, Path(entry["source"]))
        else:
            self._flush_if_wanted(manifest, entry)
        self._retain_stage()

    def _share_globals(self, manifest: LocalManifest, entry: dict[str, Any]) -> None:
        """This node wrote the checkpoint's global files: every journal gets a copy."""
        names = {*self.announced.get(manifest.ckpt, {}).get("global_files", []),
                 *entry.get("global_files", [])}
        held = [e for e in manifest.files if e.path in names]
        if held and not entry.get("globals_shared"):
            others = [r for r in self.ranks_by_node if r != self.rank]
            self.globals.share(manifest.ckpt, Path(entry["source"]), held, others)
            self.journal.update(manifest.ckpt, globals_shared=True)

    def _mirror(self, ckpt: str) -> None:
        """Once every node captured `ckpt` and its global files reached this journal, put
        them into this node's spool too, so loaders that read only their own node's
        directory (DCP's `load`) find them (`commit.mirror`)."""
        manifest = self.journal.global_manifest(ckpt)
        target = self.paths.spool_dir(ckpt)
        if not self.config.commit.mirror or manifest is None:
            return
        held = global_files_dir(self.paths.journal, ckpt)
        for entry in manifest.files:
            path = entry["path"]
            into = self._mirror_target(ckpt, target, path, entry["node"])
            if path not in manifest.global_files or into is None:
                continue
            if not (held / path).is_file():
                return                          # not arrived yet: the next call does it
            try:
                mirror_file(held / path, into, entry["checksum"], entry["mode"])
            except (OSError, CachexError) as exc:
                log.warning("mirror of %s/%s failed: %s", ckpt, path, describe(exc))
                return
            self.events.emit("mirrored", ckpt=ckpt, path=path)

    def _mirror_target(self, ckpt: str, ckpt_dir: Path, path: str, owner: int
                       ) -> Path | None:
        """Where this node's spool gets a global file (None: nowhere, or there already).
        A spool-root file (tracker, single-file checkpoint) goes to the spool root of
        the other nodes; a tracker is replaced when it names an older save."""
        name = spool_root_name(path)
        if name is None:
            into = ckpt_dir / path
            return into if ckpt_dir.is_dir() and not into.exists() else None
        into = self.paths.spool / name
        if owner == self.node:
            return None
        if tracker_text(name, ckpt) is not None:
            named = tracker_names(into, name)
            return into if named is None or natural_key(named) < natural_key(ckpt) else None
        return None if into.exists() else into

    def _after_replicate(self, msg: dict[str, Any]) -> None:
        ckpt = msg["ckpt"]
        entry = self.journal.get(ckpt) or {}
        if msg["ok"]:
            self.journal.update(ckpt, replicated=True)
            self.events.emit("replicated", ckpt=ckpt, seq=entry.get("seq"),
                             bytes=entry.get("bytes"), partners=msg["partners"],
                             duration=msg.get("duration"))
        else:
            log.warning("replication of %s failed: %s", ckpt, msg["errors"])
            self.events.emit("replicate_failed", ckpt=ckpt, seq=entry.get("seq"),
                             errors=msg["errors"])
        manifest = self.journal.manifest(ckpt)
        if manifest is not None and entry.get("state") in ("captured", "flushed"):
            self._flush_if_wanted(manifest, entry)
        self._retain_stage()

    def _flush_if_wanted(self, manifest: LocalManifest, entry: dict[str, Any]) -> None:
        if self.announced.get(manifest.ckpt, {}).get("flush"):
            self.flusher.submit(manifest, Path(entry["source"]))

    def _on_finalized(self, msg: dict[str, Any]) -> None:
        manifest = GlobalManifest.from_json(msg["manifest"])
        self.journal.save_global(manifest)
        self.journal.update(msg["ckpt"], state="flushed", finalized=True)
        self._retain_stage()

    def _on_failed(self, msg: dict[str, Any]) -> None:
        ckpt = msg["ckpt"]
        entry = self.journal.get(ckpt)
        if entry and entry.get("mode") == "copy":
            remove_under(self.paths.stage, self.paths.stage_dir(ckpt))
        self.journal.update(ckpt, state="failed", reason=msg["reason"])
        self.flusher.cancel(ckpt)
        self.watcher.forget(ckpt)

    def _on_drain(self, msg: dict[str, Any]) -> None:
        self.draining = True
        self.drain_deadline = time.monotonic() + self.config.flush.drain_timeout
        for ckpt in msg["flush"]:
            if ckpt in self.announced:
                self.announced[ckpt]["flush"] = True
                entry = self.journal.get(ckpt) or {}
                manifest = self.journal.manifest(ckpt)
                replicating = self.replicator is not None and ckpt in self.replicator.pending()
                if entry.get("state") == "captured" and manifest and not replicating:
                    self.flusher.submit(manifest, Path(entry["source"]))
        self.watcher.stop()

    def _check_drained(self) -> None:
        replicating = self.replicator is not None and self.replicator.busy()
        replicating = replicating or self.globals.busy()
        busy = self._queued or self.flusher.pending() or not self.inbox.empty() or replicating
        if busy and time.monotonic() < self.drain_deadline:
            return
        if not self._drained_sent:
            self._drained_sent = True
            self._to_coordinator({"type": "drained", "unflushed": self.flusher.pending()})

    # ----------------------------------------------------------------- capture
    def _on_marker(self, ckpt: str, force: bool = False) -> None:
        """Called by the watcher thread (and once at start-up)."""
        if ckpt in self._preexisting and not force:
            return
        known = self.journal.get(ckpt)
        if known is not None and known.get("state") != "failed" and not force:
            return          # e.g. a mirrored `.metadata`: this checkpoint is under way
        self.inbox.put({"type": "marker", "ckpt": ckpt, "t": time.time(),
                        "global_files": self._global_files(ckpt),
                        "rule": self.rule.kind(ckpt)})

    def _global_files(self, ckpt: str) -> list[str]:
        """What only this node may hold of `ckpt` and every node reads: the rule's
        global files and the spool-root files captured with it (trackers, a single-file
        checkpoint); GlobalManifest.build keeps those that one node alone holds."""
        try:
            inside = ([] if self.rule.is_file_checkpoint(self.paths.spool, ckpt)
                      else self.rule.global_files(self.paths.spool_dir(ckpt)))
            return inside + [root_entry(n) for n in self.rule.root_entries(self.paths.spool,
                                                                              ckpt)]
        except OSError:
            return []

    def _capture_loop(self) -> None:
        while (task := self.captures.get()) is not None:
            try:
                self._fail_for_tests()
                self._capture(task)
            except (CachexError, OSError) as exc:
                error = describe(exc)
                log.error("capture of %s failed: %s", task["ckpt"], error)
                self.events.emit("capture_failed", ckpt=task["ckpt"], seq=task["seq"], error=error)
                self.journal.update(task["ckpt"], state="failed", reason=error)
                self.inbox.put({"type": "capture_failed", "ckpt": task["ckpt"], "error": error})
            finally:
                self._queued.discard(task["ckpt"])

    def _fail_for_tests(self) -> None:
        """The integration tests' way to raise an unexpected error in this thread; the
        variable is never set in production."""
        if os.environ.get(TEST_FAIL_CAPTURE) == str(self.rank):
            raise RuntimeError(f"{TEST_FAIL_CAPTURE}={self.rank}")

    def _capture(self, task: dict[str, Any]) -> None:
        ckpt, seq = task["ckpt"], task["seq"]
        source = self.paths.spool_dir(ckpt)
        start = time.time()
        deadline = time.monotonic() + self.config.commit.timeout
        single = self.rule.is_file_checkpoint(self.paths.spool, ckpt)
        # a single file is written by one rank: a node without it holds an empty part
        late = not single and (self._wait_for_part(source, ckpt, seq, deadline)
                               or self._wait_for_own_marker(source, ckpt, seq, deadline))
        # A marker vouches at most for files written before it: a directory that
        # appeared after the commit gets this node's own check.
        vouched = self.rule.vouches_for(source) and not late
        target, entries, mode, reason = self._capture_whole(ckpt, seq, source, vouched,
                                                            deadline)
        manifest = LocalManifest(run=self.config.run, ckpt=ckpt, seq=seq, node=self.node,
                                 host=self.placement.host, rank=self.rank, files=entries)
        self.journal.save_manifest(manifest)
        # This node's own candidates, from its finished part: the marker's list is the
        # view of whichever node committed first (HF: node 1's trainer_state.json may
        # come before node 0 wrote the weights that it alone holds).
        candidates = sorted({*task["global_files"], *self._global_files(ckpt)})
        self.journal.update(ckpt, seq=seq, state="captured", source=str(target), mode=mode,
                            mode_reason=reason, bytes=manifest.bytes,
                            global_files=candidates)
        duration = time.time() - start
        self.events.emit("captured", ckpt=ckpt, seq=seq, bytes=manifest.bytes,
                         files=len(entries), mode=mode, reason=reason, duration=duration,
                         write_start=self.watcher.first_seen(ckpt),
                         committed_at=task.get("received"))
        self.inbox.put({"type": "captured", "ckpt": ckpt, "manifest": manifest.to_json(),
                        "duration": duration, "mode": mode, "reason": reason,
                        "global_files": candidates})

    def _wait_for_part(self, source: Path, ckpt: str, seq: int, deadline: float) -> bool:
        """Wait (until `deadline`: `commit.timeout`) for this node's directory; True if
        it was not there yet."""
        if source.is_dir():
            return False
        self.events.emit("capture_waiting", ckpt=ckpt, seq=seq,
                         reason=f"{source}: directory not there yet",
                         timeout=self.config.commit.timeout)
        return wait_for_directory(source, max(0.0, deadline - time.monotonic()),
                                  self.stop_event)

    def _wait_for_own_marker(self, source: Path, ckpt: str, seq: int, deadline: float
                             ) -> bool:
        """A node that saves writes its own marker, with no barrier before it (HF's
        `trainer_state.json`): wait for it; True if it was not there yet."""
        marker = self.rule.own_marker(source)
        if marker is None or (source / marker).is_file():
            return False
        self.events.emit("capture_waiting", ckpt=ckpt, seq=seq,
                         reason=f"{source / marker}: this node's marker not there yet",
                         timeout=self.config.commit.timeout)
        while not (source / marker).is_file():
            if time.monotonic() > deadline or self.stop_event.wait(0.05):
                raise CaptureError(f"{source / marker}: this node's marker did not appear"
                                   f" within commit.timeout")
        return True

    def _capture_whole(self, ckpt: str, seq: int, source: Path, vouched: bool,
                       deadline: float) -> tuple[Path, list[FileEntry], str, str]:
        """Capture until a listing after the capture equals the one before it (bounded):
        a file missing or torn is never reported captured."""
        changes = ""
        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            # a part seen changing is checked by this node, whatever the marker said
            settle = 0.0 if vouched and attempt == 1 else self.config.commit.settle
            listed = self._settled(source, settle, deadline)
            if attempt == 1:
                self.events.emit("capture_start", ckpt=ckpt, seq=seq)
            try:
                captured = self._capture_once(ckpt, source, listed)
                changes = part_changes(listed, self._listing(source))
            except PartChanged as exc:
                captured, changes = None, str(exc)
            if not changes and captured is not None:
                return captured
            log.warning("capture of %s, attempt %d: %s", ckpt, attempt, changes)
            self.events.emit("capture_retry", ckpt=ckpt, seq=seq, attempt=attempt,
                             reason=changes)
        remove_under(self.paths.stage, self.paths.stage_dir(ckpt))
        raise CaptureError(f"{source}: still changing after {CAPTURE_ATTEMPTS} captures"
                           f" ({changes})")

    def _settled(self, source: Path, settle: float, deadline: float) -> dict[Path, FileState]:
        if self._single_file(source):
            return {}           # the rule saw the file settle; the copy checks it is unchanged
        try:
            return wait_settled(source, settle, max(0.0, deadline - time.monotonic()),
                                self.stop_event)
        except FileNotFoundError:
            raise CaptureError(f"{source}: checkpoint directory is missing") from None

    def _single_file(self, source: Path) -> bool:
        return self.rule.is_file_checkpoint(self.paths.spool, source.name)

    def _listing(self, source: Path) -> dict[Path, FileState]:
        if self._single_file(source):
            return {}
        try:
            return snapshot(source)
        except FileNotFoundError:
            raise CaptureError(f"{source}: checkpoint directory is missing") from None

    def _capture_once(self, ckpt: str, source: Path, listed: dict[Path, FileState]
                      ) -> tuple[Path, list[FileEntry], str, str]:
        """(where the captured bytes are, entries, mode, why that mode) of one capture."""
        relpaths = sorted(rel for rel in (p.relative_to(source).as_posix() for p in listed)
                          if not self.rule.ignore(rel))
        roots = {root_entry(n): self.paths.spool / n
                 for n in self.rule.root_entries(self.paths.spool, ckpt)}
        total = sum(listed[source / rel][0] for rel in relpaths) + sum(
            p.stat().st_size for p in roots.values())
        target = self.paths.stage_dir(ckpt)
        if not _memory_allows(total):
            reason = f"memory short: {total} bytes would leave less than {MEMORY_RESERVE}"
        else:
            try:
                return target, capture_copy(source, target, [*relpaths, *roots],
                                            sources=roots), "copy", ""
            except OSError as exc:
                if not is_stage_full(exc):
                    raise
                reason = f"stage full ({describe(exc)})"
        # by reference: the flush and the replicas read the spool part and check it
        # against these checksums
        remove_under(self.paths.stage, target)     # an earlier attempt, partial or whole
        if roots:   # a reference reads the part's directory: spool-root files stay out
            reason += f"; not captured: {', '.join(sorted(p.name for p in roots.values()))}"
        log.warning("capture of %s by reference: %s", ckpt, reason)
        return source, capture_reference(source, relpaths), "reference", reason

    def _retain_stage(self) -> None:
        """Keep the newest `keep.stage` captures; never one still needed by a flush."""
        keep = self.config.keep.stage
        held = sorted(((e["seq"], c) for c, e in self.journal.entries.items()
                       if e.get("state") in ("captured", "flushed") and e.get("mode") == "copy"),
                      reverse=True)
        if keep == 0 or len(held) <= keep:
            return
        pending = set(self.flusher.pending())
        if self.replicator is not None:
            pending |= self.replicator.pending()
        for _seq, ckpt in held[keep:]:
            entry = self.journal.entries[ckpt]
            wanted = self.announced.get(ckpt, {}).get("flush", False)
            if ckpt in pending or (wanted and not entry.get("finalized")):
                continue
            remove_under(self.paths.stage, self.paths.stage_dir(ckpt))
            self.journal.update(ckpt, mode="evicted")
            self.events.emit("evicted", ckpt=ckpt, seq=entry["seq"], level="stage")
            if not entry.get("finalized"):
                self._to_coordinator({"type": "evicted", "ckpt": ckpt})

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
                self.inbox.put({"type": "stop", "signal": signum})
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _check_stop_files(self) -> None:
        now = time.monotonic()
        if now - self._stop_checked < 1.0:
            return
        self._stop_checked = now
        files = [journal_stop_file(self.paths.journal)]
        if self.coordinator:
            files.append(pfs_stop_file(self.paths.pfs))
        for path in files:
            try:
                requested = path.stat().st_mtime
            except FileNotFoundError:
                continue
            path.unlink(missing_ok=True)
            if requested >= self._born - 1.0:   # not a request left for agents gone since
                self.inbox.put({"type": "stop", "file": str(path)})
        if self.draining and now > self.drain_deadline + 2 * self.config.agent.timeout:
            log.error("no exit from the coordinator after the drain; leaving")
            self.exit_now = True


_TO_AGENT = {"commit", "manifest", "finalized", "failed", "drain", "exit"}
_GLOBAL_MANIFESTS = {"manifest", "finalized"}      # the others carry a node's manifest


def checked_message(msg: Any, source: str) -> dict[str, Any]:
    """A message from another agent with every name that reaches a path checked
    (safepath.py): checkpoint ids, file paths, node numbers, manifests."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise UnsafeInput(f"{source}: not a cachex message: {msg!r}")
    if "ckpt" in msg:
        checkpoint_id(msg["ckpt"], source)
    if "node" in msg:
        index(msg["node"], source)
    if "path" in msg:
        relative_path(msg["path"], source)
    relative_paths(msg.get("global_files", []), source, "global file path")
    if msg["type"] == "drain":
        for ckpt in msg.get("flush", []):
            checkpoint_id(ckpt, source)
    if "manifest" in msg:
        kind = GlobalManifest if msg["type"] in _GLOBAL_MANIFESTS else LocalManifest
        kind.from_json(msg["manifest"], source, msg.get("ckpt"))
    return msg


def _held(entry: dict[str, Any]) -> bool:
    """The captured copy (stage, or spool when captured by reference) is still there."""
    return entry.get("mode") in ("copy", "reference") and Path(entry["source"]).is_dir()


def _memory_allows(nbytes: int) -> bool:
    return psutil.virtual_memory().available - nbytes > MEMORY_RESERVE


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
