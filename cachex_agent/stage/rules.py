"""Commit rules: when is a checkpoint in the spool complete?

A checkpoint is a top-level directory of the spool; its id is the directory name.
Data files are never written atomically, so a rule trusts only a marker that the
framework writes last (and usually on one node only: the agents forward what they see
to the coordinator, which announces the commit to everyone). Rules also say which files
only the coordinator writes ("global files", mirrored to every node after a commit) and
which files are temporary and must never be captured.

Rules keep memory between calls (DeepSpeed's `latest`, quiescence timers) and are not
thread-safe: one caller (the SpoolWatcher) serializes them.
"""

from __future__ import annotations

import abc
import fnmatch
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import ConfigError
from .quiescence import FileState, open_for_write, snapshot

__all__ = [
    "AutoRule",
    "CommitRule",
    "DcpRule",
    "DeepSpeedRule",
    "MarkerRule",
    "QuiescenceRule",
    "checkpoint_names",
    "is_checkpoint_name",
    "is_temp_file",
    "make_rule",
    "natural_key",
    "natural_sorted",
]

_NOT_IMPLEMENTED = ("megatron", "hf", "orbax", "torch")

# Temporary names written by the frameworks and by us: DCP's `.metadata.tmp`, our own
# `.name.tmp-cachex-<pid>` (fsutil.temp_name), editors, partial downloads, NFS
# silly-renames, Orbax tmp dirs.
_TEMP_FILE = re.compile(
    r"(\.(tmp|temp|part|partial|swp)$|~$|\.tmp[-.]|^\.nfs|\.orbax-checkpoint-tmp)",
    re.IGNORECASE)


def natural_key(text: str) -> tuple[tuple[object, ...], str]:
    """Sort key that orders step_9 before step_10 (ties broken by the raw text)."""
    # re.split with a capturing group alternates text/number, so positions compare
    # str with str and int with int.
    parts = tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", text)))
    return parts, text


def natural_sorted(ids: Iterable[str]) -> list[str]:
    return sorted(set(ids), key=natural_key)


def is_temp_dir_name(name: str) -> bool:
    """A directory that is being written under a name it will lose (HF, Orbax, ours)."""
    lowered = name.lower()
    return (lowered.endswith((".tmp", "-tmp")) or lowered.startswith("tmp-")
            or ".orbax-checkpoint-tmp" in lowered)


def is_checkpoint_name(name: str) -> bool:
    """Hidden and temporary top-level directories are never checkpoints."""
    return not (name.startswith(".") or is_temp_dir_name(name) or name == "lost+found")


def is_temp_file(relpath: str) -> bool:
    """True for a path inside a checkpoint that must never be captured."""
    parts = relpath.split("/")
    if any(is_temp_dir_name(part) for part in parts[:-1]):
        return True
    return bool(_TEMP_FILE.search(parts[-1]))


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


class CommitRule(abc.ABC):
    """How one framework marks a checkpoint as complete."""

    #: the `commit.rule` value that builds this rule
    name: str = ""
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

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class DcpRule(CommitRule):
    """PyTorch Distributed Checkpoint: `<id>/.metadata`, renamed into place last by the
    coordinator rank. `extra_global` adds coordinator-only files, e.g. `__0_0.distcp`
    when saving with `DefaultSavePlanner(dedup_save_to_lowest_rank=True)`."""

    name = "dcp"
    marker = ".metadata"
    marker_implies_complete = True      # the coordinator rank writes it after a gather

    def __init__(self, extra_global: Sequence[str] = ()) -> None:
        self.extra_global = tuple(extra_global)

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return [n for n in names if (spool / n / self.marker).is_file()]

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return [f for f in (self.marker, *self.extra_global) if (Path(ckpt_dir) / f).is_file()]


class DeepSpeedRule(CommitRule):
    """DeepSpeed: `<spool>/latest` holds the tag (`global_stepN` by default) of the last
    complete save; rank 0 writes it after every rank finished.

    A tag is committed once `latest` named it while its directory existed, and stays
    committed (older tags remain valid after a newer save) until its directory
    disappears. `latest` is rewritten in place (not atomic): a torn read names nothing
    or an older tag, and the next change of its inode/mtime/size makes us read it again.
    A tag that was consumed (or forgotten) is not committed again until `latest` is
    rewritten, so a re-created directory of the same name waits for the new save.
    An agent restarted mid-run learns only the tag `latest` names now; older ones come
    from its journal.

    Global files: `latest` lives outside the checkpoint dir (see `root_files`); inside
    it, `mp_rank_*_model_states.pt` is written by data-parallel rank 0 only (unless
    DeepSpeed's `use_node_local_storage` is on) yet every rank loads it.
    """

    name = "deepspeed"
    root_files = ("latest",)
    marker_implies_complete = True      # rank 0 writes `latest` after a barrier
    _GLOBAL = "mp_rank_*_model_states.pt"

    def __init__(self) -> None:
        self._committed: set[str] = set()
        self._latest_sig: tuple[int, int, int] | None = None
        self._pending: str | None = None    # tag named by `latest`, not yet consumed

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        self._refresh_latest(spool / "latest")
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
            tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self._latest_sig, self._pending = None, None
            return
        self._latest_sig = sig
        # A tag is a single directory name; anything else is torn or foreign.
        ok = tag and "/" not in tag and "\n" not in tag and is_checkpoint_name(tag)
        self._pending = tag if ok else None

    def global_files(self, ckpt_dir: Path) -> list[str]:
        return sorted(p.name for p in Path(ckpt_dir).glob(self._GLOBAL) if p.is_file())

    def forget(self, ckpt_id: str) -> None:
        self._committed.discard(ckpt_id)
        if self._pending == ckpt_id:
            self._pending = None


