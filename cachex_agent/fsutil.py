"""Durable, private file operations: temp -> fsync -> rename -> fsync the directory.

Every file cachex creates is 0600 and every directory 0700, whatever the umask
(checkpoints are private model weights): files and directories are made only through
`create_file`, `open_private` and `makedirs` here. Trainer files restored into a spool
or exported get the permission bits recorded at capture (`trainer_mode`), never
setuid, setgid or sticky, and belong to the user running cachex.

Temporary names follow one scheme (`temp_name`, `partial_path`; `is_temporary` decides):
a hidden sibling `.<name>.tmp-cachex-<pid>` (or `-partial` for a directory assembled
before its rename), with `<name>` replaced by a hash when the result would pass the
255-byte limit of a name, so any name the file system allows can be written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from .errors import OperationError

FILE_MODE = 0o600
DIR_MODE = 0o700
NAME_MAX = 255                  # bytes in one path component (Linux file systems)
TEMP_MARK = ".tmp-cachex-"      # also matched by the spool rules' temporary-name pattern
_SUFFIX_ROOM = len(TEMP_MARK) + 19      # pid (at most 10 digits)-token, or "partial"
# a bare pid is an older version's name, still recognised (and cleaned up)
_TEMPORARY = re.compile(r"\..+" + re.escape(TEMP_MARK) + r"(?:\d+(?:-[0-9a-f]{8})?|partial)",
                        re.DOTALL)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ modes
def trainer_mode(mode: int) -> int:
    """The permission bits a trainer file may get back: never setuid, setgid, sticky."""
    return mode & 0o777


def create_file(path: str | os.PathLike[str], flags: int = os.O_WRONLY | os.O_TRUNC) -> int:
    """Open `path` for writing, created 0600 (an existing file is made 0600 too)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)        # the umask may have narrowed it; a reused file was wider
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: str | os.PathLike[str], buffering: int = -1) -> BinaryIO:
    """`open(path, "wb", buffering)`, but created 0600."""
    return os.fdopen(create_file(path), "wb", buffering=buffering)


def makedirs(path: str | os.PathLike[str]) -> Path:
    """mkdir -p: each directory created 0700, each parent that gained an entry fsynced.
    Directories that already exist are left as they are (they may be the user's)."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(DIR_MODE)
        except FileExistsError:
            continue                # another thread or agent made it: not ours to chmod
        os.chmod(directory, DIR_MODE)   # a umask such as 0o277 would have narrowed it
        fsync_dir(directory.parent)
    return path


# ------------------------------------------------------------------------ names
def derived_name(name: str, suffix: str = "", prefix: str = "") -> str:
    """`prefix + name + suffix`, or with `name` replaced by its hash when that would pass
    NAME_MAX bytes: derived names must exist for every name the file system allows."""
    whole = f"{prefix}{name}{suffix}"
    if len(os.fsencode(whole)) <= NAME_MAX:
        return whole
    return f"{prefix}{_digest(name)}{suffix}"


def _temp_stem(name: str) -> str:
    """The part of a temporary name that tells its final name (the same for any pid)."""
    if len(os.fsencode(name)) + 1 + _SUFFIX_ROOM <= NAME_MAX:
        return f".{name}"
    return f".{_digest(name)}"


def _digest(name: str) -> str:
    return hashlib.sha256(os.fsencode(name)).hexdigest()[:40]


def temp_name(path: Path) -> Path:
    """A sibling name that readers never trust (they only read renamed files). The pid
    alone would collide on a shared PFS, where two hosts' processes may have one pid."""
    token = secrets.token_hex(4)
    return path.with_name(f"{_temp_stem(path.name)}{TEMP_MARK}{os.getpid()}-{token}")


def partial_path(path: Path) -> Path:
    """The sibling directory where `path` is assembled before its rename."""
    return path.with_name(f"{_temp_stem(path.name)}{TEMP_MARK}partial")


def is_temporary(name: str) -> bool:
    """A name made by `temp_name` or `partial_path`: cachex's, and never finished."""
    return _TEMPORARY.fullmatch(name) is not None


