"""The PFS index (`<pfs>/<run>/index.json`): every checkpoint that reached the PFS or
never will, the one record of a run that outlives its agents and their journals.

    {"format": "cachex-index", "version": 1, "run": ..., "current": <newest valid id>,
     "pinned": true (only when set by `cachex index --current`),
     "checkpoints": [{"id", "seq", "state": valid|failed|purged, "bytes", "flushed_at"}]}

The coordinator writes it, after a checkpoint's global manifest is durable; between jobs
`cachex index` may pin `current` (what `recover` and `export` then pick) or drop a row
with its PFS files (set_current, drop: read, change, replace durably). The coordinator's
next write (its next flush) rebuilds it from its own state, unpinned. A
coordinator or an agent without a journal (its node was replaced) and `cachex status`
without agents read it. Anyone with write access to the run directory can change it, so
the one reader checks every value (safepath.py): an id names a PFS directory that the
coordinator later writes and purges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, OperationError
from .fsutil import makedirs, read_json, remove_under, write_json
from .layout import index_path, pfs_ckpt_dir, pfs_ckpts_dir
from .safepath import UnsafeInput, checkpoint_id
from .safepath import index as count

FORMAT = "cachex-index"
VERSION = 1
STATES = ("valid", "failed", "purged")


class NotAnIndex(OperationError):
    """The file is no index at all (not JSON, another format or version)."""


@dataclass(frozen=True)
class Row:
    id: str
    seq: int
    state: str              # one of STATES
    bytes: int
    flushed_at: float | None

    @property
    def level(self) -> str:
        """The coordinator's name for the state."""
        return "flushed" if self.state == "valid" else self.state


@dataclass(frozen=True)
class Index:
    run: str
    current: str | None     # the newest valid checkpoint, or the one pinned
    checkpoints: tuple[Row, ...]
    pinned: bool = False    # `current` chosen by `cachex index --current`

    @classmethod
    def build(cls, run: str, rows: list[Row]) -> Index:
        rows = sorted(rows, key=lambda r: r.seq)
        valid = [r.id for r in rows if r.state == "valid"]
        return cls(run, valid[-1] if valid else None, tuple(rows))

    def ids(self) -> set[str]:
        return {row.id for row in self.checkpoints}

    def row(self, ckpt: str) -> Row:
        """ConfigError (a usage error) naming `ckpt` and the ids there are."""
        for row in self.checkpoints:
            if row.id == ckpt:
                return row
        known = ", ".join(r.id for r in self.checkpoints) or "none"
        raise ConfigError(f"{ckpt}: unknown checkpoint in the index of run {self.run}"
                          f" (known: {known})")

    def to_json(self) -> dict[str, Any]:
        pinned = {"pinned": True} if self.pinned else {}
        return {"format": FORMAT, "version": VERSION, "run": self.run,
                "current": self.current, **pinned,
                "checkpoints": [asdict(r) for r in self.checkpoints]}


def state_of_level(level: str) -> str:
    """The index's name for a coordinator level (flushed, failed, purged)."""
    return "valid" if level == "flushed" else level


def read_index(pfs_run: Path) -> Index:
    """OSError: unreadable; NotAnIndex: not an index; UnsafeInput: a value that must not
    be used (each names the file)."""
    path = index_path(pfs_run)
    try:
        data = read_json(path)
    except ValueError as exc:       # not JSON, or not UTF-8 at all
        raise NotAnIndex(f"{path}: not JSON ({exc})") from None
    return from_json(data, path)


def from_json(data: Any, source: object) -> Index:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise NotAnIndex(f"{source}: not a {FORMAT}")
    if data.get("version") != VERSION:
        raise NotAnIndex(f"{source}: {FORMAT} version {data.get('version')!r} is not"
                         f" supported (this cachex reads version {VERSION})")
    rows = data.get("checkpoints")
    if not isinstance(rows, list):
        raise UnsafeInput(f"{source}: 'checkpoints' is not a list but {type(rows).__name__}")
    run, current = data.get("run"), data.get("current")
    if not isinstance(run, str):
        raise UnsafeInput(f"{source}: run {run!r} is not a string")
    if current is not None:
        checkpoint_id(current, source)
    pinned = data.get("pinned", False)
    if not isinstance(pinned, bool):
        raise UnsafeInput(f"{source}: pinned {pinned!r} is not true or false")
    return Index(run, current, tuple(_row(r, source) for r in rows), pinned)


def _row(row: Any, source: object) -> Row:
    if not isinstance(row, dict):
        raise UnsafeInput(f"{source}: a checkpoint row is not an object: {row!r}")
    ckpt = checkpoint_id(row.get("id"), source)
    if row.get("state") not in STATES:
        raise UnsafeInput(f"{source}: state {row.get('state')!r} of {ckpt} is not one of"
                          f" {', '.join(STATES)}")
    flushed_at = row.get("flushed_at")
    if flushed_at is not None and (type(flushed_at) not in (int, float)):
        raise UnsafeInput(f"{source}: flushed_at {flushed_at!r} of {ckpt} is not a time")
    return Row(ckpt, count(row.get("seq"), source, f"seq of {ckpt}"), row["state"],
               count(row.get("bytes"), source, f"bytes of {ckpt}"), flushed_at)


def write_index(pfs_run: Path, index: Index) -> None:
    """Durably replace the index (fsutil.write_json: temporary, fsync, rename)."""
    makedirs(pfs_run)
    write_json(index_path(pfs_run), index.to_json())


def set_current(pfs_run: Path, ckpt: str) -> Index:
    """Pin `ckpt`, a valid checkpoint of the index, as the one `recover` and `export`
    pick; the index replaced durably. Unknown: ConfigError; not valid: OperationError."""
    index = read_index(pfs_run)
    row = index.row(ckpt)
    if row.state != "valid":
        raise OperationError(f"{ckpt}: {row.state} in the index of run {index.run}, not"
                             " valid: only a flushed checkpoint can be current")
    pinned = Index(index.run, ckpt, index.checkpoints, pinned=True)
    write_index(pfs_run, pinned)
    return pinned


def drop(pfs_run: Path, ckpt: str) -> Index:
    """Remove `ckpt`'s row, then its PFS directory: the index never names files that are
    gone. A pinned current that is dropped gives way to the newest valid checkpoint."""
    index = read_index(pfs_run)
    index.row(ckpt)
    rows = [r for r in index.checkpoints if r.id != ckpt]
    rebuilt = Index.build(index.run, rows)
    if index.pinned and index.current != ckpt:
        rebuilt = Index(index.run, index.current, rebuilt.checkpoints, pinned=True)
    write_index(pfs_run, rebuilt)
    # remove_under: an id is checked (safepath) yet the removal still may not leave ckpt/
    remove_under(pfs_ckpts_dir(pfs_run), pfs_ckpt_dir(pfs_run, ckpt))
    return rebuilt


def pinned_current(pfs_run: Path) -> str | None:
    """The checkpoint pinned by `cachex index --current`, if any (no index: None)."""
    try:
        index = read_index(pfs_run)
    except (OSError, NotAnIndex):
        return None
    return index.current if index.pinned else None
