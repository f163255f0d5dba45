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
    assert "a node lost: " in shown and "since step_00008 was committed" in shown, shown
    assert c.stop() == 0
