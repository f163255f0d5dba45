"""Erasure coding against memcpy: encode throughput and bytes stored per node, per scheme.

One process measures, alternating the kinds every repeat (rotated) so drift hits all:

  memcpy     np.copyto of one part's bytes, segment by segment, from a pool of random
             bytes into a buffer: the machine's limit for touching the bytes once.
  <scheme>   one member's share of the encoding of a group: its M parity chunks, each
             computed from K data chunks (erasure.Scheme.encode, per segment, only the
             parity the member keeps), for a part of the same size. XOR groups of 4 and
             8 (K = 3, 7) and rs:4+2 (zfec).

Throughput is the part's bytes over the time, so a ratio of 1.0 means the member
encodes its share as fast as it could copy its part once. Stored per node is the parity
a member keeps over its part (M x chunk / part; `copy` keeps its partner's whole part).

Under `mpiexec -n N` (N >= 2), every rank also stages a part of --part bytes in /dev/shm
and the real exchange (peer/encode_exchange.encode_part: reads, Isend/Irecv, encoding,
parity writes with fsync, manifest) runs as one XOR group of N ranks, against memcpy of
the part; then rank 1 is taken as lost and its part rebuilt from the others' data and
parity (recovery/erasure_rebuild.rebuild_parts: the transfer, decoding, checksums, the
files written, fsynced, checked and renamed), against the same memcpy. N ranks share the
machine's cores, so read both as an upper bound on the cost.

    [mpiexec -n 4] python benchmarks/redundancy.py [--part 256MiB] [--segment 1MiB]
                                                   [--repeat 3] [--json FILE]
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
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cachex_agent.checksum import file_checksum  # noqa: E402
from cachex_agent.config import parse_size  # noqa: E402
from cachex_agent.manifest import FileEntry, LocalManifest  # noqa: E402
from cachex_agent.peer.erasure import Scheme, chunk_length, segments  # noqa: E402

MiB = 1024**2
SCHEMES = {"xor g4": Scheme(3, 1), "xor g8": Scheme(7, 1), "rs:4+2": Scheme(4, 2)}
POOL = 64 * MiB     # random source bytes, larger than the caches


def memcpy(pool: np.ndarray, part: int, segment: int) -> float:
    out = np.empty(segment, np.uint8)
    start = time.perf_counter()
    for offset, length in segments(part, segment):
        at = offset % (pool.nbytes - segment)
        np.copyto(out[:length], pool[at:at + length])
    return time.perf_counter() - start


def encode_share(code: Scheme, pool: np.ndarray, part: int, segment: int) -> float:
    """One member's parities: for each of its M codewords, every segment of K chunks."""
    chunk = chunk_length(part, code.k)
    start = time.perf_counter()
    for parity in range(code.m):
        for offset, length in segments(chunk, segment):
            data = []
            for j in range(code.k):
                at = (offset + j * chunk) % (pool.nbytes - segment)
                data.append(pool[at:at + length])
            code.encode(data, [parity])
    return time.perf_counter() - start


def stored_ratio(code: Scheme | None, part: int) -> float:
    return 1.0 if code is None else code.m * chunk_length(part, code.k) / part


def kernels(args: argparse.Namespace, part: int, segment: int) -> dict[str, Any]:
    pool = np.frombuffer(np.random.default_rng(1).bytes(POOL), np.uint8)
    kinds = ["memcpy", *SCHEMES]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}

    def run(kind: str) -> float:
        if kind == "memcpy":
            return memcpy(pool, part, segment)
        return encode_share(SCHEMES[kind], pool, part, segment)
    for kind in kinds:
        run(kind)                               # warm-up: page faults, zfec tables
    for r in range(args.repeat):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            times[kind].append(run(kind))
        print(f"repeat {r + 1}: " + "  ".join(f"{k} {times[k][-1]:.3f}s" for k in kinds),
              flush=True)
    rate = {k: part / MiB / statistics.median(v) for k, v in times.items()}
    return {"seconds": times, "median_mib_s": rate,
            "ratio": {k: rate[k] / rate["memcpy"] for k in SCHEMES},
            "stored_per_part": {"copy": stored_ratio(None, part),
                                **{k: stored_ratio(c, part) for k, c in SCHEMES.items()}}}


