"""Real agents per redundancy scheme, for benchmarks/redundancy.py: commit to `replicated`
and the rebuild of one lost node through `cachex recover`, each beside its floor.

Per scheme, `mpiexec -n N cachex-agent` on N virtual nodes (topology.domain "rank";
spools, stages and caches under one directory, /dev/shm by default; model.path "peer";
flush.every large, so only the warm-up checkpoint reaches the PFS and the timed ones
live on the nodes alone). Every repeat, alternating which goes first:

  floor       every node at once, one thread each: `cp -r` of its part from beside its
              spool to beside its stage, then a raw write+fsync of the bytes the scheme
              stores per node (copy: the partner's whole part; xor/rs: its parity share)
  replicated  the part written into every spool untimed, then committed (DCP `.metadata`
              renamed on node 0): seconds from the rename to the last node's `replicated`

Then the agents are killed (SIGKILL to their session: the job died), node 1 loses
everything node-local (spool, stage, cache: journal, replicas, parity) and
`mpiexec -n N cachex recover` brings the newest checkpoint back from the peers alone
(a replica, or the group's data and parity); node 1's files are compared with what was
written. Its floor is `cp -r` of one part into a fresh directory of the same file system.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import BIN, AgentJob, commit, remove_parts, write_parts
from pipeline import agent_config, floor_once
from sources import part_sizes

RUN = "bench-ec"
LOST = 1
FILES = 8


def write_config(root: Path, scheme: str, group: int, nodes: int) -> Path:
    (root / "pfs").mkdir()
    return agent_config(root, root / "pfs", nodes, RUN, "120s",
                        peer={"scheme": scheme, "group": group})


def replicated_once(agents: AgentJob, root: Path, nodes: int, ckpt: str, total: int,
                    seed: int) -> float:
    """Seconds from the commit to the last node's `replicated` event."""
    write_parts(root, nodes, ckpt, total, FILES, seed)
    time.sleep(0.3)         # the watcher's look at the new files passes before the commit
    start = commit(root / "node0" / "spool" / ckpt)
    last = 0.0
    for node in range(nodes):
        found = agents.wait_event(node, lambda e: e["event"] in ("replicated",
                                                                 "replicate_failed")
                                  and e.get("ckpt") == ckpt, 600)
        if found["event"] == "replicate_failed" or not found.get("ok", True):
            raise SystemExit(f"node {node}: replication of {ckpt} failed: {found}")
        last = max(last, found["t"] - start)
    return last


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def kill(agents: AgentJob) -> None:
    os.killpg(agents.proc.pid, signal.SIGKILL)
    agents.proc.wait(30)
    agents.log.close()


def recover(config: Path, nodes: int) -> dict[str, float]:
    """`cachex recover`'s wall time, its time until every spool is complete (planned, in
    which parity rebuilds run, plus moved) and its whole time (re-replication too)."""
    start = time.perf_counter()
    result = subprocess.run([str(BIN / "mpiexec"), "-n", str(nodes), str(BIN / "cachex"),
                             "recover", "--config", str(config)],
                            capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"cachex recover failed ({result.returncode}):\n"
                         f"{result.stdout}{result.stderr}")

    def seconds(pattern: str) -> float:
        found = re.search(pattern, result.stdout)
        return float(found.group(1)) if found else float("nan")
    return {"wall": wall, "all": seconds(r"([\d.]+)s in all"),
            "spools": seconds(r"moved [^;]*? in ([\d.]+)s \(")
            + seconds(r"planned in ([\d.]+)s"), "output": result.stdout}


def cp_part(root: Path, ckpt: str) -> float:
    """The rebuild's floor: cp -r of one surviving part into a fresh directory."""
    dest = root / "floor-cp"
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(root / "node0" / "spool" / ckpt), str(dest)], check=True,
                   timeout=600)
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest)
    return elapsed


def bench_scheme(name: str, scheme: str, group: int, nodes: int, stored: float, total: int,
                 repeat: int, directory: str) -> dict[str, Any]:
    """One scheme: warm-up, `repeat` timed checkpoints beside their floors, one rebuild."""
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-ec-agents-", dir=directory))
    pool = np.frombuffer(np.random.default_rng(5).bytes(64 * 1024**2), dtype=np.uint8)
    store_sizes = part_sizes(max(1, round(total * stored)), FILES)
    config = write_config(root, scheme, group, nodes)
    agents = AgentJob(config, nodes, root / "agents.log")
    floors: list[float] = []
    times: list[float] = []
    try:
        agents.started(300)
        replicated_once(agents, root, nodes, "step_00000", total, 0)        # warm-up
        agents.wait_event(0, lambda e: e["event"] == "level_flushed"
                          and e.get("ckpt") == "step_00000", 600)
        for rep in range(1, repeat + 1):
            ckpt = f"step_{rep:05d}"
            for kind in (["floor", "agents"] if rep % 2 else ["agents", "floor"]):
                if kind == "floor":
                    write_parts(root, nodes, ckpt, total, FILES, rep, "floor-spool")
                    floors.append(floor_once(root, ckpt, store_sizes, pool, nodes,
                                             "floor-store"))
                    for node in range(nodes):
                        shutil.rmtree(root / f"node{node}" / "floor-spool", ignore_errors=True)
                else:
                    times.append(replicated_once(agents, root, nodes, ckpt, total, rep))
                    remove_parts(root, nodes, f"step_{rep - 1:05d}")    # as a trainer would
            print(f"  {name}: repeat {rep}/{repeat}: floor {floors[-1]:.2f} s,"
                  f" commit -> replicated {times[-1]:.2f} s", flush=True)
        last = f"step_{repeat:05d}"
        time.sleep(1.0)     # the older checkpoints' evictions settle before the kill
        kill(agents)
        before = digest(root / f"node{LOST}" / "spool" / last)
        shutil.rmtree(root / f"node{LOST}")
        (root / f"node{LOST}" / "spool").mkdir(parents=True)
        rebuilt = recover(config, nodes)
        if digest(root / f"node{LOST}" / "spool" / last) != before:
            raise SystemExit(f"{name}: node {LOST}'s recovered part differs:\n"
                             f"{rebuilt['output']}")
        cp = cp_part(root, last)
    finally:
        if agents.proc.poll() is None:
            kill(agents)
        shutil.rmtree(root, ignore_errors=True)
    floor, replicated = statistics.median(floors), statistics.median(times)
    return {"scheme": scheme, "group": group, "nodes": nodes, "stored_per_part": stored,
            "floor": floors, "replicated": times, "replicated_ratio": floor / replicated,
            "recover": {k: v for k, v in rebuilt.items() if k != "output"}, "cp_part": cp,
            "recover_ratio": cp / rebuilt["spools"],
            "recover_notes": [line for line in rebuilt["output"].splitlines()
                              if "rebuilds" in line or "recovered" in line]}
