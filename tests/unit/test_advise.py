"""`cachex advise`: the save interval's optimum against Young/Daly's closed form where they
hold (one level, durable when the write returns), the failure rates and their sources,
and what the advice says of its own inputs."""

from __future__ import annotations

import json
import math
import stat
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from cachex_agent import config as configuration
from cachex_agent.cli import main_group
from cachex_agent.errors import ConfigError, OperationError
from cachex_agent.metrics import MetricsFile
from cachex_agent.model.advice_store import load_advice, save_advice
from cachex_agent.model.advise import Losses, advise, keep_up_notes, option
from cachex_agent.model.durability import exact_lost_work, expected_lost_work
from cachex_agent.model.plan import CLASSES, HOUR, Rates, survival
from cachex_agent.model.predict import fit_system
from cachex_agent.model.protection import Protection
from cachex_agent.model.rates import (
    Exposure,
    combine,
    exposure,
    failure_rates,
    read_failures,
    record_failure,
)
from cachex_agent.outputs import problems
from tests.unit.test_report import synthetic

pytestmark = pytest.mark.timeout(120)

NODES = 1
SHIELD = Protection.of(configuration.Peer(), NODES)


def single_level(stall: float, lag: float | None = None) -> Losses:
    """Every failure kind survived once the level holds, `lag` after the save starts (by
    default when the blocking write returns: the setting of Young and Daly)."""
    held = np.full(2000, stall if lag is None else lag)
    return Losses(stall, {c: held for c in CLASSES}, "direct")


@pytest.mark.parametrize("stall, rate", [(0.5, 0.05), (5.0, 0.2), (60.0, 1.0), (2.0, 0.01)])
def test_the_single_level_optimum_is_young_and_daly(stall, rate):
    """W(T) = C/T + lambda (T/2 + C): the optimum T (save start to save start) is Young's
    sqrt(2 C mu), and the compute between saves, T - C, Daly's first order sqrt(2 C mu) - C."""
    interval, waste = single_level(stall).best(Rates(rate, 0.0, 0.0), NODES, SHIELD)
    mu = HOUR / rate
    young = math.sqrt(2 * stall * mu)
    assert interval == pytest.approx(young, rel=0.01)
    assert interval - stall == pytest.approx(young - stall, rel=0.01)     # Daly's tau
    assert waste == pytest.approx(math.sqrt(2 * stall / mu) + stall / mu, rel=1e-3)


def test_rates_of_every_kind_add_up_in_the_closed_form():
    rates = Rates(crash=0.05, node=0.01, job=0.02)          # per node-hour: x 8 nodes
    shield = Protection.of(configuration.Peer(), 8)
    losses = Losses(2.0, {c: np.full(2000, 2.0) for c in CLASSES}, "direct")
    interval, _ = losses.best(rates, 8, shield)
    total = (0.05 + 8 * 0.01 + 0.02) / HOUR
    assert interval == pytest.approx(math.sqrt(2 * 2.0 / total), rel=0.01)


def test_a_durability_lag_costs_its_length_per_failure_and_leaves_the_optimum():
    """D < T: E[L] = T/2 + D, so the lag adds lambda D to the waste at every T."""
    rates = Rates(0.1, 0.0, 0.0)
    quick, slow = single_level(1.0), single_level(1.0, lag=20.0)
    t_quick, w_quick = quick.best(rates, NODES, SHIELD)
    t_slow, w_slow = slow.best(rates, NODES, SHIELD)
    assert t_slow == pytest.approx(t_quick, rel=0.01)
    assert w_slow - w_quick == pytest.approx(0.1 / HOUR * 19.0, rel=0.02)


