"""Every reporting command's --json: one object with `schema`, the documented keys; and
`stop` says what it is waiting for."""

from __future__ import annotations

import json
import subprocess

import pytest
from harness import BIN, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02"]
COPY = {"level", "node", "where", "checked", "ok", "problems", "note"}
INDEX_ROW = {"id", "seq", "state", "bytes", "flushed_at"}


def _json(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data.pop("schema") == 1
    return data


def test_json_outputs_carry_their_schema_and_keys(cluster, tmp_path):
    c = cluster(nodes=2)
    c.start_agents()
    finish(c.trainer("--steps", "4", "--every", "4", *TRAIN, ranks=4))
    c.wait_level("step_00004", "flushed")

    verified = _json(c.cachex("verify", "step_00004", "--json"))
    assert verified["ckpt"] == "step_00004" and verified["ok"] is True
    assert verified["copies"] and all(set(copy) == COPY for copy in verified["copies"])
    assert {copy["level"] for copy in verified["copies"] if copy["ok"]} >= {"stage", "pfs"}

    exported = _json(c.cachex("export", "step_00004", str(tmp_path / "out"), "--json"))
    assert set(exported) == {"ckpt", "dest", "files", "bytes", "seconds"}
    assert exported["files"] == 5 and exported["bytes"] > 0

    plan = subprocess.run([str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex"), "recover",
                           "--dry-run", "--json", "--config", str(c.config)],
                          capture_output=True, text=True, timeout=120)
    planned = _json(plan)
    assert planned["ckpt"] == "step_00004" and planned["dry_run"] is True
    assert set(planned) == {"ckpt", "seq", "dry_run", "nodes", "moves", "erasure"}
    assert {m["kind"] for m in planned["moves"]} <= {"spool", "journal"}  # all in place

    listed = _json(c.cachex("index", "--json"))
    assert set(listed) == {"run", "current", "pinned", "action", "name", "checkpoints"}
    assert listed["current"] == "step_00004" and listed["action"] == "list"
    assert [set(row) for row in listed["checkpoints"]] == [INDEX_ROW]

    stopped = _json(c.cachex("stop", "--json", "--timeout", "1min", timeout=90))
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
