"""The job templates without a job: they parse (`bash -n`), their scheduler directives
match their variables, and the Slurm and PBS templates launch the same commands (the
plan that `CX_PLAN=1` prints from the shared scripts/lib/cachex-job.sh)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
from slurm_harness import BIN, ROOT, SCRIPTS, run

SLURM = {p.name: p for p in sorted((SCRIPTS / "slurm").glob("*.sbatch"))}
PBS = {p.name: p for p in sorted((SCRIPTS / "pbs").glob("*.pbs"))}
TEMPLATES = {**SLURM, **PBS}
SHELL = [*TEMPLATES.values(), *sorted((SCRIPTS / "lib").glob("*.sh")),
         *sorted((SCRIPTS / "ci").glob("*.sh"))]
REAL = ["frontier.sbatch", "neuron.sbatch", "cachex.pbs"]
TRAIN = "python /apps/train.py --checkpoint-dir '/mnt/local ckpt' --steps 100"


def test_the_templates_are_there():
    assert {"frontier.sbatch", "neuron.sbatch", "local.sbatch"} <= set(SLURM)
    assert "cachex.pbs" in PBS


@pytest.mark.parametrize("path", SHELL, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_parses(path: Path):
    result = run(["bash", "-n", str(path)])
    assert result.returncode == 0, result.stderr
    assert "set -euo pipefail" in path.read_text() or path.suffix == ".sh"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_templates_source_the_shared_logic(name: str):
    text = TEMPLATES[name].read_text()
    assert 'source "$CX_ROOT/scripts/lib/cachex-job.sh"' in text
    assert text.rstrip().endswith("cx_main")
    # The cachex commands live in the shared file only, never copied into a template.
    assert "cachex recover" not in code_lines(text) and "cachex stop" not in code_lines(text)


def code_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def directives(name: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in TEMPLATES[name].read_text().splitlines()
            if line.startswith(prefix)]


def default(name: str, variable: str) -> str:
    match = re.search(rf"^{variable}=\$\{{{variable}:-([^}}]*)\}}$",
                      TEMPLATES[name].read_text(), re.M)
    assert match, f"{name}: no `{variable}=${{{variable}:-...}}` line"
    return match.group(1)


@pytest.mark.parametrize("name", ["frontier.sbatch", "neuron.sbatch"])
def test_real_slurm_templates_keep_spares_and_survive_node_loss(name: str):
    found = directives(name, "#SBATCH")
    assert "--no-kill" in found
    nodes = [d for d in found if d.startswith("--nodes=")]
    assert nodes == [f"--nodes={int(default(name, 'NODES')) + int(default(name, 'SPARES'))}"]
    assert int(default(name, "SPARES")) >= 1
    # what each site's guide makes mandatory: tests/slurm/test_sites.py
    for option in ("--partition=", "--time=", "--job-name="):
        assert any(d.startswith(option) for d in found), f"{name}: no #SBATCH {option}"


def test_local_template_is_one_node():
    found = directives("local.sbatch", "#SBATCH")
    assert "--nodes=1" in found and "--no-kill" not in found
    text = TEMPLATES["local.sbatch"].read_text()
    assert "FAILURE_DOMAIN=rank" in text and "{node}" in text


def test_pbs_directives():
    found = directives("cachex.pbs", "#PBS")
    select = [d for d in found if d.startswith("-l select=")]
    assert len(select) == 1
    chunks = int(re.match(r"-l select=(\d+):", select[0]).group(1))
    assert chunks == int(default("cachex.pbs", "NODES")) + int(default("cachex.pbs", "SPARES"))
    assert "mpiprocs=" in select[0]
    assert "-W tolerate_node_failures=all" in found
    assert any(re.fullmatch(r"-l walltime=\d+:\d\d:\d\d", d) for d in found)
    for option in ("-N ", "-A ", "-q ", "-j oe", "-l place=scatter"):
        assert any(d.startswith(option) for d in found), f"no #PBS {option}"


# ----------------------------------------------------------------- the plans
HOSTS = [f"n{i:03d}" for i in range(1, 11)]      # 10 hosts: 8 nodes + 2 spares


def plan(name: str, tmp_path: Path, **variables: str) -> dict[str, list[str]]:
    """`CX_PLAN=1 bash TEMPLATE` inside a pretend allocation of HOSTS: each step's words."""
    config = tmp_path / "cachex.toml"
    config.write_text('run = "x"\n')
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{h}\n" * 4 for h in reversed(HOSTS)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    env.update(CX_PLAN="1", CX_ROOT=str(ROOT), CX_BIN=str(BIN), CACHEX_CONFIG=str(config),
               TRAIN_CMD=TRAIN, RESUME_ARGS="--resume --strict", NODES="8", SPARES="2",
               RANKS_PER_NODE="4", CX_RUNDIR=str(tmp_path / "run"), USER="u", HOME="/h",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[001-010]", PBS_JOBID="7.pbs",
               PBS_NODEFILE=str(nodefile), MPIEXEC="mpiexec", MODULES="", STAGE_VENV="0",
               AGENT_ENV_UNSET="", TRAIN_ENV="", **variables)
    result = subprocess.run(["bash", str(TEMPLATES[name])], capture_output=True, text=True,
                            timeout=30, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = {}
    for line in result.stdout.splitlines():
        if line.startswith("plan "):
            kind, _, words = line[5:].partition(": ")
            steps[kind] = shlex.split(words)
    assert {"agents", "recover", "train", "train-resume", "stop"} <= set(steps), result.stdout
    return steps


def command(words: list[str]) -> list[str]:
    """The command a launcher runs: from the cachex binary or the trainer on."""
    starts = [i for i, w in enumerate(words)
              if w.startswith(str(BIN)) or w == "python" or w == "mkdir"]
    return words[starts[0]:]


def test_slurm_and_pbs_templates_launch_the_same_commands(tmp_path):
    plans = {name: plan(name, tmp_path) for name in REAL}
    agent = [str(BIN / "cachex-agent"), "--config", str(tmp_path / "cachex.toml")]
    recover = [str(BIN / "cachex"), "recover", "--config", str(tmp_path / "cachex.toml")]
    train = shlex.split(TRAIN)
    for name, steps in plans.items():
        assert command(steps["agents"]) == agent, name
        assert command(steps["recover"]) == recover, name
        assert command(steps["train"]) == train, name
        assert command(steps["train-resume"]) == [*train, "--resume", "--strict"], name
        assert steps["stop"][:4] == [str(BIN / "cachex"), "stop", "--config",
                                     str(tmp_path / "cachex.toml")], name


@pytest.mark.parametrize("name", ["frontier.sbatch", "neuron.sbatch"])
def test_slurm_steps_one_agent_per_node_on_the_first_nodes(name: str, tmp_path):
    steps = plan(name, tmp_path, SRUN_MPI="pmix")
    nodelist = "--nodelist=" + ",".join(HOSTS[:8])
    for kind in ("agents", "recover"):
        launcher = steps[kind][:steps[kind].index(command(steps[kind])[0])]
        assert launcher[0] == "srun"
        assert {"--ntasks-per-node=1", "--overlap", "--nodes=8", nodelist,
                "--mpi=pmix"} <= set(launcher)
    train = steps["train"]
    assert {"--ntasks-per-node=4", "--nodes=8", nodelist, "--job-name=train"} <= set(train)
    assert "--overlap" not in train


def test_pbs_steps_one_agent_per_node_on_the_first_nodes(tmp_path):
    steps = plan("cachex.pbs", tmp_path)
    for kind in ("agents", "recover"):
        assert steps[kind][:7] == ["mpiexec", "-f", str(tmp_path / "run" / "hosts"), "-n", "8",
                                   "-ppn", "1"]
    assert steps["train"][:7] == ["mpiexec", "-f", str(tmp_path / "run" / "hosts"), "-n", "32",
                                  "-ppn", "4"]
    # One line per host (PBS_NODEFILE has one per rank), sorted as cachex numbers nodes.
    assert (tmp_path / "run" / "hosts").read_text().split() == HOSTS[:8]
    pals = plan("cachex.pbs", tmp_path, MPIEXEC_FLAVOR="pals")
    assert pals["agents"][:7] == ["mpiexec", "--hostfile", str(tmp_path / "run" / "hosts"),
                                  "-n", "8", "--ppn", "1"]


def test_local_plan_runs_virtual_nodes_on_one_host(tmp_path):
    steps = plan("local.sbatch", tmp_path, VNODES="3", WORKDIR=str(tmp_path / "w"))
    assert {"--nodes=1", "--ntasks=3", "--overcommit", "--mpi=pmi2"} <= set(steps["agents"])
    assert {"--nodes=1", "--ntasks=12", "--overcommit"} <= set(steps["train"])


def test_a_bad_variable_is_one_line_and_status_2(tmp_path):
    config = tmp_path / "cachex.toml"
    config.write_text('run = "x"\n')
    # the package checks the variables once the modules are loaded (its python runs
    # under them); this host has no `module`, which would be the one line instead
    env = {**os.environ, "CX_ROOT": str(ROOT), "CX_BIN": str(BIN), "MAX_RELAUNCHES": "many",
           "CACHEX_CONFIG": str(config), "SLURM_JOB_NODELIST": "n[001-010]", "USER": "u",
           "MODULES": "", "CX_RUNDIR": str(tmp_path / "run")}
    result = subprocess.run(["bash", str(TEMPLATES["frontier.sbatch"])], capture_output=True,
                            text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "MAX_RELAUNCHES=many: expected a whole number" in result.stderr


def test_setup_slurm_returns_at_once_when_slurm_is_up(slurm):
    start = time.monotonic()
    result = run(["bash", str(SCRIPTS / "ci" / "setup-slurm.sh")], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Slurm is up" in result.stdout
    assert time.monotonic() - start < 10
