"""The network module chosen before MPI_Init (cachex_agent/mpi_env.py)."""

from __future__ import annotations

import subprocess
import sys

from cachex_agent.mpi_env import NETMOD, choose_netmod, wheel_mpich

SLURM_PMI2 = {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11"}


def test_the_wheel_under_the_pmi2_plugin_gets_ofi():
    environ = dict(SLURM_PMI2)
    line = choose_netmod(environ, wheel=True)
    assert environ[NETMOD] == "ofi"
    assert line is not None and line.startswith(f"{NETMOD}=ofi") and "pmi2" in line


def test_a_choice_of_the_user_is_kept():
    environ = {**SLURM_PMI2, NETMOD: "ucx"}
    assert choose_netmod(environ, wheel=True) is None
    assert environ[NETMOD] == "ucx"


def test_nothing_changes_off_slurm_pmi2_or_off_the_wheel():
    for environ, wheel in (({"PMI_FD": "11"}, True),                      # mpiexec (hydra)
                           ({"SLURM_MPI_TYPE": "cray_shasta"}, True),
                           ({"SLURM_MPI_TYPE": "pmi2"}, True),             # no PMI socket
                           (dict(SLURM_PMI2), False)):                     # a site MPI
        before = dict(environ)
        assert choose_netmod(environ, wheel=wheel) is None
        assert environ == before


def test_the_suite_runs_on_the_wheel():
    assert wheel_mpich()     # the [mpi] extra: what the rule above looks for


def test_the_chosen_module_starts_mpi():
    # a real MPI_Init on the module chosen, as one process (a singleton)
    code = ("import os; from cachex_agent.mpi_env import choose_netmod;"
            " print(choose_netmod(os.environ) is not None);"
            " from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())")
    env = {"PATH": "/usr/bin:/bin", "SLURM_MPI_TYPE": "pmi2", "PMI_FD": "-1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["True", "1"], done.stderr