def exchange(comm: Any, args: argparse.Namespace, part: int, segment: int) -> dict[str, Any]:
    """The real encode_part over the ranks as one XOR group, against memcpy."""
    from cachex_agent.peer.encode_exchange import encode_part
    from cachex_agent.recovery.erasure_rebuild import rebuild_parts
    root = Path(tempfile.mkdtemp(prefix=f"cachex-bench-ec-{comm.rank}-", dir="/dev/shm"))
    try:
        source = root / "stage"
        source.mkdir()
        pool = np.frombuffer(np.random.default_rng(comm.rank).bytes(POOL), np.uint8)
        with open(source / "part.bin", "wb") as handle:
            for _offset, length in segments(part, POOL):
                handle.write(pool[:length])
        entry = FileEntry("part.bin", part, 0o600, file_checksum(source / "part.bin"))
        times: dict[str, list[float]] = {"memcpy": [], "exchange": [], "rebuild": []}
        group = list(range(comm.size))
        for r in range(args.repeat + 1):
            manifest = LocalManifest("bench", f"c{r}", r, comm.rank, "h", comm.rank, [entry])
            comm.Barrier()
            start = time.perf_counter()
            encode_part(comm, group, "xor", manifest, source, root / "parity", 600.0, segment)
            elapsed = comm.allreduce(time.perf_counter() - start, op=_max())
            copy = comm.allreduce(memcpy(pool, part, segment), op=_max())
            comm.Barrier()
            start = time.perf_counter()
            rebuild_parts(comm, [1], root / "parity", source, root / "rebuilt", manifest.ckpt,
                          600.0, segment)
            rebuilt = comm.allreduce(time.perf_counter() - start, op=_max())
            shutil.rmtree(root / "parity")
            shutil.rmtree(root / "rebuilt", ignore_errors=True)
            if r:                                   # the first is the warm-up
                times["exchange"].append(elapsed)
                times["rebuild"].append(rebuilt)
                times["memcpy"].append(copy)
        rate = {k: part / MiB / statistics.median(v) for k, v in times.items()}
        return {"ranks": comm.size, "seconds": times, "median_mib_s": rate,
                "ratio": rate["exchange"] / rate["memcpy"],
                "rebuild_ratio": rate["rebuild"] / rate["memcpy"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _max() -> Any:
    from mpi4py import MPI
    return MPI.MAX


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="256MiB", help="bytes of one node's part")
    parser.add_argument("--segment", default="1MiB", help="bytes encoded at once")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    args = parse(argv)
    part, segment = parse_size(args.part, "--part"), parse_size(args.segment, "--segment")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0],
                              "part": part, "segment": segment}
    if comm.rank == 0:
        print(f"part {part / MiB:.0f} MiB, segment {segment / MiB:g} MiB,"
              f" load {result['load']:.1f}", flush=True)
        result["kernels"] = kernels(args, part, segment)
    comm.Barrier()
    if comm.size > 1:
        found = exchange(comm, args, part, segment)
        if comm.rank == 0:
            result["exchange"] = found
    if comm.rank == 0:
        k = result["kernels"]
        for name in SCHEMES:
            print(f"{name:7s} encode {k['median_mib_s'][name]:8.1f} MiB/s  ratio"
                  f" {k['ratio'][name]:.2f} of memcpy ({k['median_mib_s']['memcpy']:.0f} MiB/s);"
                  f" stored per node {k['stored_per_part'][name]:.3f} x part")
        print(f"copy    stored per node {k['stored_per_part']['copy']:.3f} x part")
        if "exchange" in result:
            e = result["exchange"]
            print(f"exchange (xor over {e['ranks']} ranks, encode_part) ratio {e['ratio']:.2f}"
                  f" of memcpy ({e['median_mib_s']['exchange']:.1f} vs"
                  f" {e['median_mib_s']['memcpy']:.1f} MiB/s)")
            print(f"rebuild of one lost rank (rebuild_parts) ratio {e['rebuild_ratio']:.2f}"
                  f" of memcpy ({e['median_mib_s']['rebuild']:.1f} MiB/s,"
                  f" {statistics.median(e['seconds']['rebuild']):.2f}s)")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
