"""The fitted system: stage models plus coordination overheads, and level predictions.

A node's part reaches level L after the stages of L on its path (section 4):

    captured    capture
    replicated  capture, replicate           (peer path only)
    flushed     capture, replicate, flush    (peer)  /  capture, flush  (direct)

When the events hold that level on that path, the node's time to it is fitted as one
stage ("flushed:peer": stages and the waits between them, as they correlate); when not
(the path not taken yet), it is the sum of the stage times. The checkpoint holds L when
all N nodes do,
plus the coordinator's own share c_L (messages, global manifest, index). Given what the
nodes of one checkpoint share (the common part of each stage's bandwidth), the nodes are
independent: F_L(t) = E[F_node(t - c_L | common)^N]. Monte Carlo draws the common part
per simulated checkpoint; the node's sum of log-normal stage times is log-normal by
moment matching (Fenton-Wilkinson), and its maximum over N nodes is drawn exactly as
F^-1(U^(1/N)), so N may be in the thousands. One stage with no common part is closed
form: t_q = c_L + F_node^-1(q^(1/N)).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OperationError
from ..fsutil import atomic_open
from .distributions import FAMILIES, scipy_module
from .durability import cdf_of_max, quantile_of_max
from .history import LEVELS, STAGES, History
from .stages import FORMS, StageModel, fit_stage

PATHS = ("peer", "direct")
MONTE_CARLO = 20_000


def level_stages(level: str, path: str) -> tuple[str, ...]:
    if level not in LEVELS or path not in PATHS:
        raise OperationError(f"unknown level/path {level!r}/{path!r} (levels: {LEVELS},"
                             f" paths: {PATHS})")
    if level == "captured":
        return ("capture",)
    if path == "direct":
        if level == "replicated":
            raise OperationError("the direct path never reaches level replicated")
        return ("capture", "flush")
    return ("capture", "replicate") if level == "replicated" else ("capture", "replicate",
                                                                    "flush")


@dataclass
class Prediction:
    """Completion time of one level for a checkpoint of `size` bytes on `nodes` nodes."""

    level: str
    path: str
    size: float
    nodes: int
    shift: float                            # fixed costs: stage overheads + c_L
    node_cdf: Callable[[np.ndarray], np.ndarray] | None = None  # variable part of a node
    node_ppf: Callable[[np.ndarray], np.ndarray] | None = None
    simulated: np.ndarray | None = None     # sorted completion times, when not closed form

    def cdf(self, t: np.ndarray | float) -> np.ndarray:
        """P(the level holds for the whole checkpoint by t) = F_node(t - shift)^N."""
        t = np.asarray(t, dtype=float)
        if self.simulated is not None:
            return np.searchsorted(self.simulated, t, side="right") / self.simulated.size
        return cdf_of_max(self._node_cdf, t - self.shift, self.nodes)

    def _node_cdf(self, over: np.ndarray) -> np.ndarray:
        return np.where(over > 0, self.node_cdf(np.maximum(over, 1e-300)), 0.0)

    def ppf(self, q: float | np.ndarray) -> np.ndarray:
        q = np.asarray(q, dtype=float)
        if self.simulated is not None:
            return np.quantile(self.simulated, q)
        return self.shift + quantile_of_max(self.node_ppf, q, self.nodes)

    def quantile(self, q: float) -> float:
        return float(self.ppf(q))

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return self.ppf(rng.uniform(1e-9, 1 - 1e-9, size=count))


@dataclass
class SystemModel:
    stages: dict[str, StageModel]
    overheads: dict[str, float]             # c_L per level, seconds
    period: float | None = None             # median time between commits seen
    size: float | None = None               # median checkpoint bytes seen
    nodes: int | None = None                # most common node count seen
    counts: dict[str, int] = field(default_factory=dict)

    def stage(self, name: str) -> StageModel:
        model = self.stages.get(name)
        if model is None:
            raise OperationError(f"no {name} samples in the events: the model cannot say how"
                                 f" long the {name} stage takes")
        return model

    def predict(self, level: str, path: str, size: float, nodes: int,
                samples: int = MONTE_CARLO, seed: int = 1, load: float | None = None
                ) -> Prediction:
        """`load`: the nodes' load per core (default: each stage's reference load)."""
        if size <= 0 or nodes < 1:
            raise OperationError(f"need size > 0 and nodes >= 1, got {size}, {nodes}")
        whole = self.stages.get(f"{level}:{path}")
        models = [whole] if whole else [self.stage(s) for s in level_stages(level, path)]
        part = size / nodes
        shift = sum(m.fixed(nodes, load) for m in models) + self.overheads.get(level, 0.0)
        if len(models) == 1 and models[0].log_params[2] == 0.0:
            only = models[0]
            fixed = only.fixed(nodes, load)
            return Prediction(level, path, size, nodes, shift,
                              lambda y: only.cdf(y + fixed, part, nodes, load),
                              lambda q: only.ppf(q, part, nodes, load) - fixed)
        times = shift + _slowest_node(models, part, nodes, samples, seed, load)
        return Prediction(level, path, size, nodes, shift, simulated=np.sort(times))

    def durability(self, level: str, path: str, size: float, nodes: int,
                   samples: int = MONTE_CARLO, seed: int = 2) -> np.ndarray:
        """Samples of D: from the start of the trainer's write to the level holding."""
        rng = np.random.default_rng(seed)
        done = self.predict(level, path, size, nodes, samples).sample(rng, samples)
        write = self.stages.get("write")
        if write is not None:
            u = rng.uniform(1e-9, 1 - 1e-9, size=samples) ** (1.0 / nodes)
            done = done + write.ppf(u, size / nodes, nodes)
        return done

    # ------------------------------------------------------------------ storage
    def to_json(self) -> dict[str, Any]:
        return {"format": "cachex-model", "version": 1,
                "stages": {k: v.to_json() for k, v in self.stages.items()},
                "overheads": self.overheads, "period": self.period, "size": self.size,
                "nodes": self.nodes, "counts": self.counts}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SystemModel:
        if data.get("format") != "cachex-model":
            raise OperationError("not a cachex model file (format != cachex-model)")
        return cls({k: StageModel.from_json(v) for k, v in data["stages"].items()},
                   {k: float(v) for k, v in data["overheads"].items()}, data.get("period"),
                   data.get("size"), data.get("nodes"), data.get("counts", {}))

    def save(self, path: Path) -> None:
        with atomic_open(path) as handle:
            handle.write((json.dumps(self.to_json(), indent=1) + "\n").encode())

    @classmethod
    def load(cls, path: Path) -> SystemModel:
        try:
            return cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise OperationError(f"{path}: no such model file") from None
        except (ValueError, KeyError) as exc:
            raise OperationError(f"{path}: not a valid model file ({exc})") from None