def test_with_spread_lags_the_optimum_is_the_grid_minimum():
    rng = np.random.default_rng(5)
    lags = {"crash": 0.5 + rng.lognormal(0, 0.5, 4000),
            "node": 2.0 + rng.lognormal(1, 0.8, 4000),
            "job": 10.0 + rng.lognormal(2, 1.0, 4000)}
    losses = Losses(0.8, lags, "direct")
    rates = Rates(0.5, 0.05, 0.2)
    interval, waste = losses.best(rates, 4, Protection.of(configuration.Peer(), 4))
    grid = np.geomspace(interval / 3, interval * 3, 61)
    dense = [losses.waste(t, rates, 4, Protection.of(configuration.Peer(), 4)) for t in grid]
    assert waste <= min(dense) * 1.0005
    assert grid[int(np.argmin(dense))] == pytest.approx(interval, rel=0.05)


def test_no_failures_means_saving_seldom():
    interval, _ = single_level(1.0).best(Rates(0.0, 0.0, 0.0), NODES, SHIELD)
    assert interval >= 24 * HOUR


# ------------------------------------------------------------------------- rates
def test_rates_only_from_the_configuration_keep_it_with_a_wide_interval():
    r = combine("crash", 0.05, True, 0, 0, 0.0)
    assert r.rate == pytest.approx(0.05)
    # Gamma(1, 1/0.05): the 5% and 95% quantiles of an exponential of mean 0.05
    assert r.low == pytest.approx(-0.05 * math.log(0.95), rel=1e-6)
    assert r.high == pytest.approx(-0.05 * math.log(0.05), rel=1e-6)
    assert r.from_defaults_only and "site default model.crash_rate = 0.05" in r.source()


def test_a_long_history_outweighs_the_configuration():
    r = combine("job", 0.01, True, 40, 0, 1000.0)
    assert r.rate == pytest.approx(41 / 1100.0)
    assert r.low < 0.04 < r.high and r.high / r.low < 2
    assert not r.from_defaults_only


def test_drills_are_shown_and_left_out_and_node_losses_count_each_node():
    cfg = configuration.load(None, {"paths.spool": "-spool", "paths.pfs": "-pfs",
                                    "model.node_rate": "0.002"})
    records = [{"kind": "node", "lost": 2}, {"kind": "node", "lost": 1, "drill": True},
               {"kind": "crash"}]
    rates = failure_rates(cfg.model, records, Exposure(hours=10.0, node_hours=80.0))
    node = rates["node"]
    assert (node.failures, node.drills, node.exposure) == (2, 1, 80.0)
    assert not node.default and node.rate == pytest.approx(3 / (500 + 80))
    assert "configured model.node_rate = 0.002 per node-hour, MTBF 500 h" in node.source()
    assert "1 drill(s) excluded" in node.source()
    assert rates["crash"].failures == 1 and rates["crash"].exposure == 10.0


