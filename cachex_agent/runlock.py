"""One coordinator per run: a lock file in the run's PFS directory.

    <pfs>/<run>/coordinator.lock    {"job", "host", "pid", "t"}: who coordinates the run

Two agent jobs that share a run name and a PFS would both number checkpoints, write
manifests and index, and remove each other's temporaries. The coordinator takes the
lock before any agent touches the PFS and refreshes it every `REFRESH` seconds from a
thread of its own (a hung PFS stalls only that thread). A lock is taken over when:
  - it names this same scheduler job (a restarted agent step of the job), or
  - it names a process of this host that no longer exists, or
  - it was not refreshed for `stale` seconds (the holder's job is gone or cut off).
Otherwise the second coordinator refuses with one line naming the holder.

Creating the lock is atomic (O_EXCL); a takeover replaces it with a rename, so a reader
never sees half a lock. Two coordinators taking over one stale lock at the same moment
both succeed: the window is one PFS round trip after `stale` seconds of silence.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from .errors import ConfigError
from .fsutil import create_file, fsync_dir, write_json
from .layout import run_lock_path

log = logging.getLogger(__name__)
REFRESH = 2.0       # seconds between refreshes of a held lock
STALE = 60.0        # seconds without a refresh before another job takes the run over


def stale_after(agent_timeout: float) -> float:
    """A lock not refreshed for this long is taken over: its holder is gone or cut off."""
    return max(STALE, 2 * agent_timeout)
_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")


def job_id() -> str:
    """The scheduler's job id, or the agent's process on its host outside a scheduler."""
    for name in _JOB_VARS:
        if os.environ.get(name):
            return f"{name.split('_')[0].lower()}:{os.environ[name]}"
    return f"pid:{os.getpid()}@{socket.gethostname()}"


class RunLock:
    """Held by the coordinator for as long as it runs; `release` on a clean exit."""

    def __init__(self, path: Path, record: dict[str, Any]) -> None:
        self.path, self.record = path, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, pfs_run: Path, stale: float) -> RunLock:
        path = run_lock_path(pfs_run)
        record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
                  "t": time.time()}
        try:
            fd = create_file(path, os.O_WRONLY | os.O_EXCL)
        except FileExistsError:
            refusal = blocking_holder(pfs_run, stale, record)
            if refusal is not None:
                raise ConfigError(f"{path}: {refusal}") from None
            holder = _read(path)
            log.warning("%s: taking over the run lock of job %s on %s: %s", path,
                        holder.get("job"), holder.get("host"),
                        _takeover_reason(holder, record, stale, _age(path)))
            write_json(path, record)
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(json.dumps(record, sort_keys=True).encode() + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(path.parent)
        return cls(path, record)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH):
            try:
                os.utime(self.path)
            except OSError as exc:      # a PFS hiccup: the next refresh tries again
                log.warning("%s: not refreshed: %s", self.path, exc)

    def release(self) -> None:
        """Remove the lock if it is still ours (a takeover may have replaced it)."""
        self._stop.set()
        if _read(self.path) == self.record:
            self.path.unlink(missing_ok=True)


def blocking_holder(pfs_run: Path, stale: float, me: dict[str, Any] | None = None
                    ) -> str | None:
    """Why a coordinator of this process could not take the run's lock now (a live
    holder of another job), or None when it could."""
    path = run_lock_path(pfs_run)
    if not path.exists():
        return None
    me = me or {"job": job_id(), "host": socket.gethostname()}
    holder, age = _read(path), _age(path)
    if _takeover_reason(holder, me, stale, age) is not None:
        return None
    return (f"run {pfs_run.name!r} is coordinated by job {holder.get('job')} on"
            f" {holder.get('host')} (pid {holder.get('pid')}, refreshed {age:.0f}s ago); a"
            " second coordinator refuses (another run name, or end that job)")


def _read(path: Path) -> dict[str, Any]:
    """The holder as recorded; an unreadable lock is treated as nobody's (taken over
    only once stale, like any other)."""
    try:
        value = json.loads(path.read_bytes()[:4096])
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _age(path: Path) -> float:
    try:
        return max(time.time() - path.stat().st_mtime, 0.0)
    except OSError:
        return float("inf")


def _takeover_reason(holder: dict[str, Any], me: dict[str, Any], stale: float,
                     age: float) -> str | None:
    if holder.get("job") == me["job"]:
        return "the same job (a restarted agent step)"
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) \
            and not _alive(holder["pid"]):
        return f"its process {holder['pid']} is gone"
    if age > stale:
        return f"not refreshed for {age:.0f}s"
    return None


def _alive(pid: int) -> bool:
    """A zombie is gone: killed agents stay zombies until their parent reaps them."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
