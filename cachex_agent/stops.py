"""How an agent ends: a user's stop (a signal, or a stop file: `cachex stop`), or an
unexpected error (`abort`).

SIGTERM or SIGINT puts a `Stop` report into the inbox (the coordinator drains the job:
flush what it must, then exit); a second signal leaves at once. A stop file (in this
node's journal; on the coordinator's node also on the PFS) is read once a second and
acted on once per new token: a file already there when the agent started is an earlier
run's. Files are compared by token, never by time: their time is the clock of whoever
wrote them, not this host's. An unexpected error in any thread ends the agent and its
job at once, in one line and one event: the other agents would wait on it forever.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from .errors import describe
from .handles import Emitter
from .messages import Stop

log = logging.getLogger(__name__)
CHECK_EVERY = 1.0       # seconds between two looks at the stop files


class StopRequests:
    def __init__(self, files: list[Path], node: int, post: Callable[[Stop], None],
                 leave: Callable[[], None]) -> None:
        self.files, self.node, self.post, self.leave = files, node, post, leave
        self._stale = {path: stop_token(path) for path in files}
        self._checked = 0.0
        self._signals = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            self.leave()        # a second signal: leave now
        else:
            log.info("node %d: stop asked by signal %d", self.node, signum)
            self.post(Stop())

    def check(self) -> None:
        """A stop file with a new token: one `Stop` for it (at most once a second)."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY:
            return
        self._checked = now
        for path in self.files:
            token = stop_token(path)
            if token is None or token == self._stale.get(path):
                continue
            path.unlink(missing_ok=True)
            log.info("node %d: stop asked by %s", self.node, path)
            self.post(Stop(token=token))


def stop_token(path: Path) -> str | None:
    """Which stop request `path` holds (None: none): its token, or for a request without
    one (a hand-made file) the file's identity. Compared for equality only."""
    try:
        st = path.stat()
    except OSError:
        return None
    try:
        data = json.loads(path.read_bytes()[:4096])
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = None
    token = data.get("token") if isinstance(data, dict) else None
    if isinstance(token, str) and 0 < len(token) <= 64:
        return token
    return f"file {st.st_ino} {st.st_mtime_ns} {st.st_size}"


def abort(comm: Any, events: Emitter, who: str, where: str, exc: BaseException | None
          ) -> NoReturn:
    """`who` (the agent's rank, node and host) ends its job: `where` failed with `exc`."""
    error = f"{type(exc).__name__}: {describe(exc)}" if exc else "unknown error"
    log.error("agent %s: %s failed: %s; aborting the agent job", who, where, error)
    log.debug("traceback", exc_info=exc)
    try:
        events.emit("agent_failed", where=where, error=error)
    finally:
        comm.Abort(1)
        os._exit(1)         # Abort does not return; should it, this process ends anyway
