"""The two noise forms of a stage model: the byte term varies (bandwidth form) or the
whole time does (time form); the likelier is chosen, and each carries to a size the
fit never saw."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cachex_agent.errors import OperationError
from cachex_agent.model.history import StageSample
from cachex_agent.model.predict import SystemModel
from cachex_agent.model.stages import StageModel, fit_stage

MB = 1e6
A, B = 0.2, 400 * MB          # a large fixed cost: a 16 MB part is mostly fixed cost


def samples(rng, form: str, sizes=(16 * MB, 48 * MB), count: int = 80) -> list[StageSample]:
    out = []
    for i in range(count):
        size = sizes[i % len(sizes)]
        noise = math.exp(0.3 * rng.standard_normal())
        if form == "time":               # a loaded node: every part of the time varies
            t = (A + size / B) * noise
        else:                            # a busy device: only the bytes' time varies
            t = A + size / (B / noise)
        out.append(StageSample("r", f"s{i}", 0, 1, "capture", int(size), t, float(i), "peer"))
    return out


def median_at(model: StageModel, size: float) -> float:
    return SystemModel({"capture": model}, {}).predict("captured", "peer", size, 1).quantile(0.5)


def test_a_time_that_varies_whole_is_fitted_in_the_time_form_and_carries_to_larger_sizes():
    rng = np.random.default_rng(11)
    data = samples(rng, "time")
    chosen = fit_stage(data)
    bandwidth_only = fit_stage(data, forms=("bandwidth",))
    assert chosen is not None and bandwidth_only is not None
    assert chosen.form == "time" and bandwidth_only.form == "bandwidth"
    truth = A + 160 * MB / B                  # 10x the smaller size, never seen
    assert abs(median_at(chosen, 160 * MB) - truth) / truth < 0.10
    # the spread of B from the parts that are mostly fixed cost, carried to a large part
    assert abs(median_at(bandwidth_only, 160 * MB) - truth) / truth > 0.25


def test_a_time_whose_bytes_vary_stays_in_the_bandwidth_form():
    rng = np.random.default_rng(12)
    model = fit_stage(samples(rng, "bandwidth", sizes=(64 * MB, 256 * MB)))
    assert model is not None and model.form == "bandwidth"
    truth = A + 512 * MB / B
    assert abs(median_at(model, 512 * MB) - truth) / truth < 0.10


def test_one_size_and_node_count_is_the_bandwidth_form():
    rng = np.random.default_rng(13)
    model = fit_stage(samples(rng, "time", sizes=(48 * MB,)))
    assert model is not None and model.form == "bandwidth" and model.overhead == 0.0


def test_the_form_is_saved_and_a_bad_one_refused():
    model = fit_stage(samples(np.random.default_rng(14), "time"))
    assert model is not None
    data = model.to_json()
    restored = StageModel.from_json(data)
    assert (restored.form, restored.per_byte) == (model.form, model.per_byte)
    assert restored.ppf(0.9, 100 * MB, 1) == pytest.approx(model.ppf(0.9, 100 * MB, 1))
    with pytest.raises(OperationError, match="unknown stage form 'magic'"):
        StageModel.from_json({**data, "form": "magic"})
