"""Rules whose commit is a tracker file at the spool root naming the last complete save
(DeepSpeed's `latest`, Megatron's `latest_checkpointed_iteration.txt`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..names import is_checkpoint_name
from .base import CommitRule


class TrackerRule(CommitRule):
    """A checkpoint is committed once the tracker named it while its directory existed,
    and stays committed until its directory disappears; the tracker is rewritten in
    place, so a torn read names nothing and its next change is read again
    (docs/levels.md, Trackers). Subclasses set `tracker` and, where the tracker holds
    something else than the directory's name, `names` and `text_for`."""

    marker_implies_complete = True      # rank 0 writes the tracker after a barrier
    new_files = True    # a directory per save; the tracker (rewritten) is always copied

    def __init__(self) -> None:
        self._committed: set[str] = set()
        self._latest_sig: tuple[int, int, int] | None = None
        self._pending: str | None = None    # save named by the tracker, not yet consumed

    @classmethod
    def names(cls, text: str) -> str | None:
        """The checkpoint directory the tracker's `text` names (None: torn or foreign)."""
        return text if _one_name(text) else None

    @classmethod
    def text_for(cls, ckpt_id: str) -> str | None:
        """What the tracker holds when it names `ckpt_id` (None: it cannot name it)."""
        return ckpt_id

    @classmethod
    def read(cls, tracker: Path) -> str | None:
        """The checkpoint the tracker file names (None: missing, torn or foreign)."""
        try:
            text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        return cls.names(text)

    @property
    def root_files(self) -> tuple[str, ...]:    # type: ignore[override]
        return (self.tracker,)

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        return [self.tracker] if self.read(Path(spool) / self.tracker) == ckpt_id else []

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        self._refresh_latest(spool / self.tracker)
        present = set(names)
        if self._pending in present:
            self._committed.add(self._pending)
            self._pending = None
        self._committed &= present
        return list(self._committed)

    def _refresh_latest(self, latest: Path) -> None:
        try:
            st = latest.stat()
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if sig == self._latest_sig:
                return
        except (FileNotFoundError, NotADirectoryError):
            self._latest_sig, self._pending = None, None
            return
        self._latest_sig = sig
        self._pending = self.read(latest)

    def forget(self, ckpt_id: str) -> None:
        self._committed.discard(ckpt_id)
        if self._pending == ckpt_id:
            self._pending = None


def _one_name(text: str) -> bool:
    # a tag is a single directory name; anything else is torn or foreign
    return bool(text) and "/" not in text and "\n" not in text and is_checkpoint_name(text)
