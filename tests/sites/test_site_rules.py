"""Each template's usage line, as written in its header, submitted at a fake site of its
kind (fake_site.py): the site's qsub or sbatch applies the site's rules (site_rules.py)
and refuses what the real one refuses; a job it takes runs, with no variable the usage
line does not give, up to its first srun or mpiexec. The same scheduler refuses the
jobs the templates asked for before issue 45."""

from __future__ import annotations

import dataclasses
import os

import pytest
from fake_site import SITES, FakeSite, usage_line
from stubs import TEMPLATES

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the fake site is a mount namespace: run as root (CI does)")

# the first launch ends the fake job: its one error line says so, nothing before it
LAUNCH_FAILED = ("could not create", "unpacking the venv")


def submitted(tmp_path, name: str, line: str | None = None, site=None):
    fake = FakeSite(tmp_path, name)
    if site is not None:
        fake.site = site
    return fake.submit(line or usage_line(name))


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if "error:" in line]


def reached_first_launch(result) -> list[str]:
    """The job ran as submitted up to its first launch: the launch's command line."""
    assert result.said.returncode == 0, result.said.stderr
    assert result.status == 1, result.output
    [error] = errors(result.output)
    assert any(why in error for why in LAUNCH_FAILED), result.output
    return result.launches()[0]


def test_polaris_usage_line_runs_to_its_first_mpiexec(tmp_path):
    result = submitted(tmp_path, "polaris")
    first = reached_first_launch(result)
    assert first[:2] == ["mpiexec", "--hostfile"] and first[first.index("--ppn") + 1] == "1"
    assert first[first.index("-n") + 1] == "10"
    # the login shell (#!/bin/bash -l) defined `module`; -A alone named the project
    assert result.calls[:2] == ["module use /soft/modulefiles", "module load conda/2025-09-25"]
    assert "/lus/eagle/projects/MYPROJECT/u/cachex/cachex-llm-cachex.toml" in result.output


def test_aurora_usage_line_runs_to_its_first_mpiexec(tmp_path):
    result = submitted(tmp_path, "aurora")
    first = reached_first_launch(result)
    assert first[first.index("-n") + 1] == "256"
    # the job's own files beside its output in the project directory, not in /tmp
    hostfile = first[first.index("--hostfile") + 1]
    assert hostfile.startswith("/lus/flare/projects/MYPROJECT/cachex-job-"), hostfile


def test_aurora_leaves_out_a_node_pbs_marks_down_as_the_job_starts(tmp_path):
    """tolerate_node_failures=all starts the job on a node already bad: the guide's
    `pbsnodes -l | grep <jobid>` finds it and a spare takes its place."""
    bad = "x4001c0s7b0n0"
    site = dataclasses.replace(SITES["aurora"], down={bad: "4242.aurora-pbs-01",
                                                      "x4001c0s100b0n0": "1111.aurora-pbs-01"})
    result = submitted(tmp_path, "aurora", site=site)
    first = reached_first_launch(result)
    hosts = (tmp_path / "fs" / first[first.index("--hostfile") + 1].lstrip("/")).read_text()
    assert bad not in hosts.split() and len(hosts.split()) == 256
    assert "x4001c0s100b0n0" in hosts.split()             # another job's node: not ours
    assert f"at its start: {bad} (left out)" in result.output


def test_frontier_usage_line_runs_to_its_first_srun(tmp_path):
    result = submitted(tmp_path, "frontier")
    first = reached_first_launch(result)
    sbcast, srun = result.launches()[:2]
    assert first == sbcast and sbcast[-2] == "/lustre/orion/abc123/scratch/u/cachex-venv.tar"
    assert srun[0] == "srun" and "--nodes=34" in srun      # every node, spares too
    assert result.calls[0].startswith("module load PrgEnv-gnu/8.7.0 cpe/26.03")
    # the packed environment is on Orion, not in Project Home
    assert (tmp_path / "fs" / "lustre/orion/abc123/scratch/u/cachex-venv.tar").is_file()
    assert not list((tmp_path / "fs" / "ccs").rglob("*.tar"))


def test_neuron_usage_line_runs_to_its_first_srun(tmp_path):
    result = submitted(tmp_path, "neuron")
    first = reached_first_launch(result)
    assert first[0] == "srun" and "--nodes=4" in first
    assert result.calls[:2] == ["module purge",
                                "module load gcc/15.2.0 cuda/12.4.1 cudampi/openmpi-4.1.8"]
    assert "/scratch/u/cachex-job-4242" in result.output or (
        tmp_path / "fs" / "scratch/u/cachex-job-4242").is_dir()


@pytest.mark.parametrize(("name", "change", "why"), [
    # before issue 45: Polaris 12 nodes for 6 h in prod (small: 3 h; medium: 25 nodes)
    ("polaris", "-l walltime=06:00:00", "rejected by all possible destinations"),
    ("polaris", "-q small", "cannot submit to small directly"),
    ("polaris", "-l filesystems=home:grand", "invalid filesystems: grand"),
    ("aurora", "-l select=100", "rejected by all possible destinations"),
    ("aurora", "-l walltime=18:00:00", "rejected by all possible destinations"),
    ("frontier", "-t 6:00:00", "over its bin's walltime"),
    ("frontier", "-p extended -N 65 -t 1:00:00", "over 64 nodes"),
    # Neuron before: the placeholder field, eme_h200nv_8 with 5 nodes, 10 A100 nodes
    ("neuron", "'--comment=field=FIELD;appl=pytorch'", "unknown field or appl"),
    ("neuron", "-p eme_h200nv_8", "eme_h200nv_8 has 1 nodes"),
    ("neuron", "-N 10", "amd_a100nv_8 has 9 nodes"),
    ("neuron", "-p cas_v100nv_8", "40 GPUs, over the 32 a user may hold"),
    ("neuron", "-t 3-00:00:00", "over 2 days"),
])
def test_the_site_refuses_what_its_scheduler_refuses(tmp_path, name, change, why):
    line = usage_line(name)
    command = "qsub" if " qsub " in f" {line}" else "sbatch"
    result = submitted(tmp_path, name, line.replace(f"{command} ", f"{command} {change} ", 1))
    assert result.said.returncode == 1 and why in result.said.stderr, result.said.stderr
    assert result.status is None                        # no job ran


def test_neuron_refuses_a_job_submitted_outside_scratch(tmp_path):
    line = usage_line("neuron").replace("cd /scratch/$USER && ", "")
    result = submitted(tmp_path, "neuron", line)
    assert result.said.returncode == 1
    assert "jobs are submitted from /scratch/u only" in result.said.stderr


def test_without_a_login_shell_an_alcf_job_has_no_module(tmp_path):
    """`#!/bin/bash` (not -l): PBS's fresh environment has neither the site's PATH (qstat:
    no project read) nor `module`: either way one line and exit 2."""
    text = TEMPLATES["polaris"].read_text().replace("#!/bin/bash -l\n", "#!/bin/bash\n", 1)
    line = usage_line("polaris").replace("$HOME/cachex-agent/scripts/pbs/polaris.pbs",
                                         "$HOME/nologin.pbs")
    for case, (given, said) in enumerate((
            ("", "no project: qstat names no Account_Name"),
            ("-v PROJECT=MYPROJECT ", "this shell has no `module` command"))):
        (tmp_path / str(case)).mkdir()
        site = FakeSite(tmp_path / str(case), "polaris")
        result = site.submit(line.replace("qsub ", f"qsub {given}"),
                             home_files={"nologin.pbs": text})
        assert result.status == 2, result.output
        [error] = errors(result.output)
        assert said in error, result.output
