"""Commit to `replicated` inside real agents against the machine's floor for the same bytes.

Two virtual nodes on this host (`mpiexec -n 2 cachex-agent`, topology.domain "rank",
model.path "peer": each node replicates to the other). Spools, stages and caches (the
replica directories and journals) live under --dir (/dev/shm); the PFS under --pfs (the
disk). Every repeat, alternating which kind goes first:

  floor     both nodes at once, one thread each: `cp -r` of the node's part from a
            directory beside its spool (same file system) to one beside its stage, then a
            raw write of the part's file sizes into a directory beside its replicas
            (os.pwrite of 1 MiB pieces of a pre-filled buffer, fsync per file, then the
            directory). The floor is the wall time until
            both nodes are done: what moving the bytes costs with no protocol at all.
  pipeline  a checkpoint of --size per node (--files files, random bytes) is written into
            both spools untimed, then committed: DCP's `.metadata` renamed into node 0's
            part. The time is from that rename to the later of the two nodes' `replicated`
            events (capture, checksums, manifest, coordinator messages, Put, credits, the
            partner's verify, fsync, rename, manifest). `flush.every` is large: only the
            warm-up checkpoint is flushed, and the run waits for that flush before timing.

The ratio is floor time / pipeline time (>= 0.7 is the target). Each repeat's spool part
is removed afterwards (keep.stage and keep.replica 1 drop the older copies).

    python benchmarks/pipeline.py [--size 1GiB] [--files 16] [--repeat 3] [--dir /dev/shm]
                                  [--pfs /tmp] [--json FILE]

Run it also with MPIR_CVAR_NOLOCAL=1 in the environment (the agents inherit it).
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    AgentJob,
    MiB,
    commit,
    machine,
    make_spools,
    node_tree,
    remove_parts,
    write_config,
    write_parts,
)
from sources import part_sizes

from cachex_agent.config import parse_size
from cachex_agent.fsutil import fsync_dir

NODES = 2
RUN = "bench"
TARGET = 0.7
PIECE = MiB


def agent_config(root: Path, pfs: Path, nodes: int = NODES, run: str = RUN,
                 timeout: str = "60s", agent: dict[str, Any] | None = None,
                 flush_every: int = 1000, **sections: dict[str, Any]) -> Path:
    """Agents on the peer path, every node's directories under root/node<n>/, that keep
    one checkpoint in the stage and one replica and flush only when asked (or every
    `flush_every`); `agent` adds [agent] keys, `sections` more sections (e.g. peer=...).
    Every node's spool is made."""
    config = write_config(root / "bench.toml", run, paths=node_tree(root, pfs),
                          topology={"domain": "rank"}, model={"path": "peer"},
                          commit={"rule": "dcp"}, flush={"every": flush_every},
                          keep={"stage": 1, "replica": 1},
                          agent={"timeout": timeout, **(agent or {})}, **sections)
    make_spools(config, nodes)
    return config


def start_agents(root: Path, config: Path) -> AgentJob:
    """`mpiexec -n 2 cachex-agent`, once every node said it started."""
    agents = AgentJob(config, NODES, root / "agents.log")
    agents.started(120)
    return agents


