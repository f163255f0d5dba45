"""When a checkpoint in flight should reach its next levels (forecasts.py): the model's
median and 95% from the coordinator's stage samples, on the coordinator's clock."""

from __future__ import annotations

import pytest

from cachex_agent.config import load
from cachex_agent.forecasts import Forecasts, in_flight
from cachex_agent.model.choose import PathChooser
from cachex_agent.model.stages import MIN_SAMPLES
from cachex_agent.risk import at_risk, risk_lines

pytestmark = pytest.mark.timeout(60)
GB = 10 ** 9
NODES = 2
STAGE_SECONDS = {"capture": 1.0, "replicate": 4.0, "flush": 20.0}


def chooser(path: str = "peer") -> PathChooser:
    cfg = load(None, {"paths.spool": "/x", "paths.pfs": "/y", "model.path": path},
               environ={})
    return PathChooser(cfg, NODES, can_replicate=True)


def fed(c: PathChooser, count: int = 8) -> PathChooser:
    for stage, seconds in STAGE_SECONDS.items():
        for i in range(count):      # a little spread, as real stage times have
            c.observe(stage, f"k{i // NODES}", i % NODES, GB, seconds * (1 + 0.05 * (i % 3)))
    return c


class Lane:
    """The model lane, run when the test says (the coordinator's runs on a thread)."""

    def __init__(self) -> None:
        self.queued: dict = {}

    def offer(self, key, work) -> bool:
        self.queued[key] = work
        return True

    def run(self) -> None:
        queued, self.queued = self.queued, {}
        for work in queued.values():
            work()


def row(seq: int, level: str, written: float = 1000.0, path: str | None = "peer",
        flush: bool = True, size: int = NODES * GB) -> dict:
    return {"id": f"step_{seq:03d}", "seq": seq, "level": level, "bytes": size,
            "flush": flush, "path": path, "times": {"written": written}}


def test_each_level_is_predicted_later_than_the_one_before_from_the_stage_times():
    forecast = fed(chooser()).forecast(NODES * GB, "peer")
    medians = [forecast[level]["median"] for level in ("captured", "replicated", "flushed")]
    assert medians == sorted(medians)
    assert 0.9 < medians[0] < 1.3 and 4.5 < medians[1] < 6.0 and 22 < medians[2] < 30
    for quantiles in forecast.values():
        assert quantiles["p95"] >= quantiles["median"]
    direct = fed(chooser()).forecast(NODES * GB, "direct")
    assert set(direct) == {"captured", "flushed"}
    assert direct["flushed"]["median"] < medians[2]         # no replication before it


def test_no_prediction_before_every_stage_the_path_needs_has_samples():
    c = chooser()
    assert c.forecast(NODES * GB, "peer") is None
    for i in range(MIN_SAMPLES):
        c.observe("capture", "k", i, GB, 1.0)
        c.observe("flush", "k", i, GB, 1.0)
    assert c.forecast(NODES * GB, "peer") is None           # replicate has none
    assert c.forecast(NODES * GB, "direct") is not None
    assert c.forecast(0, "direct") is None


def test_the_lane_computes_the_forecast_and_the_status_shows_the_later_levels_only():
    lane = Lane()
    forecasts = Forecasts(fed(chooser()), lane.offer)
    rows = [row(1, "flushed"), row(2, "captured", written=1000.0),
            row(3, "replicated", flush=False), row(4, "written", path=None, size=0)]
    first = forecasts.annotate([dict(r) for r in rows])
    assert first[1]["predicted"] is None and "predicted" not in first[0]
    assert "predicted" not in first[2]          # replicated and never to be flushed
    assert first[3]["predicted"] is None        # no path chosen yet
    assert list(lane.queued) == [("forecast", "step_002")]
    lane.run()
    second = forecasts.annotate([dict(r) for r in rows])
    predicted = second[1]["predicted"]
    assert set(predicted) == {"replicated", "flushed"}      # it is captured already
    assert 1004.5 < predicted["replicated"]["median"] < 1006.0
    assert not lane.queued                      # same checkpoint, same size: kept


def test_a_written_part_takes_the_size_of_the_last_captured_one_and_gone_ones_are_dropped():
    lane = Lane()
    forecasts = Forecasts(fed(chooser()), lane.offer)
    rows = [row(1, "flushed"), row(2, "written", size=10)]
    forecasts.annotate([dict(r) for r in rows])
    lane.run()
    shown = forecasts.annotate([dict(r) for r in rows])[1]["predicted"]
    assert set(shown) == {"captured", "replicated", "flushed"}
    forecasts.annotate([row(1, "flushed"), row(2, "flushed")])
    assert not forecasts._made                  # nothing kept for a checkpoint at rest


def test_no_model_yet_is_asked_again_once_new_samples_came():
    lane = Lane()
    c = chooser()
    forecasts = Forecasts(c, lane.offer)
    rows = [row(2, "captured")]
    forecasts.annotate([dict(r) for r in rows])
    lane.run()
    assert forecasts.annotate([dict(r) for r in rows])[0]["predicted"] is None
    assert not lane.queued                      # no new samples: not asked again
    fed(c)
    forecasts.annotate([dict(r) for r in rows])
    lane.run()
    assert forecasts.annotate([dict(r) for r in rows])[0]["predicted"] is not None


def test_status_says_when_each_level_is_expected_on_the_coordinators_clock():
    rows = [row(1, "flushed", written=900.0),
            {**row(2, "captured", written=1000.0),
             "predicted": {"replicated": {"median": 1005.0, "p95": 1010.0},
                           "flushed": {"median": 1030.0, "p95": 1100.0}}},
            {**row(3, "written", written=1004.0), "predicted": None}]
    status = {"run": "r", "state": "running", "checkpoints": rows,
              "heartbeat": {"beat": 1, "life": "a", "t": 1007.0, "period": 2.0}}
    risk = at_risk(status)
    assert risk["in_flight"] == [
        {"ckpt": "step_002", "level": "captured",
         "next": {"replicated": {"median": -2.0, "p95": 3.0},
                  "flushed": {"median": 23.0, "p95": 93.0}}},
        {"ckpt": "step_003", "level": "written", "next": None}]
    lines = risk_lines({**status, "at_risk": risk})
    assert lines[3] == ("  step_002 (captured): replicated 2 s overdue (95%: in 3 s);"
                        " flushed in 23 s (95%: in 93 s)")
    assert lines[4].startswith("  step_003 (written): no prediction yet")


def test_in_flight():
    assert in_flight(row(1, "written")) and in_flight(row(1, "captured"))
    assert in_flight(row(1, "replicated")) and not in_flight(row(1, "replicated", flush=False))
    assert not any(in_flight(row(1, level)) for level in ("flushed", "failed", "evicted"))


def test_a_checkpoint_flush_every_leaves_out_is_not_promised_a_flush():
    lane = Lane()
    forecasts = Forecasts(fed(chooser()), lane.offer)
    rows = [row(1, "flushed"), row(2, "captured", flush=False)]
    forecasts.annotate([dict(r) for r in rows])
    lane.run()
    assert set(forecasts.annotate([dict(r) for r in rows])[1]["predicted"]) == {"replicated"}