def is_temporary_of(name: str, final: str) -> bool:
    """A temporary of the file or directory that will be called `final`."""
    return is_temporary(name) and name.rsplit(TEMP_MARK, 1)[0] == _temp_stem(final)


# ---------------------------------------------------------------------- writing
def commit_rename(temp: Path, final: Path) -> None:
    """Make `temp` durable under the name `final`."""
    fsync_file(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)


@contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int | None = None, sync: bool = True
                ) -> Iterator[BinaryIO]:
    """Write a file that appears whole under `path` (mode 0600, or `mode`: a trainer
    file's own bits, see trainer_mode) or not at all; `sync=False`: the rename itself
    is not made durable (no fsync of the directory), so after the host goes down the
    name holds this file or the one before, whole either way."""
    final = Path(path)
    temp = temp_name(final)
    try:
        with open_private(temp) as handle:
            yield handle
            handle.flush()
            if mode is not None:
                os.fchmod(handle.fileno(), trainer_mode(mode))
            os.fsync(handle.fileno())
        os.replace(temp, final)
        if sync:
            fsync_dir(final.parent)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], data: Any, compact: bool = False,
               sync: bool = True) -> int:
    """No indent: json's C encoder handles only that; the pure-Python one it falls back
    to was most of an agent's CPU per checkpoint. `compact` also drops the spaces, for
    large machine-read files (a global manifest, coordinator.json: O(nodes))."""
    text = compact_json(data) if compact else json.dumps(data, sort_keys=True)
    return write_bytes(path, text.encode() + b"\n", sync)


def compact_json(value: Any) -> str:
    """Sorted keys, no spaces: what `write_json(compact=True)` writes; pieces of it can
    be encoded once and joined (coordinator.json, a global manifest)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def write_bytes(path: str | os.PathLike[str], data: bytes, sync: bool = True) -> int:
    """`data` atomically under `path`, durably unless not `sync` (atomic_open); its
    length."""
    with atomic_open(path, sync=sync) as handle:
        handle.write(data)
    return len(data)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, "rb") as handle:
        return json.loads(handle.read())


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every directory of a tree (its files were fsynced as they were written)."""
    for directory, _dirs, _files in os.walk(root):
        fsync_dir(directory)


def is_under(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """True if `path`, symlinks resolved, is strictly below `root` (resolved)."""
    base = Path(root).resolve()
    target = Path(path).resolve()
    return target != base and base in target.parents


def remove_under(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """remove_tree, refused for any path that is not strictly below `root`: a name that
    came from a file (manifest, journal) can never make a removal leave its own root."""
    if not is_under(root, path):
        raise OperationError(f"{path}: refusing to remove, not under {root}")
    remove_tree(path)


def remove_tree(path: str | os.PathLike[str]) -> None:
    if not os.path.lexists(path):
        return              # nothing changes in the parent: no fsync to pay
    shutil.rmtree(path, ignore_errors=True)
    parent = Path(path).parent
    if parent.exists():
        fsync_dir(parent)


def remove_temporaries(directory: Path, recursive: bool = False,
                       only_of: frozenset[str] | None = None) -> list[Path]:
    """Remove what `is_temporary` calls ours in `directory` (and below, with
    `recursive`; `only_of`: only temporaries of these final names); return what went."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        path = Path(entry.path)
        if is_temporary(entry.name) and (only_of is None or any(
                is_temporary_of(entry.name, final) for final in only_of)):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        elif recursive and entry.is_dir(follow_symlinks=False):
            removed += remove_temporaries(path, True, only_of)
    if removed:
        fsync_dir(directory)
    return removed


def is_linked(path: str | os.PathLike[str]) -> bool:
    """A staged file that is also a name of the trainer's file (a capture by link whose
    spool name still exists): the trainer can still write it."""
    try:
        return os.stat(path).st_nlink > 1
    except OSError:
        return False


def linked_hint(path: str | os.PathLike[str]) -> str:
    """What a report of a staged file's checksum mismatch adds when it is linked."""
    return (" (captured by hard link: the trainer rewrote its file in place since)"
            if is_linked(path) else "")
