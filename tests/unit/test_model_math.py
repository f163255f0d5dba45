"""The durability model's mathematics against closed forms and Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from cachex_agent.errors import OperationError
from cachex_agent.model.distributions import Fit, best_fit, fit
from cachex_agent.model.durability import cdf_of_max, expected_lost_work, quantile_of_max
from cachex_agent.model.plan import Rates, evaluate, make_plan
from cachex_agent.model.predict import SystemModel
from cachex_agent.model.stages import StageModel

RNG = np.random.default_rng(7)


@pytest.mark.parametrize("nodes", [1, 4, 64])
def test_quantile_of_the_max_of_n_lognormals_matches_monte_carlo(nodes):
    dist = stats.lognorm(s=0.4, scale=2.0)
    samples = dist.rvs(size=(20_000, nodes), random_state=RNG).max(axis=1)
    for q in (0.5, 0.9, 0.99):
        predicted = quantile_of_max(dist.ppf, q, nodes)
        assert predicted == pytest.approx(np.quantile(samples, q), rel=0.03)
        assert cdf_of_max(dist.cdf, np.array([predicted]), nodes)[0] == pytest.approx(q)


def test_lost_work_is_half_period_plus_mean_delay_when_durable_within_a_period():
    period = 60.0
    fixed = expected_lost_work(lambda t: (t < 12.0).astype(float), period, points=20_001)
    assert fixed == pytest.approx(period / 2 + 12.0, rel=1e-3)
    uniform = stats.uniform(loc=6.0, scale=30.0)              # D in [6, 36) < T, E[D] = 21
    value = expected_lost_work(uniform.sf, period)
    assert value == pytest.approx(period / 2 + 21.0, rel=1e-3)


def test_lost_work_matches_a_simulation_when_durability_can_take_longer_than_a_period():
    period, dist = 10.0, stats.lognorm(s=0.8, scale=8.0)     # often longer than T
    cdf_n = lambda t: dist.cdf(t) ** 4                        # noqa: E731 (4 nodes)
    predicted = expected_lost_work(lambda t: 1.0 - cdf_n(t), period)
    checkpoints = 200_000
    delays = dist.rvs(size=(checkpoints, 4), random_state=RNG).max(axis=1)
    durable_at = np.arange(1, checkpoints + 1) * period + delays
    fail = RNG.uniform(100 * period, (checkpoints - 100) * period, size=20_000)
    # the work since the newest checkpoint k*T <= fail that was durable by then
    lost = []
    for t in fail:
        k = int(t // period)
        back = 0
        while durable_at[k - 1 - back] > t:
            back += 1
        lost.append(t - (k - back) * period)
    assert predicted == pytest.approx(float(np.mean(lost)), rel=0.03)


@pytest.mark.parametrize("family,dist", [
    ("lognormal", stats.lognorm(s=0.5, scale=3.0)),
    ("weibull", stats.weibull_min(1.8, scale=4.0)),
    ("gamma", stats.gamma(6.0, scale=0.5)),
])
def test_fits_recover_the_family_and_parameters(family, dist):
    data = dist.rvs(size=4000, random_state=RNG)
    ranked = best_fit(data)
    assert ranked[0].family == family
    best = ranked[0]
    assert best.mean() == pytest.approx(dist.mean(), rel=0.05)
    assert best.ks(data) < 0.03
    assert best.aic < ranked[-1].aic and best.bic == pytest.approx(
        best.aic - 4 + 2 * np.log(len(data)))


def test_fit_rejects_bad_data():
    with pytest.raises(OperationError, match="at least 3"):
        fit([1.0, 2.0], "lognormal")
    with pytest.raises(OperationError, match="positive"):
        fit([1.0, 0.0, 2.0], "gamma")
    with pytest.raises(OperationError, match="unknown distribution"):
        fit([1.0, 2.0, 3.0], "cauchy")


# ---------------------------------------------------------------- plan (model/plan.py)
PART = 1e9          # bytes per node in the plan tests


def stage_model(name: str, seconds: float, overhead: float = 0.0, sigma: float = 1e-6
                ) -> StageModel:
    """A stage taking `seconds` (median) for a PART-byte part; sigma 1e-6: deterministic."""
    bandwidth = Fit("lognormal", (math.log(PART / (seconds - overhead)), sigma), 100, 0.0)
    return StageModel(name, overhead, 0.0, (bandwidth,), (bandwidth,), 100, 0.0)


def system(sigma: float = 1e-6, **seconds: float) -> SystemModel:
    return SystemModel({name: stage_model(name, s, sigma=sigma) for name, s in seconds.items()},
                       {})


def test_evaluate_with_a_fixed_lag_is_half_period_plus_lag_per_class():
    """D_c deterministic and < T: E[L_c] = T/2 + D_c; D_c includes the trainer's write."""
    model = SystemModel({"write": stage_model("write", 2.0),
                         "capture": stage_model("capture", 1.0, overhead=0.25),
                         "replicate": stage_model("replicate", 3.0),
                         "flush": stage_model("flush", 20.0, overhead=1.5)}, {"flushed": 0.5})
    nodes, period, rates = 4, 60.0, Rates(crash=0.5, node=0.01, job=0.1)
    per_hour = {"crash": 0.5, "node": 0.04, "job": 0.1}
    lags = {"peer": {"crash": 3.0, "node": 6.0, "job": 26.5},
            "direct": {"crash": 3.0, "node": 23.5, "job": 23.5}}
    for path, lag in lags.items():
        plan = evaluate(model, path, 1, nodes * PART, nodes, period, rates, samples=2000)
        assert plan.name == path and plan.every == 1
        for c in lag:
            assert plan.lag[c] == pytest.approx(lag[c], abs=1e-3), (path, c)
            assert plan.lost[c] == pytest.approx(period / 2 + lag[c], abs=0.1), (path, c)
        assert plan.loss == pytest.approx(sum(per_hour[c] * (period / 2 + lag[c])
                                              for c in lag), rel=1e-3)
        assert plan.loss == pytest.approx(sum(per_hour[c] * plan.lost[c] for c in lag))
        assert plan.excess == pytest.approx(sum(per_hour[c] * lag[c] for c in lag), abs=0.05)
    every = evaluate(model, "peer", 3, nodes * PART, nodes, period, rates, samples=2000)
    assert every.name == "peer, flush every 3" and every.every == 3
    assert every.lost["job"] == pytest.approx(3 * period / 2 + 26.5, abs=0.1)   # period kT
    assert every.lost["node"] == pytest.approx(period / 2 + 6.0, abs=0.1)
    assert every.lost["crash"] == pytest.approx(period / 2 + 3.0, abs=0.1)


