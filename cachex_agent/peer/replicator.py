"""Peer replication: stream each captured checkpoint into the partners' windows.

Protocol (small messages on the PEER tag; bulk bytes only through `Put`):
  owner   -> partner  begin   ckpt and the owner's local manifest
  owner   -> partner  slot    slot k of my region holds bytes [offset, offset+n) of file i
  partner -> owner    credit  slot k is on disk; fill it again
  owner   -> partner  end     every byte was sent
  partner -> owner    ack     verified, fsynced, manifest written (or the error)

Each owner has `peer.slots` slots of `peer.slot` bytes in each partner's window, so
memory is bounded by the window whatever the checkpoint size, and several owners can
send to one partner at once. Bytes go from a mapping of the staged file straight into
the partner's window (no read into a buffer first). The main thread calls `pump()`
every tick: it never blocks on a partner. A partner that leaves slots unanswered for
`agent.timeout` is declared dead: reported, never sent to again in this run; the
owner's data goes on to the PFS.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..config import Config
from ..events import EventLog
from ..handles import Handle, Stage, StageLog, State, held_for_tests
from ..layout import NodePaths
from ..manifest import LocalManifest
from ..messages import Ack, Begin, Credit, End, Slot
from .partners import incoming
from .store import ReplicaStore
from .window import ReceiveWindow

log = logging.getLogger(__name__)
Send = Callable[[int, Any], None]         # (rank, a typed message)
Post = Callable[[Any], None]        # into the agent's inbox
POPULATE = getattr(mmap, "MAP_POPULATE", 0)     # Linux; elsewhere faults per page


@dataclass
class Sender:
    """One checkpoint to one partner: the owner's side of the stream."""

    manifest: LocalManifest
    source: Path
    partner: int            # node
    rank: int
    region: int             # my region in the partner's window
    free: deque[int]
    mapped: bool = True     # Put straight from a mapping of each piece (see `next_chunk`)
    file: int = 0
    offset: int = 0
    handle: BinaryIO | None = None
    state: str = "queued"   # queued | sending | ending | done | failed
    heard: float = field(default_factory=time.monotonic)
    error: str | None = None

    def next_chunk(self, buffer: np.ndarray) -> tuple[int, int, np.ndarray] | None:
        """The next piece, at most `buffer.nbytes` long: (file index, offset, its bytes),
        or None when every file was sent.

        Mapped, the bytes are a view of a mapping of just that piece (no copy, and memory
        bounded by one slot whatever the file size); drop the view once it was Put. A
        capture by reference is read into `buffer` instead: its files are the trainer's,
        and a mapped file truncated under us would end the agent with SIGBUS."""
        files = self.manifest.files
        while self.file < len(files):
            entry = files[self.file]
            if self.offset < entry.size:
                if self.handle is None:
                    self.handle = self._open(entry.path, entry.size)
                length = min(buffer.nbytes, entry.size - self.offset)
                data = (map_piece(self.handle.fileno(), self.offset, length) if self.mapped
                        else self._read(buffer, length))
                chunk = (self.file, self.offset, data)
                self.offset += length
                return chunk
            self._next_file()
        return None

    def _open(self, relpath: str, size: int) -> BinaryIO:
        handle = open(self.source / relpath, "rb", buffering=0)  # noqa: SIM115
        if os.fstat(handle.fileno()).st_size < size:
            handle.close()
            raise OSError(errno.EIO, f"{self.source / relpath}: shorter than its manifest")
        handle.seek(self.offset)
        return handle

    def _read(self, buffer: np.ndarray, length: int) -> np.ndarray:
        assert self.handle is not None
        view = memoryview(buffer)[:length]
        done = 0
        while done < length:
            n = self.handle.readinto(view[done:])
            if not n:
                raise OSError(errno.EIO, f"{self.handle.name}: shorter than its manifest")
            done += n
        return buffer[:length]

    def _next_file(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        self.file, self.offset = self.file + 1, 0

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def map_piece(fd: int, offset: int, length: int) -> np.ndarray:
    """Bytes [offset, offset+length) of the file, mapped read-only and populated in one
    call (one fault per piece, not per page). A mapping must start on an allocation
    boundary: map from the one below `offset`. The mapping goes with the last view of it.
    `length` > 0 (an empty file has no piece; mmap refuses 0 bytes)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, offset + length - start, flags=mmap.MAP_SHARED | POPULATE,
                            prot=mmap.PROT_READ, offset=start)
    except ValueError as exc:       # mmap's word for "past the end of the file"
        raise OSError(errno.EIO, f"shorter than its manifest ({exc})") from None
    return np.frombuffer(mapping, dtype=np.uint8, count=length, offset=offset - start)


def shared_memory_ranks(comm: Any) -> set[int]:
    """Collective: the ranks whose windows this rank reaches through shared memory (those
    of its host, unless MPICH is told not to use shared memory between them)."""
    hosts = comm.allgather(socket.gethostname())
    if os.environ.get("MPIR_CVAR_NOLOCAL", "").lower() in ("1", "yes", "true", "on"):
        return {comm.Get_rank()}
    return {rank for rank, host in enumerate(hosts) if host == hosts[comm.Get_rank()]}


class ReplicateHandle(Handle):
    """One checkpoint to every partner: queued, running from the first `begin`, done
    when every partner acked it verified (failed if any did not: the PFS still gets it)."""

    stage = Stage.REPLICATE

    def __init__(self, manifest: LocalManifest, source: Path, mapped: bool,
                 replicator: Replicator) -> None:
        super().__init__(manifest.ckpt, manifest.seq, replicator.log)
        self.manifest, self.source, self.mapped = manifest, source, mapped
        self.replicator = replicator

    def _start(self) -> None:
        self.replicator.queue(self)

    def _cancel(self) -> None:
        self.replicator.cancel(self.ckpt)


class Replicator:
    def __init__(self, comm: Any, node: int, pmap: list[list[int]], ranks_by_node: list[int],
                 config: Config, paths: NodePaths, events: EventLog, send: Send,
                 post: Post, log_: StageLog | None = None) -> None:
        """`log_`: where stage states go (journal and events); events only if None."""
        self.node = node
        self.partners = pmap[self.node]
        self.ranks = ranks_by_node
        self.regions = {p: incoming(p, pmap).index(self.node) for p in self.partners}
        self.timeout = config.agent.timeout
        self.slots = config.peer.slots
        self.events, self.send, self.post = events, send, post
        self.log = log_ or StageLog(events)
        # Put from a mapping pays only where the window is shared memory; over the network
        # path a reused buffer is faster (1 GiB, quiet machine: ratio 0.64 mapped vs 0.83
        # from the buffer with MPIR_CVAR_NOLOCAL=1; 0.92 vs 0.85 with shared memory)
        local = shared_memory_ranks(comm)
        self.map_to = {p for p in self.partners if self.ranks[p] in local}
        self.window = ReceiveWindow(comm, len(incoming(self.node, pmap)), config.peer.slots,
                                    config.peer.slot)
        self.store = ReplicaStore(paths.replicas, self.window,
                                  {o: i for i, o in enumerate(incoming(self.node, pmap))},
                                  config.keep.replica, post, events, config.agent.timeout)
        self.buffer = np.empty(config.peer.slot, dtype=np.uint8)
        self.queues: dict[int, deque[Sender]] = {p: deque() for p in self.partners}
        self.dead: dict[int, str] = {}
        self.results: dict[str, dict[int, str | None]] = {}     # ckpt -> partner -> error
        self.handles: dict[str, ReplicateHandle] = {}           # not ended yet
        self.started: dict[str, float] = {}

    # ----------------------------------------------------------------- owner side
    def replicate(self, manifest: LocalManifest, source: Path, mapped: bool = True
                  ) -> ReplicateHandle:
        """Queue `manifest` to every partner; `post`s `replicated` when all answered.
        `mapped`: `source` is the agent's own copy (never truncated), Put from mappings."""
        handle = self.handles.get(manifest.ckpt)
        if handle is not None:
            return handle               # already under way (a repeated announcement)
        handle = ReplicateHandle(manifest, source, mapped, self)
        self.handles[manifest.ckpt] = handle
        return handle.submit()

    def queue(self, handle: ReplicateHandle) -> None:
        manifest = handle.manifest
        self.results[manifest.ckpt] = {}
        self.started[manifest.ckpt] = time.monotonic()
        for partner in self.partners:
            if partner in self.dead:
                self._finish(manifest, partner, f"partner node {partner}: {self.dead[partner]}")
                continue
            self.queues[partner].append(Sender(
                manifest, handle.source, partner, self.ranks[partner], self.regions[partner],
                deque(range(self.slots)), handle.mapped and partner in self.map_to))

    def cancel(self, ckpt: str) -> None:
        """Drop the partners' streams of `ckpt` not begun yet; a begun one runs to its ack
        (the partner holds slots of it)."""
        for queue in self.queues.values():
            for sender in queue:
                if sender.manifest.ckpt == ckpt and sender.state == "queued":
                    self._fail(sender, "cancelled")

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
            handle = self.handles[sender.manifest.ckpt]
            if handle.state == State.QUEUED:
                handle.set(State.RUNNING, bytes=sender.manifest.bytes, partners=self.partners)
            self.send(sender.rank, Begin(sender.manifest))
        held = held_for_tests(Stage.REPLICATE, self.node)
        try:
            while sender.state == "sending" and sender.free and not held:
                chunk = sender.next_chunk(self.buffer)
                if chunk is None:
                    sender.state = "ending"
                    self.send(sender.rank, End(sender.manifest.ckpt))
                    break
                index, offset, data = chunk
                slot = sender.free.popleft()
                self.window.put(data, sender.rank, sender.region, slot)
                self.send(sender.rank, Slot(sender.manifest.ckpt, slot, index, offset,
                                            data.nbytes))
                del data, chunk     # a mapped piece is unmapped with its last view
        except OSError as exc:
            # end the stream but stay at the head of the queue until the partner's ack:
            # credits for slots it still writes must not reach the next checkpoint's sender
            sender.error, sender.state = f"reading {sender.source}: {exc}", "ending"
            sender.close()
            self.send(sender.rank, End(sender.manifest.ckpt))
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
        sender.state = "done" if ok and sender.error is None else "failed"
        sender.close()
        if sender.error is None and not ok:
            sender.error = f"partner node {partner}: {error}"
        self._finish(sender.manifest, partner, sender.error)

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
        if len(results) < len(self.partners):
            return
        errors = {str(p): e for p, e in results.items() if e}
        duration = time.monotonic() - self.started.pop(manifest.ckpt, time.monotonic())
        del self.results[manifest.ckpt]
        handle = self.handles.pop(manifest.ckpt)
        if errors:
            log.warning("replication of %s failed: %s", manifest.ckpt, errors)
            state = State.CANCELLED if handle.cancelled.is_set() else State.FAILED
            handle.set(state, error="; ".join(errors.values()), errors=errors)
        else:
            handle.set(State.DONE, bytes=manifest.bytes, partners=self.partners,
                       duration=duration)
        self.post({"type": "replicated", "ckpt": manifest.ckpt, "ok": not errors,
                   "errors": errors, "partners": self.partners, "duration": duration})

    # --------------------------------------------------------------- partner side
    def handle(self, source_node: int, msg: Begin | Slot | End | Credit | Ack) -> None:
        """A peer message (messages.decode) from the agent of `source_node`."""
        kind = type(msg)
        if kind is Begin:
            self.store.begin(source_node, msg.manifest)
        elif kind is Slot:
            self.store.slot(source_node, msg.ckpt, msg.slot, msg.file, msg.offset, msg.length)
        elif kind is End:
            self.store.end(source_node, msg.ckpt)
        elif kind is Credit:
            self.on_credit(source_node, msg.slot)
        elif kind is Ack:
            self.on_ack(source_node, msg.ckpt, msg.ok, msg.error)

    def close(self, free: bool = True) -> None:
        """Collective when `free`: pass False when any agent is known dead (freeing the
        window would wait for it forever)."""
        self.store.close()
        for queue in self.queues.values():
            for sender in queue:
                sender.close()
        if free and not self.dead:
            self.window.free()
