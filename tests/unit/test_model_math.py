"""The durability model's mathematics against closed forms and Monte Carlo."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from cachex_agent.errors import OperationError
from cachex_agent.model.distributions import best_fit, fit
from cachex_agent.model.durability import cdf_of_max, expected_lost_work, quantile_of_max

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
