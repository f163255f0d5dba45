"""`cachex status` opens with the work at risk now (risk.py): real agents, a node whose
agent is stopped (SIGSTOP) so that its checkpoints are withheld, a reader whose clock
is an hour off."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from harness import finish, skewed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "64KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--every", "4"]
NEWER = ("replicated", "flushed")
GAP = 4.0


def risk(c, env: dict[str, str] | None = None) -> dict:
    result = c.cachex("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["at_risk"]


def test_the_work_at_risk_rises_while_a_checkpoint_is_withheld_and_drops_once_it_is_safe(
        cluster, tmp_path):
    c = cluster(nodes=2, agent_timeout="60s")     # the stopped node is not given up on
    c.start_agents()
    finish(c.trainer("--steps", "4", *TRAIN))
    c.wait_level("step_00004", *NEWER)
    node1 = [e for e in c.events(1) if e["event"] == "agent_start"][-1]["pid"]
    os.kill(node1, signal.SIGSTOP)
    try:
        time.sleep(GAP)                 # step_00008 is committed at least GAP s later
        finish(c.trainer("--steps", "8", "--resume", *TRAIN))    # step_00008: withheld
        first = risk(c)
        time.sleep(3)
        second = risk(c)
        ahead = risk(c, env=skewed(tmp_path / "clock", 3600.0))    # the reader's clock
        behind = risk(c, env=skewed(tmp_path / "clock2", -3600.0))
    finally:
        os.kill(node1, signal.SIGCONT)
    for seen in (first, second, ahead, behind):
        assert seen["node_loss"]["ckpt"] == "step_00004", seen
        assert seen["allocation_end"]["ckpt"] in ("step_00004", None), seen
    rise = second["node_loss"]["seconds"] - first["node_loss"]["seconds"]
    assert 2.0 < rise < 40.0, (first, second)
    # an hour off either way: the same figure, give or take the seconds between reads
    for skewed_reader in (ahead, behind):
        assert abs(skewed_reader["node_loss"]["seconds"]
                   - second["node_loss"]["seconds"]) < 30, (second, skewed_reader)

    c.wait_level("step_00008", *NEWER)
    after = risk(c)
    assert after["node_loss"]["ckpt"] == "step_00008", after
    # what a node loss would cost now is less than with step_00004 the newest to survive
    still_4 = second["node_loss"]["seconds"] + after["now"] - second["now"]
    assert after["node_loss"]["seconds"] < still_4 - GAP + 1.0, (second, after)
    shown = c.cachex("status").stdout
    assert "at risk now (the coordinator's clock):" in shown
    only = c.cachex("status", "--at-risk").stdout.splitlines()    # the job templates'
    assert only[0] == "at risk now (the coordinator's clock):" and len(only) == 3, only
    assert "a node lost: " in shown and "since step_00008 was committed" in shown, shown
    assert c.stop() == 0


def prometheus(path) -> dict[tuple[str, str], float]:
    """(metric, its `loss`/`level` label or "") -> value, as Prometheus parses the file."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, s.labels.get("loss", s.labels.get("level", ""))): s.value
            for family in text_string_to_metric_families(path.read_text())
            for s in family.samples}


def wait_for(read, ok, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        seen = read()
        if ok(seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


def test_xor_groups_are_named_the_next_levels_predicted_and_the_metrics_agree(
        cluster, tmp_path):
    prom = tmp_path / "textfile"
    prom.mkdir()
    c = cluster(nodes=4, agent_timeout="60s", extra=f'''[peer]
scheme = "xor"
group = 4
[flush]
every = 100
[metrics]
path = "{prom}/cachex-{{run}}.prom"
period = "1s"
''')
    metrics = prom / "cachex-t.prom"
    c.start_agents()
    finish(c.trainer("--steps", "8", *TRAIN))       # step_00004 flushed, step_00008 not
    c.wait_level("step_00004", "flushed")
    c.wait_level("step_00008", "replicated")
    node1 = [e for e in c.events(1) if e["event"] == "agent_start"][-1]["pid"]
    os.kill(node1, signal.SIGSTOP)
    try:
        finish(c.trainer("--steps", "12", "--resume", *TRAIN))   # step_00012: withheld
        seen = wait_for(lambda: risk(c), lambda r: r["in_flight"] and r["in_flight"][0]["next"])
        shown = c.cachex("status").stdout
        figures = prometheus(metrics)
    finally:
        os.kill(node1, signal.SIGCONT)
    [flying] = seen["in_flight"]
    assert flying["ckpt"] == "step_00012" and flying["level"] in ("written", "captured")
    # flush.every = 100 leaves it out of the flush: the model promises `replicated` only
    assert set(flying["next"]) <= {"captured", "replicated"} and "replicated" in flying["next"]
    assert flying["next"]["replicated"]["p95"] >= flying["next"]["replicated"]["median"]
    assert "outlives any 1 lost node of each group of 4" in shown, shown
    assert "step_00012 (" in shown and "replicated " in shown.split("step_00012 (")[1]
    assert figures[("cachex_up", "")] == 1.0
    assert figures[("cachex_newest_checkpoint_seq", "node")] == 2.0
    assert figures[("cachex_newest_checkpoint_seq", "allocation")] == 1.0
    assert figures[("cachex_checkpoints_in_flight", "")] == 1.0
    assert figures[("cachex_work_at_risk_seconds", "node")] >= 0.0
    assert figures[("cachex_level_latency_seconds", "flushed")] > 0.0
    assert figures[("cachex_flush_bandwidth_bytes_per_second", "")] > 0.0

    c.wait_level("step_00012", "replicated")
    assert c.stop() == 0
    final = prometheus(metrics)
    assert final[("cachex_up", "")] == 0.0
    assert final[("cachex_checkpoints_in_flight", "")] == 0.0
    assert oct(metrics.stat().st_mode & 0o777) == "0o644"
