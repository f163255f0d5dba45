"""The partner side of replication: drains filled window slots to node-local NVMe.

    <cache>/<run>/replicas/node-<owner>/<ckpt>/...             the owner's files
    <cache>/<run>/replicas/node-<owner>/<ckpt>.manifest.json   written last

(layout.py names them.) One writer thread does all disk work, in the
order the slots were filled, so a file's checksum is computed as its bytes arrive (a
second thread hashes each slot while the writer writes it, in 1 MiB pieces). With
`lanes` > 1 (`peer.streams`: the owner sends that many files in turn) the writer hands
each slot to lane `file % lanes`, a thread of its own: the files are written side by
side (a file system serializes the writes into one file, not into several), each file's
slots still in order on one lane, and a part ends only once its lanes are done with it.
The main thread only queues work (`begin`, `file`, `slot`, `end`) and forwards what the
writer `post`s: a `credit` once a slot's bytes are on disk (the owner may refill it), and
an `ack` once every file is verified against the owner's checksums, fsynced, renamed into
place and the manifest written: only then is the replica durable. A part streamed while
it was captured (its files announced one by one) is kept only if the final manifest
that ends it names exactly the files received; anything else is abandoned.

A full disk evicts replicas that a newer replica of the same owner supersedes, oldest
first, and retries; with nothing left to evict the replica fails (the owner flushes to
the PFS instead). `keep` bounds the replicas kept per owner.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..checksum import COPY_CHUNK as PIECE
from ..checksum import hasher
from ..errors import describe
from ..events import EventLog
from ..fsutil import (
    create_file,
    fsync_dir,
    fsync_tree,
    makedirs,
    partial_path,
    remove_under,
)
from ..layout import replica_dir, replica_manifest_path, replica_manifest_paths
from ..manifest import PENDING, FileEntry, LocalManifest
from ..messages import Ack, Credit, ToNode
from ..safepath import UnsafeInput
from .window import ReceiveWindow

log = logging.getLogger(__name__)
Post = Callable[[Any], None]        # into the agent's inbox (main thread sends)
# after an ack the owner's next part, if one is queued, begins within a tick or two:
# poll for its `begin` this long instead of hearing it at the next agent.poll tick
LINGER = 0.05


def held_replicas(root: Path) -> dict[int, list[LocalManifest]]:
    """Complete replicas by owner, oldest first (only those whose manifest was written).

    A manifest must name the checkpoint and the owner it is stored under (UnsafeInput)."""
    found: dict[int, list[LocalManifest]] = {}
    for path in replica_manifest_paths(root):
        try:
            manifest = LocalManifest.load(path)
        except (OSError, ValueError):
            continue
        if replica_manifest_path(root, manifest.node, manifest.ckpt) != path:
            raise UnsafeInput(f"{path}: node {manifest.node}'s {manifest.ckpt!r} is not"
                              " the replica stored here")
        found.setdefault(manifest.node, []).append(manifest)
    return {owner: sorted(items, key=lambda m: m.seq) for owner, items in found.items()}


def _update(digest: Any, data: memoryview) -> None:
    """Hash `data` in pieces of PIECE bytes, the writes' order."""
    for start in range(0, len(data), PIECE):
        digest.update(data[start:start + PIECE])


def _identity(manifest: LocalManifest) -> tuple[Any, ...]:
    return (manifest.run, manifest.ckpt, manifest.seq, manifest.node, manifest.host,
            manifest.rank, manifest.algorithm)


def _differs(owner: int, item: _Incoming, final: LocalManifest | None) -> str | None:
    """Why the files received are not the part `final` describes (None: they are). A
    file that differs only in its checksum is named (`item.mismatch`): for a file the
    owner streamed as it hashed it, the bytes sent were not the ones it hashed."""
    if final is None:
        return (f"node {owner} abandoned the stream (its capture changed or failed)"
                if item.streamed else None)
    if _identity(final) != _identity(item.manifest) or final.files != item.manifest.files:
        index = _checksum_only(final.files, item.manifest.files)
        if index is not None:
            item.mismatch = index
            return f"{final.files[index].path}: checksum differs from the owner's"
        return (f"the final manifest ({len(final.files)} files) differs from the"
                f" {len(item.manifest.files)} files received")
    return None


def _checksum_only(final: list[FileEntry], received: list[FileEntry]) -> int | None:
    """The first file whose checksum alone differs, when that is the only difference."""
    if len(final) != len(received):
        return None
    differ = [i for i, (f, r) in enumerate(zip(final, received, strict=True)) if f != r]
    if differ and all(replace(final[i], checksum=received[i].checksum) == received[i]
                      for i in differ):
        return differ[0]
    return None


