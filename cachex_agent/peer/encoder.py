"""The agent's erasure encoding (`peer.scheme` xor or rs:K+M), in place of the RMA copy.

Each group has a communicator of its own (split from the agents' at start-up, one rank
per member in member order). A checkpoint is encoded once the coordinator's ManifestReady
says every node captured it: the coordinator broadcasts those in one order, so every
member queues the same checkpoints in the same order, and one thread per agent runs
`encode_part` (blocking, collective within the group) on them one at a time. That thread
calls MPI beside the main thread, on its own communicator: the MPI library must give
MPI_THREAD_MULTIPLE, checked at start-up.

Each encoding is a REPLICATE handle (journal, events, resume as for a copy) and ends
with the `replicated` report a replicator posts: partners are the group's other nodes,
and `replicated` then means the group can lose what its scheme tolerates.

A member that drops a queued checkpoint (the coordinator failed it) still takes its turn:
the members first agree on which checkpoint they are at and whether any dropped it, so
the queues stay in step and no member encodes against another's checkpoint.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ..collective import agree, arrive
from ..config import Config
from ..errors import CachexError, ConfigError, OperationError
from ..handles import Handle, Stage, StageLog, State
from ..journal import JournalEntry
from ..layout import NodePaths
from ..manifest import LocalManifest
from ..messages import FileCaptured
from .encode_exchange import encode_part
from .groups import group_of
from .parity import retain_parity
from .redundancy import redundancy_of, replicated

log = logging.getLogger(__name__)
Post = Callable[[Any], None]        # into the agent's inbox


def erasure_groups(comm: Any, config: Config, hosts: list[str]) -> list[list[int]] | None:
    """Collective over the agents, at start-up before anything is created: the erasure
    groups, None for `copy` (or a flush-only run). Groups the failure domains cannot form,
    or an MPI without MPI_THREAD_MULTIPLE, fail every agent with one line (exit 2)."""
    if redundancy_of(config).replicas or config.model.path == "direct":
        return None
    return agree(comm, "erasure groups", lambda: _checked_groups(config, hosts),
                 config.agent.timeout)


def start_encoder(comm: Any, config: Config, groups: list[list[int]] | None, node: int,
                  paths: NodePaths, log_: StageLog, post: Post) -> Encoder | None:
    """Collective over the agents: this node's encoder on its group's communicator
    (split here), or None without groups."""
    if groups is None:
        return None
    members = group_of(node, groups)
    group_comm = comm.Split(groups.index(members), members.index(node))
    return Encoder(group_comm, node, members, config, paths, log_, post)


def _checked_groups(config: Config, hosts: list[str]) -> list[list[int]] | None:
    level = MPI.Query_thread()
    if level < MPI.THREAD_MULTIPLE:
        raise ConfigError(f"peer.scheme: {config.peer.scheme!r} encodes on a thread of its"
                          f" own and needs MPI_THREAD_MULTIPLE; this MPI gives thread level"
                          f" {level} (use `copy`, or an MPI built with thread support)")
    return redundancy_of(config).groups(config, hosts)


class EncodeHandle(Handle):
    """One checkpoint's encoding with the group: queued until the encoder's thread takes
    it, running while the group encodes, done once the parity manifest is written."""

    stage = Stage.REPLICATE

    def __init__(self, manifest: LocalManifest, source: Path, encoder: Encoder) -> None:
        super().__init__(manifest.ckpt, manifest.seq, encoder.log)
        self.manifest, self.source, self.encoder = manifest, source, encoder

    def _start(self) -> None:
        self.encoder.jobs.put(self)


class Encoder:
    def __init__(self, comm: Any, node: int, members: list[int], config: Config,
                 paths: NodePaths, log_: StageLog, post: Post) -> None:
        self.comm, self.node, self.members = comm, node, members
        self.partners = [n for n in members if n != node]
        self.scheme = config.peer.scheme
        self.timeout = config.agent.timeout
        self.keep = config.keep.replica
        self.root = paths.parity
        self.log, self.post = log_, post
        self.jobs: queue.Queue[EncodeHandle | None] = queue.Queue()
        self.handles: dict[str, EncodeHandle] = {}      # not ended yet
        self.dead: dict[int, str] = {}                  # none known: the group times out
        self.streams, self.feed = 0, None   # one encoding at a time; no capture feeds it
        self.thread = threading.Thread(target=self._work, name="encode", daemon=True)
        self.thread.start()

    # ------------------------------------------------ the agent's verbs (Protector)
    def protect(self, manifest: LocalManifest, source: Path, entry: JournalEntry,
                fed_wait: float = 0.0) -> None:
        """Captured here: the group encodes once every node has (a restart that heard
        the global manifest before its capture ended encodes now)."""
        if entry.digest is not None:
            self.group_ready(manifest, source, entry)

    def group_ready(self, manifest: LocalManifest, source: Path,
                    entry: JournalEntry) -> None:
        if self._wanted(entry, manifest):
            self.encode(manifest, source)

    def file_captured(self, msg: FileCaptured) -> None:
        """Parity needs every member's whole part: nothing is encoded file by file."""

    def resume(self, manifest: LocalManifest, source: Path, entry: JournalEntry) -> None:
        """The group has moved on: one member alone cannot encode (it is collective)."""

    def handle(self, source_node: int, msg: Any) -> None:
        """The group talks on its own communicator: no peer message is the encoder's."""

    def pump(self) -> None:
        """The encoder's thread moves the encoding."""

    def waits_on_peer(self) -> bool:
        return False

    def _wanted(self, entry: JournalEntry, manifest: LocalManifest) -> bool:
        """Captured, not failed, and not encoded (or under way) already."""
        return (entry.captured and not entry.done(Stage.REPLICATE)
                and manifest.ckpt not in self.handles)

    def encode(self, manifest: LocalManifest, source: Path) -> EncodeHandle:
        handle = EncodeHandle(manifest, source, self)
        self.handles[manifest.ckpt] = handle
        return handle.submit(scheme=self.scheme, group=self.members)  # type: ignore[return-value]

    def cancel(self, ckpt: str, reason: str = "cancelled") -> None:
        handle = self.handles.get(ckpt)
        if handle is not None:
            handle.cancel()

    def pending(self) -> set[str]:
        """Checkpoints whose encoding has not ended (their staged files must stay)."""
        return set(self.handles)

    def give_up_on_suspects(self) -> None:
        """Nothing waits on a suspect here: every wait of a group's exchange has its own
        deadline (agent.timeout), after which that encoding fails."""

    def busy(self) -> bool:
        return bool(self.handles)

    def close(self, free: bool = True, timeout: float = 0.0) -> None:
        """Stop the thread after the encoding under way (bounded by its deadlines)."""
        self.jobs.put(None)
        self.thread.join(timeout)

    # ---------------------------------------------------------- encode thread
    def _work(self) -> None:
        while (handle := self.jobs.get()) is not None:
            try:
                self._turn(handle)
            finally:
                self.handles.pop(handle.ckpt, None)

    def _turn(self, handle: EncodeHandle) -> None:
        step = f"erasure encode of {handle.ckpt}"
        started = time.monotonic()
        try:
            if not self._in_step(handle, step):
                handle.set(State.CANCELLED)
                return
            handle.set(State.RUNNING, bytes=handle.manifest.bytes, partners=self.partners)
            # a cancel never ended this hold: the test that holds it kills the agent
            handle.hold(self.node, until=())
            encode_part(self.comm, self.members, self.scheme, handle.manifest,
                        handle.source, self.root, self.timeout)
        except (CachexError, OSError) as exc:
            error = str(exc)
            log.warning("%s failed: %s", step, error)
            handle.set(State.FAILED, error=error, errors={str(self.node): error})
            self._report(handle, {str(self.node): error}, started)
            return
        handle.set(State.DONE, bytes=handle.manifest.bytes, partners=self.partners,
                   duration=time.monotonic() - started)
        self._report(handle, {}, started)
        for ckpt in retain_parity(self.root, self.keep):
            self.log.emit("evicted", ckpt=ckpt, level="parity", reason="keep.replica")

    def _in_step(self, handle: EncodeHandle, step: str) -> bool:
        """Every member is at this checkpoint (raises if not); False if any dropped it."""
        arrive(self.comm, step, self.timeout)
        turns = self.comm.allgather((handle.ckpt, handle.cancelled.is_set()))
        ckpts = sorted({c for c, _ in turns})
        if len(ckpts) > 1:
            raise OperationError(f"{step}: the group's members are at checkpoints"
                                 f" {', '.join(ckpts)}")
        return not any(dropped for _, dropped in turns)

    def _report(self, handle: EncodeHandle, errors: dict[str, str], started: float) -> None:
        self.post(replicated(handle.ckpt, self.partners, errors, time.monotonic() - started))