def test_recorded_failures_append_privately_and_a_torn_line_is_named(tmp_path):
    path = tmp_path / "run" / "failures.jsonl"
    record_failure(path, "node", 2, drill=False)
    record_failure(path, "crash", 1, drill=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [(r["kind"], r["lost"], r["drill"]) for r in read_failures(path)] == [
        ("node", 2, False), ("crash", 1, True)]
    with path.open("a") as handle:
        handle.write('{"kind": "nod')
    with pytest.raises(OperationError, match=r"failures.jsonl:3: not a failure record"):
        read_failures(path)
    with pytest.raises(ConfigError, match="--record: 'disk'"):
        record_failure(path, "disk", 1, drill=False)


def test_exposure_is_each_agents_own_time_between_its_starts(tmp_path):
    events = tmp_path / "events.jsonl"
    lines = [{"event": "agent_start", "t": 0.0}, {"event": "x", "t": 3600.0},
             {"event": "agent_start", "t": 90000.0}, {"event": "x", "t": 91800.0}]
    other = [{"event": "agent_start", "t": 5.0, "node": 1}, {"event": "x", "t": 1805.0,
                                                            "node": 1}]
    events.write_text("".join(json.dumps({"run": "r", "node": 0, **e}) + "\n"
                              for e in lines)
                      + "".join(json.dumps({"run": "r", **e}) + "\n" for e in other))
    seen = exposure([events])
    assert seen.hours == pytest.approx(1.5)             # the gap between jobs not counted
    assert seen.node_hours == pytest.approx(2.0)


# ----------------------------------------------------------------- the advice itself
def default_config(**sets: str):
    return configuration.load(None, {"paths.spool": "-spool", "paths.pfs": "-pfs", **sets})


def test_the_advice_of_a_run_names_its_inputs_and_beats_a_habitual_interval():
    history = synthetic(checkpoints=30, nodes=2)
    model = fit_system(history)
    cfg = default_config()
    rates = failure_rates(cfg.model, [], Exposure(0.1, 0.2))
    advice = advise(model, history, cfg, model.size, model.nodes, 10.0, rates)
    assert advice.tier.waste_advised < advice.tier.waste_now
    assert advice.tier.range[0] < advice.tier.interval < advice.tier.range[1]
    assert advice.direct is not None and advice.direct.losses.stall > advice.tier.losses.stall
    assert 1.0 <= advice.independent <= 2.0
    assert any("site defaults only" in n for n in advice.notes)
    data = advice.to_json()
    assert data["protects"] == {"crash": "captured", "node": "replicated", "job": "flushed"}
    assert problems("advise", {"schema": 1, **data}) == []
    assert json.loads(json.dumps(data)) == data


def test_levels_slower_than_the_advised_interval_are_said():
    slow = Losses(0.1, {"crash": np.full(100, 1.0), "node": np.full(100, 50.0),
                        "job": np.full(100, 80.0)}, "peer")
    rates = {k: combine(k, 0.05, True, 0, 0, 0.0) for k in CLASSES}
    shown = option("tier", slow, 30.0, rates, 4, Protection.of(configuration.Peer(), 4))
    fast = Losses(0.1, {c: np.full(100, 0.5) for c in CLASSES}, "peer")
    lines = keep_up_notes(replace(shown, interval=30.0), 1)
    assert any(line.startswith("replicated cannot keep up") for line in lines)
    assert any(line.startswith("flushed cannot keep up") for line in lines)
    assert keep_up_notes(replace(shown, losses=fast), 1) == []


def test_advice_file_round_trip_and_status_never_fails_on_it(tmp_path):
    cfg = default_config(**{"paths.pfs": str(tmp_path)})
    assert save_advice(cfg, {"advised_interval": 5.0}) is None      # no <pfs>/<run>/ yet
    assert load_advice(cfg) is None
    (tmp_path / cfg.run).mkdir()
    written = save_advice(cfg, {"advised_interval": 5.0})
    assert written is not None and stat.S_IMODE(written.stat().st_mode) == 0o600
    assert load_advice(cfg) == {"advised_interval": 5.0}
    written.write_text("{torn")
    assert load_advice(cfg) is None


def write_events(path, checkpoints: int = 12, nodes: int = 2, part: int = 8 << 20) -> None:
    """Events as the agents and the coordinator write them: a save every 10 s, each
    stage's time drawn."""
    rng = np.random.default_rng(3)
    lines = [{"event": "agent_start", "node": n, "nodes": nodes, "t": 0.0}
             for n in range(nodes)]
    for k in range(checkpoints):
        ckpt, commit = f"step_{k:05d}", 100.0 + 10.0 * k
        done = {"captured": [], "replicated": [], "flushed": []}
        lines.append({"event": "committed", "ckpt": ckpt, "path": "peer", "nodes": nodes,
                      "t": commit, "node": 0, "seq": k})
        for n in range(nodes):
            capture, replicate, flush = rng.lognormal(np.log([0.2, 0.4, 0.6]), 0.2)
            captured = commit + capture
            lines += [{"event": "captured", "ckpt": ckpt, "node": n, "bytes": part,
                       "duration": capture, "write_start": commit - rng.uniform(0.2, 0.3),
                       "committed_at": commit, "t": captured},
                      {"event": "replicate_start", "ckpt": ckpt, "node": n, "t": captured},
                      {"event": "replicated", "ckpt": ckpt, "node": n, "bytes": part,
                       "t": captured + replicate},
                      {"event": "flushed", "ckpt": ckpt, "node": n, "bytes": part,
                       "duration": flush, "t": captured + replicate + flush}]
            for level, t in zip(done, (captured, captured + replicate,
                                       captured + replicate + flush), strict=True):
                done[level].append(t)
        lines += [{"event": f"level_{level}", "ckpt": ckpt, "node": 0, "seq": k,
                   "bytes": part * nodes, "latency": max(ts) - commit, "t": max(ts)}
                  for level, ts in done.items()]
    path.write_text("".join(json.dumps({"run": "r", **e}) + "\n" for e in lines))


def test_the_command_prints_the_advice_and_the_job_line(tmp_path):
    history_dir = tmp_path / "events"
    history_dir.mkdir()
    write_events(history_dir / "events.jsonl")
    result = CliRunner().invoke(main_group, ["advise", str(history_dir), "--period", "10s"])
    assert result.exit_code == 0, result.output
    assert "failure rates (90% interval)" in result.output
    assert result.output.strip().splitlines()[-1].startswith("cachex advise: save every")
    as_json = CliRunner().invoke(main_group, ["advise", str(history_dir), "--json"])
    assert as_json.exit_code == 0 and problems("advise", json.loads(as_json.output)) == []
    bad = subprocess.run([sys.executable, "-c", "from cachex_agent.cli import main; main()",
                          "advise", str(history_dir), "--record", "node"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("cachex: error: --record: the run's PFS directory")
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("period", [0.7, 3.0, 40.0])
def test_the_exact_lost_work_agrees_with_the_fine_trapezoid(period):
    """Lags spanning several periods: terms beyond the first count."""
    lags = 0.5 + np.random.default_rng(8).lognormal(0.5, 0.8, 3000)
    exact = exact_lost_work(lags, period)
    fine = expected_lost_work(survival(lags), period, points=40_000)
    assert exact == pytest.approx(fine, rel=2e-4)
    assert exact > period / 2 + np.mean(np.minimum(lags, period)) - 1e-9


def test_the_metrics_carry_the_advice_from_the_status(tmp_path):
    history = synthetic(checkpoints=20, nodes=2)
    model = fit_system(history)
    cfg = default_config()
    rates = failure_rates(cfg.model, [], Exposure(0.1, 0.2))
    data = advise(model, history, cfg, model.size, model.nodes, 10.0, rates).to_json()
    text = MetricsFile(tmp_path / "m.prom", "r").text({"advice": data, "checkpoints": []}, {})
    assert (f'cachex_advised_interval_seconds{{run="r",path="tier"}}'
            f' {data["tier"]["interval"]!r}') in text
    assert 'cachex_expected_waste_seconds_per_hour{run="r",path="direct_to_pfs",interval="now"}' \
        in text
    assert (f'cachex_failure_rate{{run="r",kind="node"}} {data["rates"]["node"]["rate"]!r}'
            in text)
    assert "cachex_advised_interval" not in MetricsFile(tmp_path / "m.prom", "r").text(
        {"checkpoints": []}, {})


@pytest.mark.parametrize("period, lag", [(30.0, 2.0), (30.0, 70.0)])
def test_the_benchmarks_replay_loses_half_a_period_plus_the_lag(period, lag):
    """benchmarks/advice.py: constant lags D, every failure loses T/2 + D on average (D
    spanning two periods too), and the blocked time comes once per save."""
    from advice import replay
    stall = np.full(7, 1.5)
    lags = {c: np.full(7, lag) for c in CLASSES}
    rates = {"crash": 2.0, "node": 0.0, "job": 1.0}
    waste = replay(stall, lags, period, rates, failures=40_000, seed=3)
    expected = 1.5 / period + 3.0 * (period / 2 + lag) / HOUR
    assert waste == pytest.approx(expected, rel=0.01)
