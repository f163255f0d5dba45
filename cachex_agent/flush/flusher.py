"""The asynchronous flusher: stage -> one HDF5 bundle per node per checkpoint on the PFS.

Call order (agent main thread): `submit(manifest, source)` for each captured checkpoint
(a FlushHandle: handles.py), then `close(timeout)` at drain. Worker threads run at low
CPU and I/O priority, share one token bucket (the byte-rate limit of the node), and
retry failures with capped exponential backoff: a PFS that is down or full delays the
flush, it never loses the staged data and never crashes the agent. An unexpected error
(a bug) is reported, then goes where any thread's does (`threading.excepthook`: the
agent ends). Every outcome is handed to `report`, which the agent forwards to the
coordinator; `report` must be thread-safe.

A bundle already complete on the PFS whose files match the manifest is adopted, not
rewritten (an agent restarted after the rename but before the coordinator's commit).

With each bundle done, the worker appends the node's new events to its log on the PFS
(events.EventCopy), `flushed` included, before the coordinator hears of the flush.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ..config import Flush
from ..errors import OperationError, describe
from ..events import EventCopy, EventLog
from ..fsutil import makedirs
from ..handles import Handle, Stage, StageLog, State
from ..layout import bundle_path
from ..manifest import LocalManifest
from ..messages import Flushed, FlushError, Progress
from ..priority import lower_thread
from .bundle import BundleError, is_complete, read_manifest, write_bundle
from .throttle import TokenBucket

log = logging.getLogger(__name__)
Report = Callable[[Any], None]      # a report for the coordinator (messages.REPORTS)


class FlushHandle(Handle):
    """One checkpoint's bundle: queued in the pool, running per attempt, done once the
    bundle is renamed into place (or adopted), failed when retrying cannot help."""

    stage = Stage.FLUSH

    def __init__(self, manifest: LocalManifest, source: Path, flusher: Flusher) -> None:
        super().__init__(manifest.ckpt, manifest.seq, flusher.log)
        self.manifest, self.source, self.flusher = manifest, source, flusher
        self.future: Future[None] | None = None

    def _start(self) -> None:
        self.future = self.flusher.pool.submit(self.flusher.run, self)
        self.future.add_done_callback(_raise_in_thread)

    def _cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()        # a queued one never runs; a write in progress ends


class Flusher:
    def __init__(self, pfs_run: Path, settings: Flush, events: EventLog, report: Report,
                 log_: StageLog | None = None, events_copy: EventCopy | None = None) -> None:
        """`log_`: where stage states go (journal and events); events only if None.
        `events_copy`: the node's events to the PFS after each bundle (None: not)."""
        self.pfs_run = pfs_run
        self.events_copy = events_copy
        self.settings = settings
        self.log = log_ or StageLog(events)
        self.report = report
        self.bucket = TokenBucket(settings.bandwidth)
        self._stop = threading.Event()
        self.handles: dict[str, FlushHandle] = {}
        self.pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="flush",
                                       initializer=lower_thread, initargs=(settings.nice, True))

    def submit(self, manifest: LocalManifest, source: Path) -> FlushHandle:
        """Queue the flush of one captured checkpoint (the live handle if already queued)."""
        handle = self.handles.get(manifest.ckpt)
        if handle is not None and not handle.test():
            return handle
        handle = FlushHandle(manifest, source, self)
        self.handles[manifest.ckpt] = handle
        return handle.submit()

    def cancel(self, ckpt: str) -> None:
        """Stop retrying `ckpt` (it failed elsewhere); a write in progress completes."""
        handle = self.handles.get(ckpt)
        if handle is not None:
            handle.cancel()

    def pending(self) -> list[str]:
        """A worker still has it (after `close`, none does). Until the worker returns,
        not only until the handle ended: its report goes after the state is recorded,
        and a drain that took a flush done but unreported as finished told the
        coordinator `drained` before `flushed`, which then exited unfinalized."""
        return [ckpt for ckpt, handle in list(self.handles.items())
                if handle.future is not None and not handle.future.done()]

    def close(self, timeout: float) -> list[str]:
        """Wait up to `timeout` for queued flushes; return the ones left unfinished (their
        state stays `queued` or `running`: a restarted agent flushes them)."""
        # the workers, not the handles: a handle ends before its worker has reported
        wait([h.future for h in list(self.handles.values()) if h.future is not None],
             timeout=timeout)
        left = self.pending()
        self._stop.set()
        self.pool.shutdown(wait=not left, cancel_futures=True)
        return left

    def run(self, handle: FlushHandle) -> None:
        """A pool worker: attempts with backoff until done, failed, cancelled or closed."""
        source = handle.source
        attempt = 0
        while not self._stop.is_set() and not handle.cancelled.is_set():
            try:
                self._attempt(handle)
                return
            except Exception as exc:        # noqa: BLE001 (a worker must always report)
                if not isinstance(exc, (OSError, OperationError)):
                    self._failed(handle, f"internal error: {exc!r}", final=True)
                    raise
                if not source.exists():
                    self._failed(handle, f"{source}: staged copy is gone", final=True)
                    return
                if isinstance(exc, BundleError):    # the data is wrong: retrying cannot help
                    self._failed(handle, str(exc), final=True)
                    return
                attempt += 1
                delay = backoff(attempt, self.settings.retry_max)
                self._failed(handle, describe(exc), final=False, retry_in=delay)
                self._stop.wait(delay)
        if handle.cancelled.is_set():
            handle.set(State.CANCELLED)

    def _attempt(self, handle: FlushHandle) -> None:
        manifest = handle.manifest
        target = bundle_path(self.pfs_run, manifest.ckpt, manifest.node)
        start = time.monotonic()
        if _matches(target, manifest):
            self._done(handle, target, start, adopted=True)
            return
        makedirs(target.parent)
        handle.set(State.RUNNING, bytes=manifest.bytes, target=str(target))
        handle.hold(manifest.node, until=(self._stop, handle.cancelled))
        progress = _Progress(manifest, self.report)
        write_bundle(target, manifest, handle.source, chunk=self.settings.chunk,
                     throttle=self.bucket, on_bytes=progress.add, verify=self.settings.verify,
                     writers=self.settings.writers)
        self._done(handle, target, start, adopted=False)

    def _done(self, handle: FlushHandle, target: Path, start: float, adopted: bool) -> None:
        manifest = handle.manifest
        duration = time.monotonic() - start
        if handle.set(State.DONE, persist={"bundle": target.name}, bytes=manifest.bytes,
                      duration=duration, adopted=adopted, target=str(target)):
            self.report(flushed_report(manifest.ckpt, manifest.node, target.name, duration,
                                       adopted))
            self._copy_events()

    def copy_events_soon(self) -> None:
        """The node's new events to the PFS on a flush worker (never the MPI thread): a
        stage that ends after the bundle (the replication beside the flush) gets there
        too, not only at the next flush."""
        if self.events_copy is not None and not self._stop.is_set():
            self.pool.submit(self._copy_events)

    def _copy_events(self) -> None:
        """The bundle is durable already: a PFS that refuses the events now only delays
        them to the next flush."""
        if self.events_copy is None:
            return
        try:
            self.events_copy.copy()
        except OSError as exc:
            log.warning("events not copied to the PFS (next flush retries): %s",
                        describe(exc))

    def _failed(self, handle: FlushHandle, error: str, final: bool, retry_in: float = 0.0
                ) -> None:
        manifest = handle.manifest
        log.warning("flush of %s failed: %s%s", manifest.ckpt, error,
                    "" if final else f" (retry in {retry_in:.0f}s)")
        if final:
            handle.set(State.FAILED, error=error, final=True, retry_in=retry_in)
        else:
            handle.note("flush_error", error=error, final=False, retry_in=retry_in)
        self.report(FlushError(ckpt=manifest.ckpt, node=manifest.node, error=error,
                               final=final, retry_in=retry_in))


def flushed_report(ckpt: str, node: int, bundle: str, duration: float, adopted: bool
                   ) -> Flushed:
    """The coordinator's `flushed` report (also re-sent from the journal on resume)."""
    return Flushed(ckpt=ckpt, node=node, bundle=bundle, duration=duration, adopted=adopted)


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
            self.report(Progress(ckpt=self.manifest.ckpt, stage="flush",
                                 node=self.manifest.node, done=self.done,
                                 total=self.manifest.bytes))


def _matches(target: Path, manifest: LocalManifest) -> bool:
    if not is_complete(target):
        return False
    try:
        return read_manifest(target).files == manifest.files
    except OperationError:
        return False


def backoff(attempt: int, cap: float) -> float:
    """Exponential with jitter: uniform in [d/2, d], d = min(cap, 0.5 s x 2^attempt).
    Thousands of nodes that lost the PFS at one moment do not retry a recovering Lustre
    in lockstep, and none retries sooner than half the backoff."""
    delay = min(cap, 0.5 * 2 ** min(attempt, 16))
    return random.uniform(delay / 2, delay)