def partial_dir(root: Path, owner: int, ckpt: str) -> Path:
    return partial_path(replica_dir(root, owner, ckpt))


def commit_replica(root: Path, manifest: LocalManifest, partial: Path,
                   retry: Callable[[Callable[[], Any]], Any] = lambda action: action()) -> None:
    """`partial` holds every file, verified: fsync, rename into place, manifest last."""
    fsync_tree(partial)
    final = replica_dir(root, manifest.node, manifest.ckpt)
    remove_under(root, final)
    os.rename(partial, final)
    fsync_dir(final.parent)
    retry(lambda: manifest.save(replica_manifest_path(root, manifest.node, manifest.ckpt)))


@dataclass
class _Incoming:
    manifest: LocalManifest
    partial: Path
    hashers: dict[int, Any] = field(default_factory=dict)
    written: dict[int, int] = field(default_factory=dict)
    fds: dict[int, int] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    error: str | None = None
    mismatch: int | None = None     # the file whose bytes had another checksum
    streamed: bool = False      # files announced one by one; the final manifest at `end`
    writes: list[Future[None]] = field(default_factory=list)   # slots on the lanes

    def written_out(self) -> None:
        """Every slot handed to a lane is written (or failed)."""
        for write in self.writes:
            write.result()
        self.writes.clear()


