"""The supervisor's scheduler side (cachex_agent/job/adapters.py) against the fake
site's stubbed squeue, sinfo and pbsnodes, with life.decide choosing, and the
supervisor's own pieces with real processes: a relaunch's node set and its recovery
line from the job library, the hosts to blame, timeouts cut to the halt, SIGTERM."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from stubs import FakeSite, flag

from cachex_agent.job import life
from cachex_agent.job.adapters import Pbs, Slurm
from cachex_agent.job.shell import BatchShell
from cachex_agent.job.supervisor import Finished, Settings, Supervisor


def stub(site: FakeSite, name: str, body: str) -> None:
    (site.bin / name).write_text(f"#!/bin/bash\n{body}")
    (site.bin / name).chmod(0o755)


def slurm_site(tmp_path: Path, monkeypatch, down: set[str]) -> FakeSite:
    """Five hosts in job 42; those in `down` read as down in sinfo."""
    site = FakeSite(tmp_path, "slurm", hosts=5)
    states = "".join(f"echo '{h} {'down*' if h in down else 'allocated'}'\n" for h in site.hosts)
    stub(site, "squeue", "echo 'n[001-005]'\n")
    stub(site, "sinfo", states)
    monkeypatch.setenv("PATH", site.env["PATH"])
    return site


def after_failure(site: FakeSite, spares: tuple[str, ...], min_nodes: int = 0,
                  failed_on: tuple[str, ...] = ()) -> life.Decision:
    nodes = tuple(h for h in site.hosts if h not in spares)
    up = Slurm("42").up([*nodes, *spares])
    state = life.JobState(nodes, spares, min_nodes, training=True)
    return life.decide(state, life.TrainExited(1, True, frozenset(up.hosts), failed_on))


def recover_line(site: FakeSite, nodes: tuple[str, ...]) -> list[str]:
    """The recovery's launch line the job library gives for that node set."""
    script = (f'CX_SCHEDULER=slurm; source "$CX_ROOT/scripts/lib/cachex-job.sh";'
              f' CX_SET=({" ".join(nodes)}); cx_step recover 1; printf "%s\\n" "${{CX_ARGV[@]}}"')
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env={**site.env, "CACHEX_CONFIG": "c.toml"}, cwd=site.tmp)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_a_lost_node_is_replaced_by_a_spare_and_the_recovery_runs_on_the_new_set(
        tmp_path, monkeypatch):
    site = slurm_site(tmp_path, monkeypatch, {"n002"})
    d = after_failure(site, ("n005",))
    assert d.state.nodes == ("n001", "n003", "n004", "n005")
    line = recover_line(site, d.state.nodes)
    assert flag(line, "--nodes") == "4" and flag(line, "--nodelist") == "n001,n003,n004,n005"


def test_too_few_spares_shrink_to_min_nodes_below_it_the_job_fails(tmp_path, monkeypatch):
    site = slurm_site(tmp_path, monkeypatch, {"n002", "n003"})
    d = after_failure(site, ("n005",), min_nodes=3)
    assert d.state.nodes == ("n001", "n004", "n005") and not d.state.ended
    line = recover_line(site, d.state.nodes)
    assert flag(line, "--nodes") == "3" and flag(line, "--nodelist") == "n001,n004,n005"
    for minimum in (4, 0):
        failed = after_failure(site, ("n005",), min_nodes=minimum)
        assert failed.state.ended and failed.actions[-1].verdict == "failed"


def test_when_sinfo_or_squeue_says_nothing_no_node_counts_as_lost(tmp_path, monkeypatch):
    """Every node read as lost had ended the job."""
    site = slurm_site(tmp_path, monkeypatch, {"n002"})
    for silent in ("sinfo", "squeue"):
        stub(site, silent, "exit 1\n")
        up = Slurm("42").up(site.hosts)
        assert up.hosts == site.hosts
        assert up.notes == ["squeue or sinfo said nothing of the job's nodes: every node"
                            " taken as up"]
        stub(site, "squeue", "echo 'n[001-005]'\n")
        stub(site, "sinfo", "echo 'n001 allocated'\n")


def test_pbs_nodes_down_or_offline_are_replaced_by_spares(tmp_path, monkeypatch):
    site = FakeSite(tmp_path, "pbs", hosts=5)
    stub(site, "pbsnodes", 'h=${!#}; echo "$h"; echo "     Mom = $h";'
                           ' case $h in n002) s=offline ;; n003) s=down ;; *) s=free ;; esac;'
                           ' echo "     state = $s"\n')
    monkeypatch.setenv("PATH", site.env["PATH"])
    up = Pbs("42.pbs").up(site.hosts)
    state = life.JobState(("n001", "n002", "n003"), ("n004", "n005"), training=True)
    d = life.decide(state, life.TrainExited(1, True, frozenset(up.hosts)))
    assert d.state.nodes == ("n001", "n004", "n005")


def test_a_node_the_training_failed_on_is_left_out_of_the_relaunch(tmp_path, monkeypatch):
    """It still shows allocated, so it was reused until MAX_RELAUNCHES ran out."""
    site = slurm_site(tmp_path, monkeypatch, set())
    said = ("srun: error: n002: task 3: Exited with exit code 1\n"
            "srun: error: n001: tasks 0-1: Killed\nsrun: error: n003: tasks 4-5: Killed\n")
    blamed = Slurm("42").failed_on(said, ["n001", "n002", "n003", "n004"])
    assert blamed == ["n002"]
    d = after_failure(site, ("n005",), failed_on=tuple(blamed))
    assert d.state.nodes == ("n001", "n003", "n004", "n005") and d.state.bad == {"n002"}


def supervisor(tmp_path: Path, time_left: int | None, halt_margin: int = 900) -> Supervisor:
    shell = BatchShell(Path("lib.sh"), tmp_path / "vars")
    settings = Settings(scheduler="pbs", job_id="42", shell=shell, rundir=tmp_path,
                        cachex="cachex", config="c.toml", run_name="r", ranks_per_node=1,
                        time_left=time_left, agent_stop_timeout=20)
    return Supervisor(settings, life.JobState(("n001",), halt_margin=halt_margin))


def test_a_recovery_is_cut_to_the_halt_not_to_the_jobs_end(tmp_path):
    """The final drain's window (HALT_MARGIN) is not the recovery's to use."""
    s = supervisor(tmp_path, time_left=1000)
    assert 95 <= s._fit(1800, halt=True) <= 100
    assert 965 <= s._fit(1800) <= 970 and s._fit(50, halt=True) == 50
    assert supervisor(tmp_path, time_left=None)._fit(1800, halt=True) == 1800


def test_sigterm_lets_the_agents_drain_before_anything_is_killed(tmp_path):
    """The batch shell's SIGTERM went straight to SIGKILL of the agents."""
    said, ready = tmp_path / "agent-said", tmp_path / "agent-ready"
    agent = (f"trap 'echo drained >{said}; exit 0' TERM; touch {ready}; sleep 30 & wait;"
             f" echo killed >{said}")
    s = supervisor(tmp_path, time_left=None)
    s.steps.agents = subprocess.Popen(["bash", "-c", agent], start_new_session=True)
    while not ready.exists():
        time.sleep(0.05)
    decision = life.decide(s.state, life.Signal("TERM"))
    assert decision.actions == (life.Drain("term", "SIGTERM: the job is ending"),)
    try:
        s._term()
    except Finished as done:
        assert done.status == 143
    else:
        raise AssertionError("no exit after SIGTERM")
    assert said.read_text().strip() == "drained"