def test_evaluate_when_durability_takes_several_periods():
    """A fixed D > T: still T/2 + D (the newest checkpoint issued before t - D holds)."""
    model = system(capture=1.0, flush=150.0)
    plan = evaluate(model, "direct", 1, 2 * PART, 2, 40.0, Rates(0, 0, 1), samples=2000)
    assert plan.lost["job"] == pytest.approx(20.0 + 151.0, abs=0.2)


def test_plan_recommends_direct_when_the_flush_beats_replication():
    rates = Rates(crash=0.05, node=0.001, job=0.01)
    slow_peers = make_plan(system(capture=1.0, replicate=100.0, flush=2.0), 4 * PART, 4,
                           600.0, 5.0, rates)
    assert [p.name for p in slow_peers.paths] == ["peer", "direct", "peer, flush every 2"]
    assert slow_peers.best.path == "direct" and slow_peers.best.lag["node"] == pytest.approx(3.0)


def test_plan_recommends_peer_when_the_flush_is_much_slower():
    rates = Rates(crash=0.05, node=0.001, job=0.01)
    slow_pfs = make_plan(system(capture=1.0, replicate=1.0, flush=290.0), 4 * PART, 4, 60.0,
                         5.0, rates)
    assert slow_pfs.best.name == "peer"
    assert slow_pfs.paths[2].name == "peer, flush every 5"     # ceil(flush 290 s / T 60 s)


def test_plan_without_replication_has_only_the_direct_path():
    rates = Rates(crash=0.05, node=0.001, job=0.01)
    flush_only = make_plan(system(capture=1.0, flush=2.0), PART, 1, 600.0, 5.0, rates)
    assert [p.name for p in flush_only.paths] == ["direct"]


