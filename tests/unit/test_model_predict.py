"""Stage models and level predictions against the model they were generated from."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from cachex_agent.errors import OperationError
from cachex_agent.model.distributions import Fit
from cachex_agent.model.history import History, LevelSample, StageSample
from cachex_agent.model.predict import SystemModel, fit_system, level_stages
from cachex_agent.model.stages import StageModel, fit_stage

MB = 1e6
SIZES = (100 * MB, 400 * MB, 1600 * MB)
NODES = (1, 2, 4, 8)
# stage: (a seconds, gamma, mu and sigma of log B, B in bytes/s); sigma is each node's
# own spread, the part common to the nodes of one checkpoint is an argument (default 0)
TRUTH = {
    "capture": (0.05, 0.0, math.log(4e9), 0.25),
    "replicate": (0.2, 0.0, math.log(1.5e9), 0.35),
    "flush": (0.4, 0.6, math.log(1e9), 0.3),
}


def generate(rng, stage, sizes=SIZES, nodes=NODES, checkpoints=20, common=0.0, run="r",
             gamma_fixed=0.0):
    """Samples of t = a N**gamma_fixed + s N**gamma / B, log B = mu + common Z_ckpt +
    sigma Z_node: `checkpoints` checkpoints for every (s, N), one sample per node of each."""
    a, gamma, mu, sigma = TRUTH[stage]
    out = []
    for s in sizes:
        for n in nodes:
            for i in range(checkpoints):
                shared = common * rng.standard_normal()
                for node, z in enumerate(rng.standard_normal(n)):
                    b = math.exp(mu + shared + sigma * z)
                    out.append(StageSample(run, f"{s:g}-{n}-{i}", node, n, stage, int(s),
                                           a * n ** gamma_fixed + s * n ** gamma / b, 0.0,
                                           "peer"))
    return out


def known(stage, common=None):
    """The stage model of TRUTH exactly (no fit); `common`: with that shared spread."""
    a, gamma, mu, sigma = TRUTH[stage]
    f = Fit("lognormal", (mu, sigma), 1000, 0.0)
    if common is None:
        return StageModel(stage, a, gamma, (f,), (f,), 1000, 0.0)
    return StageModel(stage, a, gamma, (f,), (f,), 1000, 0.0, mu, sigma, common)


def simulate(rng, stages, part, nodes, count=40_000, common=None):
    """Per checkpoint, the slowest node's sum of stage times (true model)."""
    common = common or {}
    total = np.zeros((count, nodes))
    for stage in stages:
        a, gamma, mu, sigma = TRUTH[stage]
        log_b = (mu + common.get(stage, 0.0) * rng.standard_normal((count, 1))
                 + sigma * rng.standard_normal((count, nodes)))
        total += a + part * nodes ** gamma / np.exp(log_b)
    return total.max(axis=1)


@pytest.mark.parametrize("stage", ["flush", "replicate"])
def test_fit_stage_recovers_overhead_gamma_and_bandwidth(stage):
    rng = np.random.default_rng(11)
    a, gamma, mu, sigma = TRUTH[stage]
    model = fit_stage(generate(rng, stage))
    assert model.stage == stage and model.n == len(SIZES) * sum(NODES) * 20
    assert model.overhead == pytest.approx(a, abs=0.1)
    assert model.gamma == pytest.approx(gamma, abs=0.1)
    assert model.gamma_fixed == pytest.approx(0.0, abs=0.1)
    assert model.fixed(8) == pytest.approx(a, abs=0.1)
    assert model.bandwidth.family == "lognormal"        # best by AIC of the three
    fitted_mu, fitted_sigma = model.bandwidth.params
    assert fitted_mu == pytest.approx(mu, abs=0.1)      # median bandwidth within ~10%
    assert fitted_sigma == pytest.approx(sigma, abs=0.05)
    assert model.log_params[0] == pytest.approx(mu, abs=0.1)
    assert model.log_params[1] == pytest.approx(sigma, abs=0.05)
    assert model.ks < 0.05
    assert {f.family for f in model.fits} == {"lognormal", "gamma", "weibull"}
    assert [f.aic for f in model.fits] == sorted(f.aic for f in model.fits)


