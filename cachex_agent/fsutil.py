"""Durable file operations: temp -> fsync -> rename -> fsync the directory."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from .errors import OperationError


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


def temp_name(path: Path) -> Path:
    """A sibling name that readers never trust (they only read renamed files)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def commit_rename(temp: Path, final: Path) -> None:
    """Make `temp` durable under the name `final`."""
    fsync_file(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)


@contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Write a file that appears whole under `path` or not at all."""
    final = Path(path)
    temp = temp_name(final)
    try:
        with open(temp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
        fsync_dir(final.parent)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    with atomic_open(path) as handle:
        handle.write(json.dumps(data, indent=1, sort_keys=True).encode() + b"\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, "rb") as handle:
        return json.loads(handle.read())


def makedirs(path: str | os.PathLike[str]) -> Path:
    """mkdir -p, fsyncing each parent that gained an entry."""
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        fsync_dir(directory.parent)
    return path


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
    shutil.rmtree(path, ignore_errors=True)
    parent = Path(path).parent
    if parent.exists():
        fsync_dir(parent)
