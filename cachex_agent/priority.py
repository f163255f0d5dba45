"""The agent's CPU priority beside the trainer (`agent.nice`, `agent.sched`, `flush.nice`)
and the CPUs it runs on (`agent.cpus`).

Linux keeps the nice value and the scheduling policy per thread, and a new thread takes
its creator's: the agent lowers every thread it has at start-up (MPI's included), and the
threads it starts later inherit it. An unprivileged process may lower its priority but
not raise it again, so a thread asked for a nice value below the one it has keeps its
own (the flush threads run at max(`agent.nice`, `flush.nice`)).

    SCHED_BATCH  a CPU-bound thread: no wake-up preemption of the trainer's threads
    SCHED_IDLE   runs only on a core nothing else wants (on a fully busy node, the agent
                 may then wait for the trainer's next pause: partner-durable gets later)

Where the kernel groups processes by session (`kernel.sched_autogroup_enabled`, on in
most distributions), the CPU is shared between sessions first and nice acts only within
one: an agent in a session of its own (`srun`, `setsid`, a test's `start_new_session`)
would keep its share however nice its threads. So the agent also sets its session's
autogroup nice, but only when every process of that autogroup is an agent of this job
on this host or one of its launchers (its ancestors): a trainer that shares the
session is never slowed down with it. A process in the kernel's root group (a session
nobody started with setsid, as under some containers' init) has no autogroup to lower
and shares the CPU by nice alone. Under cgroup CPU weights (one Slurm step's cgroup
against another's), nothing inside the process can lower its share: bind the agent's
step to cores of its own instead (docs/benchmarks.md).

The CPUs: the job step's binding (`srun --cpu-bind`, the step cgroup's cpuset) is the
process's affinity when it starts. `agent.cpus` narrows every thread to a subset of it
(the kernel keeps the affinity per thread too, and a new thread takes its creator's);
a CPU outside the binding is a configuration error, never silently widened. What the
agent ends up with sizes its threads (`peer.streams`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

import psutil

from .errors import ConfigError

POLICIES = {"other": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}
_TASKS = "/proc/self/task"
_PROC = "/proc"


def lower_process(nice: int, sched: str = "other", peers: Iterable[int] = ()) -> list[str]:
    """Every thread of this process at `nice` (never higher priority than it has) and
    under `sched`, and its autogroup at `nice` if only `peers` (this job's agents on the
    host) and this process's ancestors are in it; what could not be done, one line each
    (the agent logs them)."""
    problems = []
    for tid in (int(t) for t in os.listdir(_TASKS)):
        problems += _lower(tid, nice, POLICIES[sched])
    if nice:
        problems += _lower_autogroup(nice, peers)
    return sorted(set(problems))


def bind_cpus(cpus: Iterable[int]) -> list[int]:
    """Every thread of this process on `cpus` (all of the step's binding if empty); the
    CPUs it runs on now. ConfigError if `cpus` names one outside the binding."""
    binding = os.sched_getaffinity(0)
    wanted = set(cpus)
    if not wanted or wanted == binding:
        return sorted(binding)
    outside = sorted(wanted - binding)
    if outside:
        raise ConfigError(f"agent.cpus: CPU {outside[0]} is not in this job step's binding"
                          f" ({cpu_list(binding)})")
    for tid in (int(t) for t in os.listdir(_TASKS)):
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:
            pass        # the thread ended since it was listed
    return sorted(wanted)


def cpu_list(cpus: Iterable[int]) -> str:
    """0-3,8: the kernel's way of writing a CPU set."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def streams(configured: int, cpus: int) -> int:
    """Files in flight per partner (`peer.streams`): as configured, or one per two CPUs
    the agent runs on, 1 to 4 (the main loop and the capture keep a CPU busy already)."""
    return configured or max(1, min(4, cpus // 2))


def autogroup() -> tuple[str, int] | None:
    """This process's autogroup and its nice; None where the kernel has none."""
    return _autogroup(os.getpid())


def _autogroup(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"{_PROC}/{pid}/autogroup") as handle:
            name, _, nice = handle.read().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def _lower_autogroup(nice: int, peers: Iterable[int]) -> list[str]:
    own = autogroup()
    if own is None or own[1] >= nice:
        return []
    allowed = {os.getpid(), *peers, *_ancestors()}
    others = [pid for pid in _pids() if pid not in allowed
              and (group := _autogroup(pid)) is not None and group[0] == own[0]]
    if others:
        return [f"autogroup nice: left at {own[1]}, pid {others[0]} (not an agent of this"
                f" job) shares the session"]
    try:
        with open(f"{_PROC}/self/autogroup", "w") as handle:
            handle.write(str(nice))
    except OSError as exc:
        return [f"autogroup nice {nice}: {exc.strerror}"]
    return []


def _pids() -> list[int]:
    return [int(name) for name in os.listdir(_PROC) if name.isdigit()]


def _ancestors() -> set[int]:
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            break
    return found


def lower_thread(nice: int, idle_io: bool = False) -> None:
    """The calling thread at `nice` or below (and its I/O best-effort, lowest level)."""
    tid = threading.get_native_id()
    _lower(tid, nice, None)
    if idle_io:
        try:
            psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
        except (psutil.Error, OSError, AttributeError):
            pass


def _lower(tid: int, nice: int, policy: int | None) -> list[str]:
    try:
        if nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        if policy is not None and policy != os.sched_getscheduler(tid):
            # SCHED_OTHER, SCHED_BATCH, SCHED_IDLE: static priority 0; the nice value stays
            os.sched_setscheduler(tid, policy, os.sched_param(0))
    except ProcessLookupError:
        return []           # the thread ended since it was listed
    except OSError as exc:
        return [f"nice {nice}, policy {policy}: {exc.strerror}"]
    return []