class ReplicaStore:
    def __init__(self, root: Path, window: ReceiveWindow, regions: dict[int, int], keep: int,
                 post: Post, events: EventLog, idle: float = 60.0,
                 wake: Callable[[], None] = lambda: None, lanes: int = 1) -> None:
        """`wake`: ends the main loop's sleep; called when the writer runs out of work.
        `lanes`: threads writing files side by side (1: the writer writes them all)."""
        self.root = makedirs(root)
        self.window, self.regions, self.keep = window, regions, keep
        self.post, self.events, self.wake = post, events, wake
        self.idle = idle
        self._open_streams: dict[int, float] = {}       # owner -> last heard
        self._linger_until = 0.0    # monotonic: the last ack's LINGER ends
        self._tasks: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue()
        self._incoming: dict[tuple[int, str], _Incoming] = {}
        self._hashing = ThreadPoolExecutor(lanes, thread_name_prefix="replica-hash")
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"replica-lane-{i}")
                       for i in range(lanes)] if lanes > 1 else []
        self._evicting = threading.Lock()      # lanes meet a full disk at once
        self._thread = threading.Thread(target=self._run, name="replica-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ main thread
    def begin(self, owner: int, manifest: LocalManifest, streamed: bool = False) -> None:
        self._open_streams[owner] = time.monotonic()
        if manifest.node != owner:
            raise UnsafeInput(f"replication from node {owner}: manifest of node {manifest.node}")
        self._tasks.put(("begin", (owner, manifest, streamed)))

    def file(self, owner: int, ckpt: str, index: int, entry: FileEntry) -> None:
        self._open_streams[owner] = time.monotonic()
        self._tasks.put(("file", (owner, ckpt, index, entry)))

    def slot(self, owner: int, ckpt: str, slot: int, index: int, offset: int, length: int
             ) -> None:
        self.window.sync()      # the owner's Put is complete: make it visible here
        self._open_streams[owner] = time.monotonic()
        self._tasks.put(("write", (owner, ckpt, slot, index, offset, length)))

    def end(self, owner: int, ckpt: str, final: LocalManifest | None = None) -> None:
        """`final`: a streamed part's final manifest (None abandons the stream)."""
        self._open_streams.pop(owner, None)
        self._tasks.put(("end", (owner, ckpt, final)))

    def busy(self) -> bool:
        """Work queued, or a stream open (more slots will come: keep the loop fast);
        an owner silent for `idle` seconds no longer counts."""
        now = time.monotonic()
        self._open_streams = {o: t for o, t in self._open_streams.items()
                              if now - t < self.idle}
        return self._tasks.unfinished_tasks > 0 or bool(self._open_streams)

    def expects_slots(self) -> bool:
        """A stream is open (or an ack went out less than LINGER ago) and the writer has
        nothing queued: the next move is an owner's next message, over MPI. While the
        writer has work, its credits (and the wake when it runs dry) end the main loop's
        sleep instead."""
        lingering = time.monotonic() < self._linger_until
        return self._tasks.unfinished_tasks == 0 and (self.busy() or lingering)

    def close(self, timeout: float = 10.0) -> None:
        self._tasks.put(None)
        self._thread.join(timeout)
        for lane in self._lanes:
            lane.shutdown(wait=False)
        self._hashing.shutdown(wait=False)

    # ---------------------------------------------------------- writer thread
    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            kind, args = task
            item = self._incoming.get(args[:2]) if kind == "write" and self._lanes else None
            if item is None:
                self._task(kind, args)
                continue
            # its task is done when the lane is: `unfinished_tasks` counts lane work too
            lane = self._lanes[args[3] % len(self._lanes)]
            if len(item.writes) > 4 * len(self._lanes):     # bounded whatever the part's size
                item.writes = [w for w in item.writes if not w.done()]
            item.writes.append(lane.submit(self._task, kind, args))
        self._tasks.task_done()

    def _task(self, kind: str, args: tuple[Any, ...]) -> None:
        try:
            getattr(self, f"_do_{kind}")(*args)
        except Exception:       # noqa: BLE001 (the writer must never die silently)
            log.exception("replica writer: %s %s", kind, args[:2])
        finally:
            self._tasks.task_done()
        if self._tasks.unfinished_tasks == 0:
            self.wake()     # dry: the main loop polls for the owner's next slot again

    def _do_begin(self, owner: int, manifest: LocalManifest, streamed: bool) -> None:
        partial = partial_dir(self.root, owner, manifest.ckpt)
        earlier = self._incoming.get((owner, manifest.ckpt))
        if earlier is not None:         # begun again without an end (the owner restarted)
            earlier.written_out()
            self._abandon(earlier)      # its descriptors too
        item = _Incoming(manifest, partial, streamed=streamed)
        self._incoming[(owner, manifest.ckpt)] = item
        self.events.emit("replica_start", ckpt=manifest.ckpt, seq=manifest.seq, owner=owner,
                         bytes=manifest.bytes, streamed=streamed)
        try:
            if streamed and manifest.files:
                raise OSError(errno.EINVAL, "a streamed part must begin without files")
            if any(e.checksum == PENDING for e in manifest.files):
                raise OSError(errno.EINVAL, "a file without its checksum (only a streamed"
                              " file may come before it)")
            remove_under(self.root, partial)
            self._retry_full(lambda: makedirs(partial))
            for index, entry in enumerate(manifest.files):
                self._created_if_empty(item, index, entry)
        except OSError as exc:
            item.error = describe(exc)

    def _do_file(self, owner: int, ckpt: str, index: int, entry: FileEntry) -> None:
        """A streamed file's entry: its slots follow."""
        item = self._incoming.get((owner, ckpt))
        if item is None or item.error is not None:
            return
        try:
            if not item.streamed or index != len(item.manifest.files):
                raise OSError(errno.EINVAL, f"file {index} ({entry.path}) announced out of"
                              f" order (expected {len(item.manifest.files)})")
            if entry.checksum == PENDING and entry.size == 0:
                raise OSError(errno.EINVAL, f"{entry.path}: an empty file without checksum")
            item.manifest.files.append(entry)
            self._created_if_empty(item, index, entry)
        except OSError as exc:
            item.error = describe(exc)
            item.written_out()      # no lane writes into what is removed
            self._abandon(item)

    def _created_if_empty(self, item: _Incoming, index: int, entry: FileEntry) -> None:
        """An empty file gets no slot: created (and done) when it is named."""
        if entry.size == 0:
            self._retry_full(lambda: self._create_empty(item.partial, entry))
            item.done.add(index)

    def _do_write(self, owner: int, ckpt: str, slot: int, index: int, offset: int,
                  length: int) -> None:
        item = self._incoming.get((owner, ckpt))
        try:
            if item is not None and item.error is None:
                self._write(item, self.regions[owner], slot, index, offset, length)
        except OSError as exc:
            item.error = describe(exc)
            if not self._lanes:     # with lanes, at `end`: another may still write
                self._abandon(item)         # give the space back now, not at `end`
        finally:
            self.post(ToNode(owner, Credit(slot)))

    def _write(self, item: _Incoming, region: int, slot: int, index: int, offset: int,
               length: int) -> None:
        if index >= len(item.manifest.files):
            raise OSError(errno.EINVAL, f"a slot of file {index}, never announced")
        entry = item.manifest.files[index]
        if item.written.get(index, 0) != offset:
            raise OSError(errno.EIO, f"{entry.path}: out-of-order chunk at {offset}")
        if index not in item.fds:
            item.fds[index] = self._retry_full(lambda: self._open(item.partial, entry))
            item.hashers[index] = hasher()
        data = self.window.view(region, slot, length)
        # the hash runs beside the writes (xxhash lets go of the GIL), over the same
        # pieces in the same order: a slot costs max(write, hash), not their sum. Both
        # are done before the slot is credited back to the owner.
        hashed = self._hashing.submit(_update, item.hashers[index], data)
        try:
            fd = item.fds[index]
            for start in range(0, length, PIECE):
                piece = data[start:start + PIECE]
                done = 0
                while done < len(piece):
                    done += self._retry_full(lambda p=piece, at=offset + start + done, d=done:
                                             os.pwrite(fd, p[d:], at))
        finally:
            hashed.result()
        item.written[index] = offset + length
        if item.written[index] == entry.size:
            self._close_file(item, index)

    def _close_file(self, item: _Incoming, index: int) -> None:
        entry = item.manifest.files[index]
        fd = item.fds.pop(index)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = item.hashers.pop(index).hexdigest()
        if entry.checksum == PENDING:
            # streamed while the owner hashed it: its checksum comes with the final
            # manifest, which `_differs` compares with this one
            item.manifest.files[index] = replace(entry, checksum=digest)
        elif digest != entry.checksum:
            item.mismatch = index
            raise OSError(errno.EIO, f"{entry.path}: checksum differs from the owner's")
        item.done.add(index)

    def _do_end(self, owner: int, ckpt: str, final: LocalManifest | None) -> None:
        item = self._incoming.get((owner, ckpt))
        if item is None:
            return
        item.written_out()
        del self._incoming[(owner, ckpt)]
        error = item.error or _differs(owner, item, final) or self._missing(item)
        if error is None:
            item.manifest = final or item.manifest
            try:
                self._commit(owner, item)
            except OSError as exc:
                error = describe(exc)
        if error is not None:
            self._abandon(item)
            self.events.emit("replica_failed", ckpt=ckpt, seq=item.manifest.seq, owner=owner,
                             error=error)
        else:
            self.events.emit("replica_done", ckpt=ckpt, seq=item.manifest.seq, owner=owner,
                             bytes=item.manifest.bytes)
        self._linger_until = time.monotonic() + LINGER
        # a mismatch is set only with the error it raised
        self.post(ToNode(owner, Ack(ckpt, error is None, error, item.mismatch)))
        if error is None:
            # after the ack: freeing an older replica (a third of the partner's CPU per
            # checkpoint on tmpfs) does not hold back the owner's partner-durable; this
            # thread writes the next part's slots only after it, so space comes back first
            self._retain(owner)

    def _abandon(self, item: _Incoming) -> None:
        for fd in item.fds.values():
            os.close(fd)
        item.fds.clear()
        remove_under(self.root, item.partial)

    def _missing(self, item: _Incoming) -> str | None:
        missing = [e.path for i, e in enumerate(item.manifest.files) if i not in item.done]
        return f"{len(missing)} files incomplete (first: {missing[0]})" if missing else None

    def _commit(self, owner: int, item: _Incoming) -> None:
        commit_replica(self.root, item.manifest, item.partial, self._retry_full)

    # -------------------------------------------------------------- disk space
    def _retry_full(self, action: Callable[[], Any]) -> Any:
        """Run `action`; on ENOSPC evict a superseded replica and try again."""
        while True:
            try:
                return action()
            except OSError as exc:
                if exc.errno != errno.ENOSPC or not self._evict_one():
                    raise

    def _evict_one(self) -> bool:
        with self._evicting:
            return self._evict_superseded()

    def _evict_superseded(self) -> bool:
        superseded = [m for items in held_replicas(self.root).values() for m in items[:-1]]
        if not superseded:
            return False
        victim = min(superseded, key=lambda m: m.captured_at)
        self._delete(victim.node, victim, reason="disk full")
        return True

    def _retain(self, owner: int) -> None:
        items = held_replicas(self.root).get(owner, [])
        if self.keep and len(items) > self.keep:
            for manifest in items[:-self.keep]:
                self._delete(owner, manifest, reason="keep.replica")

    def _delete(self, owner: int, manifest: LocalManifest, reason: str) -> None:
        replica_manifest_path(self.root, owner, manifest.ckpt).unlink(missing_ok=True)
        remove_under(self.root, replica_dir(self.root, owner, manifest.ckpt))
        self.events.emit("evicted", ckpt=manifest.ckpt, seq=manifest.seq, owner=owner,
                         level="replica", reason=reason)

    @staticmethod
    def _open(partial: Path, entry: Any) -> int:
        path = partial / entry.path
        makedirs(path.parent)
        return create_file(path)        # private: the manifest keeps the trainer's mode

    @staticmethod
    def _create_empty(partial: Path, entry: Any) -> None:
        fd = ReplicaStore._open(partial, entry)
        os.fsync(fd)
        os.close(fd)
