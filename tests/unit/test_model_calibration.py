"""Calibration of the model's quantiles, on synthetic checkpoints whose true completion
time distribution is known: the true model covers q, a biased one does not."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from cachex_agent.errors import OperationError
from cachex_agent.model.calibration import QUANTILES, calibration, coverage_of
from cachex_agent.model.history import LevelSample
from cachex_agent.model.predict import Prediction

NODES = 4
SIZE = 64 * 2**20
MU, SIGMA, SHIFT = math.log(2.0), 0.4, 0.3      # a node's time: SHIFT + lognormal
COUNT = 4000


def observed(rng: np.random.Generator, level: str = "flushed") -> list[LevelSample]:
    """Each checkpoint ends when its slowest of NODES nodes does."""
    nodes = SHIFT + rng.lognormal(MU, SIGMA, size=(COUNT, NODES))
    return [LevelSample("r", f"s{i}", i, NODES, level, SIZE, float(t), float(i), "peer")
            for i, t in enumerate(nodes.max(axis=1))]


def model(scale: float = 1.0):
    """Predictions from the node distribution, its times multiplied by `scale`."""
    node = stats.lognorm(s=SIGMA, scale=scale * math.exp(MU))

    def predict(s: LevelSample) -> Prediction:
        return Prediction(s.level, s.path, s.bytes, s.nodes, scale * SHIFT, node.cdf, node.ppf)
    return predict


def test_the_true_distribution_covers_each_quantile():
    rows = calibration(observed(np.random.default_rng(1)), model())
    assert [(r.level, r.path, r.n) for r in rows] == [("flushed", "peer", COUNT)]
    for q in QUANTILES:         # within 3 binomial standard errors of q
        assert abs(rows[0].coverage[q] - q) <= 3 * rows[0].error(q), (q, rows[0].coverage)
        assert rows[0].within(q)


@pytest.mark.parametrize("scale, low", [(0.7, True), (1.4, False)])
def test_a_biased_model_is_far_off(scale, low):
    """Predicting times 30% short: the quantiles cover too little; 40% long: too much."""
    row = calibration(observed(np.random.default_rng(2)), model(scale))[0]
    assert not row.within(0.5) and not row.within(0.9)
    assert (row.coverage[0.5] < 0.5 - 0.2) if low else (row.coverage[0.5] > 0.5 + 0.2)


def test_levels_are_kept_apart_and_an_unpredictable_level_is_left_out():
    rng = np.random.default_rng(3)
    samples = observed(rng, "captured") + observed(rng, "replicated") + observed(rng, "flushed")
    half = model(0.5)

    def predict(s: LevelSample) -> Prediction:
        if s.level == "replicated":
            raise OperationError("no replicate samples")
        return (half if s.level == "captured" else model())(s)
    rows = {r.level: r for r in calibration(samples, predict)}
    assert sorted(rows) == ["captured", "flushed"]
    assert rows["flushed"].within(0.9) and not rows["captured"].within(0.9)


def test_coverage_of_uniform_transforms():
    p = np.linspace(0.0005, 0.9995, 1000)
    assert coverage_of(p) == pytest.approx({0.5: 0.5, 0.9: 0.9, 0.99: 0.99}, abs=1e-3)
