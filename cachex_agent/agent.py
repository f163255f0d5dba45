"""The agent: one per node, beside the trainer, in its own MPI job.

Threads and who does what:
  main     every MPI call (messages to and from the coordinator), the coordinator's
           decisions on rank 0, stop requests; ticks every `agent.poll` seconds
  watch    the spool (inotify + rescans): commit markers -> inbox
  capture  one checkpoint at a time: spool -> stage, checksums, local manifest
  flush-*  stage -> PFS bundles (flush.flusher), low priority, throttled
Worker threads never call MPI: they put messages into `inbox`, which the main thread
forwards. That keeps MPI single-threaded in practice and every wait bounded.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from mpi4py import MPI

from .cleanup import remove_stale
from .collective import agree
from .config import Config
from .coordinator import Coordinator
from .errors import CachexError, ConfigError, describe
from .events import EventLog
from .flush.flusher import Flusher
from .fsutil import create_file, makedirs, remove_tree
from .journal import Journal
from .manifest import GlobalManifest, LocalManifest
from .peer.globals import GlobalFiles, global_dir, mirror_file
from .peer.partners import replication_map
from .peer.replicator import Replicator
from .stage.capture import CaptureError, capture_copy, capture_reference, list_files
from .stage.quiescence import wait_quiescent
from .stage.rules import make_rule
from .stage.watch import SpoolWatcher
from .topology import Placement, place_in

log = logging.getLogger(__name__)
TAG = 7           # coordinator protocol
PEER_TAG = 8      # replication protocol (peer/replicator.py)
MEMORY_RESERVE = 1 << 30    # capture by reference when the copy would leave less than this


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
        self.journal = Journal(self.paths.journal)
        self.events = EventLog(self.paths.journal / "events.jsonl", run=config.run,
                               node=self.node, rank=self.rank, host=self.placement.host)
        self._remove_stale()
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
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
        self.exit_now = False
        self._requests: list[Any] = []
        self._signals = 0
        self._dead_agents: list[int] = []
        self.ranks_by_node = self._ranks_by_node()
        self.node_of_rank = {r: n for n, r in enumerate(self.ranks_by_node)}
        self.replicator = agree(comm, "peer set-up", self._make_replicator)
        self.coordinator = (Coordinator(config, self.ranks_by_node, self.journal,
                                        self.paths.pfs, self.events, self._send,
                                        can_replicate=self.replicator is not None)
                            if self.rank == 0 else None)
        self.globals = GlobalFiles(comm, self.paths.journal, self._send_peer)
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
                self._step()
                busy = self.replicator is not None and self.replicator.busy()
                time.sleep(0.001 if busy else self.config.agent.poll)
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
            watchdog.cancel()
        return 0

    def _step(self) -> None:
        self._drain_inbox()
        self._receive()
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

    def _resume(self) -> None:
        """Tell the coordinator what the journal says is still in flight."""
        for ckpt, entry in sorted(self.journal.entries.items(), key=lambda kv: kv[1]["seq"]):
            if entry.get("state") in ("captured", "flushed") and not entry.get("finalized"):
                self._to_coordinator({"type": "marker", "ckpt": ckpt, "t": time.time(),
                                      "global_files": entry.get("global_files", [])})
        pre = sorted(self._preexisting - set(self.journal.entries))
        if pre:     # a fresh agent adopts only the newest checkpoint already in the spool
            self._on_marker(pre[-1], force=True)

    # -------------------------------------------------------------- messaging
    def _send(self, rank: int, msg: dict[str, Any], tag: int = TAG) -> None:
        self._requests.append(self.comm.isend(msg, dest=rank, tag=tag))

    def _send_peer(self, rank: int, msg: dict[str, Any]) -> None:
        self._send(rank, msg, PEER_TAG)

    def _to_coordinator(self, msg: dict[str, Any]) -> None:
        self._send(0, {**msg, "node": self.node})

    def _receive(self) -> None:
        status = MPI.Status()
        while self._probe(PEER_TAG, status):
            source = status.Get_source()
            msg = self.comm.recv(source=source, tag=PEER_TAG)
            if msg["type"] == "global_file":
                self.globals.on_header(source, msg)
            elif self.replicator is not None:
                self.replicator.handle(self.node_of_rank[source], msg)
        while self._probe(TAG, status):
            msg = self.comm.recv(source=status.Get_source(), tag=TAG)
            if "node" in msg and self.coordinator and msg["type"] not in _TO_AGENT:
                self.coordinator.handle(msg["node"], msg)
            else:
                self._handle(msg)

    def _probe(self, tag: int, status: Any) -> bool:
        # MPICH: the first probe may only drive progress; a message that has already
        # arrived is often seen by the second one (measured: a whole tick saved)
        return any(self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status)
                   for _ in range(2))

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
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
            self.inbox.put({"type": "captured", "ckpt": ckpt, "manifest": manifest.to_json()})
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
        names = set(self.announced.get(manifest.ckpt, {}).get("global_files", []))
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
        target = self.paths.spool / ckpt
        if not self.config.commit.mirror or manifest is None or not target.is_dir():
            return
        held = global_dir(self.paths.journal, ckpt)
        for entry in manifest.files:
            path = entry["path"]
            if path not in manifest.global_files or (target / path).exists():
                continue
            if not (held / path).is_file():
                return                          # not arrived yet: the next call does it
            try:
                mirror_file(held / path, target / path, entry["checksum"], entry["mode"])
            except (OSError, CachexError) as exc:
                log.warning("mirror of %s/%s failed: %s", ckpt, path, describe(exc))
                return
            self.events.emit("mirrored", ckpt=ckpt, path=path)

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
            remove_tree(self.paths.stage / ckpt)
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
                        "global_files": self._global_files(ckpt)})

    def _global_files(self, ckpt: str) -> list[str]:
        try:
            return self.rule.global_files(self.paths.spool / ckpt)
        except OSError:
            return []

    def _capture_loop(self) -> None:
        while (task := self.captures.get()) is not None:
            try:
                self._capture(task)
            except (CachexError, OSError) as exc:
                error = describe(exc)
                log.error("capture of %s failed: %s", task["ckpt"], error)
                self.events.emit("capture_failed", ckpt=task["ckpt"], seq=task["seq"], error=error)
                self.journal.update(task["ckpt"], state="failed", reason=error)
                self.inbox.put({"type": "capture_failed", "ckpt": task["ckpt"], "error": error})
            finally:
                self._queued.discard(task["ckpt"])

    def _capture(self, task: dict[str, Any]) -> None:
        ckpt, seq = task["ckpt"], task["seq"]
        source = self.paths.spool / ckpt
        start = time.time()
        settle = self.config.commit.settle if self.rule.needs_polling else 0.0
        try:
            wait_quiescent(source, settle, self.config.commit.timeout, self.stop_event)
        except FileNotFoundError:
            raise CaptureError(f"{source}: checkpoint directory is missing") from None
        self.events.emit("capture_start", ckpt=ckpt, seq=seq)
        relpaths = list_files(source, self.rule.ignore)
        total = sum((source / rel).stat().st_size for rel in relpaths)
        mode = "copy" if _memory_allows(total) else "reference"
        if mode == "copy":
            target = self.paths.stage / ckpt
            entries = capture_copy(source, target, relpaths, self.config.flush.chunk)
        else:
            log.warning("capture of %s by reference: %d bytes would not fit in memory", ckpt, total)
            target, entries = source, capture_reference(source, relpaths)
        manifest = LocalManifest(run=self.config.run, ckpt=ckpt, seq=seq, node=self.node,
                                 host=self.placement.host, rank=self.rank, files=entries)
        self.journal.save_manifest(manifest)
        self.journal.update(ckpt, seq=seq, state="captured", source=str(target), mode=mode,
                            bytes=manifest.bytes, global_files=task["global_files"])
        duration = time.time() - start
        self.events.emit("captured", ckpt=ckpt, seq=seq, bytes=manifest.bytes,
                         files=len(entries), mode=mode, duration=duration,
                         write_start=self.watcher.first_seen(ckpt),
                         committed_at=task.get("received"))
        self.inbox.put({"type": "captured", "ckpt": ckpt, "manifest": manifest.to_json(),
                        "duration": duration})

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
            remove_tree(self.paths.stage / ckpt)
            self.journal.update(ckpt, mode="evicted")
            self.events.emit("evicted", ckpt=ckpt, seq=entry["seq"], level="stage")
            if not entry.get("finalized"):
                self._to_coordinator({"type": "evicted", "ckpt": ckpt})

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
        files = [self.paths.journal / "stop"]
        if self.coordinator:
            files.append(self.paths.pfs / "control" / "stop")
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


def _held(entry: dict[str, Any]) -> bool:
    """The captured copy (stage, or spool when captured by reference) is still there."""
    return entry.get("mode") in ("copy", "reference") and Path(entry["source"]).is_dir()


def _memory_allows(nbytes: int) -> bool:
    return psutil.virtual_memory().available - nbytes > MEMORY_RESERVE
