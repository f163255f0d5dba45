"""The asynchronous flusher: stage -> one HDF5 bundle per node per checkpoint on the PFS.

Call order (agent main thread): `submit(manifest, source)` for each captured checkpoint,
then `close(timeout)` at drain. Worker threads run at low CPU and I/O priority, share one
token bucket (the byte-rate limit of the node), and retry failures with capped
exponential backoff: a PFS that is down or full delays the flush, it never loses the
staged data and never crashes the agent. An unexpected error (a bug) is reported, then
goes where any thread's does (`threading.excepthook`: the agent ends). Every outcome is
handed to `report`, which the agent forwards to the coordinator; `report` must be
thread-safe.

A bundle already complete on the PFS whose files match the manifest is adopted, not
rewritten (an agent restarted after the rename but before the coordinator's commit).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from ..config import Flush
from ..errors import OperationError, describe
from ..events import EventLog
from ..fsutil import makedirs
from ..layout import bundle_path
from ..manifest import LocalManifest
from .bundle import BundleError, is_complete, read_manifest, write_bundle
from .throttle import TokenBucket

log = logging.getLogger(__name__)
Report = Callable[[dict[str, Any]], None]


class Flusher:
    def __init__(self, pfs_run: Path, settings: Flush, events: EventLog, report: Report) -> None:
        self.pfs_run = pfs_run
        self.settings = settings
        self.events = events
        self.report = report
        self.bucket = TokenBucket(settings.bandwidth)
        self._stop = threading.Event()
        self._futures: dict[str, Future[None]] = {}
        self._cancelled: set[str] = set()
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="flush",
                                        initializer=_lower_priority, initargs=(settings.nice,))

    def submit(self, manifest: LocalManifest, source: Path) -> None:
        """Queue the flush of one captured checkpoint (no-op if already queued)."""
        if manifest.ckpt in self._futures and not self._futures[manifest.ckpt].done():
            return
        self._cancelled.discard(manifest.ckpt)
        future = self._pool.submit(self._flush, manifest, source)
        future.add_done_callback(_raise_in_thread)
        self._futures[manifest.ckpt] = future

    def cancel(self, ckpt: str) -> None:
        """Stop retrying `ckpt` (it failed elsewhere); a write in progress completes."""
        self._cancelled.add(ckpt)
        future = self._futures.get(ckpt)
        if future is not None:
            future.cancel()

    def pending(self) -> list[str]:
        return [ckpt for ckpt, future in self._futures.items() if not future.done()]

    def close(self, timeout: float) -> list[str]:
        """Wait up to `timeout` for queued flushes; return the ones left unfinished."""
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.pending()
        self._stop.set()
        self._pool.shutdown(wait=not left, cancel_futures=True)
        return left

    def _flush(self, manifest: LocalManifest, source: Path) -> None:
        attempt = 0
        while not self._stop.is_set() and manifest.ckpt not in self._cancelled:
            try:
                self._attempt(manifest, source)
                return
            except Exception as exc:        # noqa: BLE001 (a worker must always report)
                if not isinstance(exc, (OSError, OperationError)):
                    self._failed(manifest, f"internal error: {exc!r}", final=True)
                    raise
                if not source.exists():
                    self._failed(manifest, f"{source}: staged copy is gone", final=True)
                    return
                if isinstance(exc, BundleError):    # the data is wrong: retrying cannot help
                    self._failed(manifest, str(exc), final=True)
                    return
                attempt += 1
                delay = backoff(attempt, self.settings.retry_max)
                self._failed(manifest, describe(exc), final=False, retry_in=delay)
                self._stop.wait(delay)

    def _attempt(self, manifest: LocalManifest, source: Path) -> None:
        target = bundle_path(self.pfs_run, manifest.ckpt, manifest.node)
        start = time.time()
        if _matches(target, manifest):
            self._done(manifest, target, start, adopted=True)
            return
        makedirs(target.parent)
        self.events.emit("flush_start", ckpt=manifest.ckpt, seq=manifest.seq,
                         bytes=manifest.bytes, target=str(target))
        progress = _Progress(manifest, self.report)
        write_bundle(target, manifest, source, chunk=self.settings.chunk, throttle=self.bucket,
                     on_bytes=progress.add, verify=self.settings.verify,
                     writers=self.settings.writers)
        self._done(manifest, target, start, adopted=False)

    def _done(self, manifest: LocalManifest, target: Path, start: float, adopted: bool) -> None:
        duration = time.time() - start
        self.events.emit("flushed", ckpt=manifest.ckpt, seq=manifest.seq, bytes=manifest.bytes,
                         duration=duration, adopted=adopted, target=str(target))
        self.report({"type": "flushed", "ckpt": manifest.ckpt, "node": manifest.node,
                     "bundle": target.name, "duration": duration, "adopted": adopted})

    def _failed(self, manifest: LocalManifest, error: str, final: bool,
                retry_in: float = 0.0) -> None:
        log.warning("flush of %s failed: %s%s", manifest.ckpt, error,
                    "" if final else f" (retry in {retry_in:.0f}s)")
        self.events.emit("flush_error", ckpt=manifest.ckpt, seq=manifest.seq, error=error,
                         final=final, retry_in=retry_in)
        self.report({"type": "flush_error", "ckpt": manifest.ckpt, "node": manifest.node,
                     "error": error, "final": final, "retry_in": retry_in})


def _raise_in_thread(future: Future[None]) -> None:
    """A pool keeps a worker's exception in its future, where nobody looks: hand it to
    the thread exception hook like any thread's."""
    exc = None if future.cancelled() else future.exception()
    if exc is not None:
        threading.excepthook(threading.ExceptHookArgs(
            (type(exc), exc, exc.__traceback__, threading.current_thread())))


class _Progress:
    """Rate-limited progress reports (at most two a second) for `cachex status`; called
    by every writer thread of the bundle."""

    def __init__(self, manifest: LocalManifest, report: Report) -> None:
        self.manifest, self.report = manifest, report
        self.done, self.last = 0, 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.last < 0.5:
                return
            self.last = now
            self.report({"type": "progress", "ckpt": self.manifest.ckpt, "stage": "flush",
                         "node": self.manifest.node, "done": self.done,
                         "total": self.manifest.bytes})


def _matches(target: Path, manifest: LocalManifest) -> bool:
    if not is_complete(target):
        return False
    try:
        return read_manifest(target).files == manifest.files
    except OperationError:
        return False


def _lower_priority(nice: int) -> None:
    """Per thread on Linux: a flush must not take CPU or disk from the trainer."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, psutil.Error, AttributeError):
        pass


def backoff(attempt: int, cap: float) -> float:
    """Exponential with jitter: uniform in [d/2, d], d = min(cap, 0.5 s x 2^attempt).
    Thousands of nodes that lost the PFS at one moment do not retry a recovering Lustre
    in lockstep, and none retries sooner than half the backoff."""
    delay = min(cap, 0.5 * 2 ** min(attempt, 16))
    return random.uniform(delay / 2, delay)
