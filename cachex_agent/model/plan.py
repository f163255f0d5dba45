"""Expected lost work per write path, and the checkpoint period to use.

Three failure classes, each survived by the first level that outlives it:

    crash  (the trainer dies, the node lives)    captured
    node   (one node and its memory are lost)    replicated (peer) / flushed (direct)
    job    (the whole allocation is lost)        flushed

A node loss on the peer path is survived at `replicated` only within what the scheme
rebuilds (protection.py): the fraction f of node losses that leave a group beyond its
tolerance within a period falls back to `flushed`, so E[L_node] = (1 - f) E[L | replicated]
+ f E[L | flushed].

For a path, D_c is the time from the start of the trainer's write to that level on
every node, and E[L_c] the expected work lost to a failure of class c at a random time
(durability.expected_lost_work, with checkpoint period T; a path that flushes only every
k-th checkpoint has period kT for job loss). The loss rate is sum_c lambda_c E[L_c]
(seconds of work per hour); the waste fraction adds the blocking cost: C/T + loss/3600.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import Model as ModelConfig
from ..config import Peer
from .durability import exact_lost_work, expected_lost_work
from .predict import SystemModel
from .protection import Protection

CLASSES = ("crash", "node", "job")
HOUR = 3600.0


@dataclass(frozen=True)
class Rates:
    crash: float        # per hour, whole job
    node: float         # per node-hour
    job: float          # per hour

    @classmethod
    def of(cls, config: ModelConfig) -> Rates:
        return cls(config.crash_rate, config.node_rate, config.job_rate)

    def per_hour(self, nodes: int) -> dict[str, float]:
        return {"crash": self.crash, "node": self.node * nodes, "job": self.job}


@dataclass(frozen=True)
class PathPlan:
    name: str
    path: str
    every: int
    lag: dict[str, float]       # median D_c, seconds
    lost: dict[str, float]      # E[L_c], seconds per failure
    loss: float                 # seconds of work lost per hour
    excess: float               # the part of `loss` beyond T/2 per failure: the path's own
    fallback: float = 0.0       # node losses beyond the scheme's tolerance (to `flushed`)

    def waste(self, stall: float, period: float) -> float:
        return stall / period + self.loss / HOUR


@dataclass(frozen=True)
class Plan:
    size: float
    nodes: int
    period: float
    stall: float
    rates: dict[str, float]
    paths: list[PathPlan]
    young: float | None
    daly: float | None
    optimum: float
    optimum_waste: float
    protection: Protection | None = None
    beyond: float = 0.0         # P(some group beyond its tolerance within one period)

    @property
    def best(self) -> PathPlan:
        return min(self.paths, key=lambda p: p.loss)


def survival(samples: np.ndarray):
    """S(t) = P(D > t) from samples."""
    ordered = np.sort(samples)

    def sf(t: np.ndarray) -> np.ndarray:
        return 1.0 - np.searchsorted(ordered, t, side="right") / ordered.size
    return sf


def evaluate(model: SystemModel, path: str, every: int, size: float, nodes: int,
             period: float, rates: Rates, samples: int = 20_000,
             protection: Protection | None = None) -> PathPlan:
    lags = durabilities(model, path, size, nodes, samples)
    per_hour = rates.per_hour(nodes)
    shield = protection or Protection.of(Peer(), nodes)
    lost, fallback = class_losses(lags, path, every, period, rates, nodes, shield, 800)
    name = path if every == 1 else f"{path}, flush every {every}"
    half = {c: period * (every if c == "job" else 1) / 2 for c in CLASSES}
    return PathPlan(name, path, every, {c: float(np.median(lags[c])) for c in CLASSES}, lost,
                    sum(per_hour[c] * lost[c] for c in CLASSES),
                    sum(per_hour[c] * (lost[c] - half[c]) for c in CLASSES), fallback)


def class_losses(lags: dict[str, np.ndarray], path: str, every: int, period: float,
                 rates: Rates, nodes: int, protection: Protection, points: int
                 ) -> tuple[dict[str, float], float]:
    """E[L_c] per failure class, and the fraction of node losses falling back to
    `flushed` (the job class's level, flushed every k-th: period kT). `points` = 0: each
    E[L_c] exact for its samples (durability.exact_lost_work), else on that many."""
    def lost_work(samples: np.ndarray, window: float) -> float:
        return (exact_lost_work(samples, window) if points == 0
                else expected_lost_work(survival(samples), window, points=points))
    lost = {c: lost_work(lags[c], period * (every if c == "job" else 1)) for c in CLASSES}
    if path != "peer":
        return lost, 0.0            # direct: a node loss already waits for `flushed`
    fallback = protection.fallback(rates.node, period, nodes)
    lost["node"] = (1.0 - fallback) * lost["node"] + fallback * lost["job"]
    return lost, fallback


def durabilities(model: SystemModel, path: str, size: float, nodes: int, samples: int
                 ) -> dict[str, np.ndarray]:
    captured = model.durability("captured", path, size, nodes, samples)
    flushed = model.durability("flushed", path, size, nodes, samples)
    node = (model.durability("replicated", path, size, nodes, samples) if path == "peer"
            else flushed)
    return {"crash": captured, "node": node, "job": flushed}


def make_plan(model: SystemModel, size: float, nodes: int, period: float, stall: float,
              rates: Rates, every: int | None = None, concurrency: int = 1,
              protection: Protection | None = None) -> Plan:
    shield = protection or Protection.of(Peer(), nodes)
    paths = [evaluate(model, p, 1, size, nodes, period, rates, protection=shield)
             for p in ("peer", "direct") if p != "peer" or "replicate" in model.stages]
    if "replicate" in model.stages:
        flush_time = paths[0].lag["job"] - paths[0].lag["node"]
        k = every or max(2, math.ceil(flush_time / period))
        paths.append(evaluate(model, "peer", k, size, nodes, period, rates, protection=shield))
    best = min(paths, key=lambda p: p.loss)
    total = sum(rates.per_hour(nodes).values()) / HOUR         # failures per second
    young = math.sqrt(2 * stall / total) if stall > 0 and total > 0 else None
    daly = (math.sqrt(2 * stall / total) - stall
            if young is not None and stall < 2 / total else None)
    optimum, waste = _optimum(model, best, size, nodes, stall, rates, period, concurrency,
                              shield)
    return Plan(size, nodes, period, stall, rates.per_hour(nodes), paths, young, daly,
                optimum, waste, shield, shield.beyond_in_window(rates.node, period))


def _optimum(model: SystemModel, best: PathPlan, size: float, nodes: int, stall: float,
             rates: Rates, period: float, concurrency: int, protection: Protection
             ) -> tuple[float, float]:
    """The period minimizing C/T + loss(T): D enters through E[L_c] exactly. Not shorter
    than the flush can keep up with: E[L] assumes checkpoints do not queue behind each
    other, and flushes `concurrency` at a time would."""
    lags = durabilities(model, best.path, size, nodes, 4000)
    per_hour = rates.per_hour(nodes)
    keep_up = float(np.median(lags["job"])) / (concurrency * best.every)
    low = max(stall, float(np.median(lags["crash"])), keep_up, 1.0)
    best_t, best_w = period, math.inf
    for t in np.geomspace(low, 7 * 24 * HOUR, 120):
        lost, _ = class_losses(lags, best.path, best.every, float(t), rates, nodes,
                               protection, 400)
        loss = sum(per_hour[c] * lost[c] for c in CLASSES)
        waste = stall / t + loss / HOUR
        if waste < best_w:
            best_t, best_w = float(t), waste
    return best_t, best_w
