"""Per-stage models: how long a node's part of `s` bytes takes on `N` nodes.

    t = a + s * N**gamma / B,    B ~ a fitted distribution (log-normal, gamma, Weibull)

`a` is the fixed cost of the stage (file creation, fsync of metadata, messages), B the
effective bandwidth, and `gamma` how much the nodes share the resource behind the stage
(0: each node has its own, as a node-local NVMe; 1: one device shared by all, as a
saturated PFS). `a` and `gamma` come from least squares of t on s * N**gamma; with a
single part size and node count `a` is 0. `gamma` needs samples from at least two node
counts; with one, it is 0 (a node count never seen is assumed not to change per-node
bandwidth).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OperationError
from .distributions import FAMILIES, Fit, best_fit, fit
from .history import StageSample

MIN_SAMPLES = 3


@dataclass(frozen=True)
class StageModel:
    stage: str
    overhead: float             # a, seconds
    gamma: float
    fits: tuple[Fit, ...]       # of the effective bandwidth B (bytes/s), best first
    durations: tuple[Fit, ...]  # of the raw durations, best first (for the report)
    n: int
    ks: float                   # Kolmogorov-Smirnov distance of the chosen bandwidth fit

    @property
    def bandwidth(self) -> Fit:
        return self.fits[0]

    def scale(self, size: float, nodes: int) -> float:
        return size * nodes ** self.gamma

    def ppf(self, q: float | np.ndarray, size: float, nodes: int) -> float | np.ndarray:
        """Quantile of one node's time (slow bandwidth = long time)."""
        return self.overhead + self.scale(size, nodes) / self.bandwidth.ppf(1.0 - np.asarray(q))

    def cdf(self, t: np.ndarray, size: float, nodes: int) -> np.ndarray:
        over = np.asarray(t, dtype=float) - self.overhead
        out = np.zeros_like(over)
        positive = over > 0
        out[positive] = self.bandwidth.frozen.sf(self.scale(size, nodes) / over[positive])
        return out

    def sample(self, rng: np.random.Generator, count: int, size: float, nodes: int
               ) -> np.ndarray:
        bandwidth = self.bandwidth.frozen.rvs(size=count, random_state=rng)
        return self.overhead + self.scale(size, nodes) / np.maximum(bandwidth, 1e-300)

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "overhead": self.overhead, "gamma": self.gamma,
                "n": self.n, "ks": self.ks,
                "fits": [_fit_json(f) for f in self.fits],
                "durations": [_fit_json(f) for f in self.durations]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageModel:
        return cls(data["stage"], float(data["overhead"]), float(data["gamma"]),
                   tuple(_fit_from(f) for f in data["fits"]),
                   tuple(_fit_from(f) for f in data["durations"]), int(data["n"]),
                   float(data["ks"]))


def fit_stage(samples: Sequence[StageSample], criterion: str = "aic",
              families: Sequence[str] = FAMILIES) -> StageModel | None:
    """The stage's model from its samples; None when there are too few."""
    if len(samples) < MIN_SAMPLES:
        return None
    size = np.array([s.bytes for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    nodes = np.array([s.nodes for s in samples], dtype=float)
    overhead, gamma = _overhead_and_gamma(size, seconds, nodes)
    bandwidth = size * nodes ** gamma / (seconds - overhead)
    fits = _ranked(bandwidth, criterion, families)
    durations = _ranked(seconds, criterion, families)
    return StageModel(samples[0].stage, overhead, gamma, tuple(fits), tuple(durations),
                      len(samples), fits[0].ks(bandwidth))


def _ranked(data: np.ndarray, criterion: str, families: Sequence[str]) -> list[Fit]:
    if tuple(families) == FAMILIES:
        return best_fit(data, criterion)
    return sorted((fit(data, f) for f in families), key=lambda f: getattr(f, criterion))


def _overhead_and_gamma(size: np.ndarray, seconds: np.ndarray, nodes: np.ndarray
                        ) -> tuple[float, float]:
    """Least squares of t = a + b * s * N**gamma over a grid of gamma; `a` kept within
    [0, 0.9 min t] so that every sample keeps a positive bandwidth."""
    varied_n = np.ptp(np.log(nodes)) > 1e-9
    varied_s = np.ptp(np.log(size)) > math.log(1.5)
    best = (math.inf, 0.0, 0.0)
    for gamma in np.linspace(0.0, 1.0, 11) if varied_n else (0.0,):
        x = size * nodes ** gamma
        if varied_s or varied_n:
            slope, a = np.polyfit(x, seconds, 1)
            a = float(min(max(a, 0.0), 0.9 * seconds.min())) if slope > 0 else 0.0
        else:
            a = 0.0
        b = float(np.sum((seconds - a) * x) / np.sum(x * x))
        sse = float(np.sum((seconds - a - b * x) ** 2))
        if sse < best[0] - 1e-15:
            best = (sse, a, float(gamma))
    return best[1], best[2]


def _fit_json(f: Fit) -> dict[str, Any]:
    return {"family": f.family, "params": list(f.params), "n": f.n, "loglik": f.loglik,
            "aic": f.aic, "bic": f.bic}


def _fit_from(data: dict[str, Any]) -> Fit:
    if data["family"] not in FAMILIES:
        raise OperationError(f"unknown distribution family {data['family']!r} in the model")
    return Fit(data["family"], tuple(float(p) for p in data["params"]), int(data["n"]),
               float(data["loglik"]))
