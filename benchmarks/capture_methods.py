"""Capture methods: one file (--size, 1 GiB) captured within one file system, three ways.

  copy     the copy through user space, hashed in the same pass (checksum.copy_with_checksum:
           read into a 1 MiB buffer, hash, write; fsync)
  range    copy_file_range inside the kernel, fsync, then one read of the copy to hash it
           (checksum.copy_range_with_checksum)
  link     os.link, fsync, then one read to hash it (what a capture by link costs)

alternating every repeat, in each --dir (default /dev/shm and the disk of the system
temp directory), wall and CPU seconds (this process: a kernel copy is the caller's
system time), medians last. The capture takes `range` for copies within one file system
on disk and `copy` on tmpfs, whichever took less CPU here (docs/benchmarks.md).

    python benchmarks/capture_methods.py [--size 1GiB] [--repeat 5]
                                         [--dir /dev/shm --dir /var/tmp] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capture import timed
from common import MiB
from sources import write_files

from cachex_agent.checksum import (
    copy_range_with_checksum,
    copy_with_checksum,
    file_checksum,
)
from cachex_agent.config import parse_size
from cachex_agent.fsutil import fsync_file
from cachex_agent.stage.capture import file_system_type


def link_with_checksum(src: Path, dst: Path) -> tuple[int, str]:
    """What the capture does for a linked file (stage/capture.py, `_link_one`)."""
    os.link(src, dst)
    fsync_file(dst)
    return dst.stat().st_size, file_checksum(dst)


METHODS: dict[str, Callable[[Path, Path], tuple[int, str]]] = {
    "copy": copy_with_checksum, "range": copy_range_with_checksum, "link": link_with_checksum}


def bench_dir(root: Path, size: int, repeat: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cachex-bench-", dir=root))
    (name,) = write_files(work / "src", size, 1)
    src = work / "src" / name
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    sums = set()
    for rep in range(repeat):
        order = list(METHODS) if rep % 2 == 0 else list(reversed(METHODS))
        for method in order:
            dst = work / f"dst-{method}"
            got: list[tuple[int, str]] = []
            runs[method].append(timed(lambda m=method, d=dst, g=got: g.append(METHODS[m](src, d))))
            sums.add(got[0])
            dst.unlink()
            wall, cpu = runs[method][-1]
            print(f"  {root} {rep + 1}/{repeat} {method:6s} {wall:6.3f} s"
                  f" ({size / MiB / wall:6.0f} MiB/s, cpu {cpu:.3f} s)", flush=True)
    src.unlink()
    for path in sorted(work.rglob("*"), reverse=True):
        path.rmdir()
    work.rmdir()
    assert len(sums) == 1, f"the methods disagree on the bytes: {sums}"
    result: dict[str, Any] = {"dir": str(root), "fs": file_system_type(root), "bytes": size,
                              "load": os.getloadavg()[0]}
    for method, values in runs.items():
        result[method] = {"wall": statistics.median(w for w, _ in values),
                          "cpu": statistics.median(c for _, c in values),
                          "walls": [w for w, _ in values], "cpus": [c for _, c in values]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", action="append", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    size = parse_size(args.size, "--size")
    dirs = args.dir or ["/dev/shm", tempfile.gettempdir()]
    results = [bench_dir(Path(d), size, args.repeat) for d in dirs]
    for r in results:
        print(f"{r['dir']} ({r['fs']}, load {r['load']:.1f}): " + ", ".join(
            f"{m} {r[m]['wall']:.3f} s wall / {r[m]['cpu']:.3f} s cpu" for m in METHODS))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
