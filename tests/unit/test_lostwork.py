"""Lost work replayed on observed level times, against the durability model's E[L]
(model/durability.py) where the answer is known, and against a failure-by-failure
count."""

from __future__ import annotations

import numpy as np
import pytest

from cachex_agent.model.durability import expected_lost_work
from cachex_agent.model.lostwork import Observed, mean_period, replayed_loss
from cachex_agent.model.plan import survival


def periodic(period: float, lags: list[float], count: int = 400) -> list[Observed]:
    return [Observed(f"step_{i}", i * period, {"crash": i * period + lags[i % len(lags)]})
            for i in range(count)]


def by_hand(checkpoints: list[Observed], failure: float) -> float:
    return failure - max(o.origin for o in checkpoints if o.safe["crash"] <= failure)


@pytest.mark.parametrize("period, lag", [(10.0, 3.0), (10.0, 15.0), (4.0, 9.5)])
def test_a_constant_lag_loses_half_a_period_plus_the_lag(period, lag):
    """E[L] = T/2 + D for a constant D, also when D spans several periods."""
    checkpoints = periodic(period, [lag])
    measured = replayed_loss(checkpoints, "crash")
    assert measured == pytest.approx(period / 2 + lag, rel=0.02)
    model = expected_lost_work(survival(np.array([lag])), period)
    assert measured == pytest.approx(model, rel=0.02)


def test_varying_lags_match_the_model_of_their_distribution():
    lags = list(np.random.default_rng(3).lognormal(np.log(6.0), 0.6, 97))
    checkpoints = periodic(5.0, lags, count=2000)
    model = expected_lost_work(survival(np.array(lags)), 5.0)
    assert replayed_loss(checkpoints, "crash", count=50_000) == pytest.approx(model, rel=0.03)


def test_each_failure_counts_from_the_newest_checkpoint_safe_by_then():
    """A later checkpoint that became safe before an earlier one (its replication was
    quicker) counts: what matters is the newest state that was safe."""
    checkpoints = [Observed("a", 0.0, {"crash": 1.0}), Observed("b", 10.0, {"crash": 30.0}),
                   Observed("c", 20.0, {"crash": 22.0}), Observed("d", 30.0, {"crash": 31.0})]
    assert by_hand(checkpoints, 25.0) == 5.0        # c, not a: b is not safe yet
    rng = np.random.default_rng(1)
    failures = rng.uniform(1.0, 30.0, 4000)
    expected = np.mean([by_hand(checkpoints, f) for f in failures])
    assert replayed_loss(checkpoints, "crash", count=4000, seed=1) == pytest.approx(expected)
    assert mean_period(checkpoints) == 10.0


def test_too_short_a_run_is_refused():
    with pytest.raises(ValueError, match="two checkpoints"):
        replayed_loss(periodic(10.0, [1.0], count=1), "crash")
    with pytest.raises(ValueError, match="no steady part"):
        replayed_loss(periodic(10.0, [50.0], count=3), "crash")


def test_observed_takes_the_write_start_and_each_class_level_of_the_path():
    from cachex_agent.model.history import History, LevelSample, StageSample
    from cachex_agent.model.lostwork import observed

    def level(ckpt: str, name: str, latency: float, path: str) -> LevelSample:
        return LevelSample("r", ckpt, 1, 2, name, 100, latency, 50.0, path)

    history = History(
        stages=[StageSample("r", "s1", n, 2, "write", 50, w, 50.0, "peer")
                for n, w in ((0, 1.0), (1, 2.5))],
        levels=[level("s1", "captured", 0.5, "peer"), level("s1", "replicated", 2.0, "peer"),
                level("s1", "flushed", 4.0, "peer"), level("s2", "captured", 0.5, "direct"),
                level("s2", "flushed", 3.0, "direct"), level("s3", "captured", 1.0, "peer")])
    found = observed(history)
    assert [o.ckpt for o in found] == ["s1", "s2"]          # s3 never replicated
    s1, s2 = found
    assert s1.origin == 47.5                                # the slower node's write
    assert s1.safe == {"crash": 50.5, "node": 52.0, "job": 54.0}
    assert s2.safe == {"crash": 50.5, "node": 53.0, "job": 53.0}   # direct: flushed
    assert observed(history, ["s2"]) == [s2]
