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

Run without mpiexec, it does all of that in one run: the kernels, then the exchange
under `mpiexec -n 4` of itself (`--only exchange`), then per scheme real agents
(benchmarks/redundancy_agents.py: `copy`, `xor` groups of 4 and 8 on --nodes virtual
nodes, `rs:4+2` on 6, each with --agents-part per node): commit to `replicated` against
the floor of every node copying its part and writing what the scheme stores, and the
rebuild of one lost node by `cachex recover` against `cp -r` of one part. The table
comes last; --json writes everything.

    [mpiexec -n 4] python benchmarks/redundancy.py [--part 256MiB] [--segment 1MiB]
                   [--repeat 3] [--nodes 8] [--agents-part 64MiB] [--agents-repeat 3]
                   [--dir /dev/shm] [--no-agents] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import BIN, MiB

from cachex_agent.checksum import file_checksum
from cachex_agent.config import parse_size, scheme_shape
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.peer.erasure import Scheme, chunk_length, segments

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
    parser.add_argument("--nodes", type=int, default=8, help="virtual nodes of the agents")
    parser.add_argument("--agents-part", default="64MiB", help="bytes per node (agents)")
    parser.add_argument("--agents-repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="the agents' node directories")
    parser.add_argument("--no-agents", action="store_true", help="kernels and exchange only")
    parser.add_argument("--only", choices=["exchange"], help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser.parse_args(argv)


def under_mpiexec() -> bool:
    return "PMI_RANK" in os.environ or "PMI_SIZE" in os.environ


def exchange_child(args: argparse.Namespace) -> dict[str, Any]:
    """The exchange on 4 ranks, in its own `mpiexec` (this process stays out of MPI)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([str(BIN / "mpiexec"), "-n", "4",
                        sys.executable, __file__, "--only", "exchange", "--part", args.part,
                        "--segment", args.segment, "--repeat", str(args.repeat),
                        "--json", out.name], check=True, timeout=1800)
        return json.loads(Path(out.name).read_text())["exchange"]


def agent_schemes(args: argparse.Namespace) -> list[dict[str, Any]]:
    from redundancy_agents import bench_scheme
    total = parse_size(args.agents_part, "--agents-part")
    runs = [("copy", "copy", 4, args.nodes), ("xor g4", "xor", 4, args.nodes),
            ("xor g8", "xor", 8, args.nodes), ("rs:4+2", "rs:4+2", 6, 6)]
    found = []
    for name, scheme, group, nodes in runs:
        if nodes < group or (scheme == "copy" and nodes < 2):
            print(f"  {name}: skipped, {nodes} nodes cannot make a group of {group}")
            continue
        shape = scheme_shape(scheme, group)     # these runs have no leftover nodes
        share = stored_ratio(Scheme(*shape) if shape else None, total)
        found.append({"name": name, **bench_scheme(name, scheme, group, nodes, share, total,
                                                   args.agents_repeat, args.dir)})
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    part, segment = parse_size(args.part, "--part"), parse_size(args.segment, "--segment")
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0],
                              "cores": os.cpu_count(), "part": part, "segment": segment}
    started = time.perf_counter()
    if under_mpiexec():
        return ranks(args, result, part, segment)
    print(f"part {part / MiB:.0f} MiB, segment {segment / MiB:g} MiB,"
          f" load {result['load']:.1f}", flush=True)
    result["kernels"] = kernels(args, part, segment)
    print("exchange and rebuild on 4 ranks", flush=True)
    result["exchange"] = exchange_child(args)
    if not args.no_agents:
        print(f"real agents, {args.agents_part} per node", flush=True)
        result["agents"] = agent_schemes(args)
    result["load_end"] = os.getloadavg()[0]
    result["runtime"] = time.perf_counter() - started
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def ranks(args: argparse.Namespace, result: dict[str, Any], part: int, segment: int) -> int:
    """Under mpiexec: rank 0's kernels (unless --only exchange), then the exchange."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.rank == 0 and args.only is None:
        result["kernels"] = kernels(args, part, segment)
    comm.Barrier()
    if comm.size > 1:
        found = exchange(comm, args, part, segment)
        if comm.rank == 0:
            result["exchange"] = found
    if comm.rank == 0:
        if args.only is None:
            report(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def report(result: dict[str, Any]) -> None:
    k = result.get("kernels")
    if k:
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
    if result.get("agents"):
        agents_table(result["agents"], k)
    if "runtime" in result:
        print(f"runtime {result['runtime']:.0f} s; load {result['load']:.1f} at the start,"
              f" {result['load_end']:.1f} at the end, {result['cores']} cores")


def agents_table(rows: list[dict[str, Any]], kernel: dict[str, Any] | None) -> None:
    """Medians; floor/replicated and cp/rebuild are the ratios (1.0: as fast as the floor)."""
    print(f"\n{'scheme':8} {'nodes':>5} {'stored':>7} {'enc/memcpy':>10} {'->replicated':>12}"
          f" {'floor':>7} {'floor/repl':>10} {'rebuild':>8} {'in all':>7} {'cp':>6}"
          f" {'cp/rebuild':>10}")
    for row in rows:
        encode = (f"{kernel['ratio'][row['name']]:.2f}"
                  if kernel and row["name"] in kernel["ratio"] else "-")
        print(f"{row['name']:8} {row['nodes']:>5} {row['stored_per_part']:>7.3f} {encode:>10}"
              f" {statistics.median(row['replicated']):>11.2f}s"
              f" {statistics.median(row['floor']):>6.2f}s {row['replicated_ratio']:>10.2f}"
              f" {row['recover']['spools']:>7.2f}s {row['recover']['all']:>6.2f}s"
              f" {row['cp_part']:>5.2f}s {row['recover_ratio']:>10.2f}")


if __name__ == "__main__":
    sys.exit(main())