class MarkerRule(CommitRule):
    """A configured glob relative to the spool (`marker:*/COMMITTED`); the checkpoint is
    the first path component of each match, the matched files are its global files.
    Nothing says who writes the marker or when, so it vouches for no node's files."""

    def __init__(self, pattern: str) -> None:
        self.pattern = _check_marker(pattern)
        self.name = f"marker:{self.pattern}"
        parts = self.pattern.split("/")
        self._head, self._rest = parts[0], "/".join(parts[1:])

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        if self._head == "**":
            present = set(names)
            return {ckpt for ckpt, rel in self._spool_matches(spool) if ckpt in present}
        return [n for n in names
                if fnmatch.fnmatchcase(n, self._head) and self._inside(spool / n)]

    def _inside(self, ckpt_dir: Path) -> list[str]:
        return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.glob(self._rest)
                      if not self.ignore(p.relative_to(ckpt_dir).as_posix()))

    def _spool_matches(self, spool: Path) -> list[tuple[str, str]]:
        found = []
        for match in spool.glob(self.pattern):
            parts = match.relative_to(spool).parts
            if len(parts) >= 2 and not self.ignore("/".join(parts[1:])):
                found.append((parts[0], "/".join(parts[1:])))
        return found

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        if self._head == "**":
            rels = [rel for ckpt, rel in self._spool_matches(ckpt_dir.parent)
                    if ckpt == ckpt_dir.name]
        elif fnmatch.fnmatchcase(ckpt_dir.name, self._head):
            rels = self._inside(ckpt_dir)
        else:
            rels = []
        return sorted(r for r in rels if (ckpt_dir / r).is_file())


def _check_marker(pattern: str) -> str:
    pattern = pattern.strip()
    parts = PurePosixPath(pattern).parts if pattern else ()
    if not pattern or pattern.startswith("/") or ".." in parts:
        raise ConfigError(f"commit.rule: marker:<glob> needs a glob relative to the spool,"
                          f" like */COMMITTED; got {pattern!r}")
    if len(parts) < 2:
        raise ConfigError(f"commit.rule: marker glob {pattern!r} must name a file inside a"
                          f" checkpoint directory, like */COMMITTED")
    return "/".join(parts)


@dataclass
class _Observation:
    files: dict[Path, FileState]
    since: float            # when this exact file set was first seen (or a writer last seen)
    quiet: bool = False     # verified: no writer, settled


class QuiescenceRule(CommitRule):
    """Generic: a directory is committed when no process holds any of its files open for
    writing and its file set (paths, sizes, mtimes) has not changed for `settle` seconds.
    Empty directories are never committed. Timers live in this object, so it must be
    called repeatedly (`needs_polling`). The settle was measured on one node's files
    only: it vouches for no other node's."""

    name = "quiescence"
    needs_polling = True

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.settle = float(settle)
        self._clock = clock
        self._seen: dict[str, _Observation] = {}

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        now = self._clock()
        for gone in set(self._seen) - set(names):
            del self._seen[gone]
        ready = []
        for name in names:
            try:
                files = snapshot(spool / name)
            except FileNotFoundError:
                self._seen.pop(name, None)
                continue
            if self._settled(name, spool / name, files, now):
                ready.append(name)
        return ready

    def _settled(self, name: str, ckpt_dir: Path, files: dict[Path, FileState],
                 now: float) -> bool:
        if not any(not self.ignore(p.relative_to(ckpt_dir).as_posix()) for p in files):
            self._seen.pop(name, None)
            return False
        seen = self._seen.get(name)
        if seen is None or seen.files != files:
            seen = self._seen[name] = _Observation(files, now)
        if seen.quiet:
            return True
        if now - seen.since < self.settle:
            return False
        # Asking every process is the expensive part: only for candidates, once per
        # settle period while a writer holds a file open.
        if open_for_write(files):
            seen.since = now
            return False
        seen.quiet = True
        return True

    def forget(self, ckpt_id: str) -> None:
        self._seen.pop(ckpt_id, None)