def test_fit_stage_recovers_a_fixed_cost_growing_with_the_node_count():
    rng = np.random.default_rng(14)
    model = fit_stage(generate(rng, "flush", gamma_fixed=0.5))
    assert model.gamma_fixed == pytest.approx(0.5, abs=0.1)
    assert model.gamma == pytest.approx(0.6, abs=0.1)
    assert model.fixed(8) == pytest.approx(0.4 * 8 ** 0.5, rel=0.15)


def test_fit_stage_splits_the_spread_into_common_and_node_parts():
    """log B = mu + 0.25 Z_ckpt + 0.3 Z_node: the within-checkpoint spread is the nodes'."""
    rng = np.random.default_rng(13)
    _a, _gamma, mu, sigma = TRUTH["flush"]
    model = fit_stage(generate(rng, "flush", checkpoints=40, common=0.25))
    fitted_mu, node, common = model.log_params
    assert fitted_mu == pytest.approx(mu, abs=0.2)
    assert node == pytest.approx(sigma, abs=0.03)
    assert common == pytest.approx(0.25, abs=0.05)
    independent = fit_stage(generate(rng, "flush", checkpoints=40))
    assert independent.log_params[1] == pytest.approx(sigma, abs=0.03)
    assert independent.log_params[2] < 0.12         # common variance < 1/6 of the nodes'
    alone = fit_stage(generate(rng, "flush", nodes=(1,), common=0.25))
    assert alone.log_params[2] == 0.0               # no two nodes of one checkpoint: all node


@pytest.mark.parametrize("nodes", [2, 8])
def test_a_common_spread_matches_the_max_over_nodes_sharing_it(nodes):
    common = {"capture": 0.2, "replicate": 0.3}
    model = SystemModel({s: known(s, common[s]) for s in common}, {"replicated": 0.05})
    size = nodes * 600 * MB
    rng = np.random.default_rng(nodes)
    for level, stages, c in (("captured", ["capture"], 0.0),
                             ("replicated", ["capture", "replicate"], 0.05)):
        prediction = model.predict(level, "peer", size, nodes)
        observed = c + simulate(rng, stages, size / nodes, nodes, common=common)
        for q in (0.05, 0.5, 0.95):
            assert prediction.quantile(q) == pytest.approx(np.quantile(observed, q),
                                                           rel=0.05), (level, q)
    # without the common part the spread of the checkpoint's time is much narrower
    apart = SystemModel({"capture": known("capture")}, {}).predict("captured", "peer", size,
                                                                 nodes)
    shared = model.predict("captured", "peer", size, nodes)
    assert (shared.quantile(0.95) - shared.quantile(0.05)
            > 1.3 * (apart.quantile(0.95) - apart.quantile(0.05)))


def test_fit_stage_with_one_size_and_node_count_has_no_overhead():
    rng = np.random.default_rng(12)
    model = fit_stage(generate(rng, "flush", sizes=(400 * MB,), nodes=(4,)))
    assert model.overhead == 0.0 and model.gamma == 0.0
    # the overhead folds into the bandwidth: median of s / t, exactly the data's
    samples = generate(np.random.default_rng(12), "flush", sizes=(400 * MB,), nodes=(4,))
    bandwidth = np.array([s.bytes / s.seconds for s in samples])
    assert model.bandwidth.ppf(0.5) == pytest.approx(np.median(bandwidth), rel=0.05)


def test_fit_stage_needs_three_samples():
    few = generate(np.random.default_rng(1), "capture", sizes=(MB,), nodes=(1,), checkpoints=2)
    assert fit_stage(few) is None
    assert fit_stage(few + few[:1]) is not None


@pytest.mark.parametrize("nodes", [1, 2, 4, 8])
def test_one_stage_quantile_is_the_closed_form_and_the_max_over_nodes(nodes):
    model = SystemModel({"capture": known("capture")}, {"captured": 0.125})
    a, gamma, mu, sigma = TRUTH["capture"]
    size = nodes * 800 * MB
    part = size / nodes
    bandwidth = stats.lognorm(s=sigma, scale=math.exp(mu))
    prediction = model.predict("captured", "peer", size, nodes)
    observed = simulate(np.random.default_rng(nodes), ["capture"], part, nodes) + 0.125
    for q in (0.5, 0.9, 0.95, 0.99):
        closed = 0.125 + a + part * nodes ** gamma / bandwidth.ppf(1 - q ** (1 / nodes))
        assert prediction.quantile(q) == pytest.approx(closed, rel=1e-9)
        assert prediction.cdf(closed) == pytest.approx(q, rel=1e-9)
        assert prediction.quantile(q) == pytest.approx(np.quantile(observed, q), rel=0.03)
    assert float(prediction.cdf(0.125 + a)) == 0.0          # never before the fixed costs