# -------------------------------------------------------------------------- floor
def raw_write(directory: Path, sizes: list[int], pool: np.ndarray) -> None:
    """The part's files from memory, fsync each, then the directory (as the replica
    store does, without the protocol)."""
    directory.mkdir(parents=True)
    view = memoryview(pool)
    for i, size in enumerate(sizes):
        fd = os.open(directory / f"f{i:03d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            offset = 0
            while offset < size:
                piece = view[offset % pool.nbytes:][:min(PIECE, size - offset)]
                offset += os.pwrite(fd, piece, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)


def floor_once(root: Path, ckpt: str, sizes: list[int], pool: np.ndarray, nodes: int = NODES,
               store: str = "floor-replica") -> float:
    """Every node at once: cp -r floor-spool -> floor-stage, then the raw write of `sizes`
    (what the node stores for its partners) to `store`; both removed after (the spool is
    the caller's)."""
    failures: list[BaseException] = []
    start_line = threading.Barrier(nodes + 1)

    def node_work(node: int) -> None:
        base = root / f"node{node}"
        try:
            start_line.wait()
            subprocess.run(["cp", "-r", str(base / "floor-spool" / ckpt),
                            str(base / "floor-stage")], check=True, timeout=600)
            raw_write(base / store, sizes, pool)
        except BaseException as exc:   # noqa: BLE001 (reported by the caller)
            failures.append(exc)
    threads = [threading.Thread(target=node_work, args=(n,)) for n in range(nodes)]
    for thread in threads:
        thread.start()
    start_line.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join(600)
    elapsed = time.perf_counter() - start
    for node in range(nodes):
        for name in ("floor-stage", store):
            shutil.rmtree(root / f"node{node}" / name, ignore_errors=True)
    if failures:
        raise failures[0]
    return elapsed


# ----------------------------------------------------------------------- pipeline
def pipeline_once(agents: AgentJob, root: Path, ckpt: str, total: int, files: int, seed: int,
                  before_commit: Callable[[], None] | None = None) -> dict[str, float]:
    """Seconds from the commit to each node's `captured` and the later `replicated`.
    `before_commit` runs just before the commit (e.g. reads the agents' CPU)."""
    write_parts(root, NODES, ckpt, total, files, seed)
    time.sleep(0.3)         # the watcher's look at the new files passes before the commit
    if before_commit is not None:
        before_commit()
    start = commit(root / "node0" / "spool" / ckpt)
    marks: dict[str, float] = {}
    for node in range(NODES):
        for event in ("captured", "replicated"):
            found = agents.wait_event(
                node, lambda e, ev=event: e["event"] in (ev, "replicate_failed")
                and e.get("ckpt") == ckpt, 600)
            if found["event"] == "replicate_failed":
                raise SystemExit(f"node {node}: replication of {ckpt} failed: {found}")
            marks[f"{event}{node}"] = found["t"] - start
    return {"captured": max(marks["captured0"], marks["captured1"]),
            "replicated": max(marks["replicated0"], marks["replicated1"]),
            "committed_at": start, **marks}


# --------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB", help="per node")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="spools, stages, replicas, journals")
    parser.add_argument("--pfs", default="/tmp", help="the PFS (flushed after, untimed)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    total = parse_size(args.size, "--size")
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-pipeline-", dir=args.dir))
    pfs = Path(tempfile.mkdtemp(prefix="cachex-bench-pipeline-pfs-", dir=args.pfs))
    results: dict[str, Any] = {**machine(), "bytes_per_node": total,
                               "nodes": NODES, "files": args.files,
                               "nolocal": os.environ.get("MPIR_CVAR_NOLOCAL", "")}
    sizes = part_sizes(total, args.files)
    pool = np.frombuffer(np.random.default_rng(3).bytes(min(total, 256 * MiB)), dtype=np.uint8)
    agents = start_agents(root, agent_config(root, pfs))
    floors: list[float] = []
    runs: list[dict[str, float]] = []
    try:
        print(f"{NODES} nodes x {total / MiB:.0f} MiB in {args.files} files; spool, stage,"
              f" replicas under {root}; PFS {pfs};"
              f" MPIR_CVAR_NOLOCAL={results['nolocal']!r}", flush=True)
        pipeline_once(agents, root, "step_00000", total, args.files, 0)     # warm-up
        agents.wait_event(0, lambda e: e["event"] == "level_flushed"
                    and e.get("ckpt") == "step_00000", 600)
        remove_parts(root, NODES, "step_00000")
        for rep in range(1, args.repeat + 1):
            ckpt = f"step_{rep:05d}"
            order = ["floor", "pipeline"] if rep % 2 else ["pipeline", "floor"]
            for kind in order:
                if kind == "floor":
                    # beside the spool, on the same file system: not a checkpoint to the agents
                    write_parts(root, NODES, ckpt, total, args.files, rep, "floor-spool")
                    floors.append(floor_once(root, ckpt, sizes, pool))
                    remove_parts(root, NODES, ckpt, "floor-spool")
                else:
                    runs.append(pipeline_once(agents, root, ckpt, total, args.files, rep))
                    remove_parts(root, NODES, ckpt)
            run = runs[-1]
            print(f"  repeat {rep}/{args.repeat}: floor {floors[-1]:.3f} s,"
                  f" commit -> captured {run['captured']:.3f} s,"
                  f" -> replicated {run['replicated']:.3f} s", flush=True)
    finally:
        agents.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pfs, ignore_errors=True)
    floor = statistics.median(floors)
    replicated = statistics.median(r["replicated"] for r in runs)
    captured = statistics.median(r["captured"] for r in runs)
    results.update(floor={"median": floor, "runs": floors},
                   pipeline={"median": replicated, "captured_median": captured, "runs": runs},
                   ratio=floor / replicated)
    print(f"\nresults (load {results['load']:.1f} at the start, {results['cores']} cores)")
    print(f"  floor (cp -r spool -> stage, then raw write to the replica dir, both nodes):"
          f" median {floor:.3f} s ({NODES * total / MiB / floor:.0f} MiB/s in all)")
    print(f"  pipeline commit -> replicated: median {replicated:.3f} s"
          f" ({NODES * total / MiB / replicated:.0f} MiB/s in all); of which commit ->"
          f" captured {captured:.3f} s")
    print("ratios")
    print(f"  floor / pipeline: {floor / replicated:.2f} (target >= {TARGET})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