def test_young_and_the_numeric_optimum_with_a_small_lag():
    """waste(T) = C/T + sum_c lambda_c (T/2 + D_c): minimal at sqrt(2C/lambda), Young's."""
    rates, stall, nodes = Rates(crash=0.05, node=0.001, job=0.01), 10.0, 4
    plan = make_plan(system(sigma=0.3, capture=1.0, flush=5.0), nodes * PART, nodes, 600.0,
                     stall, rates)
    total = (0.05 + 0.004 + 0.01) / 3600
    assert plan.young == pytest.approx(math.sqrt(2 * stall / total))
    assert plan.daly == pytest.approx(plan.young - stall)
    # the optimum is searched on a geometric grid (ratio ~1.1): Young within a grid step
    assert plan.young / 1.15 < plan.optimum < plan.young * 1.15
    lost = plan.optimum / 2 + np.array([plan.best.lag["crash"], plan.best.lag["job"]])
    assert plan.optimum_waste == pytest.approx(
        stall / plan.optimum + (0.05 * lost[0] + 0.014 * lost[1]) / 3600, rel=0.02)
    assert make_plan(system(capture=1.0, flush=5.0), PART, 1, 600.0, 0.0, rates).young is None


def simulated_lost_work(rng, period: float, lags: np.ndarray) -> float:
    """Mean work lost at a failure at a uniform time; checkpoint k issued at kT holds at
    kT + lags[k]; the failure loses everything since the newest one that holds."""
    k = np.arange(lags.size)
    holds_at = k * period + lags
    order = np.argsort(holds_at)
    newest = np.maximum.accumulate(k[order])
    fail = rng.uniform(0.1 * lags.size * period, 0.9 * lags.size * period, 20_000)
    held = np.searchsorted(holds_at[order], fail, side="right") - 1
    return float(np.mean(fail - newest[held] * period))


def test_a_long_variable_lag_moves_the_optimum_below_young():
    """Job loss only (1/h), blocking cost C = 10 s: Young says sqrt(2 C / lambda) = 268 s.

    Reasoning: with a fixed lag D, E[L] = T/2 + D for every T, so the optimum is Young's
    whatever D. With a variable lag (log-normal, median 600 s, sigma 1, far longer than
    T), E[L] - T/2 grows with T: from about the shortest lag (T -> 0, some checkpoint in
    flight always makes it early) to E[D] (T >> D). That extra slope makes shorter periods
    pay: the optimum drops below Young's. A simulation of the timeline (independent
    checkpoints, as the model assumes) confirms the waste at the model's optimum and that
    Young's period wastes more."""
    stall, rates = 10.0, Rates(crash=0.0, node=0.0, job=1.0)
    young = math.sqrt(2 * stall * 3600)
    # concurrency 64: flushes of successive checkpoints do not queue (the model's premise)
    plan = make_plan(system(sigma=1.0, capture=1.0, flush=600.0), PART, 1, 600.0, stall, rates,
                     concurrency=64)
    assert plan.optimum < young / 1.4

    rng = np.random.default_rng(17)
    lags = 1.0 + rng.lognormal(math.log(600.0), 1.0, 20_000)

    def waste(period: float) -> float:
        return stall / period + simulated_lost_work(rng, period, lags) / 3600
    at_optimum = waste(plan.optimum)
    assert at_optimum == pytest.approx(plan.optimum_waste, rel=0.03)
    assert waste(young) > 1.03 * at_optimum


def test_a_long_fixed_lag_leaves_the_optimum_at_young():
    """The counterpart: a fixed lag of 601 s (> T) adds a constant D to E[L]."""
    stall, rates = 10.0, Rates(crash=0.0, node=0.0, job=1.0)
    young = math.sqrt(2 * stall * 3600)
    fixed = make_plan(system(capture=1.0, flush=600.0), PART, 1, 600.0, stall, rates,
                      concurrency=64)
    assert fixed.young == pytest.approx(young)
    assert young / 1.15 < fixed.optimum < young * 1.15
    assert fixed.optimum_waste == pytest.approx(stall / fixed.optimum
                                                + (fixed.optimum / 2 + 601.0) / 3600, rel=0.01)


def test_the_optimum_period_lets_the_flush_keep_up():
    """One flush at a time taking 601 s: a shorter period would queue flushes behind each
    other, which E[L] does not model; the plan never recommends it."""
    stall, rates = 10.0, Rates(crash=0.0, node=0.0, job=1.0)
    plan = make_plan(system(capture=1.0, flush=600.0), PART, 1, 600.0, stall, rates)
    assert plan.optimum == pytest.approx(601.0, rel=1e-3)   # Young (268 s) is too short
    assert plan.optimum < math.sqrt(2 * stall * 3600) * 3
