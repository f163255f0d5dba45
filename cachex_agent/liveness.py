"""Slow is not dead: who waited judges silence, on its own clock, net of its own stalls.

A process that was stopped (SIGSTOP, swapping, a Lustre client in D state, a long GC
pause) finds, when it runs again, that every peer seems silent for as long as it was
stopped itself. `OwnClock` is this process's monotonic clock with its own stalls taken
out: it advances at most `allowance` seconds per turn of the main loop, so the time a
loop turn did not come (the process was not listening) never counts as a peer's silence.
Every judgement of silence (a partner's credits, a child's beats, the coordinator's
deadlines) reads it.

`Watch` is what a node knows of the nodes that report to it (its children in the relay
tree; on node 0 also the nodes the tree leaves out): each sends its parent something at
least every `beat` seconds (a batch, empty if it has nothing to report), so a parent
learns of a silent child from the tree's own traffic, O(1) per node, whatever phase the
child stalled in. A child silent past `agent.timeout` is reported up once (`Silence`),
and again when it speaks (`ended`); the coordinator makes it *suspect* (routed around,
named in status) and takes it back the moment it is heard. Pure bookkeeping, no MPI.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import relay
from .messages import Silence

STALL_ALLOWANCE = 1.0   # s: a turn of the main loop longer than this is this process's stall


class OwnClock:
    """`now()`: seconds on the monotonic clock, less the time this process's main loop
    stood still (turns more than `allowance` apart). `tick()` once per turn."""

    def __init__(self, allowance: float = STALL_ALLOWANCE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allowance, self.clock = allowance, clock
        self._last = clock()
        self.stalled = 0.0          # seconds taken out so far
        self.longest = 0.0          # the longest stall found

    def tick(self) -> float:
        """One turn of the main loop: the stall found since the last turn (0: none)."""
        now = self.clock()
        gap = now - self._last
        self._last = now
        if gap <= self.allowance:
            return 0.0
        self.stalled += gap - self.allowance
        self.longest = max(self.longest, gap)
        return gap

    def now(self) -> float:
        """Never more than `allowance` past the last turn: a stall under way (this call
        came late in a turn that was stopped) is not counted before the next tick."""
        return min(self.clock(), self._last + self.allowance) - self.stalled


@dataclass
class _Child:
    heard: float
    reported: bool = False      # its silence went up; its return goes up too


class Watch:
    """The nodes that report to `node`, heard on `clock` (an OwnClock's `now`)."""

    def __init__(self, node: int, timeout: float, clock: Callable[[], float]) -> None:
        self.node, self.timeout, self.clock = node, timeout, clock
        self._children: dict[int, _Child] = {}

    def expect(self, nodes: Iterable[int]) -> None:
        """The children in the newest tree; a new one starts heard now, one gone is
        forgotten (its new parent watches it)."""
        now = self.clock()
        wanted = set(nodes) - {self.node}
        self._children = {n: self._children.get(n) or _Child(now) for n in sorted(wanted)}

    def heard(self, node: int) -> Silence | None:
        """Something came from `node`: its `ended` report if its silence was reported."""
        child = self._children.get(node)
        if child is None:
            return None
        now = self.clock()
        silent_for, child.heard = now - child.heard, now
        if not child.reported:
            return None
        child.reported = False
        return Silence(peer=node, seconds=round(silent_for, 3), ended=True, holds="")

    def silent(self) -> list[Silence]:
        """Children silent past the timeout, each reported once until it speaks."""
        now = self.clock()
        out = []
        for node, child in self._children.items():
            if not child.reported and now - child.heard > self.timeout:
                child.reported = True
                out.append(Silence(peer=node, seconds=round(now - child.heard, 3),
                                   ended=False, holds="reports"))
        return out

    def silent_now(self) -> dict[int, float]:
        """The children reported silent, and for how long so far (this node's clock)."""
        now = self.clock()
        return {n: now - c.heard for n, c in self._children.items() if c.reported}


def beat_period(timeout: float) -> float:
    """How often an agent with nothing to report still sends its parent a batch: four
    beats per timeout, so one late beat is never taken for silence."""
    return max(0.05, timeout / 4)


class NodeLiveness:
    """One agent's side of it: its clock net of its own stalls, the children it watches,
    when it owes its parent a beat, and the tree frames it has read (a gap is what a
    stalled parent held: relay.Numbers)."""

    def __init__(self, node: int, nodes: int, fanout: int, timeout: float) -> None:
        self.node, self.nodes, self.fanout = node, nodes, fanout
        self.clock = OwnClock()
        self.watch = Watch(node, timeout, self.clock.now)
        self.watch.expect(relay.children(node, nodes, fanout))
        self.frames = relay.Numbers()
        self._beat, self._sent = beat_period(timeout), self.clock.now()

    def tick(self) -> float:
        """A turn of the main loop: this process's stall since the last (0: none); after
        one, the parent is told at once that this node is back."""
        stall = self.clock.tick()
        if stall:
            self._sent = float("-inf")
        return stall

    def send_up(self, reports: list[object]) -> bool:
        """Whether to send the parent a batch now: reports, or a beat due."""
        now = self.clock.now()
        if reports or now - self._sent >= self._beat:
            self._sent = now
            return True
        return False

    def follow(self, route: relay.Route) -> tuple[bool, range]:
        """A relay frame's route: whether it is new (a tree frame read already is not),
        and the tree frames missed before it. The watched children follow a new tree
        (on node 0 also the nodes it leaves out: they report to node 0 directly)."""
        if route.kind != "tree":
            return True, range(0)
        new, missed = self.frames.see(route.number) if route.number else (True, range(0))
        if new:
            children = relay.children(self.node, self.nodes, self.fanout, route.skip)
            self.watch.expect([*children, *(route.skip if self.node == 0 else ())])
        return new, missed
