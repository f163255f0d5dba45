"""Are the model's probabilities calibrated? Coverage of its quantiles, per level.

For an observed checkpoint i reaching level L after x_i seconds, the model's predicted
distribution F_i (model.predict for its size, node count and path) gives the
probability integral transform p_i = F_i(x_i). The predicted q-quantile covers x_i when
x_i <= F_i^-1(q), that is when p_i <= q, so the coverage of q is

    C(q) = #{i : p_i <= q} / n

and a calibrated model has C(q) = q for every q (its p_i uniform on [0, 1]). The
figure (reliability.png in `cachex report`) draws C(q) against q per level and path,
with the diagonal and the +-0.05 band of the target; the binomial standard error of C
is sqrt(q (1 - q) / n).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OperationError
from .history import History, LevelSample
from .predict import Prediction, SystemModel

QUANTILES = (0.5, 0.9, 0.99)
TOLERANCE = 0.05        # the target: each q-quantile covers q +- 0.05 of observations
GRID = (*np.round(np.linspace(0.05, 0.95, 19), 2), 0.99)

Predict = Callable[[LevelSample], Prediction]


@dataclass(frozen=True)
class Coverage:
    level: str
    path: str
    n: int
    coverage: dict[float, float]    # q -> C(q)

    def error(self, q: float) -> float:
        """Binomial standard error of C(q) if the model were calibrated."""
        return math.sqrt(q * (1 - q) / self.n)

    def within(self, q: float, tolerance: float = TOLERANCE) -> bool:
        return abs(self.coverage[q] - q) <= tolerance

    def to_json(self) -> dict[str, Any]:
        return {"level": self.level, "path": self.path, "n": self.n,
                "coverage": {str(q): c for q, c in self.coverage.items()}}


def predictor(model: SystemModel, with_load: bool = True) -> Predict:
    """The model's prediction for an observed checkpoint: its level, path, size and node
    count, and (`with_load`) the load per core recorded at its commit."""
    def predict(s: LevelSample) -> Prediction:
        load = s.load if with_load else None
        return model.predict(s.level, s.path, float(s.bytes), s.nodes, load=load)
    return predict


def pit(samples: Sequence[LevelSample], predict: Predict) -> dict[tuple[str, str], np.ndarray]:
    """p_i = F_i(x_i) per (level, path); one prediction per (level, path, size, nodes,
    load to 0.01). A level the model cannot predict (a stage without samples) is left
    out."""
    cache: dict[tuple[Any, ...], Prediction | None] = {}
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in samples:
        key = (s.level, s.path, s.bytes, s.nodes, None if s.load is None else round(s.load, 2))
        if key not in cache:
            try:
                cache[key] = predict(s)
            except OperationError:
                cache[key] = None
        prediction = cache[key]
        if prediction is not None:
            out[(s.level, s.path)].append(float(prediction.cdf(s.latency)))
    return {key: np.asarray(values) for key, values in out.items()}


def coverage_of(p: np.ndarray, quantiles: Sequence[float] = QUANTILES) -> dict[float, float]:
    """C(q) for each q from the transforms p_i."""
    return {float(q): float(np.mean(p <= q)) for q in quantiles}


def calibration(samples: Sequence[LevelSample], predict: Predict,
                quantiles: Sequence[float] = QUANTILES) -> list[Coverage]:
    """Coverage per level and path, in level order."""
    return [Coverage(level, path, p.size, coverage_of(p, quantiles))
            for (level, path), p in sorted(pit(samples, predict).items(),
                                           key=lambda kv: _LEVEL_ORDER.get(kv[0][0], 9))]


_LEVEL_ORDER = {"captured": 0, "replicated": 1, "flushed": 2}


def reliability(history: History, model: SystemModel) -> Any:
    """The reliability figure: C(q) against q per level and path (a matplotlib Figure).
    In `cachex report` the model was fitted on these same checkpoints (in sample);
    benchmarks/predict.py measures it on held-out ones."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9.0, 6.5), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Calibration: observed coverage of the predicted q-quantile\n"
                 "(in sample: the model was fitted on these checkpoints)", fontsize=10)
    grid = np.asarray(GRID)
    ax.fill_between(grid, grid - TOLERANCE, grid + TOLERANCE, color="#dddddd",
                    label=f"target q +- {TOLERANCE}")
    ax.plot([0, 1], [0, 1], color="#555555", lw=0.8, ls=":")
    rows = calibration(history.levels, predictor(model), GRID) if model.stages else []
    for row in rows:
        points = [row.coverage[float(q)] for q in grid]
        ax.plot(grid, points, marker="o", ms=3.5, ls="-" if row.path == "peer" else "--",
                label=f"{row.level} ({row.path}), {row.n} checkpoints")
    if not rows:
        ax.text(0.5, 0.5, "no level samples to check", ha="center", transform=ax.transAxes)
    ax.set_xlabel("predicted quantile q")
    ax.set_ylabel("fraction of observed completion times <= predicted q-quantile")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return fig
