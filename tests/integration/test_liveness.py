"""Agents that die say so, status tells live agents from dead ones, and agents that start
protect what the trainer committed while none ran (issue 10, points 9 and 10)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from harness import Cluster, finish, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "64KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
HELD = ("captured", "replicated", "flushed")


def test_an_unexpected_error_in_the_capture_thread_ends_the_agent_job(cluster):
    c = cluster()
    # rank 2's capture thread raises a RuntimeError (not a CachexError or OSError)
    c.start_agents(env={"CACHEX_TEST_FAIL_CAPTURE": "2"})
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    try:
        code = c.agents.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the agent job still runs after its capture thread died")
    assert code != 0
    log = (c.root / "agents.log").read_text()
    failed = [line for line in log.splitlines() if "aborting the agent job" in line]
    assert len(failed) == 1, log[-3000:]
    assert "agent rank 2" in failed[0] and "thread capture" in failed[0]
    assert "RuntimeError: CACHEX_TEST_FAIL_CAPTURE=2" in failed[0]
    events = [e for e in c.events(2) if e["event"] == "agent_failed"]
    assert [(e["rank"], e["where"]) for e in events] == [(2, "thread capture")]
    assert "RuntimeError" in events[0]["error"]


def test_status_after_sigkill_of_every_agent_reads_not_running(cluster):
    c = cluster()
    c.start_agents()
    live = json.loads(c.cachex("status", "--json").stdout)
    assert (live["state"], live["live"]) == ("running", True)
    assert live["heartbeat"]["pid"] > 0 and live["heartbeat"]["host"]
    kill_tree(c.agents)

    def dead() -> dict | None:
        doc = json.loads(c.cachex("status", "--json").stdout)
        return doc if doc["state"] != "running" else None
    doc = wait_for(dead, 90, "status to stop reading running")
    assert (doc["state"], doc["recorded_state"], doc["live"]) == ("not running", "running",
                                                                  False)
    assert doc["heartbeat"]["age"] > doc["heartbeat"]["period"]   # watched standing still
    text = c.cachex("status")
    assert text.returncode == 0, text.stderr
    assert "agents not running (heartbeat unchanged for " in text.stdout.splitlines()[0]


@pytest.mark.parametrize("replaced", [None, 1], ids=["journals", "node1-replaced"])
def test_checkpoints_written_while_agents_were_down_are_protected(cluster, replaced):
    c = cluster()
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN))
    c.wait_level("step_00004", "flushed")
    kill_tree(c.agents)
    # while no agent runs, the trainer resumes and commits three more checkpoints
    finish(c.trainer("--steps", "16", "--every", "4", "--resume", *TRAIN))
    if replaced is not None:        # a node that comes back without its journal
        shutil.rmtree(c.journal(replaced))
    c.start_agents()
    written = ["step_00008", "step_00012", "step_00016"]
    for ckpt in written:
        c.wait_level(ckpt, *HELD)
    listed = c.cachex("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    levels = {r["id"]: r["level"] for r in json.loads(listed.stdout)["checkpoints"]}
    assert all(levels[ckpt] in HELD for ckpt in written), levels
    assert not c.status().get("notes"), c.status()["notes"]
    assert c.stop() == 0
    assert all(c.levels()[ckpt] == "flushed" for ckpt in written), c.levels()


def test_an_agent_says_which_older_checkpoints_it_leaves_unprotected(tmp_path):
    """A first start on a spool that already holds checkpoints adopts only the newest
    one; the older ones get a line in status and in the events."""
    c = Cluster(tmp_path, nodes=2)
    try:
        finish(c.trainer("--steps", "8", "--every", "4", *TRAIN, ranks=4))
        c.start_agents()
        c.wait_level("step_00008", *HELD)
        # only node 0's spool has DCP's `.metadata`: the others see no commit of their own
        notes = wait_for(lambda: c.status().get("notes"), 30, "a note on step_00004")
        assert notes == ["node 0: step_00004 in the spool, not protected: older than"
                         " step_00008"]
        assert "step_00004" not in c.levels()
        skipped = [e for e in c.events(0) if e["event"] == "catch_up_skipped"]
        assert [e["ckpts"] for e in skipped] == [["step_00004"]]
        text = c.cachex("status").stdout
        assert "note: node 0: step_00004 in the spool, not protected" in text
        assert c.stop() == 0
    finally:
        c.close()
