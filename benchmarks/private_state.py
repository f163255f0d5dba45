"""Imported for its effect: the agents a benchmark starts record their runs
(cachex_agent/runs.py) in a state directory of the benchmark's own, removed at exit,
never in the user's (where `cachex ls` would then find a benchmark's run)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

STATE = tempfile.mkdtemp(prefix="cachex-bench-state-")
os.environ["XDG_STATE_HOME"] = STATE
atexit.register(shutil.rmtree, STATE, ignore_errors=True)
