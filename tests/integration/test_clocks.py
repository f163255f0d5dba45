"""No clock trusted across hosts (issues 26 and 31): real agents, one process's wall
clock skewed or stepped (tests/skew/sitecustomize.py), and every decision holds: the
heartbeat, the levels and `cachex stop` through a step back of 10 minutes; a stop with
the coordinator an hour ahead; `not running` after SIGKILL read by a reader an hour
behind; a second coordinator two minutes ahead refused while the first lives."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from harness import BIN, finish, kill_tree, same_run_config, skewed, step_clock, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
TRAIN = ["--shard-size", "64KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
HOUR = 3600.0


def status(c, env=None) -> dict:
    result = c.cachex("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_wall_clock_stepped_back_mid_run_changes_no_decision(cluster, tmp_path):
    c = cluster()
    clock = tmp_path / "clock"
    c.start_agents(env=skewed(clock, 0))
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    step_clock(clock, -600)             # NTP corrects the coordinator's host: 10 min back
    for _ in range(3):                  # the heartbeat goes on
        before = c.status()
        wait_for(lambda before=before: c.status() != before, 30, "the status rewritten")
    finish(c.trainer("--steps", "12", "--every", "4", "--resume", *TRAIN))
    for ckpt in ("step_00008", "step_00012"):
        c.wait_level(ckpt, "flushed")
    doc = status(c)
    assert (doc["state"], doc["live"]) == ("running", True), doc
    assert c.stop() == 0                # drained, not "nothing running"
    assert c.status()["state"] == "stopped"


def test_stop_drains_with_the_coordinator_an_hour_ahead(cluster, tmp_path):
    c = cluster()
    c.start_agents(env=skewed(tmp_path / "clock", HOUR))
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    result = c.cachex("stop", "--timeout", "60s", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the coordinator took the stop request" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1] == "agents stopped"
    assert c.agents.wait(30) == 0


def test_status_after_sigkill_reads_not_running_with_the_reader_an_hour_behind(cluster,
                                                                               tmp_path):
    c = cluster()
    c.start_agents()
    behind = skewed(tmp_path / "clock", -HOUR)      # the login node's clock
    live = status(c, behind)
    assert (live["state"], live["live"]) == ("running", True)
    kill_tree(c.agents)
    dead = status(c, behind)
    assert (dead["state"], dead["recorded_state"], dead["live"]) == ("not running",
                                                                     "running", False)
    assert dead["heartbeat"]["age"] > 5 * dead["heartbeat"]["period"]
    text = c.cachex("status", env=behind)
    assert text.returncode == 0, text.stderr
    assert "agents not running (heartbeat unchanged for " in text.stdout.splitlines()[0]


def test_a_second_coordinator_two_minutes_ahead_is_refused_while_the_first_lives(
        cluster, tmp_path):
    first = cluster(nodes=2)
    first.start_agents()
    config = same_run_config(first, tmp_path / "second")
    second = subprocess.Popen(
        [str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex-agent"), "--config",
         str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        env={**os.environ, **skewed(tmp_path / "clock", 120)})
    try:
        _, err = second.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        kill_tree(second)
        pytest.fail("the second job took the live run over and ran as its coordinator")
    assert second.returncode == 2, err
    lock = first.pfs / "coordinator.lock"
    assert f"{lock}: run 't' is coordinated by job pid:" in err
    assert "a second coordinator refuses" in err and "Traceback" not in err
    assert first.status()["state"] == "running"
    assert first.stop() == 0
