"""What every commit rule is, and the spool listings they share."""

from __future__ import annotations

import abc
import fnmatch
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import ClassVar

from ..names import is_checkpoint_name, is_temp_dir_name, natural_sorted

# Temporary names written by the frameworks and by us: DCP's `.metadata.tmp`, our own
# `.name.tmp-cachex-<pid>-<token>` (fsutil.temp_name), editors, partial downloads, NFS
# silly-renames, Orbax tmp dirs.
TEMP_FILE = re.compile(
    r"(\.(tmp|temp|part|partial|swp)$|~$|\.tmp[-.]|^\.nfs|\.orbax-checkpoint-tmp)",
    re.IGNORECASE)


def is_temp_file(relpath: str) -> bool:
    """True for a path inside a checkpoint that must never be captured."""
    parts = relpath.split("/")
    if any(is_temp_dir_name(part) for part in parts[:-1]):
        return True
    return bool(TEMP_FILE.search(parts[-1]))


def checkpoint_names(spool: str | os.PathLike[str]) -> list[str]:
    """Candidate checkpoint directories of the spool (unsorted; none if it is missing)."""
    try:
        with os.scandir(spool) as entries:
            return [e.name for e in entries
                    if is_checkpoint_name(e.name) and _is_real_dir(e)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_real_dir(entry: os.DirEntry[str]) -> bool:
    # Symlinked checkpoint dirs are skipped: capture must not wander outside the spool.
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def listdir(directory: Path) -> list[str]:
    """The names in `directory` (none if it is missing)."""
    try:
        with os.scandir(directory) as entries:
            return [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []


def files_under(ckpt_dir: Path) -> list[str]:
    """Every file below `ckpt_dir`, relative and '/'-separated, sorted."""
    found = []
    for root, _dirs, names in os.walk(ckpt_dir):
        found += [Path(root, n).relative_to(ckpt_dir).as_posix() for n in names]
    return sorted(found)


def present(ckpt_dir: Path, patterns: Iterable[str]) -> list[str]:
    """The regular files of `ckpt_dir` matching any of the globs (relative, sorted)."""
    ckpt_dir = Path(ckpt_dir)
    found = {p.relative_to(ckpt_dir).as_posix() for pattern in patterns
             for p in ckpt_dir.glob(pattern) if p.is_file() and not p.is_symlink()}
    return sorted(f for f in found if not is_temp_file(f))


def holds_match(ckpt_dir: Path, pattern: str) -> bool:
    """Does `ckpt_dir` hold a file (at its top) whose name matches the glob?"""
    return any(fnmatch.fnmatchcase(name, pattern) and (Path(ckpt_dir) / name).is_file()
               for name in listdir(ckpt_dir))


class CommitRule(abc.ABC):
    """How one framework marks a checkpoint as complete. A framework's rule also says
    how `auto` recognises its layout (`recognises`, `priority`) and what the docs'
    table says of it (`doc`): registry.py lists the rules."""

    #: the `commit.rule` value that builds this rule
    name: str = ""
    #: `auto` asks the frameworks' rules in this order, lowest first
    priority: ClassVar[int] = 100
    #: a few words on what commits (the configuration reference's list)
    brief: ClassVar[str] = ""
    #: (framework, committed when, does the marker vouch for every rank, mirrored):
    #: the row of docs/levels.md's table
    doc: ClassVar[tuple[str, str, str, str]] = ("", "", "", "")
    #: a tracker file at the spool root naming the last complete save ("" for none)
    tracker: ClassVar[str] = ""
    #: True when commits can happen without any file system event (settle timers)
    needs_polling: bool = False
    #: seconds a checkpoint must stay unchanged (quiescence-based rules only)
    settle: float = 0.0
    #: files at the spool root (outside every checkpoint dir) that belong to a commit,
    #: e.g. DeepSpeed's `latest`; restore must rewrite them to name the restored id
    root_files: tuple[str, ...] = ()
    #: True when the framework writes the marker only after every rank finished writing
    #: (it gathers or barriers first): then the commit vouches for every node's files.
    #: Otherwise each node checks its own part (commit.settle) before capturing it.
    marker_implies_complete: bool = False
    #: True when the framework writes every save into new files (a directory of its own
    #: per step) and never rewrites a committed file in place: the capture may then
    #: hard-link the files inside the checkpoint directory instead of copying them
    #: (`stage.capture = auto`). Trackers at the spool root are rewritten by every save
    #: and are always copied. docs/levels.md says what each rule read.
    new_files: bool = False

    @classmethod
    def build(cls, settle: float, extra_global: Sequence[str],
              clock: Callable[[], float]) -> CommitRule:
        """The rule as `commit.rule`, `commit.settle` and `commit.globals` ask."""
        return cls()

    @classmethod
    def recognises(cls, ckpt_dir: Path, top: set[str], trackers: frozenset[str]) -> bool:
        """For `auto`: did this framework write `ckpt_dir` (names at its top `top`;
        the trackers present at the spool root `trackers`)?"""
        return False

    def committed(self, spool: Path) -> list[str]:
        """Ids whose commit marker is present in this node's spool, oldest first."""
        spool = Path(spool)
        return natural_sorted(self._select(spool, checkpoint_names(spool)))

    @abc.abstractmethod
    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        """Which of the candidate directory `names` are committed."""

    def global_files(self, ckpt_dir: Path) -> list[str]:
        """Files of `ckpt_dir` (relative, '/'-separated) that only the coordinator writes."""
        return []

    def ignore(self, relpath: str) -> bool:
        """True for files inside a checkpoint dir that must never be captured."""
        return is_temp_file(relpath)

    def vouches_for(self, ckpt_dir: Path) -> bool:
        """Does a commit of `ckpt_dir` (seen on any node) mean this node's files under it
        are complete? Keeps no state: the capture thread calls it."""
        return self.marker_implies_complete

    def forget(self, ckpt_id: str) -> None:
        """Drop what the rule remembers of `ckpt_id` (its directory is being re-created)."""
        return None     # stateless rules remember nothing

    def kind(self, ckpt_id: str) -> str:
        """The rule that decided `ckpt_id` (`auto` says which framework it recognised)."""
        return self.name

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        """Files at the spool root captured with `ckpt_id`: a tracker that names it, or
        the checkpoint itself when it is a single file. Keeps no state."""
        return []

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        """True when `ckpt_id` is a single file at the spool root, not a directory."""
        return False

    def generation(self, spool: Path, ckpt_id: str) -> object | None:
        """What tells one committed save of `ckpt_id` from the next under the same name
        (versions.py); None: the framework never commits a name twice, or this rule
        cannot tell (every save after the first is not captured: docs/levels.md).
        Asked by the watcher only once the rule says `ckpt_id` is committed."""
        return None

    def own_marker(self, ckpt_dir: Path) -> str | None:
        """A glob of the file this node must see at the top of its own part before
        capturing it (a marker every saving node writes, with no barrier before it),
        None when the commit suffices."""
        return None

    def tracker_due(self, spool: Path, ckpt_id: str) -> str | None:
        """A tracker at the spool root that may still come to name `ckpt_id`, written
        after the save that committed it (Megatron-LM's, after `metadata.json`): the
        capture waits for it a little (`commit.settle`). None: nothing to wait for.
        Keeps no state."""
        return None

    def writes_new_files(self, spool: Path, ckpt_id: str) -> bool:
        """May the files inside `ckpt_id`'s directory be captured by hard link (`new_files`)?
        Keeps no state: the capture thread calls it."""
        return self.new_files

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
