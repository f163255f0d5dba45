"""The agent's MPI messages, on its main thread: the one message pump.

Sends are non-blocking (`isend`, `Isend` of a relay frame's bytes) and kept until MPI
completes them; `test` drops the completed ones each turn and `wait` bounds the wait at
exit. `receive` takes what has arrived, in this order: the coordinator's relay frames
(forwarded to the next hops before they are read, relay.py), then messages from other
agents by tag. Every message is decoded and checked (messages.decode) before it is handed
to `deliver(source_rank, message)`; one that fails the check is refused with an event,
never delivered. Bytes received are counted by tag (the agent's `counters` event).

The agent, the MPI replication tests and benchmarks/replicate.py all drive the
replication through this class, so what they measure is the agent's own message path.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from mpi4py import MPI

from . import relay
from .handles import Emitter
from .messages import Tag, ToNode, decode, wire
from .safepath import UnsafeInput

log = logging.getLogger(__name__)

Deliver = Callable[[int, Any], None]


class MessagePump:
    """`ranks_by_node[n]` is node n's rank; `node` is this agent's. `tags`: the tags
    probed besides relay frames (the replication alone: PEER). `on_route(route)`: every
    relay frame's route, before its message (the uplink follows the tree's changes);
    False: a frame read already, forwarded but not delivered again."""

    def __init__(self, comm: Any, ranks_by_node: list[int], node: int, deliver: Deliver,
                 events: Emitter, tags: Iterable[Tag] = (Tag.PEER, Tag.COORDINATOR),
                 on_route: Callable[[relay.Route], bool] | None = None) -> None:
        self.comm, self.ranks_by_node, self.node = comm, ranks_by_node, node
        self.deliver, self.events, self.on_route = deliver, events, on_route
        self.tags = tuple(tags)
        self.received: Counter[str] = Counter()     # bytes by tag
        self._requests: list[Any] = []
        self._own_frames: list[bytes] = []      # the coordinator's, for this node's agent
        self._status = MPI.Status()

    # ------------------------------------------------------------------ out
    def send(self, rank: int, msg: Any, tag: Tag = Tag.COORDINATOR) -> None:
        self._requests.append(self.comm.isend(wire(msg), dest=rank, tag=tag))

    def send_peer(self, rank: int, msg: Any) -> None:
        self.send(rank, msg, Tag.PEER)

    def to_node(self, msg: ToNode) -> None:
        """A worker thread's message to another node's agent (the replica store's)."""
        self.send_peer(self.ranks_by_node[msg.node], msg.message)

    def forward(self, frame: bytes, nodes: list[int], local: bool = False) -> None:
        """A relay frame's bytes as they are, to the next hops; `local`: this node's
        agent reads it too (on node 0, the coordinator's own frames)."""
        for node in nodes:
            self._requests.append(self.comm.Isend(
                [frame, MPI.BYTE], dest=self.ranks_by_node[node], tag=Tag.RELAY))
        if local:
            self._own_frames.append(frame)

    def test(self) -> bool:
        """Drop the sends MPI has completed; True if some are still in flight."""
        self._requests = [r for r in self._requests if not r.Test()]
        return bool(self._requests)

    def wait(self, timeout: float) -> None:
        """The sends in flight, for at most `timeout` seconds (the agent's exit)."""
        deadline = time.monotonic() + timeout
        while self.test() and time.monotonic() < deadline:
            time.sleep(0.01)

    # ------------------------------------------------------------------- in
    def receive(self) -> int:
        """Deliver every message that has arrived; return how many there were."""
        count = self._receive_frames()
        status = self._status
        for tag in self.tags:
            while self._probe(tag):
                source = status.Get_source()
                self.received[tag.name] += status.Get_count(MPI.BYTE)
                raw = self.comm.recv(source=source, tag=tag)
                count += 1
                self._decoded(source, raw, f"message from rank {source}", tag)
        return count

    def _receive_frames(self) -> int:
        frames = [(0, frame, False) for frame in self._own_frames]
        self._own_frames = []
        status = self._status
        while self._probe(Tag.RELAY):
            source = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([buf, MPI.BYTE], source=source, tag=Tag.RELAY)
            self.received[Tag.RELAY.name] += len(buf)
            frames.append((source, buf, True))
        nodes = len(self.ranks_by_node)
        for source, frame, onward in frames:
            where = f"relay frame from rank {source}"
            try:
                route, body = relay.parse(frame, nodes, where)
                new = self.on_route is None or self.on_route(route)
                if onward:      # before it is read: the nodes below hear it as soon
                    self.forward(frame, relay.next_hops(route, self.node, nodes))
                if not new:
                    continue
                raw = relay.message(body)
            except UnsafeInput as exc:
                self._refuse(exc)
                continue
            self._decoded(source, raw, where, Tag.RELAY)
        return len(frames)

    def _decoded(self, source: int, raw: Any, where: str, tag: Tag) -> None:
        try:
            msg = decode(raw, where, tag)
        except UnsafeInput as exc:
            self._refuse(exc)
            return
        self.deliver(source, msg)

    def _refuse(self, exc: UnsafeInput) -> None:
        log.error("refused: %s", exc)
        self.events.emit("refused", error=str(exc))

    def _probe(self, tag: Tag) -> bool:
        # MPICH: the first probe may only drive progress; a message that has already
        # arrived is often seen by the second one (measured: a whole tick saved)
        return any(self.comm.iprobe(source=MPI.ANY_SOURCE, tag=tag, status=self._status)
                   for _ in range(2))
