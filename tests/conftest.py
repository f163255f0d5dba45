import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))                  # support.py
sys.path.insert(0, str(Path(__file__).parent / "integration"))  # harness.py


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    """Agents record their run here (cachex_agent/runs.py) and commands look it up here,
    never in the user's home."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "cachex" / "runs"


def pytest_collection_finish(session):
    """pytest-mpi writes the MPI library's banner (some 20 lines) at the end of every
    rank's run: rank 0's says it once (its plugin reads `_is_testing_mpi` only there)."""
    if not session.config.getoption("--with-mpi", default=False):
        return
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != 0:
        for plugin in session.config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "MPIPlugin":
                plugin._is_testing_mpi = False
