"""Peer replication: stream each captured checkpoint into the partners' windows.

Protocol (small messages on the PEER tag; bulk bytes only through `Put`):
  owner   -> partner  begin   ckpt and the owner's local manifest
  owner   -> partner  slot    slot k of my region holds bytes [offset, offset+n) of file i
  partner -> owner    credit  slot k is on disk; fill it again
  owner   -> partner  end     every byte was sent
  partner -> owner    ack     verified, fsynced, manifest written (or the error)

Each owner has `peer.slots` slots of `peer.slot` bytes in each partner's window, so
memory is bounded by the window whatever the checkpoint size, and several owners can
send to one partner at once. The main thread calls `pump()` every tick: it never blocks
on a partner. A partner that leaves slots unanswered for `agent.timeout` is declared
dead: reported, never sent to again in this run; the owner's data goes on to the PFS.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..config import Config
from ..events import EventLog
from ..layout import NodePaths
from ..manifest import LocalManifest
from .partners import incoming
from .store import ReplicaStore
from .window import ReceiveWindow

log = logging.getLogger(__name__)
Send = Callable[[int, dict[str, Any]], None]
Post = Callable[[dict[str, Any]], None]


@dataclass
class Sender:
    """One checkpoint to one partner: the owner's side of the stream."""

    manifest: LocalManifest
    source: Path
    partner: int            # node
    rank: int
    region: int             # my region in the partner's window
    free: deque[int]
    file: int = 0
    offset: int = 0
    handle: BinaryIO | None = None
    state: str = "queued"   # queued | sending | ending | done | failed
    heard: float = field(default_factory=time.monotonic)
    error: str | None = None

    def next_chunk(self, buffer: np.ndarray) -> tuple[int, int, int] | None:
        """Read the next piece into `buffer`: (file index, offset, length), or None."""
        files = self.manifest.files
        while self.file < len(files):
            entry = files[self.file]
            if self.offset < entry.size:
                if self.handle is None:
                    self.handle = open(self.source / entry.path, "rb", buffering=0)  # noqa: SIM115
                    self.handle.seek(self.offset)
                n = self.handle.readinto(memoryview(buffer)[:min(buffer.nbytes,
                                                                 entry.size - self.offset)])
                if not n:
                    raise OSError(f"{self.source / entry.path}: shorter than its manifest")
                chunk = (self.file, self.offset, n)
                self.offset += n
                return chunk
            self._next_file()
        return None

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        self.file, self.offset = self.file + 1, 0

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class Replicator:
    def __init__(self, comm: Any, node: int, pmap: list[list[int]], ranks_by_node: list[int],
                 config: Config, paths: NodePaths, events: EventLog, send: Send,
                 post: Post) -> None:
        self.node = node
        self.partners = pmap[self.node]
        self.ranks = ranks_by_node
        self.regions = {p: incoming(p, pmap).index(self.node) for p in self.partners}
        self.timeout = config.agent.timeout
        self.slots = config.peer.slots
        self.events, self.send, self.post = events, send, post
        self.window = ReceiveWindow(comm, len(incoming(self.node, pmap)), config.peer.slots,
                                    config.peer.slot)
        self.store = ReplicaStore(paths.replicas, self.window,
                                  {o: i for i, o in enumerate(incoming(self.node, pmap))},
                                  config.keep.replica, post, events, config.agent.timeout)
        self.buffer = np.empty(config.peer.slot, dtype=np.uint8)
        self.queues: dict[int, deque[Sender]] = {p: deque() for p in self.partners}
        self.dead: dict[int, str] = {}
        self.results: dict[str, dict[int, str | None]] = {}     # ckpt -> partner -> error
        self.started: dict[str, float] = {}

    # ----------------------------------------------------------------- owner side
    def replicate(self, manifest: LocalManifest, source: Path) -> None:
        """Queue `manifest` to every partner; `post`s `replicated` when all answered."""
        if manifest.ckpt in self.results:
            return                      # already under way (a repeated announcement)
        self.results[manifest.ckpt] = {}
        self.started[manifest.ckpt] = time.monotonic()
        self.events.emit("replicate_start", ckpt=manifest.ckpt, seq=manifest.seq,
                         bytes=manifest.bytes, partners=self.partners)
        for partner in self.partners:
            if partner in self.dead:
                self._finish(manifest, partner, f"partner node {partner}: {self.dead[partner]}")
                continue
            self.queues[partner].append(Sender(
                manifest, source, partner, self.ranks[partner], self.regions[partner],
                deque(range(self.slots))))

    def pump(self) -> None:
        """Move what can move now; detect partners that stopped answering."""
        now = time.monotonic()
        for queue in self.queues.values():
            if queue:
                self._pump_one(queue[0], now)
            while queue and queue[0].state in ("done", "failed"):
                queue.popleft()

    def pending(self) -> set[str]:
        """Checkpoints whose replication has not finished (their source must stay)."""
        return set(self.results)

    def busy(self) -> bool:
        return any(self.queues.values()) or self.store.busy()

    def _pump_one(self, sender: Sender, now: float) -> None:
        if sender.state == "queued":
            sender.state, sender.heard = "sending", now
            self.send(sender.rank, {"type": "begin", "manifest": sender.manifest.to_json()})
        try:
            while sender.state == "sending" and sender.free:
                chunk = sender.next_chunk(self.buffer)
                if chunk is None:
                    sender.state = "ending"
                    self.send(sender.rank, {"type": "end", "ckpt": sender.manifest.ckpt})
                    break
                slot = sender.free.popleft()
                self.window.put(self.buffer[:chunk[2]], sender.rank, sender.region, slot)
                self.send(sender.rank, {"type": "slot", "ckpt": sender.manifest.ckpt,
                                        "slot": slot, "file": chunk[0], "offset": chunk[1],
                                        "length": chunk[2]})
        except OSError as exc:
            self._fail(sender, f"reading {sender.source}: {exc}")
            self.send(sender.rank, {"type": "end", "ckpt": sender.manifest.ckpt})
            return
        waiting = sender.state == "ending" or not sender.free
        if waiting and now - sender.heard > self.timeout:
            reason = f"did not answer for {self.timeout:.0f}s"
            self.dead[sender.partner] = reason
            log.error("partner node %d (rank %d) %s; its replicas go to the PFS instead",
                      sender.partner, sender.rank, reason)
            for queued in self.queues[sender.partner]:
                self._fail(queued, f"partner node {sender.partner} (rank {sender.rank}) {reason}")

    def on_credit(self, partner: int, slot: int) -> None:
        sender = self._current(partner)
        if sender is not None:
            sender.free.append(slot)
            sender.heard = time.monotonic()

    def on_ack(self, partner: int, ckpt: str, ok: bool, error: str | None) -> None:
        sender = self._current(partner)
        if sender is None or sender.manifest.ckpt != ckpt:
            return
        sender.state = "done" if ok else "failed"
        sender.close()
        self._finish(sender.manifest, partner, None if ok else f"partner node {partner}: {error}")

    def _current(self, partner: int) -> Sender | None:
        queue = self.queues.get(partner)
        return queue[0] if queue and partner not in self.dead else None

    def _fail(self, sender: Sender, error: str) -> None:
        if sender.state in ("done", "failed"):
            return
        sender.state, sender.error = "failed", error
        sender.close()
        self._finish(sender.manifest, sender.partner, error)

    def _finish(self, manifest: LocalManifest, partner: int, error: str | None) -> None:
        results = self.results.setdefault(manifest.ckpt, {})
        results[partner] = error
        if len(results) == len(self.partners):
            errors = {str(p): e for p, e in results.items() if e}
            duration = time.monotonic() - self.started.pop(manifest.ckpt, time.monotonic())
            self.post({"type": "replicated", "ckpt": manifest.ckpt, "ok": not errors,
                       "errors": errors, "partners": self.partners, "duration": duration})
            del self.results[manifest.ckpt]

    # --------------------------------------------------------------- partner side
    def handle(self, source_node: int, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "begin":
            self.store.begin(source_node, msg["manifest"])
        elif kind == "slot":
            self.store.slot(source_node, msg["ckpt"], msg["slot"], msg["file"], msg["offset"],
                            msg["length"])
        elif kind == "end":
            self.store.end(source_node, msg["ckpt"])
        elif kind == "credit":
            self.on_credit(source_node, msg["slot"])
        elif kind == "ack":
            self.on_ack(source_node, msg["ckpt"], msg["ok"], msg.get("error"))

    def close(self, free: bool = True) -> None:
        """Collective when `free`: pass False when any agent is known dead (freeing the
        window would wait for it forever)."""
        self.store.close()
        for queue in self.queues.values():
            for sender in queue:
                sender.close()
        if free and not self.dead:
            self.window.free()
