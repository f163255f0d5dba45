"""How the coordinator's messages reach every agent: serialized once, then forwarded.

At 10,000 nodes the coordinator cannot send each message N times from the thread that
services MPI (every `isend` of a dict pickles it again). A message for every agent is
pickled once into a frame and goes down a tree of `agent.fanout` children per agent
(`tree`): each agent forwards the frame's bytes unchanged to its children before it
reads the message itself, so no agent sends more than `fanout` copies and the depth is
log_fanout(N). A message for a few (the whole global manifest for the metadata holders)
goes down a `chain`: each holder forwards it to the next, so the coordinator sends it once.
Reports go back up the same tree (`parent`, `subtree`; the batching is uplink.py).

A frame is `<4-byte header length><pickled header><pickled message>`; the header says the
route and is checked (`parse`) before anything is forwarded: it comes from another rank.

The tree is over the nodes still alive: `skip` (the nodes the coordinator knows dead or
suspect) are left out and their children adopted by others, so one lost agent does not
cut off its subtree from the next message. A frame a relay took before it stalled does
not reach its subtree until it runs again: tree frames are numbered (`number`), and an
agent that sees a gap asks the coordinator for the frames it missed (`Frames`), which it
sends that agent directly; a frame seen twice is read once (`Numbers`). Pure functions,
no MPI.
"""

from __future__ import annotations

import pickle
import struct
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Any

from .safepath import UnsafeInput, index

HEADER = struct.Struct("<I")
MAX_HEADER = 1 << 20       # a skip list of every node of a 100,000-node job fits


@dataclass(frozen=True, slots=True)
class Route:
    kind: str                           # "tree" or "chain"
    fanout: int = 16
    skip: tuple[int, ...] = ()          # sorted: nodes the tree leaves out
    chain: tuple[int, ...] = ()         # the nodes of a chain, in order
    number: int = 0                     # a tree frame's: 1, 2, ... in the coordinator's life


def frame(route: Route, message: dict[str, Any]) -> bytes:
    header = pickle.dumps({"kind": route.kind, "fanout": route.fanout,
                           "skip": list(route.skip), "chain": list(route.chain),
                           "number": route.number},
                          protocol=pickle.HIGHEST_PROTOCOL)
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return b"".join((HEADER.pack(len(header)), header, body))


def parse(buf: bytes | bytearray | memoryview, nodes: int, source: str
          ) -> tuple[Route, memoryview]:
    """The route (checked against a job of `nodes` nodes) and the message's bytes."""
    view = memoryview(buf)
    if len(view) < HEADER.size:
        raise UnsafeInput(f"{source}: relay frame of {len(view)} bytes")
    (size,) = HEADER.unpack_from(view)
    if size > min(MAX_HEADER, len(view) - HEADER.size):
        raise UnsafeInput(f"{source}: relay header of {size} bytes")
    header = pickle.loads(view[HEADER.size:HEADER.size + size])
    return _route(header, nodes, source), view[HEADER.size + size:]


def message(body: memoryview) -> Any:
    return pickle.loads(body)


def _route(header: Any, nodes: int, source: str) -> Route:
    if not isinstance(header, dict) or header.get("kind") not in ("tree", "chain"):
        raise UnsafeInput(f"{source}: relay header {header!r:.80}")
    fanout = header.get("fanout")
    if isinstance(fanout, bool) or not isinstance(fanout, int) or not 2 <= fanout <= 1024:
        raise UnsafeInput(f"{source}: relay fanout {fanout!r:.40}")
    lists = []
    for key in ("skip", "chain"):
        value = header.get(key)
        if not isinstance(value, list):
            raise UnsafeInput(f"{source}: relay {key} {value!r:.40} is not a list")
        for node in value:
            if index(node, f"{source} (relay {key})") >= nodes:
                raise UnsafeInput(f"{source}: relay {key} names node {node} of {nodes}")
        lists.append(value)
    skip, chain = lists
    if 0 in skip or skip != sorted(set(skip)):
        raise UnsafeInput(f"{source}: relay skip list not sorted, or skips the root")
    number = header.get("number", 0)
    if isinstance(number, bool) or not isinstance(number, int) or number < 0:
        raise UnsafeInput(f"{source}: relay frame number {number!r:.40}")
    return Route(header["kind"], fanout, tuple(skip), tuple(chain), number)


class Numbers:
    """The tree frames one agent has read, by number: which are new, and which it
    missed (a gap: they went to a parent that stalled holding them)."""

    def __init__(self) -> None:
        self.upto = 0       # every number up to this one is read, or asked for

    def see(self, number: int) -> tuple[bool, range]:
        """Whether frame `number` is new, and the numbers missed before it. A missed
        one counts as read from now: it is asked for once and comes directly, and its
        copy through the tree, late, is read no more."""
        if number <= self.upto:
            return False, range(0)
        missed = range(self.upto + 1, number)
        self.upto = number
        return True, missed


def next_hops(route: Route, node: int, nodes: int) -> list[int]:
    """Where `node` forwards a frame of `route` in a job of `nodes` nodes."""
    if route.kind == "chain":
        if node not in route.chain:
            return list(route.chain[:1]) if node == 0 else []
        at = route.chain.index(node)
        return list(route.chain[at + 1:at + 2])
    return children(node, nodes, route.fanout, route.skip)


def children(node: int, nodes: int, fanout: int, skip: tuple[int, ...] = ()) -> list[int]:
    """The nodes `node` forwards to in the tree over the nodes not in `skip` (sorted),
    rooted at node 0: the live node at position p has those at fanout*p+1 .. fanout*p+fanout."""
    if _skipped(node, skip):
        return []
    position = node - bisect_left(skip, node)
    live = nodes - len(skip)
    first = fanout * position + 1
    return [_node_at(p, skip) for p in range(first, min(first + fanout, live))]


def parent(node: int, nodes: int, fanout: int, skip: tuple[int, ...] = ()) -> int:
    """Where `node` sends its reports up the same tree (relay.py's children, inverted);
    a node the tree leaves out, and the root's children, report to node 0 directly."""
    if node == 0 or _skipped(node, skip):
        return 0
    position = node - bisect_left(skip, node)
    return _node_at((position - 1) // fanout, skip)


def subtree(node: int, nodes: int, fanout: int, skip: tuple[int, ...] = ()) -> int:
    """How many live nodes report through `node` (itself included): 1 for a leaf and for
    a node the tree leaves out. O(depth): the subtree is one range of positions a level."""
    if _skipped(node, skip):
        return 1
    live = nodes - len(skip)
    low = high = node - bisect_left(skip, node)
    count = 0
    while low < live:
        count += min(high, live - 1) - low + 1
        low, high = fanout * low + 1, fanout * high + fanout
    return count


def depth(nodes: int, fanout: int) -> int:
    """Hops from the root to the deepest node."""
    hops, reach, level = 0, 1, 1
    while reach < nodes:
        level *= fanout
        reach += level
        hops += 1
    return hops


def _skipped(node: int, skip: tuple[int, ...]) -> bool:
    at = bisect_left(skip, node)
    return at < len(skip) and skip[at] == node


def _node_at(position: int, skip: tuple[int, ...]) -> int:
    """The live node at `position`: the smallest n with n - #skip[<= n] == position."""
    node = position
    while True:
        shifted = position + bisect_right(skip, node)
        if shifted == node and not _skipped(node, skip):
            return node
        node = shifted