class AutoRule(CommitRule):
    """Per checkpoint directory: DCP if it has `.metadata` or `*.distcp` files, DeepSpeed
    if `<spool>/latest` exists or it looks like a DeepSpeed save (`global_stepN`,
    `*_model_states.pt`, `*_optim_states.pt`), else quiescence.

    A recognized framework never falls back to quiescence: on nodes that do not hold the
    marker (DCP's `.metadata`, DeepSpeed's `latest` live on the coordinator only) the
    checkpoint is committed by the coordinator's announcement, not by a settle timer
    that a slow writer could outlast.
    """

    name = "auto"

    def __init__(self, settle: float, clock: Callable[[], float] = time.monotonic,
                 extra_global: Sequence[str] = ()) -> None:
        self.settle = float(settle)
        self._rules: dict[str, CommitRule] = {
            "dcp": DcpRule(extra_global), "deepspeed": DeepSpeedRule(),
            "quiescence": QuiescenceRule(settle, clock)}
        self._kind: dict[str, str] = {}

    @property
    def needs_polling(self) -> bool:
        return "quiescence" in self._kind.values()

    @property
    def root_files(self) -> tuple[str, ...]:
        return self._rules["deepspeed"].root_files if "deepspeed" in self._kind.values() else ()

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        has_latest = (spool / "latest").is_file()
        for gone in set(self._kind) - set(names):
            del self._kind[gone]
        groups: dict[str, list[str]] = {kind: [] for kind in self._rules}
        for name in names:
            groups[self._classify(spool / name, has_latest)].append(name)
        ready: list[str] = []
        for kind, rule in self._rules.items():
            ready.extend(rule._select(spool, groups[kind]))
        return ready

    def _classify(self, ckpt_dir: Path, has_latest: bool) -> str:
        kind = self._kind.get(ckpt_dir.name)
        if kind in ("dcp", "deepspeed"):
            return kind     # sticky: a framework save never turns generic again
        kind = detect_kind(ckpt_dir, has_latest)
        self._kind[ckpt_dir.name] = kind
        return kind

    def global_files(self, ckpt_dir: Path) -> list[str]:
        ckpt_dir = Path(ckpt_dir)
        kind = self._kind.get(ckpt_dir.name) or detect_kind(
            ckpt_dir, (ckpt_dir.parent / "latest").is_file())
        return self._rules[kind].global_files(ckpt_dir)

    def forget(self, ckpt_id: str) -> None:
        self._kind.pop(ckpt_id, None)
        for rule in self._rules.values():
            rule.forget(ckpt_id)

    def vouches_for(self, ckpt_dir: Path) -> bool:
        # Classified afresh from this node's files (`_kind` belongs to the watcher's
        # thread): a framework save vouches, the quiescence fallback does not.
        ckpt_dir = Path(ckpt_dir)
        kind = detect_kind(ckpt_dir, (ckpt_dir.parent / "latest").is_file())
        return self._rules[kind].vouches_for(ckpt_dir)


_DS_DIR = re.compile(r"global_step\d+")


def detect_kind(ckpt_dir: Path, has_latest: bool) -> str:
    """`dcp`, `deepspeed` or `quiescence` for one checkpoint directory (see AutoRule)."""
    try:
        with os.scandir(ckpt_dir) as entries:
            top = [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        top = []
    if any(n in (".metadata", ".metadata.tmp") or n.endswith(".distcp") for n in top):
        return "dcp"
    if (has_latest or _DS_DIR.fullmatch(ckpt_dir.name)
            or any(n.endswith(("_model_states.pt", "_optim_states.pt")) for n in top)):
        return "deepspeed"
    return "quiescence"


def make_rule(spec: str, settle: float, extra_global: Sequence[str] = ()) -> CommitRule:
    """Build the rule named by `commit.rule`; `extra_global`
    (`commit.globals`) names more coordinator-only files of a DCP checkpoint."""
    spec = str(spec).strip()
    if settle < 0:
        raise ConfigError(f"commit.settle: must be >= 0, got {settle!r}")
    if spec == "auto":
        return AutoRule(settle, extra_global=extra_global)
    if spec == "dcp":
        return DcpRule(extra_global)
    if spec == "deepspeed":
        return DeepSpeedRule()
    if spec == "quiescence":
        return QuiescenceRule(settle)
    if spec.startswith("marker:"):
        return MarkerRule(spec[len("marker:"):])
    if spec in _NOT_IMPLEMENTED:
        raise ConfigError(f"commit.rule: {spec!r} is not implemented yet (use auto, dcp,"
                          f" deepspeed, marker:<glob> or quiescence)")
    raise ConfigError(f"commit.rule: unknown rule {spec!r} (expected auto, dcp, deepspeed,"
                      f" marker:<glob> or quiescence)")
