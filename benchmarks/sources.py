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


def part_sizes(total: int, files: int) -> list[int]:
    """The sizes write_files gives (node 0's part of a checkpoint in DCP's shape also
    holds the 2-byte `.metadata`)."""
    return [total // files + (total % files if i == files - 1 else 0) for i in range(files)]


def write_files(directory: Path, total: int, count: int, seed: int = 1) -> list[str]:
    """`count` files of random bytes adding up to `total`; their relative paths."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, min(total // count, 64 * MiB) or 1, dtype=np.uint8).tobytes()
    names = []
    for i, size in enumerate(part_sizes(total, count)):
        name = f"shard_{i:03d}.bin"
        with open(directory / name, "wb") as handle:
            handle.write(rng.bytes(16))     # no two files alike
            left = size - 16
            while left > 0:
                left -= handle.write(block[:left])
        names.append(name)
    return names
