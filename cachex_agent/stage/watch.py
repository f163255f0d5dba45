"""Watch the trainer's spool and report each checkpoint once its commit rule fires.

inotify (close-after-write, moved-to, create, delete, moved-from) makes commits visible
within milliseconds; a periodic scan backs it up (events lost to a queue overflow, file
systems without inotify, watch limits) and drives settle timers. Every evaluation asks
the rule about the whole spool, so a missed event costs latency, never correctness.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import CachexError
from ..rules import CommitRule

__all__ = ["SpoolWatcher"]

log = logging.getLogger(__name__)

try:
    from inotify_simple import INotify
    from inotify_simple import flags as _flags
except ImportError:  # pragma: no cover - inotify_simple is a dependency, but be lenient
    INotify = None  # type: ignore[assignment,misc]
    _flags = None  # type: ignore[assignment]

_MIN_PERIOD = 0.05        # floor of the settle-driven polling period
_SPOOL_POLL = 0.5         # how often to look for a spool that does not exist yet
_COALESCE = 0.01          # gather a burst of events into one evaluation
_BURST = 0.05             # events this soon after an evaluation are part of a burst
_STOP_JOIN = 10.0         # bound on stop(): a rule stuck on a hung file system
REMOVED = 256            # directories remembered as removed, newest first


class SpoolWatcher:
    """A daemon thread that calls `on_commit(ckpt_id)` once per committed checkpoint.

    `on_commit` runs on the watcher thread (or on the thread calling `rescan`) with the
    watcher's lock held, in oldest-first order: keep it short (enqueue work). It may call
    `forget` and `rescan`. An exception from it is logged; the id still counts as reported.
    `on_again(name)`, likewise, for each save of a reported name (its first, and each
    time the rule's `generation` of it changes: versions.py); False asks again at the
    next evaluation (the save is not accounted for yet).
    """

    def __init__(self, spool: Path, rule: CommitRule, on_commit: Callable[[str], None],
                 scan: float = 5.0, use_inotify: bool = True,
                 on_again: Callable[[str], bool] | None = None) -> None:
        if scan <= 0:
            raise ValueError(f"scan period must be > 0, got {scan!r}")
        self.spool = Path(spool)
        self.rule = rule
        self.on_commit = on_commit
        self.scan = float(scan)
        self.use_inotify = use_inotify
        self._lock = threading.RLock()      # rules keep state and are not thread-safe
        self._reported: set[str] = set()
        self.on_again = on_again
        self._generations: dict[str, object] = {}   # reported name -> its save's
        self._first_seen: dict[str, float | None] | None = None    # None: not listed yet
        self._removed: dict[str, float] = {}    # directories seen, then gone (newest REMOVED)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._inotify: INotify | None = None
        self._wds: dict[int, Path] = {}
        self._inotify_broken = INotify is None
        self._next_due = 0.0
        self._evaluated = 0.0       # monotonic time of the last evaluation
        #: monotonic time inotify last said the trainer wrote into the spool (-inf: never)
        self.written = float("-inf")
        self._last_error = ""

    # -- public API ---------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"spool-watcher:{self.spool}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = _STOP_JOIN) -> None:
        """Stop the thread and wait for it (at most `timeout` seconds)."""
        self._stop.set()
        self._wake()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("spool watcher on %s did not stop within %gs", self.spool, timeout)
                return      # it still owns the pipe and the inotify descriptor
        self._thread = None
        self._close_inotify()

    def rescan(self) -> list[str]:
        """Evaluate the rule now (on the calling thread); return the newly reported ids."""
        return self._evaluate()

    def forget(self, ckpt_id: str) -> None:
        """Allow `ckpt_id` to be reported again (its directory is being re-created)."""
        with self._lock:
            self._reported.discard(ckpt_id)
            self._generations.pop(ckpt_id, None)
            self.rule.forget(ckpt_id)

    @property
    def reported(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._reported)

    @property
    def inotify_active(self) -> bool:
        """True while inotify watches the spool (False: polling only)."""
        return self._inotify is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- evaluation ---------------------------------------------------------------

    def first_seen(self, ckpt_id: str) -> float | None:
        """When the checkpoint's directory appeared (None: it was there at start-up):
        the start of the trainer's write, for the model's write stage."""
        with self._lock:
            return (self._first_seen or {}).get(ckpt_id)

    def removed(self, ckpt_id: str) -> bool:
        """True if the checkpoint's directory was seen in the spool and is gone now (the
        trainer's retention deleted it before its capture: waiting for it is pointless)."""
        with self._lock:
            self._note_directories()
            return ckpt_id in self._removed

    def _note_directories(self) -> None:
        try:
            names = {e.name for e in os.scandir(self.spool) if e.is_dir()}
        except OSError:
            return
        now = None if self._first_seen is None else time.time()
        old = self._first_seen or {}
        self._first_seen = {name: old[name] if name in old else now for name in names}
        for name in names:
            self._removed.pop(name, None)
        # monotonic: only their order counts (the oldest forgotten first)
        self._removed.update((name, time.monotonic()) for name in old.keys() - names)
        for name in sorted(self._removed, key=self._removed.__getitem__)[:-REMOVED]:
            del self._removed[name]

    def _evaluate(self) -> list[str]:
        with self._lock:
            self._note_directories()
            try:
                ids = self.rule.committed(self.spool)
            except (OSError, ValueError, CachexError) as exc:
                # a dir deleted mid-scan, EACCES, a trainer's file that does not parse or
                # names an unsafe path: the next scan tries again. A rule's bug (any other
                # error) ends the agent (the watcher's thread, threading.excepthook)
                self._log_error(f"commit rule {self.rule.name} failed on {self.spool}: {exc!r}")
                return []
            finally:
                # After the rule ran: it may just have started a settle timer.
                self._evaluated = time.monotonic()
                self._next_due = self._evaluated + self._period()
            self._last_error = ""
            new = []
            for ckpt_id in ids:
                # Re-checked per id: on_commit may have called rescan() re-entrantly.
                if ckpt_id in self._reported:
                    self._saved_again(ckpt_id)
                    continue
                self._reported.add(ckpt_id)
                self._saved_again(ckpt_id)      # its first save: noted
                new.append(ckpt_id)
                self.on_commit(ckpt_id)     # its error is a bug: it ends the agent
            return new

    def _saved_again(self, ckpt_id: str) -> None:
        """A reported name the rule says is committed: a new save when the rule's token
        of it moved (the first one too: the node counts its saves, stage/saves.py)."""
        if self.on_again is None:
            return
        before = self._generations.get(ckpt_id)
        now = self.rule.generation(self.spool, ckpt_id)
        if now is None or now == before:
            return
        if self.on_again(ckpt_id) is not False:
            self._generations[ckpt_id] = now

    def _period(self) -> float:
        if self.rule.needs_polling:
            return min(self.scan, max(self.rule.settle / 2, _MIN_PERIOD))
        return self.scan

    def _log_error(self, message: str) -> None:
        # The same failure repeats every scan: say it once, then only at debug level.
        level = logging.DEBUG if message == self._last_error else logging.WARNING
        self._last_error = message
        log.log(level, "%s", message)

    # -- the thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except OSError as exc:   # the spool or inotify went away: watch again
                    log.warning("spool watcher on %s: %s", self.spool, exc)
                    self._close_inotify()
                    self._stop.wait(min(self.scan, 1.0))
                # any other error is a bug: it reaches threading.excepthook (the agent
                # ends visibly) instead of a watcher that silently misses commits
        finally:
            self._close_inotify()

    def _step(self) -> None:
        if not self.spool.is_dir():
            # The trainer may create its checkpoint directory only at the first save.
            self._close_inotify()
            self._sleep(min(self.scan, _SPOOL_POLL))
            return
        if self.use_inotify and self._inotify is None and not self._inotify_broken:
            self._open_inotify()
            self._next_due = 0.0    # files may predate the watches: look now
        timeout = self._next_due - time.monotonic()
        events = timeout > 0 and self._wait_for_events(timeout)
        if events:
            self.written = time.monotonic()
        if timeout <= 0 or events:
            if not self._stop.is_set():
                self._evaluate()

    def _sleep(self, seconds: float) -> None:
        readable, _, _ = select.select([self._wake_r], [], [], seconds)
        if readable:
            self._drain_wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        try:
            os.read(self._wake_r, 4096)
        except OSError:
            pass

    # -- inotify ------------------------------------------------------------------

    def _mask(self) -> int:
        f = _flags
        return (f.CLOSE_WRITE | f.MOVED_TO | f.CREATE | f.DELETE | f.MOVED_FROM
                | f.DELETE_SELF | f.MOVE_SELF | f.ONLYDIR)

    def _open_inotify(self) -> None:
        try:
            self._inotify = INotify()
        except OSError as exc:      # no inotify instances left, or none in this kernel
            log.info("inotify unavailable (%s); polling %s every %gs", exc, self.spool,
                     self.scan)
            self._inotify_broken = True
            return
        self._wds = {}
        self._sync_watches()

    def _close_inotify(self) -> None:
        inotify, self._inotify = self._inotify, None
        self._wds = {}
        if inotify is not None:
            try:
                inotify.close()
            except OSError:
                pass

    def _sync_watches(self) -> None:
        """Watch every directory under the spool; drop watches of directories gone.

        inotify_add_watch on an already watched directory returns its existing
        descriptor, so re-walking is idempotent and also fixes paths after renames. A
        directory made inside one between its listing and its watch raises no event: walk
        again while walks find new directories.
        """
        for _ in range(4):
            if not self._sync_once():
                return

    def _sync_once(self) -> bool:
        """One walk; True if it added watches."""
        inotify = self._inotify
        if inotify is None:
            return False
        mask = self._mask()
        current: dict[int, Path] = {}
        for top, _dirs, _files in os.walk(self.spool):
            try:
                current[inotify.add_watch(top, mask)] = Path(top)
            except FileNotFoundError:
                continue    # removed while walking; its parent's DELETE tells us
            except NotADirectoryError:
                continue
            except OSError as exc:
                if Path(top) == self.spool or exc.errno == errno.ENOSPC:  # watch limit
                    log.warning("inotify watch on %s failed (%s); polling %s every %gs",
                                top, exc, self.spool, self.scan)
                    self._inotify_broken = True
                    self._close_inotify()
                    return False
                log.debug("cannot watch %s: %s", top, exc)
        for wd in set(self._wds) - set(current):
            try:
                inotify.rm_watch(wd)
            except OSError:
                pass    # already gone with its directory
        added = bool(set(current) - set(self._wds))
        self._wds = current
        return added

    def _wait_for_events(self, timeout: float) -> bool:
        """Block until file system events, a wake-up or `timeout`; True if events came."""
        inotify = self._inotify
        fds = [self._wake_r] + ([inotify.fileno()] if inotify is not None else [])
        readable, _, _ = select.select(fds, [], [], max(0.0, timeout))
        if self._wake_r in readable:
            self._drain_wake()
        if inotify is None or inotify.fileno() not in readable:
            return False
        if time.monotonic() - self._evaluated < _BURST:
            # the trainer is writing: one evaluation for the burst, not one per file; a
            # first event (the marker after a quiet spell) is looked at at once
            time.sleep(_COALESCE)
        self._handle(inotify.read(timeout=0))
        return True

    def _handle(self, events: list) -> None:
        f = _flags
        resync = False
        root_wd = next((wd for wd, path in self._wds.items() if path == self.spool), None)
        for event in events:
            if event.mask & f.Q_OVERFLOW:
                resync = True       # events were lost; the evaluation that follows rescans
            elif event.wd == root_wd and event.mask & (f.DELETE_SELF | f.MOVE_SELF | f.IGNORED):
                self._close_inotify()   # spool gone or renamed: start over when it is back
                return
            elif event.mask & f.IGNORED:
                self._wds.pop(event.wd, None)
            elif event.mask & f.ISDIR and event.mask & (f.CREATE | f.MOVED_TO | f.MOVED_FROM):
                # New or renamed directories: watch them (and their subtree, which may
                # have filled before the watch existed); the evaluation rescans.
                resync = True
        if resync:
            self._sync_watches()

    def __del__(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            for fd in (getattr(self, "_wake_r", -1), getattr(self, "_wake_w", -1)):
                try:
                    os.close(fd)
                except OSError:
                    pass
