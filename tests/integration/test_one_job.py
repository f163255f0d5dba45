"""One MPI job of agents, one coordinator per run: real agents refused at start-up."""

from __future__ import annotations

import os
import subprocess

import pytest
from harness import BIN, Cluster, same_run_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_second_job_on_the_same_run_is_refused_and_takes_over_once_the_first_ended(
        cluster, tmp_path):
    first = cluster(nodes=2)
    first.start_agents()
    second = cluster(nodes=2)
    second.root = tmp_path / "second"           # its own nodes, the first one's PFS run
    second.config = same_run_config(first, second.root)
    lock = first.pfs / "coordinator.lock"
    assert lock.exists()

    refused = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex-agent"), "--config",
         str(second.config)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if "cachex-agent" in line]
    assert len(lines) == 1, refused.stderr
    assert f"{lock}: run 't' is coordinated by job pid:" in lines[0]
    assert "a second coordinator refuses" in lines[0] and "Traceback" not in refused.stderr
    assert first.status()["state"] == "running"      # the first job did not notice

    assert first.stop() == 0
    assert not lock.exists()                          # a clean exit gives the run back
    second.start_agents()
    assert lock.exists()
    assert second.stop() == 0


def test_agents_that_did_not_form_one_mpi_job_refuse_with_one_line(tmp_path):
    """A PMI mismatch: the scheduler started 4 tasks, MPI made each a job of its own."""
    c = Cluster(tmp_path, nodes=3)
    procs = []
    for task in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_"))}
        env.update(SLURM_STEP_NUM_TASKS="4", SLURM_PROCID=str(task), SLURM_JOB_ID="77")
        procs.append(subprocess.Popen([str(BIN / "cachex-agent"), "--config", str(c.config)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2, 2], outputs
    said = [line for _, err in outputs for line in err.splitlines()]
    assert said == ["cachex-agent: error: MPI formed a job of 1 agent but the launcher"
                    " started 4 (SLURM_STEP_NUM_TASKS=4): the agents are not one MPI job;"
                    " use the `srun --mpi=` plugin (or mpiexec) of the MPI that mpi4py was"
                    " built with"], said
    assert not (c.pfs / "coordinator.lock").exists()


def test_check_prints_the_plan_and_refuses_what_the_agents_would(cluster):
    c = cluster(nodes=2)
    command = [str(BIN / "mpiexec"), "-n", "2", str(BIN / "cachex-agent"), "--config",
               str(c.config), "--check"]
    planned = subprocess.run(command, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "CRAY_MPICH_DIR": "/opt/cray/pe/mpich/8"})
    assert planned.returncode == 0, planned.stderr
    lines = planned.stdout.splitlines()
    assert lines[0].startswith("run t: 2 nodes, one agent each; coordinator on")
    assert "(writable, run lock free)" in lines[0]
    assert any(line.startswith("node 1 on ") and "replicas to 0" in line for line in lines)
    assert any(line.startswith("MPI library: ") and "libmpi" in line for line in lines)
    assert ("warning: node 0: the MPI of a PyPI wheel" in planned.stdout
            and "CRAY_MPICH_DIR=/opt/cray/pe/mpich/8" in planned.stdout), planned.stdout
    assert not (c.pfs / "coordinator.lock").exists()      # checked, not taken

    c.start_agents()
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "coordinator.lock: run 't' is coordinated by job pid:" in refused.stderr
    assert c.stop() == 0
