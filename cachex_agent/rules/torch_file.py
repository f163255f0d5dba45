"""`torch`: single-file checkpoints at the spool root (`torch.save`, Lightning's
`ModelCheckpoint`, safetensors; docs/levels.md, Frameworks: Lightning)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..names import natural_sorted
from .base import TEMP_FILE
from .settle import SettledRule

SUFFIXES = (".ckpt", ".pt", ".pth", ".safetensors")


class TorchFileRule(SettledRule):
    """A spool-root file is committed once no process holds it open for writing and it
    stayed unchanged for `settle` seconds (no marker exists); the file is the whole
    checkpoint and is mirrored to every node. Symbolic links are not checkpoints."""

    name = "torch"
    brief = "single files at the spool root, once settled"
    doc = ("`torch.save`, Lightning `ModelCheckpoint`, safetensors",
           "a `.pt`, `.pth`, `.ckpt` or `.safetensors` file at the spool root that no"
           " process holds open for writing and that stayed unchanged for `commit.settle`",
           "no", "the file itself (every rank loads it); symbolic links such as Lightning's"
           " `save_last=\"link\"` are not checkpoints")
    new_files = False   # torch.save truncates an existing file and writes it in place

    def committed(self, spool: Path) -> list[str]:
        spool = Path(spool)
        return natural_sorted(self._select(spool, checkpoint_files(spool)))

    def _select(self, spool: Path, names: list[str]) -> Iterable[str]:
        return self._quiet.settled_files(spool, names)

    def is_file_checkpoint(self, spool: Path, ckpt_id: str) -> bool:
        return is_checkpoint_file(ckpt_id)

    def generation(self, spool: Path, ckpt_id: str) -> object | None:
        """torch.save truncates and rewrites the file in place (the same inode), Lightning
        too: the size and modification time of the settled file tell saves apart."""
        return file_generation(Path(spool) / ckpt_id)

    def root_entries(self, spool: Path, ckpt_id: str) -> list[str]:
        path = Path(spool) / ckpt_id
        return [ckpt_id] if path.is_file() and not path.is_symlink() else []


def file_generation(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of a file, None when it is gone. Not the ctime: a capture
    by hard link changes it, and that is no new save."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def is_checkpoint_file(name: str) -> bool:
    """A spool-root file name that TorchFileRule treats as a checkpoint."""
    return (name.lower().endswith(SUFFIXES) and not name.startswith(".")
            and not TEMP_FILE.search(name))


def checkpoint_files(spool: str | os.PathLike[str]) -> list[str]:
    """Single-file checkpoints at the spool root (regular files, not links)."""
    try:
        with os.scandir(spool) as entries:
            return [e.name for e in entries if is_checkpoint_file(e.name)
                    and e.is_file(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