def _slowest_node(models: list[StageModel], part: float, nodes: int, samples: int,
                  seed: int, load: float | None = None) -> np.ndarray:
    """Variable part of the slowest node's time, one draw per simulated checkpoint."""
    rng = np.random.default_rng(seed)
    mean = np.zeros(samples)
    var = np.zeros(samples)
    for model in models:
        mu, sigma, common = model.log_params
        # log of the node's variable time s*N^g/B, B = exp(mu + common part + node part)
        loc = (math.log(model.scale(part, nodes) * model.factor(load)) - mu
               - common * rng.standard_normal(samples))
        mean += np.exp(loc + sigma * sigma / 2)
        var += np.expm1(sigma * sigma) * np.exp(2 * loc + sigma * sigma)
    s2 = np.log1p(var / (mean * mean))
    u = rng.uniform(size=samples) ** (1.0 / nodes)
    return np.exp(np.log(mean) - s2 / 2 + np.sqrt(s2) * scipy_module("special").ndtri(u))


def fit_system(history: History, criterion: str = "aic",
               families: Sequence[str] = FAMILIES, forms: Sequence[str] = FORMS
               ) -> SystemModel:
    if not history.stages:
        sources = ", ".join(str(s) for s in history.sources) or "no event files"
        raise OperationError(f"no stage samples to fit in {sources}")
    stages = {}
    for name in (*STAGES, *(f"{level}:{path}" for level in LEVELS for path in PATHS)):
        model = fit_stage(history.stage(name), criterion, families, forms)
        if model is not None:
            stages[name] = model
    counts = {name: len(history.stage(name)) for name in STAGES}
    return SystemModel(stages, _overheads(history), _period(history), _median_size(history),
                       _common_nodes(history), counts)


def _overheads(history: History) -> dict[str, float]:
    """c_L: how much later than its slowest node the coordinator records level L."""
    by_ckpt: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for s in history.stages:
        by_ckpt.setdefault((s.run, s.ckpt), {}).setdefault(s.node, {})[s.stage] = s.seconds
    out = {}
    for level in LEVELS:
        residuals = []
        for sample in history.level(level):
            nodes = by_ckpt.get((sample.run, sample.ckpt), {})
            whole = f"{level}:{sample.path}"
            wanted = (whole,) if all(whole in n for n in nodes.values()) else level_stages(
                level, sample.path)
            if len(nodes) < sample.nodes or not all(set(wanted) <= set(n) for n in
                                                    nodes.values()):
                continue
            slowest = max(sum(n[s] for s in wanted) for n in nodes.values())
            residuals.append(max(sample.latency - slowest, 0.0))
        if residuals:
            out[level] = statistics.median(residuals)
    return out


def _period(history: History) -> float | None:
    times = sorted({(s.run, s.committed) for s in history.levels})
    gaps = [b[1] - a[1] for a, b in pairwise(times) if a[0] == b[0] and b[1] > a[1]]
    return statistics.median(gaps) if gaps else None


def _median_size(history: History) -> float | None:
    sizes = [s.bytes for s in history.levels]
    return float(statistics.median(sizes)) if sizes else None


def _common_nodes(history: History) -> int | None:
    nodes = [s.nodes for s in history.levels] or [s.nodes for s in history.stages]
    return statistics.mode(nodes) if nodes else None

