"""The coordinator's Prometheus file (metrics.py), read with prometheus-client's own
text parser, as node_exporter's textfile collector would."""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachex_agent.config import load
from cachex_agent.errors import ConfigError
from cachex_agent.metrics import METRICS, MetricsFile, metrics_file

pytestmark = pytest.mark.timeout(20)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "commands.md"


def row(seq: int, level: str, **times: float) -> dict:
    return {"id": f"step_{seq:03d}", "seq": seq, "level": level, "bytes": 4 * 2 ** 20,
            "flush": True, "times": {"written": 1000.0 + seq, **times}}


def status(rows: list[dict], state: str = "running", t: float = 1100.0) -> dict:
    return {"run": "r1", "state": state, "nodes": 4, "checkpoints": rows,
            "heartbeat": {"beat": 7, "life": "a", "t": t, "period": 2.0}}


def parsed(text: str) -> dict[str, dict[tuple, float]]:
    """metric -> {labels other than run, as sorted pairs: value}"""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("run") == "r1"
            out.setdefault(sample.name, {})[tuple(sorted(labels.items()))] = sample.value
    return out


ROWS = [row(10, "flushed", captured=1010.5, replicated=1011.0, flushed=1014.5),
        row(20, "replicated", captured=1020.5, replicated=1022.0),
        row(30, "captured", captured=1031.0), row(40, "failed")]


def test_every_figure_parses_as_prometheus_reads_it():
    got = parsed(MetricsFile(Path("x.prom"), "r1").text(status(ROWS), {"pfs": 2, "model": 0}))
    assert got["cachex_up"] == {(): 1.0}
    assert got["cachex_nodes"] == {(): 4.0}
    assert got["cachex_work_at_risk_seconds"] == {(("loss", "node"),): 80.0,
                                                  (("loss", "allocation"),): 90.0}
    assert got["cachex_newest_checkpoint_seq"] == {(("loss", "node"),): 20.0,
                                                   (("loss", "allocation"),): 10.0}
    assert got["cachex_checkpoints_in_flight"] == {(): 2.0}
    levels = got["cachex_checkpoints"]
    assert levels[(("level", "failed"),)] == 1.0 and levels[(("level", "flushed"),)] == 1.0
    assert got["cachex_checkpoints_failed_total"] == {(): 1.0}
    assert got["cachex_level_latency_seconds"] == {
        (("level", "captured"),): 1.0, (("level", "replicated"),): 2.0,
        (("level", "flushed"),): 4.5}
    assert got["cachex_flush_bandwidth_bytes_per_second"] == {(): 4 * 2 ** 20 / 4.0}
    assert got["cachex_lane_pending"] == {(("lane", "model"),): 0.0, (("lane", "pfs"),): 2.0}


def test_nothing_outlives_a_loss_yet_is_nan_and_stopped_agents_are_down():
    got = parsed(MetricsFile(Path("x.prom"), "r1").text(
        status([row(30, "captured", captured=1031.0)], state="stopped"), {}))
    assert got["cachex_up"] == {(): 0.0}
    assert all(math.isnan(v) for v in got["cachex_work_at_risk_seconds"].values())
    assert "cachex_newest_checkpoint_seq" not in got
    assert "cachex_flush_bandwidth_bytes_per_second" not in got


def test_the_failure_counter_never_goes_down_when_failed_rows_leave_the_status():
    metrics = MetricsFile(Path("x.prom"), "r1")
    metrics.text(status(ROWS), {})
    later = parsed(metrics.text(status([row(50, "failed"), row(60, "flushed")]), {}))
    assert later["cachex_checkpoints_failed_total"] == {(): 2.0}


def test_a_label_value_is_escaped():
    text = MetricsFile(Path("x.prom"), 'r"1\\\n').text(status([]), {})
    names = {s.labels["run"] for f in text_string_to_metric_families(text) for s in f.samples}
    assert names == {'r"1\\\n'}


def test_the_file_is_replaced_whole_and_readable_by_a_collector_of_another_user(tmp_path):
    cfg = load(None, {"paths.spool": "/x", "paths.pfs": "/y",
                      "metrics.path": str(tmp_path / "{run}.prom")}, environ={})
    metrics = metrics_file(cfg)
    assert metrics.path == tmp_path / f"{cfg.run}.prom"
    metrics.write("a 1\n")
    metrics.write("b 2\n")
    assert metrics.path.read_text() == "b 2\n"
    assert stat.S_IMODE(os.stat(metrics.path).st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{cfg.run}.prom"]


def test_off_by_default_and_bad_paths_name_the_key(tmp_path):
    base = {"paths.spool": "/x", "paths.pfs": "/y"}
    assert metrics_file(load(None, base, environ={})) is None
    with pytest.raises(ConfigError, match=r"^metrics.path: must end in .prom"):
        load(None, {**base, "metrics.path": str(tmp_path / "m.txt")}, environ={})
    missing = load(None, {**base, "metrics.path": str(tmp_path / "no" / "m.prom")}, environ={})
    with pytest.raises(ConfigError, match=r"^metrics.path: the directory .*/no does not exist"):
        metrics_file(missing)
    with pytest.raises(ConfigError, match=r"^metrics.period: "):
        load(None, {**base, "metrics.period": "0.1s"}, environ={})


def test_every_metric_is_documented():
    documented = set(re.findall(r"`(cachex_[a-z_]+)`", DOCS.read_text()))
    assert set(METRICS) <= documented, set(METRICS) - documented
