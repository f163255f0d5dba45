"""How the agents' reports reach the coordinator: up the relay tree, reduced at each hop.

At 10,000 nodes the coordinator cannot take N messages per level of every checkpoint
on the thread that services MPI, and no agent may receive more as the job grows. Each
agent sends its reports to its parent in the tree the coordinator's frames go down
(relay.parent, over the nodes the newest frame did not skip). A parent holds a
checkpoint's `replicated` or `flushed` reports until its whole subtree has reported or
HOLD seconds have passed since the first, then reduces them to one `reduced` report:
the nodes as runs of numbers (a whole subtree is one run per tree level), up to
SAMPLES of their durations (a uniform sample, for the model), and the nodes their
replicators found dead. So the coordinator hears one batch per child per level, each a
few hundred bytes whatever the job's size, and a level is not delayed: it is reached
only when the last node has reported anyway. A flush's progress goes up only in jobs
of at most PROGRESS_NODES nodes. Markers are reduced the same way but go
up at the next turn of the loop (the first one commits the checkpoint); every other
report goes up whole at the next turn, so a failure is still named by its node with
its error.

A `captured` report does not come this way: it carries the node's part manifest, which
the coordinator must hold; through the tree the agents near the root would carry
N/fanout manifests each, so it goes to node 0 directly.

A parent lost without the coordinator knowing yet takes the batches sent to it along.
Every report of a checkpoint in flight is kept (`sent`) until the coordinator's
`Finalized` or `Failed` for it, and sent again when the newest frame changes this
node's parent; the coordinator takes a report it already has as a no-op.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import relay
from .layout import bundle_name
from .messages import Flushed, Marker, Replicated, Report

HOLD = 0.25           # s: a level's reports wait this long at most for the rest of a subtree
HELD = frozenset({"replicated", "flushed"})
REDUCED = HELD | {"marker"}
DIRECT = frozenset({"captured", "frames"})
SAMPLES = 8           # durations a reduced report carries for the model
# A flush reports its progress twice a second per node, for `cachex status`: through the
# tree that is O(subtree) bytes a second on the agents near the root, and status lines
# for 10,000 nodes help nobody. Beyond this many nodes status shows the counts per level.
PROGRESS_NODES = 64
KEPT = 64             # checkpoints whose reports are kept for a resend


@dataclass
class _Level:
    """The reports of one (checkpoint, kind) that came through this node."""
    first: float
    count: int = 0                  # nodes heard of, whole reports too
    waiting: list[dict[str, Any]] = field(default_factory=list)    # to reduce
    whole: list[dict[str, Any]] = field(default_factory=list)      # to send as they are
    sent: list[dict[str, Any]] = field(default_factory=list)


class Uplink:
    def __init__(self, node: int, nodes: int, fanout: int, hold: float = HOLD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.node, self.nodes, self.fanout = node, nodes, fanout
        self.hold = hold if node != 0 else 0.0      # the root hands them on at once
        self.clock = clock
        self.random = random.Random(node)
        self.skip: tuple[int, ...] = ()
        self.parent = relay.parent(node, nodes, fanout)
        self._expected = relay.subtree(node, nodes, fanout)
        self._levels: dict[tuple[str, str], _Level] = {}
        self._now: list[dict[str, Any]] = []

    def follow(self, route: relay.Route) -> None:
        """Every relay frame's route (pump.py): a tree's skips are the new tree."""
        if route.kind == "tree":
            self.reroute(route.skip)

    def reroute(self, skip: tuple[int, ...]) -> None:
        """The skip list of the newest tree frame; a new parent gets every report of a
        checkpoint in flight again (the old one may have died holding them)."""
        if skip == self.skip:
            return
        self.skip = skip
        self._expected = relay.subtree(self.node, self.nodes, self.fanout, skip)
        parent = relay.parent(self.node, self.nodes, self.fanout, skip)
        if parent != self.parent:
            self.parent = parent
            for level in self._levels.values():
                for report in level.sent:
                    (level.waiting if _reducible(report) else level.whole).append(report)
                level.sent = []
                level.first = float("-inf")     # due at once

    def add(self, report: dict[str, Any]) -> bool:
        """One report (this node's, or a child's from its batch); False for one that
        names a node outside the job (refused, not passed on)."""
        if not all(0 <= n < self.nodes for n in _nodes_of(report)):
            return False
        if report["type"] == "progress" and self.nodes > PROGRESS_NODES:
            return True
        kind = report.get("kind", report["type"])
        if kind not in REDUCED or "ckpt" not in report:
            self._now.append(report)
            return True
        key = (report["ckpt"], kind)
        level = self._levels.get(key)
        if level is None:
            level = self._levels[key] = _Level(self.clock())
            self._trim()
        level.count += _count(report)
        (level.waiting if _reducible(report) else level.whole).append(report)
        return True

    def due(self) -> list[dict[str, Any]]:
        """The reports to send to `parent` now: whole ones, and one reduced report per
        level whose subtree is complete or has waited long enough (markers at once)."""
        out: list[dict[str, Any]] = []
        now = self.clock()
        # `drained` says a node has nothing more to report: what it holds goes first
        barrier = any(r["type"] == "drained" for r in self._now)
        for (_ckpt, kind), level in self._levels.items():
            out += level.whole
            level.sent += level.whole
            level.whole = []
            if level.waiting and (barrier or kind not in HELD or level.count >= self._expected
                                  or now - level.first >= self.hold):
                # the root hands them to the coordinator as they came: one more
                # reduction would keep SAMPLES durations of the whole job
                out += (level.waiting if self.node == 0
                        else [reduce(level.waiting, self.node, self.random)])
                level.sent += level.waiting
                level.waiting = []
        out += self._now
        self._now = []
        return out

    def forget(self, ckpt: str) -> None:
        """The coordinator has ended `ckpt`: nothing of it needs sending again. What has
        not been sent yet still goes (a replica finished after the flush is counted)."""
        for key in [k for k in self._levels if k[0] == ckpt]:
            if self._levels[key].waiting or self._levels[key].whole:
                self._levels[key].sent = []
            else:
                del self._levels[key]

    def next_due(self) -> float | None:
        """Seconds until a held level is due, None when nothing waits."""
        if self._now or any(level.whole for level in self._levels.values()):
            return 0.0
        firsts = [level.first if kind in HELD else float("-inf")
                  for (_c, kind), level in self._levels.items() if level.waiting]
        return max(0.0, min(firsts) + self.hold - self.clock()) if firsts else None

    def _trim(self) -> None:
        """A checkpoint whose end this node never heard of (it missed the frame) is not
        kept for ever: the oldest beyond KEPT checkpoints go."""
        ckpts = list(dict.fromkeys(k[0] for k in self._levels))
        for ckpt in ckpts[:-KEPT]:
            for key in [k for k in self._levels if k[0] == ckpt]:
                del self._levels[key]


# ------------------------------------------------------------------- reduction
def _reducible(report: dict[str, Any]) -> bool:
    """A report the reduction loses nothing of: a success of the usual shape. Anything
    else (a failure, an error, a restart's adopted report) goes up whole."""
    if report["type"] in ("reduced", "marker"):
        return True
    if report.get("adopted"):
        return False
    if report["type"] == "replicated":
        return report.get("ok") is True and not report.get("errors")
    return report.get("bundle") == bundle_name(report["node"])


def _nodes_of(report: dict[str, Any]) -> Iterator[int]:
    if report["type"] != "reduced":
        yield report["node"]
        return
    for first, last in report["runs"]:
        yield first
        yield last


def _count(report: dict[str, Any]) -> int:
    if report["type"] != "reduced":
        return 1
    return sum(last - first + 1 for first, last in report["runs"])


def reduce(reports: list[dict[str, Any]], node: int, rng: random.Random) -> dict[str, Any]:
    """One `reduced` report standing for `reports` (all of one checkpoint and kind)."""
    parts = [r if r["type"] == "reduced" else _single(r) for r in reports]
    kind = parts[0]["kind"]
    out: dict[str, Any] = {"type": "reduced", "kind": kind, "ckpt": parts[0]["ckpt"],
                           "node": node, "runs": _runs(p["runs"] for p in parts),
                           "samples": _sample(parts, rng)}
    dead = sorted({d for p in parts for d in p.get("dead", [])})
    if dead:
        out["dead"] = dead
    if kind == "marker":
        rule = next((p["rule"] for p in parts if p.get("rule")), None)
        out.update(rule=rule, global_files=sorted(
            {f for p in parts for f in p.get("global_files", [])}))
    return out


def _single(report: dict[str, Any]) -> dict[str, Any]:
    node = report["node"]
    out = {"type": "reduced", "kind": report["type"], "ckpt": report["ckpt"],
           "runs": [[node, node]], "samples": [[node, float(report.get("duration", 0.0))]],
           "dead": report.get("dead", [])}
    if report["type"] == "marker":
        out.update(rule=report.get("rule"),
                   global_files=report.get("global_files", []), samples=[])
    return out


def _runs(lists: Iterator[list[list[int]]]) -> list[list[int]]:
    """The union of runs of node numbers, as sorted, disjoint, non-adjacent runs."""
    merged: list[list[int]] = []
    for first, last in sorted(run for runs in lists for run in runs):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return merged


def _sample(parts: list[dict[str, Any]], rng: random.Random) -> list[list[float]]:
    """Up to SAMPLES durations, each part's drawn with the weight of the nodes each of
    its samples stands for (weighted sampling without replacement): uniform over
    the nodes below, as if every node's duration had come up."""
    keyed = []
    for part in parts:
        samples = part["samples"]
        weight = _count(part) / len(samples) if samples else 0
        keyed += [(rng.random() ** (1 / weight), s) for s in samples if weight > 0]
    keyed.sort(reverse=True)
    return [s for _key, s in keyed[:SAMPLES]]


def expand(report: dict[str, Any], now: float = 0.0) -> Iterator[Report]:
    """The coordinator's side: a `reduced` report (checked as it came) as the typed
    per-node reports it stands for, arrived at `now` (a node without a sample has no
    duration, so the model learns nothing from it; the dead and a marker's files come
    with the first)."""
    kind, ckpt = report["kind"], report["ckpt"]
    seconds = {int(n): s for n, s in report["samples"]}
    dead, files = report.get("dead", []), report.get("global_files", [])
    for first, last in report["runs"]:
        for node in range(first, last + 1):
            if kind == "marker":
                yield Marker(node=node, ckpt=ckpt, rule=report.get("rule"),
                             global_files=files, now=now)
                files = []
                continue
            duration = seconds.get(node, 0.0)
            if kind == "replicated":
                yield Replicated(node=node, ckpt=ckpt, ok=True, dead=dead,
                                 duration=duration, now=now)
                dead = []
            else:
                yield Flushed(node=node, ckpt=ckpt, bundle=bundle_name(node),
                              duration=duration, now=now)
