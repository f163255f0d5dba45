"""What this process has spent so far, for the agent's `counters` event.

CPU seconds of every thread (getrusage, which counts threads that have ended too), the
kernel's share of them, context switches, and CPU seconds by thread role: a thread's
name up to its first ':' or without a trailing '-<n>' or '_<n>' ("spool-watcher:/path"
and "flush_0" are "spool-watcher" and "flush"), so that a benchmark can say which stage
a cost grows in.
Linux only (/proc/self/task), like the rest of the agent.
"""

from __future__ import annotations

import os
import re
import resource
import threading
from typing import Any

_TASKS = "/proc/self/task"
_SUFFIX = re.compile(r":.*$|[-_]\d+$")


def usage() -> dict[str, Any]:
    """cpu, cpu_sys (s), switches {voluntary, involuntary}, threads {role: s}."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": round(own.ru_utime + own.ru_stime, 6), "cpu_sys": round(own.ru_stime, 6),
            "switches": {"voluntary": own.ru_nvcsw, "involuntary": own.ru_nivcsw},
            "threads": {role: round(seconds, 3) for role, seconds in _by_role().items()}}


def _by_role() -> dict[str, float]:
    tick = os.sysconf("SC_CLK_TCK")
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    roles: dict[str, float] = {}
    for tid in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{tid}/stat", "rb") as handle:
                # the name in parentheses may hold spaces: fields count from its ')'
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue        # ended since listed
        role = _SUFFIX.sub("", names.get(int(tid), "native"))
        roles[role] = roles.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return roles
