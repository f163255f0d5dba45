import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))                  # support.py
sys.path.insert(0, str(Path(__file__).parent / "integration"))  # harness.py
# the benchmarks' modules the tests use (contention.py, predict.py, namespaces.py,
# coordinator_scale.py), found as the benchmarks find each other
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

# The user's own run records (cachex_agent/runs.py) are no place for the suite's: every
# process of this session, and every agent a module- or session-wide fixture starts
# before `state_dir` below has run, records into a directory of the session's own, and
# the session fails if the user's records changed while it ran.
USER_RUNS = (Path(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"))
             / "cachex" / "runs")
SUITE_STATE = tempfile.mkdtemp(prefix="cachex-suite-state-")
os.environ["XDG_STATE_HOME"] = SUITE_STATE


def user_records() -> dict[str, int]:
    try:
        return {p.name: p.stat().st_mtime_ns for p in USER_RUNS.iterdir()}
    except FileNotFoundError:
        return {}


USER_RECORDS = user_records()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SUITE_STATE, ignore_errors=True)
    if user_records() != USER_RECORDS:
        print(f"\nFAILED: the suite changed the user's run records in {USER_RUNS}"
              f" (before: {sorted(USER_RECORDS)}, after: {sorted(user_records())})",
              file=sys.stderr)
        session.exitstatus = 1


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
