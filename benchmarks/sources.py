"""Staged checkpoint files for the benchmarks: incompressible, like trained weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachex_agent.checksum import file_checksum
from cachex_agent.manifest import FileEntry

MiB = 1024 * 1024


def write_sources(root: Path, named_sizes: list[tuple[str, int]]) -> list[FileEntry]:
    """Write each file under `root` in 64 MiB pieces; return manifest entries."""
    rng = np.random.default_rng(1)
    entries = []
    for name, size in named_sizes:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            left = size
            while left:
                n = min(left, 64 * MiB)
                handle.write(rng.bytes(n))
                left -= n
        entries.append(FileEntry(name, size, 0o644, file_checksum(path)))
    return entries