@pytest.mark.parametrize("nodes", [2, 8])
def test_two_stage_level_matches_the_max_over_nodes_of_sums(nodes):
    model = SystemModel({s: known(s) for s in TRUTH}, {})
    size = nodes * 500 * MB
    rng = np.random.default_rng(100 + nodes)
    for level, stages in (("replicated", ["capture", "replicate"]),
                          ("flushed", ["capture", "replicate", "flush"])):
        prediction = model.predict(level, "peer", size, nodes, samples=8000)
        assert prediction.shift == pytest.approx(sum(TRUTH[s][0] for s in stages))
        observed = simulate(rng, stages, size / nodes, nodes)
        for q in (0.5, 0.95):
            assert prediction.quantile(q) == pytest.approx(np.quantile(observed, q), rel=0.05)
    direct = model.predict("flushed", "direct", size, nodes, samples=8000)
    observed = simulate(rng, ["capture", "flush"], size / nodes, nodes)
    assert direct.quantile(0.5) == pytest.approx(np.quantile(observed, 0.5), rel=0.05)


def test_fitted_model_predicts_a_new_checkpoint_within_five_percent():
    """Fit from samples, predict a size and node count in the range: the full chain."""
    rng = np.random.default_rng(21)
    model = SystemModel({s: fit_stage(generate(rng, s), families=("lognormal",))
                         for s in TRUTH}, {})
    nodes, size = 4, 4 * 700 * MB
    observed = simulate(rng, ["capture", "replicate", "flush"], size / nodes, nodes)
    prediction = model.predict("flushed", "peer", size, nodes)
    for q in (0.5, 0.95):
        assert prediction.quantile(q) == pytest.approx(np.quantile(observed, q), rel=0.05)


def test_level_stages_per_path():
    assert level_stages("captured", "direct") == ("capture",)
    assert level_stages("replicated", "peer") == ("capture", "replicate")
    assert level_stages("flushed", "peer") == ("capture", "replicate", "flush")
    assert level_stages("flushed", "direct") == ("capture", "flush")
    with pytest.raises(OperationError, match="never reaches level replicated"):
        level_stages("replicated", "direct")
    with pytest.raises(OperationError, match="unknown level/path"):
        level_stages("written", "peer")
    with pytest.raises(OperationError, match="unknown level/path"):
        level_stages("flushed", "carrier-pigeon")
    model = SystemModel({"capture": known("capture")}, {})
    with pytest.raises(OperationError, match="no flush samples"):
        model.predict("flushed", "direct", MB, 1)
    with pytest.raises(OperationError, match="size > 0"):
        model.predict("captured", "peer", 0, 1)


def fitted_system(rng) -> SystemModel:
    stages = {s: fit_stage(generate(rng, s, checkpoints=5)) for s in TRUTH}
    return SystemModel(stages, {"captured": 0.01, "flushed": 0.5}, period=60.0, size=2e9,
                       nodes=4, counts={s: m.n for s, m in stages.items()})


def test_model_json_round_trip_and_file(tmp_path):
    model = fitted_system(np.random.default_rng(5))
    again = SystemModel.from_json(json.loads(json.dumps(model.to_json())))
    assert again.overheads == model.overheads and again.counts == model.counts
    assert (again.period, again.size, again.nodes) == (60.0, 2e9, 4)
    for name, stage in model.stages.items():
        assert again.stages[name] == stage
    qs = np.array([0.1, 0.5, 0.95, 0.999])
    for level, path in (("captured", "peer"), ("flushed", "direct")):
        one = model.predict(level, path, 3e9, 4, samples=4000)
        two = again.predict(level, path, 3e9, 4, samples=4000)
        assert np.array_equal(one.ppf(qs), two.ppf(qs))
    model.save(tmp_path / "model.json")
    loaded = SystemModel.load(tmp_path / "model.json")
    assert loaded.to_json() == model.to_json()
    with pytest.raises(OperationError, match="no such model file"):
        SystemModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(OperationError, match="not a valid model file"):
        SystemModel.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    with pytest.raises(OperationError, match="not a cachex model"):
        SystemModel.load(tmp_path / "other.json")


