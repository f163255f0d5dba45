"""Peer replication: stream each captured checkpoint into the partners' windows.

Protocol (small messages on the PEER tag; bulk bytes only through `Put`):
  owner   -> partner  begin   ckpt and the owner's local manifest
  owner   -> partner  slot    slot k of my region holds bytes [offset, offset+n) of file i
  partner -> owner    credit  slot k is on disk; fill it again
  owner   -> partner  end     every byte was sent
  partner -> owner    ack     verified, fsynced, manifest written (or the error)

A part captured by copy is streamed while it is captured: `begin` names no files, each
file goes as a `file` message (its manifest entry) once the capture thread has copied
it (`file_captured`), its slots after it, and `end` carries the final manifest
(`captured`). The partner keeps the replica only if that manifest names exactly the
files it received (paths, sizes, modes, checksums, order). A capture that started over
(a file posted again from index 0), failed, or ended with other files abandons the
stream (`end` without a manifest); once the final manifest is known the owner sends
the whole part again from it, so a torn part is never a replica.

Each owner has `peer.slots` slots of `peer.slot` bytes in each partner's window, so
memory is bounded by the window whatever the checkpoint size, and several owners can
send to one partner at once. Bytes go from a mapping of the staged file straight into
the partner's window (no read into a buffer first); a file captured by hard link, still
the trainer's, is read into a buffer instead, or, with one partner, Put from the
capture's own pieces as it hashes them (peer/feed.py: its buffers, or views of the file
mapped under a read lease, mapped.py; such a file is announced with a PENDING checksum,
which the final manifest gives). The owner does not hash what it
sends: the partner checks every file against the manifest's checksum as it writes it,
and an ack that names a file that differed makes the owner's error say why (for a
linked file, the trainer rewrote it since the capture). The main thread calls `pump()`
every tick: it never blocks on a partner. It polls MPI fast only while
`waits_on_peer()` (a credit, an ack or a slot is due); the partner's writer and the
capture (its feed too) wake it through the inbox for everything else.

A partner that leaves slots unanswered is judged on this agent's own clock net of its own
stalls (liveness.OwnClock: a resumed owner does not blame the partner for its own stop):
past `agent.timeout` it is suspect (a `Silence` report up, so status names it; the owner
keeps waiting, with one partner there is no other copy to make), and taken back as soon
as it answers; past `agent.dead_after` it is dead: reported, never sent to again in this
run; the owner's data goes on to the PFS (the flush runs beside the replication). A
drain gives up on a suspect partner at once (`give_up_on_suspects`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..config import Config
from ..events import EventLog
from ..fsutil import linked_hint
from ..handles import Handle, Stage, StageLog, State
from ..journal import JournalEntry
from ..layout import NodePaths
from ..manifest import PENDING, FileEntry, LocalManifest
from ..mapped import map_piece
from ..messages import Ack, Begin, Credit, End, File, FileCaptured, Silence, Slot
from .feed import READ, WAIT_FOR_IT, Feed, Piece
from .partners import incoming
from .redundancy import replicated
from .store import ReplicaStore
from .window import ReceiveWindow

log = logging.getLogger(__name__)
Send = Callable[[int, Any], None]         # (rank, a typed message)
Post = Callable[[Any], None]        # into the agent's inbox


Final = tuple[LocalManifest, Path, bool]     # a finished capture: manifest, source, mapped
NOT_READY = "not ready"     # Sender.next_chunk: the feed will bring that piece


@dataclass
class Stream:
    """A part replicated while it is captured: the files copied so far."""

    manifest: LocalManifest     # files appended as the capture thread posts them
    partial: Path               # where the capture copies them
    final_dir: Path             # where they are once the part is whole
    torn: bool = False          # the capture started over or changed: abandon the stream
    final: Final | None = None  # the capture finished
    failed: str | None = None   # the capture failed or was cancelled: nothing to send

    def add(self, msg: FileCaptured) -> None:
        files = self.manifest.files
        if msg.partial != self.partial or self.torn:
            self.torn = True
        elif _hashed(files, msg):
            files[-1] = msg.entry       # the checksum of a file streamed as it was hashed
        elif msg.index != len(files):
            self.torn = True        # posted from index 0 again: a new attempt
        else:
            files.append(msg.entry)

    def finish(self, final: Final) -> None:
        manifest, source, _mapped = final
        self.final = final
        if manifest.files != self.manifest.files or source != self.final_dir:
            self.torn = True        # another attempt, or by reference: not these bytes


def _hashed(files: list[FileEntry], msg: FileCaptured) -> bool:
    """`msg` gives the checksum of the file last posted PENDING (same path, size, mode)."""
    if msg.index != len(files) - 1 or msg.entry.checksum == PENDING:
        return False
    last = files[-1]
    return last.checksum == PENDING and replace(last, checksum=msg.entry.checksum) == msg.entry


@dataclass
class Cursor:
    """One file of a part on its way: the next piece's offset, the open file."""

    file: int                   # index in the manifest
    offset: int = 0
    handle: BinaryIO | None = None
    mapped: bool = False        # its pieces are Put from mappings

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


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
    stream: Stream | None = None    # files still being captured (then `source` is partial)
    streams: int = 1        # files in flight at once, their pieces in turn (peer.streams)
    cursors: list[Cursor] = field(default_factory=list)     # the files in flight
    opened: int = 0         # files taken into `cursors` so far
    turn: int = 0           # the cursor whose piece goes next
    announced: int = 0      # File messages sent (a stream)
    feed: Feed | None = None        # a stream's linked files, as the capture hashes them
    fed: Piece | None = None        # the fed piece last returned, until it was Put
    how: str = ""           # where the piece last returned came from: fed, mapped, read
    # queued | sending | ending | waiting (a stream abandoned, for the final manifest)
    # | done | failed
    state: str = "queued"
    heard: float = 0.0      # the owner's net clock (liveness.py) when the partner last spoke
    error: str | None = None
    aborted: bool = False   # a stream ended without its final manifest

    def restart(self, manifest: LocalManifest, source: Path, mapped: bool) -> None:
        """Send the whole part again, from its final manifest (the stream was abandoned)."""
        self.close()
        self.manifest, self.source, self.mapped, self.stream = manifest, source, mapped, None
        self.opened = self.turn = self.announced = 0
        self.state, self.error, self.aborted = "queued", None, False

    def width(self) -> int:
        """Files in flight: one while the capture feeds the pieces, which it reads in the
        files' order (a later file's piece would only wait for it)."""
        return 1 if self.feed is not None and self.stream is not None else self.streams

    def next_chunk(self, buffer: np.ndarray) -> tuple[int, int, np.ndarray] | str | None:
        """The next piece, at most `buffer.nbytes` long: (file index, offset, its bytes),
        NOT_READY while the capture is still hashing it for the feed, or None when every
        file was sent. A fed piece is the capture's (its buffer, or a view of the linked
        file mapped under the capture's read lease): `release` it once it was Put.
        With `streams` > 1 the pieces of that many files go in turn (the partner writes
        each file on a thread of its own).

        Mapped, the bytes are a view of a mapping of just that piece (no copy, and memory
        bounded by one slot whatever the file size); drop the view once it was Put. A
        capture by reference, or a file captured by hard link and not fed, is read into
        `buffer` instead: its file is the trainer's, and a mapped file truncated under us
        would end the agent with SIGBUS (only the capture maps one, under a lease).
        Nothing is hashed here: the partner hashes what it writes and names a file that
        differs from the manifest in its ack (`mismatch`)."""
        files = self.manifest.files
        while True:
            while len(self.cursors) < self.width() and self.opened < len(files):
                self.cursors.append(Cursor(self.opened))
                self.opened += 1
            if not self.cursors:
                return None
            self.turn %= len(self.cursors)
            cursor = self.cursors[self.turn]
            entry = files[cursor.file]
            if cursor.offset >= entry.size:
                cursor.close()
                self.cursors.remove(cursor)
                continue
            length = min(buffer.nbytes, entry.size - cursor.offset)
            data = self._fed(cursor, entry, length)
            if data is WAIT_FOR_IT:
                return NOT_READY
            self.how = "fed"
            if data is None:
                if cursor.handle is None:
                    self._open(cursor, entry.size)
                assert cursor.handle is not None
                self.how = "mapped" if cursor.mapped else "read"
                data = (map_piece(cursor.handle.fileno(), cursor.offset, length)
                        if cursor.mapped else self._read(cursor, buffer, length))
            chunk = (cursor.file, cursor.offset, data)
            cursor.offset += length
            self.turn += 1
            return chunk

    def _fed(self, cursor: Cursor, entry: FileEntry, length: int
             ) -> np.ndarray | str | None:
        """The piece from the feed, WAIT_FOR_IT, or None (read it from the file)."""
        if self.feed is None or self.stream is None:
            return None
        got = self.feed.serve(self.manifest.ckpt, cursor.file, cursor.offset, length,
                              pending=entry.checksum == PENDING)
        if isinstance(got, str):
            return None if got == READ else got
        self.fed = got
        return got.data

    def release(self) -> None:
        """The piece last returned was Put: a fed buffer goes back to the capture."""
        if self.fed is not None:
            assert self.feed is not None
            self.feed.release(self.fed)
            self.fed = None

    def _path(self, relpath: str) -> Path:
        path = self.source / relpath
        if self.stream is not None and not path.exists():
            path = self.stream.final_dir / relpath      # the part was renamed into place
        return path

    def _open(self, cursor: Cursor, size: int) -> None:
        relpath = self.manifest.files[cursor.file].path
        handle = open(self._path(relpath), "rb", buffering=0)  # noqa: SIM115
        st = os.fstat(handle.fileno())
        if st.st_size < size:
            handle.close()
            raise OSError(errno.EIO, f"{self.source / relpath}: shorter than its manifest")
        cursor.handle = handle
        # a second name is the trainer's spool file (a capture by hard link): read, not
        # mapped; the partner checks its checksum as it writes (`mismatch` says why not)
        cursor.mapped = self.mapped and st.st_nlink == 1

    def mismatch(self, index: int) -> str | None:
        """What the partner's word that file `index` arrived with another checksum means
        here; None for an index not in this part (the partner's error stands)."""
        if not 0 <= index < len(self.manifest.files):
            return None
        path = self._path(self.manifest.files[index].path)
        return f"{path}: checksum differs from the capture's{linked_hint(path)}"

    @staticmethod
    def _read(cursor: Cursor, buffer: np.ndarray, length: int) -> np.ndarray:
        assert cursor.handle is not None
        view = memoryview(buffer)[:length]
        done = 0
        while done < length:
            # positional: fed pieces before this one were not read, and files take turns
            n = os.preadv(cursor.handle.fileno(), [view[done:]], cursor.offset + done)
            if not n:
                raise OSError(errno.EIO, f"{cursor.handle.name}: shorter than its manifest")
            done += n
        return buffer[:length]

    def close(self) -> None:
        self.release()
        for cursor in self.cursors:
            cursor.close()
        self.cursors.clear()


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
                 replicator: Replicator, stream: Stream | None = None) -> None:
        super().__init__(manifest.ckpt, manifest.seq, replicator.log)
        self.manifest, self.source, self.mapped = manifest, source, mapped
        self.replicator, self.stream = replicator, stream

    def _start(self) -> None:
        self.replicator.queue(self)

    def _cancel(self) -> None:
        self.replicator.cancel(self.ckpt)


