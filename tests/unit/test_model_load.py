"""The node's load as a covariate of the stage times: found where it moves them, left
out where it does not; predictions at a given load."""

from __future__ import annotations

import math

import numpy as np

from cachex_agent.model.history import StageSample
from cachex_agent.model.predict import SystemModel
from cachex_agent.model.stages import fit_stage

MB = 1e6
A, MU, SIGMA = 0.05, math.log(500 * MB), 0.1


def samples(rng, beta: float, loads: float | None = None, recorded: bool = True,
            count: int = 120) -> list[StageSample]:
    """t = (1 + beta l)(a + s / B), l the load per core of each sample (0 to 4, or
    `loads`); `recorded` False: events without the load (older agents)."""
    out = []
    for i in range(count):
        size = (50 * MB, 200 * MB)[i % 2]
        load = float(rng.uniform(0.0, 4.0)) if loads is None else loads
        t = (1 + beta * load) * (A + size / math.exp(MU + SIGMA * rng.standard_normal()))
        out.append(StageSample("r", f"s{i}", 0, 1, "capture", int(size), t, float(i), "peer",
                               load if recorded else None))
    return out


def test_a_load_that_slows_the_stage_is_found_and_predicted():
    rng = np.random.default_rng(4)
    model = fit_stage(samples(rng, beta=0.5))
    assert model is not None and model.beta == 0.5
    assert abs(model.log_params[1] - SIGMA) < 0.03      # the spread left is the bandwidth's
    system = SystemModel({"capture": model}, {})
    idle = system.predict("captured", "peer", 200 * MB, 1, load=0.0).quantile(0.5)
    busy = system.predict("captured", "peer", 200 * MB, 1, load=4.0).quantile(0.5)
    truth = A + 200 * MB / math.exp(MU)
    assert abs(idle - truth) / truth < 0.05
    assert abs(busy - 3 * truth) / (3 * truth) < 0.05
    restored = type(model).from_json(model.to_json())
    assert (restored.beta, restored.load) == (model.beta, model.load)


def test_no_load_effect_or_no_load_recorded_keeps_the_plain_model():
    rng = np.random.default_rng(5)
    for data in (samples(rng, beta=0.0), samples(rng, beta=0.5, loads=2.0),
                 samples(rng, beta=0.5, recorded=False)):
        model = fit_stage(data)
        assert model is not None and model.beta == 0.0 and model.factor(3.0) == 1.0
