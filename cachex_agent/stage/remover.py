"""Stage copies removed on a thread of their own.

A stage copy captured by hard link is the last name of the trainer's file once the
trainer's rotation removed its own: removing it frees every page of the part (on tmpfs
here, 31 ms of kernel time per 256 MiB, 134 ms per GiB). Eviction happens as a newer
checkpoint is captured, so on the main loop it held up that checkpoint's Puts. `discard`
renames the copy to a temporary name at once (it is gone from the stage before the
journal says `evicted`; an agent killed before the removal leaves a temporary that its
next start sweeps, cleanup.py) and the remover thread deletes it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

from ..errors import OperationError, describe
from ..fsutil import fsync_dir, is_under, remove_tree, temp_name

log = logging.getLogger(__name__)


class Remover:
    """One daemon thread deleting what `discard` set aside, oldest first."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="stage-remover", daemon=True)
        self._thread.start()

    def discard(self, root: Path, path: Path) -> None:
        """Take `path` (strictly below `root`) out of its directory now; delete it soon."""
        if not is_under(root, path):
            raise OperationError(f"{path}: refusing to remove, not under {root}")
        if not os.path.lexists(path):
            return
        aside = temp_name(path)
        try:
            os.rename(path, aside)
        except OSError as exc:      # as before the thread: removed here, what it can
            log.warning("stage copy %s not set aside (%s): removing it now", path,
                        describe(exc))
            remove_tree(path)
            return
        self._queue.put(aside)
        try:
            fsync_dir(path.parent)
        except OSError as exc:      # the rename stands; the next one's fsync covers it
            log.warning("stage directory %s not synced: %s", path.parent, describe(exc))

    def close(self, timeout: float) -> bool:
        """Finish the removals queued, up to `timeout` seconds; True if all are done
        (what is left is swept at the next start)."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                remove_tree(path)
            except OSError as exc:      # the next start's sweep tries again
                log.warning("stage copy %s not removed: %s", path, describe(exc))
