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