class Replicator:
    def __init__(self, comm: Any, node: int, pmap: list[list[int]], ranks_by_node: list[int],
                 config: Config, paths: NodePaths, events: EventLog, send: Send,
                 post: Post, log_: StageLog | None = None,
                 wake: Callable[[], None] = lambda: None, feed: Feed | None = None,
                 streams: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        """`log_`: where stage states go (journal and events); events only if None.
        `wake`: ends the main loop's sleep (the agent's inbox), see `waits_on_peer`.
        `feed`: the capture's pieces of linked files (one partner only, peer/feed.py).
        `streams`: files of a part in flight to each partner, and the threads that write
        what others send here (priority.streams sizes it). `clock`: what silence is
        judged on (the agent's liveness.OwnClock, net of its own stalls)."""
        self.feed = feed
        self.streams = streams
        self.node = node
        self.partners = pmap[self.node]
        self.ranks = ranks_by_node
        self.regions = {p: incoming(p, pmap).index(self.node) for p in self.partners}
        self.timeout, self.dead_after = config.agent.timeout, config.agent.dead_after
        self.clock = clock
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
                                  config.keep.replica, post, events, config.agent.timeout,
                                  wake, lanes=streams)
        self.buffer = np.empty(config.peer.slot, dtype=np.uint8)
        self.queues: dict[int, deque[Sender]] = {p: deque() for p in self.partners}
        self.dead: dict[int, str] = {}
        self.suspect: set[int] = set()      # silent past agent.timeout, still waited for
        self.results: dict[str, dict[int, str | None]] = {}     # ckpt -> partner -> error
        self.handles: dict[str, ReplicateHandle] = {}           # not ended yet
        self.started: dict[str, float] = {}
        # bytes Put per checkpoint by where they came from (Sender.how): the event says
        self.sent_from: dict[str, Counter[str]] = {}

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

    def file_captured(self, msg: FileCaptured) -> ReplicateHandle:
        """The capture thread copied a file of a part: the first one starts streaming
        the part to every partner; each later one is sent after the earlier ones."""
        handle = self.handles.get(msg.header.ckpt)
        if handle is None:
            stream = Stream(replace(msg.header, files=[]), msg.partial, msg.final)
            handle = ReplicateHandle(stream.manifest, msg.partial, True, self, stream)
            self.handles[handle.ckpt] = handle
            handle.submit()
        if handle.stream is not None and handle.stream.final is None:
            handle.stream.add(msg)
        return handle

    def captured(self, manifest: LocalManifest, source: Path, mapped: bool,
                 fed_wait: float = 0.0) -> ReplicateHandle:
        """The part is captured: replicate it, or end its stream with this manifest
        (a stream of other files is abandoned and the whole part sent again).
        `fed_wait`: the seconds the feed held the capture back, the replication's."""
        handle = self.handles.get(manifest.ckpt)
        if handle is None or handle.stream is None:
            return self.replicate(manifest, source, mapped)
        handle.stream.finish((manifest, source, mapped))
        handle.manifest = manifest
        # the duration the model hears of: what replication adds after the capture
        # (the stream's time beside the capture is not the replication's cost), and the
        # time it held the capture back through the feed (which is)
        self.started[manifest.ckpt] = time.monotonic() - fed_wait
        for sender in self._senders(manifest.ckpt):
            if sender.state == "queued":        # not begun: no stream to end
                sender.restart(manifest, source, mapped and sender.partner in self.map_to)
            elif sender.state == "waiting":
                self._restart(sender, "the capture changed while it was streamed")
        return handle

    # ------------------------------------------------ the agent's verbs (Protector)
    def protect(self, manifest: LocalManifest, source: Path, entry: JournalEntry,
                fed_wait: float = 0.0) -> None:
        # a stage copy is the agent's own and may be mapped; a linked or referenced
        # file is the trainer's and may change under a mapping
        self.captured(manifest, source, entry.staged, fed_wait)

    def group_ready(self, manifest: LocalManifest, source: Path,
                    entry: JournalEntry) -> None:
        """Copies wait for no other node."""

    def resume(self, manifest: LocalManifest, source: Path, entry: JournalEntry) -> None:
        self.captured(manifest, source, entry.staged)

    def _senders(self, ckpt: str) -> list[Sender]:
        return [s for q in self.queues.values() for s in q if s.manifest.ckpt == ckpt]

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
                deque(range(self.slots)), handle.mapped and partner in self.map_to,
                handle.stream, self.streams, feed=self.feed))

    def cancel(self, ckpt: str, reason: str = "cancelled") -> None:
        """Drop the partners' streams of `ckpt` not begun yet; a begun one runs to its ack
        (the partner holds slots of it). A part still being captured has nothing
        whole to send: its streams are abandoned (`reason`: why)."""
        handle = self.handles.get(ckpt)
        if handle is not None and handle.stream is not None and handle.stream.final is None:
            handle.stream.failed = reason
        for sender in self._senders(ckpt):
            if sender.state in ("queued", "waiting"):
                self._fail(sender, reason)

    def pump(self) -> None:
        """Move what can move now; detect partners that stopped answering."""
        now = self.clock()
        for queue in self.queues.values():
            # an ack handled since the last pump ended the head: begin the next one now,
            # not a tick later (a queued head is no peer message the loop would poll for)
            self._drop_ended(queue)
            if queue:
                self._pump_one(queue[0], now)
            self._drop_ended(queue)

    @staticmethod
    def _drop_ended(queue: deque[Sender]) -> None:
        while queue and queue[0].state in ("done", "failed"):
            queue.popleft()

    def pending(self) -> set[str]:
        """Checkpoints whose replication has not finished (their source must stay)."""
        return set(self.results)

    def busy(self) -> bool:
        return any(self.queues.values()) or self.store.busy()

    def waits_on_peer(self) -> bool:
        """What moves replication next is a message from another agent: a credit (every
        slot of a partner in flight), an ack, or, as a partner, the next slot of an open
        stream while the writer is dry. Only then must the main loop poll MPI; any other
        next move (the capture posting a file, the writer finishing a slot) comes from
        this agent's own threads, which wake the loop through the inbox."""
        for queue in self.queues.values():
            head = queue[0] if queue else None
            if head is not None and (head.state == "ending"
                                     or head.state == "sending" and not head.free):
                return True
        return self.store.expects_slots()

    def _pump_one(self, sender: Sender, now: float) -> None:
        if sender.state == "queued":
            self._begin(sender, now)
        if sender.stream is not None and sender.state == "sending":
            self._announce(sender)
        held = ReplicateHandle.held(self.node)
        try:
            while sender.state == "sending" and sender.free and not held:
                chunk = sender.next_chunk(self.buffer)
                if chunk is None:
                    self._out_of_files(sender, now)
                    break
                if chunk is NOT_READY:
                    break           # the feed's give wakes the loop
                index, offset, data = chunk
                self.sent_from.setdefault(sender.manifest.ckpt, Counter())[sender.how] += (
                    data.nbytes)
                slot = sender.free.popleft()
                try:
                    self.window.put(data, sender.rank, sender.region, slot,
                                    sender.fed.running if sender.fed is not None else None)
                finally:
                    sender.release()    # a fed piece's lease may be waiting for it
                self.send(sender.rank, Slot(sender.manifest.ckpt, slot, index, offset,
                                            data.nbytes))
                del data, chunk     # a mapped piece is unmapped with its last view
        except OSError as exc:
            # end the stream but stay at the head of the queue until the partner's ack:
            # credits for slots it still writes must not reach the next checkpoint's sender
            sender.error = f"reading {sender.source}: {exc}"
            self._end(sender)
        waiting = sender.state == "ending" or not sender.free
        silent = now - sender.heard if waiting else 0.0
        if silent > self.dead_after:
            self._declare_dead(sender.partner, f"did not answer for {silent:.0f}s")
        elif silent > self.timeout and sender.partner not in self.suspect:
            self.suspect.add(sender.partner)
            log.warning("partner node %d (rank %d) silent for %.0fs: suspect; waiting for it"
                        " up to %.0fs", sender.partner, sender.rank, silent, self.dead_after)
            self.post(Silence(peer=sender.partner, seconds=round(silent, 3),
                              holds="replication"))

    def _declare_dead(self, partner: int, reason: str) -> None:
        self.dead[partner] = reason
        self.suspect.discard(partner)
        log.error("partner node %d (rank %d) %s; its replicas go to the PFS instead",
                  partner, self.ranks[partner], reason)
        self._fail_queue(partner, reason)

    def give_up_on_suspects(self) -> None:
        """The drain: a suspect partner is not waited for (the data goes to the PFS);
        not dead either, a later run sends to it again."""
        for partner in sorted(self.suspect):
            self._fail_queue(partner, "silent at the drain")

    def _fail_queue(self, partner: int, reason: str) -> None:
        """Every replication queued to `partner` fails, saying why."""
        for queued in self.queues[partner]:
            self._fail(queued, f"partner node {partner} (rank {self.ranks[partner]}) {reason}")

    def _heard(self, partner: int) -> None:
        """The partner answered: a suspect one is taken back."""
        if partner in self.suspect:
            self.suspect.discard(partner)
            log.info("partner node %d answers again", partner)
            self.post(Silence(peer=partner, seconds=0.0, ended=True, holds="replication"))

    def _begin(self, sender: Sender, now: float) -> None:
        sender.state, sender.heard = "sending", now
        handle = self.handles[sender.manifest.ckpt]
        if handle.state == State.QUEUED:
            handle.set(State.RUNNING, bytes=sender.manifest.bytes, partners=self.partners)
        if sender.stream is None:
            self.send(sender.rank, Begin(sender.manifest))
        else:
            self.send(sender.rank, Begin(replace(sender.manifest, files=[]), streamed=True))

    def _announce(self, sender: Sender) -> None:
        """Each file captured since, before its slots; or abandon a stream gone stale."""
        assert sender.stream is not None
        if sender.stream.torn or sender.stream.failed:
            self._end(sender)
            return
        files = sender.stream.manifest.files
        while sender.announced < len(files):
            entry = files[sender.announced]
            self.send(sender.rank, File(sender.manifest.ckpt, sender.announced, entry.path,
                                        entry.size, entry.mode, entry.checksum))
            sender.announced += 1

    def _out_of_files(self, sender: Sender, now: float) -> None:
        """Every file known was put: end, or (a stream) wait for the capture."""
        stream = sender.stream
        if stream is None:
            self._end(sender)
        elif stream.final is not None:
            self._end(sender, stream.final[0])      # not torn: `_announce` looked
        elif len(sender.free) == self.slots:
            sender.heard = now      # nothing in flight: waiting for the capture, not the partner

    def _end(self, sender: Sender, final: LocalManifest | None = None) -> None:
        """No more slots: a part's End; a stream's with its final manifest, or without
        one to abandon it."""
        sender.state = "ending"
        sender.aborted = sender.stream is not None and final is None
        self._close(sender)
        self.send(sender.rank, End(sender.manifest.ckpt, final))

    def _close(self, sender: Sender) -> None:
        """The sender takes no more pieces: nor does its feed keep any for it."""
        sender.close()
        if sender.feed is not None:
            sender.feed.drop(sender.manifest.ckpt)

    def _restart(self, sender: Sender, why: str) -> None:
        """An abandoned stream: the whole part again, from the final manifest."""
        assert sender.stream is not None and sender.stream.final is not None
        manifest, source, mapped = sender.stream.final
        self.handles[manifest.ckpt].note("replicate_restart", partner=sender.partner,
                                         reason=why)
        sender.restart(manifest, source, mapped and sender.partner in self.map_to)

    def on_credit(self, partner: int, slot: int) -> None:
        sender = self._current(partner)
        self._heard(partner)
        if sender is not None:
            sender.free.append(slot)
            sender.heard = self.clock()

    def on_ack(self, partner: int, ckpt: str, ok: bool, error: str | None,
               mismatch: int | None = None) -> None:
        self._heard(partner)
        sender = self._current(partner)
        if sender is None or sender.manifest.ckpt != ckpt or sender.state != "ending":
            return
        sender.close()
        if not ok and mismatch is not None:
            error = sender.mismatch(mismatch) or error
        if sender.stream is not None and not (ok and sender.error is None
                                              and not sender.aborted):
            self._abandoned(sender, error or sender.error or "abandoned")
            return
        sender.state = "done" if ok and sender.error is None else "failed"
        if sender.error is None and not ok:
            sender.error = f"partner node {partner}: {error}"
        self._finish(sender.manifest, partner, sender.error)

    def _abandoned(self, sender: Sender, why: str) -> None:
        """The partner dropped a stream: the whole part again once it is captured."""
        assert sender.stream is not None
        if sender.stream.failed:
            self._fail(sender, sender.stream.failed)
            return
        sender.state = "waiting"
        if sender.stream.final is not None:
            self._restart(sender, why)

    def _current(self, partner: int) -> Sender | None:
        queue = self.queues.get(partner)
        return queue[0] if queue and partner not in self.dead else None

    def _fail(self, sender: Sender, error: str) -> None:
        if sender.state in ("done", "failed"):
            return
        sender.state, sender.error = "failed", error
        self._close(sender)
        self._finish(sender.manifest, sender.partner, error)

    def _finish(self, manifest: LocalManifest, partner: int, error: str | None) -> None:
        results = self.results.setdefault(manifest.ckpt, {})
        results[partner] = error
        if len(results) < len(self.partners):
            return
        errors = {str(p): e for p, e in results.items() if e}
        duration = time.monotonic() - self.started.pop(manifest.ckpt, time.monotonic())
        sent_from = dict(self.sent_from.pop(manifest.ckpt, {}))
        del self.results[manifest.ckpt]
        handle = self.handles.pop(manifest.ckpt)
        if errors:
            log.warning("replication of %s failed: %s", manifest.ckpt, errors)
            state = State.CANCELLED if handle.cancelled.is_set() else State.FAILED
            handle.set(state, error="; ".join(errors.values()), errors=errors)
        else:
            handle.set(State.DONE, bytes=manifest.bytes, partners=self.partners,
                       duration=duration, sent_from=sent_from)
        self.post(replicated(manifest.ckpt, self.partners, errors, duration))

    # --------------------------------------------------------------- partner side
    def handle(self, source_node: int, msg: Begin | File | Slot | End | Credit | Ack
               ) -> None:
        """A peer message (messages.decode) from the agent of `source_node`."""
        kind = type(msg)
        if kind is Begin:
            self.store.begin(source_node, msg.manifest, msg.streamed)
        elif kind is File:
            self.store.file(source_node, msg.ckpt, msg.file, msg.entry)
        elif kind is Slot:
            self.store.slot(source_node, msg.ckpt, msg.slot, msg.file, msg.offset, msg.length)
        elif kind is End:
            self.store.end(source_node, msg.ckpt, msg.manifest)
        elif kind is Credit:
            self.on_credit(source_node, msg.slot)
        elif kind is Ack:
            self.on_ack(source_node, msg.ckpt, msg.ok, msg.error, msg.mismatch)

    def close(self, free: bool = True, timeout: float = 0.0) -> None:
        """Collective when `free`: pass False when any agent is known dead (freeing the
        window would wait for it forever). `timeout`: unused (the window has none)."""
        self.store.close()
        for queue in self.queues.values():
            for sender in queue:
                sender.close()
        if free and not self.dead:
            self.window.free()
