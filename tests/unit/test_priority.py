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


# agent.cpus: every thread narrowed to the set, later ones inherit; outside the binding
# is a configuration error naming the key and the binding
_CPUS = r"""
import json, os, sys, threading
from cachex_agent.errors import ConfigError
from cachex_agent.priority import bind_cpus
wanted = [int(c) for c in sys.argv[1].split(",") if c]
started = threading.Event()
before = threading.Thread(target=started.wait, daemon=True)
before.start()
try:
    got = bind_cpus(wanted)
except ConfigError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
seen = {}
after = threading.Thread(target=lambda: seen.update(after=sorted(os.sched_getaffinity(0))))
after.start(); after.join()
seen["before"] = sorted(os.sched_getaffinity(before.native_id))
seen["main"] = sorted(os.sched_getaffinity(0))
started.set()
print(json.dumps({"got": got, "seen": seen}))
"""


def cpus_child(wanted: str, binding: set[int] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _CPUS, wanted], capture_output=True,
                         text=True, timeout=30, check=True,
                         preexec_fn=(lambda: os.sched_setaffinity(0, binding))
                         if binding else None)
    return json.loads(out.stdout)


def test_agent_cpus_narrows_every_thread_and_later_ones_inherit():
    cpu = min(os.sched_getaffinity(0))
    result = cpus_child(str(cpu))
    assert result["got"] == [cpu]
    assert result["seen"] == {"before": [cpu], "after": [cpu], "main": [cpu]}


def test_no_agent_cpus_keeps_the_steps_binding():
    binding = {min(os.sched_getaffinity(0))}    # as srun --cpu-bind would leave it
    result = cpus_child("", binding)
    assert result["got"] == sorted(binding)
    assert result["seen"]["main"] == sorted(binding)


def test_agent_cpus_outside_the_binding_is_refused_with_the_binding_named():
    cpu = min(os.sched_getaffinity(0))
    result = cpus_child(f"{cpu},{cpu + 4096}", {cpu})
    assert result == {"error": f"agent.cpus: CPU {cpu + 4096} is not in this job step's"
                               f" binding ({cpu})"}


def test_cpu_lists_parse_and_print_as_the_kernel_writes_them():
    from cachex_agent.config import ConfigError, parse_cpus
    from cachex_agent.priority import cpu_list, streams
    assert parse_cpus("0-3,8", "agent.cpus") == (0, 1, 2, 3, 8)
    assert parse_cpus("", "agent.cpus") == ()
    assert parse_cpus([5, 2], "agent.cpus") == (2, 5)       # a TOML list
    assert cpu_list([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    for bad in ("3-1", "a", "1,,2", "-1", True):
        with pytest.raises(ConfigError, match="agent.cpus"):
            parse_cpus(bad, "agent.cpus")
    assert [streams(0, n) for n in (1, 2, 3, 4, 8, 64)] == [1, 1, 1, 2, 4, 4]
    assert streams(3, 1) == 3
