"""Every reporting command's --json on a real run: one object with `schema` and the keys
of its shape in cachex_agent/outputs.py (documented in docs/commands.md); and `stop`
says what it is waiting for. The model commands' outputs: test_events_pfs.py."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import BIN, finish

from cachex_agent.outputs import problems

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]


def _json(command: str, result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert problems(command, data) == [], data
    return data


def test_json_outputs_carry_their_schema_and_keys(cluster, tmp_path):
    c = cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=4))
    c.wait_level("step_00004", "flushed")

    listed = _json("ls", c.cachex("ls", "--json"))
    assert [row["id"] for row in listed["checkpoints"]] == ["step_00004"]
    status = _json("status", c.cachex("status", "--json"))
    assert status["state"] == "running" and status["checkpoints"][0]["level"] == "flushed"

    verified = _json("verify", c.cachex("verify", "step_00004", "--json"))
    assert verified["ckpt"] == "step_00004" and verified["ok"] is True
    assert verified["copies"]
    assert {copy["level"] for copy in verified["copies"] if copy["ok"]} >= {"stage", "pfs"}

    exported = _json("export", c.cachex("export", "step_00004", str(tmp_path / "out"),
                                        "--json"))
    assert exported["files"] == 5 and exported["bytes"] > 0

    plan = subprocess.run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex"), "recover",
                           "--dry-run", "--json", "--config", str(c.config)],
                          capture_output=True, text=True, timeout=120)
    planned = _json("recover", plan)
    assert planned["ckpt"] == "step_00004" and planned["dry_run"] is True
    assert "seconds" not in planned         # what it moved: only when it ran
    assert {m["kind"] for m in planned["moves"]} <= {"spool", "journal"}  # all in place

    indexed = _json("index", c.cachex("index", "--json"))
    assert indexed["current"] == "step_00004" and indexed["action"] == "list"
    assert len(indexed["checkpoints"]) == 1

    stopped = _json("stop", c.cachex("stop", "--json", "--timeout", "1min", timeout=90))
    assert stopped["state"] == "stopped" and stopped["run"] == "t"
    assert c.agents.wait(30) == 0


def test_stop_takes_a_duration_and_says_what_it_waits_for(cluster):
    c = cluster(nodes=2)
    c.start_agents()
    bad = c.cachex("stop", "--timeout", "soon")
    assert bad.returncode == 2 and "--timeout: expected a duration like 2s, got 'soon'" \
        in bad.stderr, bad.stderr
    result = c.cachex("stop", "--timeout", "2min", timeout=150)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("stop requested (")
    assert lines[-1] == "agents stopped"
    assert any(line.startswith("waiting (") and "giving up in" in line for line in lines), lines
