"""Recovery: `cachex recover` of a lost node's part against `cp` of the same bytes.

Two virtual nodes (one rank each, `mpiexec -n 2 cachex recover`); node 0 is lost (its
spool, stage and cache are gone, its replacement has an empty spool); node 1 survives
with its own small part in its spool (kept in place, verified) and node 0's part in its
replica store. Node 0's part is --size in --files files (1 GiB in 16 by default). The
state is written with the product's own writers (manifests, replica store, bundles),
then, alternating every repeat:

  cp        `cp -r` of node 0's replica directory to a fresh directory of node 0's spool
            (the same bytes, the same file systems)
  replica   `cachex recover`: node 0's part moved from node 1's replica over MPI
  cp-pfs    `cp` of node 0's bundle (its part plus HDF5 metadata) into node 0's spool
  pfs       `cachex recover --exclude replica`: node 0's part extracted from its bundle
  raw-mpi   the MPI floor: the replica's files sent by node 1 in 8 MiB messages, two in
            flight, and written by node 0 into plain files (no checksum, no rename): what
            any MPI recovery between two ranks on this host costs before it checks a byte

The recovered spool is removed between repeats (and the re-replicated part of node 1 on
node 0). Spool, stage, cache and replicas are on --dir (/dev/shm); the PFS directory is
--pfs (default: --dir as well, so that a disk's speed does not hide the product's cost;
pass a disk directory to include it). Times are medians. Three ratios per source, `cp`
over: the time until every spool is complete (the command's own `planned in` + `moved
in`: listing, planning, moving, verifying; the target, >= 0.6, is on this one: the
trainer may resume then), the command's whole time (`... in all`: re-replication to the
partners too) and recover's wall time (mpiexec, interpreter start and imports included;
the start-up alone, a --dry-run's wall time, is printed).

--profile runs one more recovery of each kind under cProfile, one file per rank, and
prints the top functions by cumulative time of each rank.

    python benchmarks/recover.py [--size 1GiB] [--files 16] [--repeat 3] [--dir /dev/shm]
                                 [--pfs DIR] [--profile] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BIN, MiB, machine, node_tree, write_config
from sources import write_files

from cachex_agent.checksum import file_checksum
from cachex_agent.config import load, parse_size
from cachex_agent.flush.bundle import write_bundle
from cachex_agent.fsutil import makedirs, write_json
from cachex_agent.layout import (
    bundle_path,
    journal_global_manifest_path,
    pfs_ckpt_dir,
    pfs_manifest_path,
    replica_dir,
)
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.peer.store import commit_replica, partial_dir

CKPT = "step_00001"
TARGET = 0.6
SURVIVOR_PART = 4 * MiB     # node 1's own part, kept in place


def local_manifest(node: int, directory: Path, names: list[str]) -> LocalManifest:
    files = [FileEntry(n, (directory / n).stat().st_size, 0o644, file_checksum(directory / n))
             for n in names]
    return LocalManifest(run="bench", ckpt=CKPT, seq=1, node=node, host=socket.gethostname(),
                         rank=node, files=files)


def build_state(config: Path, size: int, count: int) -> dict[str, Any]:
    """What a 2-node job leaves when node 0 is lost after its checkpoint was flushed."""
    cfg = load(config)
    node0, node1 = cfg.node_paths(0), cfg.node_paths(1)
    source = node0.spool_dir(CKPT)                    # removed below: node 0 is lost
    parts = [local_manifest(0, source, write_files(source, size, count)),
             local_manifest(1, node1.spool_dir(CKPT), write_files(node1.spool_dir(CKPT),
                                                                  SURVIVOR_PART, 1, seed=2))]
    pfs_run = node0.pfs
    makedirs(pfs_ckpt_dir(pfs_run, CKPT))
    for part, directory in zip(parts, (source, node1.spool_dir(CKPT)), strict=True):
        write_bundle(bundle_path(pfs_run, CKPT, part.node), part, directory, verify=False)
    manifest = GlobalManifest.build(parts, [], {"written": time.time()},
                                    {p.node: bundle_path(pfs_run, CKPT, p.node).name
                                     for p in parts})
    write_json(pfs_manifest_path(pfs_run, CKPT), manifest.to_json(), compact=True)
    makedirs(journal_global_manifest_path(node1.journal, CKPT).parent)
    write_json(journal_global_manifest_path(node1.journal, CKPT), manifest.to_json(),
               compact=True)
    partial = partial_dir(node1.replicas, 0, CKPT)
    makedirs(partial.parent)
    shutil.copytree(source, partial)
    commit_replica(node1.replicas, parts[0], partial)
    shutil.rmtree(cfg.node_paths(0).spool.parent)     # node 0's spool, stage and cache
    makedirs(node0.spool)
    return {"replica": replica_dir(node1.replicas, 0, CKPT),
            "bundle": bundle_path(pfs_run, CKPT, 0), "spool0": node0.spool,
            "node0": node0, "bytes": parts[0].bytes}


def reset(state: dict[str, Any]) -> None:
    """Node 0 lost again: no spool copy, no replicas received by re-replication."""
    node0 = state["node0"]
    shutil.rmtree(node0.spool_dir(CKPT), ignore_errors=True)
    shutil.rmtree(node0.spool.parent / "nvme", ignore_errors=True)
    for leftover in node0.spool.iterdir():
        shutil.rmtree(leftover, ignore_errors=True)


def cp(source: Path, dest_dir: Path) -> float:
    dest = dest_dir / "cp-copy"
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(dest)], check=True)
    elapsed = time.perf_counter() - start
    if dest.is_dir():
        shutil.rmtree(dest)
    else:
        dest.unlink()
    return elapsed


def raw_move(source: Path, dest: Path) -> float:
    """Wall time of `mpiexec -n 2` moving `source`'s files into `dest` (this script's
    --raw-move mode), start-up excluded: the ranks time themselves after a barrier."""
    result = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, __file__,
                             "--raw-move", str(source), str(dest)],
                            capture_output=True, text=True, timeout=600, check=True)
    shutil.rmtree(dest)
    return float(result.stdout.split()[-1])


def raw_move_ranks(source: Path, dest: Path) -> None:
    """Rank 1 sends every file of `source` in CHUNK messages; rank 0 writes them."""
    import numpy as np
    from mpi4py import MPI
    comm, chunk = MPI.COMM_WORLD, 8 * MiB
    names = sorted(p.name for p in source.iterdir())
    buffers = [np.empty(chunk, np.uint8) for _ in range(2)]
    comm.Barrier()
    start = time.perf_counter()
    requests: list[Any] = []
    if comm.Get_rank() == 1:
        for name in names:
            with open(source / name, "rb") as handle:
                while n := handle.readinto(buffers[len(requests) % 2]):
                    if len(requests) >= 2:
                        requests[-2].Wait()
                    requests.append(comm.Isend([buffers[len(requests) % 2][:n], MPI.BYTE], 0))
        MPI.Request.Waitall(requests)
    else:
        dest.mkdir()
        for name in names:
            size = (source / name).stat().st_size
            with open(dest / name, "wb", buffering=0) as out:
                for offset in range(0, size, chunk):
                    n = min(chunk, size - offset)
                    comm.Recv([buffers[0][:n], MPI.BYTE], 1)
                    out.write(memoryview(buffers[0])[:n])
                os.fsync(out.fileno())
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"{time.perf_counter() - start:.4f}")


def recover(config: Path, *args: str, profile: Path | None = None
            ) -> tuple[float, float, float, str]:
    """(wall seconds, the command's own seconds, until the spools were complete, its
    output)."""
    command = [str(BIN / "cachex"), "recover", "--config", str(config), *args]
    if profile is not None:
        code = ("import cProfile, os, sys; from cachex_agent.cli import main;"
                f" sys.argv = {command!r};"
                f" cProfile.run('main()', '{profile}.' + os.environ.get('PMI_RANK', '0'))")
        command = [sys.executable, "-c", code]
    start = time.perf_counter()
    result = subprocess.run([str(BIN / "mpiexec"), "-n", "2", *command],
                            capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"cachex recover failed ({result.returncode}):\n{result.stdout}"
                         f"{result.stderr}")
    return wall, _seconds(r"([\d.]+)s in all", result.stdout), _seconds(
        r"moved [^;]*? in ([\d.]+)s \(", result.stdout) + _seconds(r"planned in ([\d.]+)s",
                                                          result.stdout), result.stdout


def _seconds(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")


def bench(config: Path, state: dict[str, Any], repeat: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in
                                     ("cp", "replica", "replica_own", "replica_spools",
                                      "cp-pfs", "pfs", "pfs_own", "pfs_spools",
                                      "raw-mpi")}
    outputs = {}
    for i in range(repeat):
        print(f"  repeat {i + 1}/{repeat}", flush=True)
        for kind, source, args in (("replica", state["replica"], ()),
                                   ("pfs", state["bundle"], ("--exclude", "replica"))):
            times["cp" if kind == "replica" else "cp-pfs"].append(cp(source, state["spool0"]))
            reset(state)
            wall, own, spools, outputs[kind] = recover(config, *args)
            times[kind].append(wall)
            times[f"{kind}_own"].append(own)
            times[f"{kind}_spools"].append(spools)
            reset(state)
        times["raw-mpi"].append(raw_move(state["replica"], state["spool0"] / "raw-move"))
    return {"times": times, "median": {k: statistics.median(v) for k, v in times.items()},
            "output": outputs}


def startup(config: Path) -> float:
    return recover(config, "--dry-run")[0]


def profile(config: Path, state: dict[str, Any], root: Path) -> dict[str, str]:
    found = {}
    for kind, args in (("replica", ()), ("pfs", ("--exclude", "replica"))):
        out = root / f"profile-{kind}"
        recover(config, *args, profile=out)
        reset(state)
        for rank in (0, 1):
            text = io.StringIO()
            pstats.Stats(f"{out}.{rank}", stream=text).sort_stats("cumulative").print_stats(22)
            found[f"{kind} rank {rank}"] = text.getvalue()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--pfs", default=None, help="the PFS directory (default: --dir)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--raw-move", nargs=2, metavar=("SRC", "DEST"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_move:
        raw_move_ranks(Path(args.raw_move[0]), Path(args.raw_move[1]))
        return 0
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-recover-", dir=args.dir))
    pfs = Path(tempfile.mkdtemp(prefix="cachex-bench-recover-pfs-", dir=args.pfs or args.dir))
    results: dict[str, Any] = {**machine(), "size": args.size,
                               "files": args.files, "dir": args.dir, "pfs": str(pfs)}
    try:
        config = write_config(root / "bench.toml", "bench", paths=node_tree(root, pfs),
                              topology={"domain": "rank"}, agent={"timeout": "60s"})
        print(f"state: node 0's part {args.size} in {args.files} files; {root}", flush=True)
        state = build_state(config, parse_size(args.size), args.files)
        results["bytes"] = state["bytes"]
        results["startup"] = startup(config)
        results.update(bench(config, state, args.repeat))
        if args.profile:
            results["profile"] = profile(config, state, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pfs, ignore_errors=True)
    results["load_after"] = os.getloadavg()[0]
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def report(results: dict[str, Any]) -> None:
    for name, text in results.get("profile", {}).items():
        print(f"\nprofile, {name}:\n{text}")
    median = results["median"]
    print(f"\nresults (load {results['load']:.1f}-{results['load_after']:.1f} on"
          f" {results['cores']} cores; {results['bytes'] / MiB:.0f} MiB of node 0)")
    print("last summary (replica):\n  " + results["output"]["replica"].strip()
          .replace("\n", "\n  "))
    print("last summary (pfs):\n  " + results["output"]["pfs"].strip().replace("\n", "\n  "))
    print(f"  start-up of `mpiexec -n 2 cachex recover --dry-run`: {results['startup']:.2f} s")
    for kind in results["times"]:
        print(f"  {kind:12s} median {median[kind]:.3f} s"
              f" ({results['bytes'] / MiB / median[kind]:.0f} MiB/s); all:"
              f" {', '.join(f'{t:.2f}' for t in results['times'][kind])}")
    ratios = {}
    for kind, cp_kind in (("replica", "cp"), ("pfs", "cp-pfs")):
        ratios[kind] = median[cp_kind] / median[f"{kind}_spools"]
        ratios[f"{kind}_all"] = median[cp_kind] / median[f"{kind}_own"]
        ratios[f"{kind}_wall"] = median[cp_kind] / median[kind]
    results["ratios"] = ratios
    print("ratios")
    for kind in ("replica", "pfs"):
        print(f"  cp / recover from {kind}: {ratios[kind]:.2f} until the spools are complete"
              f" (target >= {TARGET}); {ratios[kind + '_all']:.2f} with re-replication;"
              f" {ratios[kind + '_wall']:.2f} with mpiexec and start-up")
    ratios["raw_mpi"] = median["cp"] / median["raw-mpi"]
    ratios["replica_of_raw_mpi"] = median["raw-mpi"] / median["replica_spools"]
    print(f"  cp / raw MPI move: {ratios['raw_mpi']:.2f} (the ceiling of the replica ratio"
          " on this host); raw MPI move / recover from replica:"
          f" {ratios['replica_of_raw_mpi']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
