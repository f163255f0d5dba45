"""Commands find a job's configuration without --config: the agents record it by run
name (cachex_agent/runs.py) in the per-user state directory; --config still wins."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from harness import BIN, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "256KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--every", "4"]


def cachex(cwd, *args: str, mpi: int = 0) -> subprocess.CompletedProcess[str]:
    """From a directory with no cachex.toml, with no $CACHEX_CONFIG."""
    env = {k: v for k, v in os.environ.items() if k != "CACHEX_CONFIG"}
    launch = [str(BIN / "mpiexec"), "-n", str(mpi)] if mpi else []
    return subprocess.run([*launch, str(BIN / "cachex"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_commands_find_the_configuration_the_agents_recorded(cluster, state_dir, tmp_path):
    c = cluster(nodes=2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert cachex(elsewhere, "ls").returncode == 2       # nothing recorded yet
    c.start_agents()
    record = json.loads((state_dir / "t.json").read_text())
    assert record["config"] == str(c.config) and record["run"] == "t"
    assert record["settings"]["paths.pfs"] == str(c.root / "pfs")
    finish(c.trainer("--steps", "4", *TRAIN, ranks=4))
    c.wait_level("step_00004", "flushed")

    listed = cachex(elsewhere, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["id"] for r in json.loads(listed.stdout)["checkpoints"]] == ["step_00004"]
    status = cachex(elsewhere, "status", "--run", "t")
    assert status.returncode == 0 and "run t: agents running" in status.stdout, status.stderr
    stopped = cachex(elsewhere, "stop", "--timeout", "1min")
    assert stopped.returncode == 0, stopped.stderr
    assert c.agents.wait(30) == 0
    index = cachex(elsewhere, "index")
    assert index.returncode == 0 and "current: step_00004" in index.stdout, index.stderr
    planned = cachex(elsewhere, "recover", "--dry-run", "--run", "t", mpi=2)
    assert planned.returncode == 0 and "recovering step_00004" in planned.stdout, \
        planned.stdout + planned.stderr

    other = tmp_path / "other.toml"                          # --config still wins
    other.write_text(c.config.read_text().replace('run = "t"', 'run = "other"'))
    wins = cachex(elsewhere, "ls", "--config", str(other))
    assert wins.returncode == 1 and "run other: no status found" in wins.stderr, wins.stderr

    # a second, older run is known, whose configuration and PFS directory are gone
    u = json.loads((state_dir / "t.json").read_text())
    u.update(run="u", config=str(tmp_path / "gone" / "cachex.toml"), written=u["written"] - 60)
    u["settings"]["paths.pfs"] = str(tmp_path / "pfs2")     # there, without u's directory
    (tmp_path / "pfs2").mkdir()
    (state_dir / "u.json").write_text(json.dumps(u))
    several = cachex(elsewhere, "ls")
    assert several.returncode == 2, several.stderr
    assert several.stderr.strip() == (
        "cachex: error: 2 runs are known (newest: t, u): give --run NAME or --config FILE;"
        " 'cachex runs' lists them")
    assert cachex(elsewhere, "ls", "--run", "t").returncode == 0
    job_dir = c.config.parent.parent            # t's configuration is below it, u's not
    assert not (job_dir / "cachex.toml").exists()
    here = cachex(job_dir, "ls", "--json")
    assert here.returncode == 0 and json.loads(here.stdout)["run"] == "t", here.stderr

    runs = json.loads(cachex(elsewhere, "runs", "--json").stdout)
    assert [(r["run"], r["config_exists"], r["pfs_exists"], r["gone"]) for r in runs["runs"]] \
        == [("t", True, True, False), ("u", False, False, True)]
    shown = cachex(elsewhere, "runs").stdout
    assert "2 runs recorded" in shown and "(gone)" in shown and "--prune" in shown, shown
    pruned = cachex(elsewhere, "runs", "--prune")
    assert pruned.returncode == 0 and "pruned u:" in pruned.stdout, pruned.stdout
    assert sorted(p.name for p in state_dir.iterdir()) == ["t.json"]
    assert cachex(elsewhere, "ls").returncode == 0      # one run left: no need to name it
    shutil.copy(state_dir / "t.json", state_dir / "u.json")
    missing = cachex(elsewhere, "ls", "--run", "nope")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1
    assert f"run nope is not recorded in {state_dir} (known: t, u)" in missing.stderr
