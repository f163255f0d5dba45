"""Flush throughput: HDF5 bundle vs the physical limit (raw sequential write + fsync).

Both sides read the same source files from /dev/shm (the stage) with the same chunk size
and end with fsync, rename and a directory fsync into the same target directory; the
bundle adds HDF5 metadata, xxh3-128 checksums of the bytes read and, with verify on (the
agent's default), a re-read of the renamed bundle. The bundle is written by 1, 2 and 4
writer threads (--writers; each copies whole files) with verify on, and by one writer
with verify off. Measurements alternate in one run (rotated each repeat) so drift of the
disk hits all of them;
each starts after os.sync() and deletes its output afterwards. The final lines compare
medians; "best" figures are printed too, since a shared disk's noise only ever adds time.

File-size mix: doubling sizes from --min-file (4, 8, 16, ... MiB) while the running sum
fits --total and the size stays <= --max-file, then the remainder in files of at most
--max-file. At 1 GiB that is 4..512 MiB (8 files, 1020 MiB) plus one 4 MiB file; a total
of 4 GiB or more also reaches 1 GiB files.

    python benchmarks/flush.py [--dir DIR] [--total 1GiB] [--repeat 3] [--writers 1,2,4]
                               [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import GiB, MiB, machine
from sources import write_sources

from cachex_agent.config import parse_size
from cachex_agent.flush.bundle import CHUNK, write_bundle
from cachex_agent.fsutil import fsync_dir
from cachex_agent.layout import bundle_name
from cachex_agent.manifest import LocalManifest


def file_sizes(total: int, smallest: int, largest: int) -> list[int]:
    """Doubling sizes from `smallest`, then the remainder in pieces of <= `largest`."""
    sizes: list[int] = []
    size = smallest
    while size <= largest and sum(sizes) + size <= total:
        sizes.append(size)
        size *= 2
    rest = total - sum(sizes)
    while rest > 0:
        piece = min(rest, largest)
        sizes.append(piece)
        rest -= piece
    return sizes


def make_sources(root: Path, sizes: list[int]) -> LocalManifest:
    names = [(f"rank{i % 8}/shard_{i:03d}.bin", size) for i, size in enumerate(sizes)]
    return LocalManifest(run="bench", ckpt="step_00001", seq=1, node=0, host="bench",
                         rank=0, files=write_sources(root, names))


def raw_write(target: Path, manifest: LocalManifest, source: Path, chunk: int) -> None:
    """What the bundle does minus HDF5 and checksums: one file, fsync, rename, fsync dir."""
    temp = target.with_name(f".{target.name}.tmp")
    buffer = np.empty(chunk, dtype=np.uint8)
    view = memoryview(buffer)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for entry in manifest.files:
            with open(source / entry.path, "rb", buffering=0) as handle:
                while n := handle.readinto(view):
                    written = 0
                    while written < n:
                        written += os.write(fd, view[written:n])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, target)
    fsync_dir(target.parent)


def timed(kind: str, out: Path, manifest: LocalManifest, source: Path, chunk: int) -> float:
    """`kind`: "raw", "verify=off" (one writer) or "writers=N" (verify on)."""
    target = out / (bundle_name(0) if kind != "raw" else "raw.bin")
    os.sync()                                   # start every run from a quiet disk
    start = time.perf_counter()
    if kind == "raw":
        raw_write(target, manifest, source, chunk)
    elif kind == "verify=off":
        write_bundle(target, manifest, source, chunk=chunk, verify=False)
    else:
        write_bundle(target, manifest, source, chunk=chunk,
                     writers=int(kind.partition("=")[2]))
    elapsed = time.perf_counter() - start
    target.unlink()
    fsync_dir(out)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="target directory (default: a new one under /tmp)")
    parser.add_argument("--total", default="1GiB")
    parser.add_argument("--min-file", default="4MiB")
    parser.add_argument("--max-file", default="1GiB")
    parser.add_argument("--chunk", default=str(CHUNK))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--writers", default="1,2,4",
                        help="bundle writer threads to compare (comma-separated)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed raw writes first (the first write into fresh page"
                             " cache is often slow on its own)")
    args = parser.parse_args(argv)
    total, chunk = parse_size(args.total, "--total"), parse_size(args.chunk, "--chunk")
    writers = [int(n) for n in args.writers.split(",")]
    sizes = file_sizes(total, parse_size(args.min_file, "--min-file"),
                       parse_size(args.max_file, "--max-file"))

    source = Path(tempfile.mkdtemp(prefix="cachex-bench-src-", dir="/dev/shm"))
    out = Path(tempfile.mkdtemp(prefix="cachex-bench-", dir=args.dir or "/tmp"))
    try:
        manifest = make_sources(source, sizes)
        print(f"{len(sizes)} files, {total / GiB:.2f} GiB, sizes MiB:"
              f" {[round(s / MiB, 1) for s in sizes]}; chunk {chunk // MiB} MiB;"
              f" target {out}")
        bundles = [f"writers={n}" for n in writers] + ["verify=off"]
        kinds = ["raw", *bundles]
        for _ in range(args.warmup):
            timed("raw", out, manifest, source, chunk)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(args.repeat):
            order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
            for kind in order:
                times[kind].append(timed(kind, out, manifest, source, chunk))
            print(f"repeat {r + 1}: " + "  ".join(f"{k} {times[k][-1]:.3f}s" for k in kinds),
                  flush=True)
        rate = {k: total / MiB / statistics.median(v) for k, v in times.items()}
        best = {k: total / MiB / min(v) for k, v in times.items()}
        for kind in kinds:
            print(f"{kind:10s} median {rate[kind]:7.1f} MiB/s   best {best[kind]:7.1f} MiB/s")
        ratios = {kind: rate[kind] / rate["raw"] for kind in bundles}
        print(f"ratios (bundle / raw write+fsync {rate['raw']:.1f} MiB/s, {total / GiB:.2f}"
              f" GiB; writers=N verify on, as the agent does)")
        for kind in bundles:
            print(f"  flush ratio ({kind}): {ratios[kind]:.2f}  ({rate[kind]:.1f} MiB/s)")
    finally:
        shutil.rmtree(source, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {**machine(), "bytes": total, "chunk": chunk, "times": times,
             "median_mib_s": rate, "best_mib_s": best, "ratios": ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