def test_fit_system_recovers_the_coordinator_overhead():
    """Level latency = the slowest node's stage sum + c_L (+ a little jitter)."""
    rng = np.random.default_rng(8)
    nodes, part, c_captured, c_flushed = 4, 250 * MB, 0.02, 0.7
    history = History()
    for k in range(24):
        ckpt, path = f"s{k}", ("direct" if k % 3 == 0 else "peer")
        stages = ["capture", "flush"] if path == "direct" else list(TRUTH)
        sums = {"captured": [], "flushed": []}
        for node in range(nodes):
            times = {}
            for stage in stages:
                a, gamma, mu, sigma = TRUTH[stage]
                times[stage] = a + part * nodes ** gamma / rng.lognormal(mu, sigma)
                history.stages.append(StageSample("r", ckpt, node, nodes, stage, int(part),
                                                  times[stage], 0.0, path))
            sums["captured"].append(times["capture"])
            sums["flushed"].append(sum(times.values()))
        for level, c in (("captured", c_captured), ("flushed", c_flushed)):
            latency = max(sums[level]) + c + rng.uniform(-0.005, 0.005)
            history.levels.append(LevelSample("r", ckpt, k + 1, nodes, level,
                                              int(part * nodes), latency, 60.0 * k, path))
    # a checkpoint missing a node's samples says nothing about c_L
    history.levels.append(LevelSample("r", "lost", 99, nodes, "flushed", 1, 500.0, 1e6,
                                      "peer"))
    model = fit_system(history, families=("lognormal",))
    assert model.overheads["captured"] == pytest.approx(c_captured, abs=0.006)
    assert model.overheads["flushed"] == pytest.approx(c_flushed, abs=0.006)
    assert "replicated" not in model.overheads
    assert model.period == 60.0 and model.nodes == nodes and model.size == part * nodes
    assert model.counts == {"write": 0, "capture": 24 * nodes, "replicate": 16 * nodes,
                            "flush": 24 * nodes}
    assert set(model.stages) == {"capture", "replicate", "flush"}
    with pytest.raises(OperationError, match="no stage samples"):
        fit_system(History())


def test_node_level_samples_take_the_place_of_the_stage_sum():
    """A node's own time to `flushed` on the peer path includes a wait (the flush queued
    2 s behind the replication): the stage sum misses it, the node levels do not."""
    rng = np.random.default_rng(9)
    nodes, part, wait, c_flushed = 4, 250 * MB, 2.0, 0.3

    def node_times(count):
        times = {}
        for stage in TRUTH:
            a, gamma, mu, sigma = TRUTH[stage]
            times[stage] = a + part * nodes ** gamma / rng.lognormal(mu, sigma, count)
        return times, sum(times.values()) + wait

    history = History()
    for k in range(40):
        ckpt = f"s{k}"
        times, whole = node_times(nodes)
        for node in range(nodes):
            for stage in TRUTH:
                history.stages.append(StageSample("r", ckpt, node, nodes, stage, int(part),
                                                  times[stage][node], 0.0, "peer"))
            history.stages.append(StageSample("r", ckpt, node, nodes, "flushed:peer",
                                              int(part), whole[node], 0.0, "peer"))
        history.levels.append(LevelSample("r", ckpt, k + 1, nodes, "flushed",
                                          int(part * nodes), whole.max() + c_flushed,
                                          60.0 * k, "peer"))
    model = fit_system(history, families=("lognormal",))
    assert "flushed:peer" in model.stages and "flushed:direct" not in model.stages
    assert model.overheads["flushed"] == pytest.approx(c_flushed, abs=1e-9)
    _, whole = node_times((40_000, nodes))
    observed = whole.max(axis=1) + c_flushed
    prediction = model.predict("flushed", "peer", part * nodes, nodes)
    for q in (0.5, 0.9):
        assert prediction.quantile(q) == pytest.approx(np.quantile(observed, q), rel=0.05)
    summed = SystemModel({s: model.stages[s] for s in TRUTH}, model.overheads)
    assert summed.predict("flushed", "peer", part * nodes, nodes).quantile(0.5) < (
        np.quantile(observed, 0.5) - 0.8 * wait)
