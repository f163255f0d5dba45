"""One coordinator per run: a lock file in the run's PFS directory.

    <pfs>/<run>/coordinator.lock    {"job", "host", "pid", "t", "token", "beat"}: who
                                    coordinates the run

Two agent jobs that share a run name and a PFS would both number checkpoints, write
manifests and index, and remove each other's temporaries. The coordinator takes the
lock before any agent touches the PFS and refreshes it every `REFRESH` seconds from a
thread of its own (a hung PFS stalls only that thread): each refresh rewrites the lock
with `beat` one higher. A lock is taken over when:
  - it names this same scheduler job (a restarted agent step of the job), or
  - it names a process of this host that no longer exists, or
  - its `beat` stood still for `stale` seconds while the contender watched it (the
    holder's job is gone or cut off).
Otherwise the second coordinator refuses with one line naming the holder. No clock of
two hosts is compared (`t` is the holder's clock, shown only): a contender judges the
lock by how long, on its own monotonic clock, it saw the same lock (beats.py). So it
waits up to one refresh before it refuses a live holder, and `stale` seconds before it
takes over a lock whose holder vanished without releasing it.

Each holder also counts itself in `<pfs>/<run>/coordinator.generation`, one more than
the holder before it (the lock makes it the only writer): its statuses carry that
generation, so of two coordinators' statuses the later one is told without comparing
the clocks of the hosts they ran on (status.newest).

Creating the lock is atomic (O_EXCL); a refresh or a takeover replaces it with a
rename, so a reader never sees half a lock. A refresh reads the lock, then rewrites it:
a holder that resumes after a stall of `stale` seconds can read its own record just
before a contender's takeover lands and then write over it. The taker remembers whose
lock it took over; when its refresh finds that holder's token back, it writes its own
again, and the displaced holder's next refresh finds the taker's and stops. Two
coordinators taking over one stale lock at the same moment both succeed: the window is
one PFS round trip after `stale` seconds of silence.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from .beats import Watch
from .errors import ConfigError
from .fsutil import create_file, fsync_dir, write_json
from .layout import run_generation_path, run_lock_path

log = logging.getLogger(__name__)
REFRESH = 2.0       # seconds between refreshes of a held lock
STALE = 60.0        # seconds without a refresh before another job takes the run over


def next_generation(pfs_run: Path) -> int:
    """One more than the run's previous coordinator's, recorded (the lock's holder only):
    the order of coordinators without a clock. 0 if the count cannot be kept (then the
    statuses fall back to their times, status.newest)."""
    path = run_generation_path(pfs_run)
    try:
        found = json.loads(path.read_bytes()[:256])     # a count, not a document
    except FileNotFoundError:
        found = {"generation": 0}
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); coordinators of this run are ordered by their"
                    " clocks from here on", path, exc)
        return 0
    last = found.get("generation") if isinstance(found, dict) else None
    if type(last) is not int or last < 0:
        log.warning("%s: not a count (%r); coordinators of this run are ordered by their"
                    " clocks from here on", path, last)
        return 0
    try:
        write_json(path, {"generation": last + 1})
    except OSError as exc:
        log.warning("%s: not written (%s)", path, exc)
        return 0
    return last + 1


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

    def __init__(self, path: Path, record: dict[str, Any], displaced: str | None = None
                 ) -> None:
        self.path, self.record = path, record
        self.displaced = displaced      # the token of the holder whose lock this took over
        self.generation = next_generation(path.parent)
        self._stop = threading.Event()
        self._writing = threading.Lock()    # a refresh never recreates a released lock
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, pfs_run: Path, stale: float) -> RunLock:
        path = run_lock_path(pfs_run)
        record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
                  "t": time.time(), "token": secrets.token_hex(8), "beat": 0}
        try:
            fd = create_file(path, os.O_WRONLY | os.O_EXCL)
        except FileExistsError:
            holder, reason = _judge(path, record, stale)
            if reason is None:
                raise ConfigError(f"{path}: {_refusal(pfs_run, holder)}") from None
            log.warning("%s: taking over the run lock of job %s on %s: %s", path,
                        holder.get("job"), holder.get("host"), reason)
            write_json(path, record)
            return cls(path, record, holder.get("token"))
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(json.dumps(record, sort_keys=True).encode() + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
            fsync_dir(path.parent)
        return cls(path, record)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH):
            with self._writing:
                if self._stop.is_set():
                    return
                try:
                    self._beat()
                except OSError as exc:      # a PFS hiccup: the next refresh tries again
                    log.warning("%s: not refreshed: %s", self.path, exc)

    def _beat(self) -> None:
        found = _read(self.path)
        token = found.get("token")
        if token is not None and token == self.displaced:
            log.warning("%s: job %s on %s, whose lock this job took over, wrote it again"
                        " (it resumed after a stall); taken back", self.path,
                        found.get("job"), found.get("host"))
        elif found and token != self.record["token"]:
            log.error("%s: the run lock was taken over by job %s on %s; no longer"
                      " refreshed", self.path, found.get("job"), found.get("host"))
            self._stop.set()
            return
        self.record = {**self.record, "beat": self.record["beat"] + 1}
        write_json(self.path, self.record)

    def release(self) -> None:
        """Remove the lock if it is still ours (a takeover may have replaced it). A
        refresh hung on the PFS is not waited for long: the lock then goes stale."""
        self._stop.set()
        if not self._writing.acquire(timeout=2 * REFRESH):
            return
        try:
            if _read(self.path).get("token") == self.record["token"]:
                self.path.unlink(missing_ok=True)
        finally:
            self._writing.release()


def blocking_holder(pfs_run: Path, stale: float, me: dict[str, Any] | None = None,
                    patience: float | None = None) -> str | None:
    """Why a coordinator of this process could not take the run's lock now (a live
    holder of another job), or None when it could. It watches the lock up to
    `patience` seconds (default `stale`) for a refresh; `cachex-agent --check` watches
    a few refreshes only: a lock that stood still that long is free for its purpose
    (the agents then wait out the rest of `stale` themselves)."""
    path = run_lock_path(pfs_run)
    if not path.exists():
        return None
    me = me or {"job": job_id(), "host": socket.gethostname()}
    holder, reason = _judge(path, me, stale if patience is None else patience)
    return _refusal(pfs_run, holder) if reason is None else None


def _refusal(pfs_run: Path, holder: dict[str, Any]) -> str:
    return (f"run {pfs_run.name!r} is coordinated by job {holder.get('job')} on"
            f" {holder.get('host')} (pid {holder.get('pid')}, its lock refreshed while"
            " this job watched); a second coordinator refuses (another run name, or end"
            " that job)")


def _read(path: Path) -> dict[str, Any]:
    """The holder as recorded; an unreadable lock is treated as nobody's (taken over
    only once stale, like any other)."""
    try:
        value = json.loads(path.read_bytes()[:4096])
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _judge(path: Path, me: dict[str, Any], patience: float
           ) -> tuple[dict[str, Any], str | None]:
    """The holder, and why `me` may take its lock over (None: a live holder)."""
    holder = _read(path)
    if holder.get("job") == me["job"]:
        return holder, "the same job (a restarted agent step)"
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) \
            and not _alive(holder["pid"]):
        return holder, f"its process {holder['pid']} is gone"
    live, holder, still = watch_lock(path).until_known(patience)
    if live:
        return holder, None
    return holder, f"not refreshed while this job watched it for {still:.0f}s"


def watch_lock(path: Path, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> Watch[dict[str, Any]]:
    """The lock read again and again: its record (a refresh raises `beat`) and its
    mtime (a holder of an older version refreshes with utime), for equality only."""
    def key(record: dict[str, Any]) -> Any:
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = None
        return json.dumps(record, sort_keys=True), mtime
    return Watch(lambda: _read(path), key, clock=clock, sleep=sleep)


def _alive(pid: int) -> bool:
    """A zombie is gone: killed agents stay zombies until their parent reaps them."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
