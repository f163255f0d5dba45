"""agent.nice / agent.sched: every thread lowered, later threads inherit (priority.py).
Each case runs in a child process: a lowered priority cannot be raised back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

_CHILD = r"""
import json, os, sys, threading, time
from cachex_agent.priority import autogroup, lower_process, lower_thread
nice, sched = int(sys.argv[1]), sys.argv[2]
started = threading.Event()
before = threading.Thread(target=started.wait, daemon=True)     # a thread already there
before.start()
problems = lower_process(nice, sched)
seen = {}
def look(name):
    tid = threading.get_native_id()
    seen[name] = [os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid)]
after = threading.Thread(target=look, args=("after",))            # one started later
after.start(); after.join()
look("main")
seen["before"] = [os.getpriority(os.PRIO_PROCESS, before.native_id),
                  os.sched_getscheduler(before.native_id)]
flush = threading.Thread(target=lambda: (lower_thread(int(sys.argv[3])), look("flush")))
flush.start(); flush.join()
started.set()
print(json.dumps({"problems": problems, "seen": seen, "autogroup": autogroup()}))
"""


def child(nice: int, sched: str, flush_nice: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(nice), sched, str(flush_nice)],
                         capture_output=True, text=True, timeout=30, check=True,
                         start_new_session=True)
    return json.loads(out.stdout)


# A session of its own (so an autogroup of its own, whatever session the test runner
# is in: CI's may be the kernel's root group, which has none) holding the child and a
# process that is neither an agent nor one of the child's ancestors.
_SHARED = r"""
import json, subprocess, sys
from cachex_agent.priority import autogroup
other = subprocess.Popen(["sleep", "60"])
try:
    out = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                         capture_output=True, text=True, timeout=30, check=True)
finally:
    other.kill()
print(json.dumps({"child": json.loads(out.stdout), "session": autogroup()}))
"""


def child_beside_another(nice: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _SHARED, _CHILD, str(nice), "other", "0"],
                         capture_output=True, text=True, timeout=40, check=True,
                         start_new_session=True)
    return json.loads(out.stdout)


def has_autogroup() -> bool:
    return os.path.exists("/proc/self/autogroup")


@pytest.mark.parametrize("sched,policy", [("batch", os.SCHED_BATCH), ("idle", os.SCHED_IDLE),
                                          ("other", os.SCHED_OTHER)])
def test_every_thread_and_every_later_one_runs_lowered(sched, policy):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    result = child(max(base, 7), sched, 3)
    assert result["problems"] == []
    # alone in its session: the session's autogroup is lowered too (where there is one)
    assert result["autogroup"] is None if not has_autogroup() else \
        result["autogroup"][1] == max(base, 7)
    for name in ("main", "before", "after"):
        assert result["seen"][name] == [max(base, 7), policy], (name, result)
    # a flush thread asked for less than the agent's nice keeps the agent's
    assert result["seen"]["flush"][0] == max(base, 7)


def test_a_nice_below_the_current_one_is_left_alone():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    result = child(0, "other", 0)
    assert result["problems"] == [] and result["seen"]["main"][0] == base


def test_an_autogroup_shared_with_another_process_is_left_alone():
    """A session shared with a process that is not this job's agent: threads lowered,
    the session's share of the CPU not (it would slow whatever else runs in it)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    result = child_beside_another(max(base, 5))
    assert result["child"]["seen"]["main"][0] == max(base, 5)
    if has_autogroup():
        problems = result["child"]["problems"]
        assert [p for p in problems if "shares the session" in p], result
        assert result["session"][1] == 0, result
    else:
        assert result["child"]["problems"] == [] and result["session"] is None
