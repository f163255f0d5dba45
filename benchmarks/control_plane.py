"""The control plane alone: checkpoints of 1 KiB per node, where every second and every
CPU-second from the commit to `replicated` is the agents' own bookkeeping (issue 46).

Two virtual nodes on this host (`mpiexec -n 2 cachex-agent`, benchmarks/pipeline.py's
configuration: the dcp rule, the peer path, keep.stage and keep.replica 1, the PFS only
for the warm-up). After one untimed warm-up checkpoint (flushed), --checkpoints
checkpoints of --size per node in one file each are written and committed one after the
other, each once the previous one is `replicated` on both nodes and removed from the
spools. Per checkpoint: commit -> the later node's `replicated` (the events' clock, this
host's); and the agents' CPU (user + system of both processes, every thread, psutil)
over the whole series, per checkpoint per node. It includes the agents' idle turns
between checkpoints (the pump's 1 ms tick): `--idle` seconds of the agents doing nothing
are measured first and that rate is printed beside it.

Printed: medians and p90 of the latency, CPU per checkpoint per node, the targets (<= 20 ms
to replicated, <= 10 ms of CPU), the median time from the commit to each step's event
(where the latency goes), and what each agent wrote to its journal and events per
checkpoint (bytes, from the files' sizes).

    python benchmarks/control_plane.py [--checkpoints 30] [--size 1KiB] [--idle 5]
                                       [--dir /dev/shm] [--pfs /tmp] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import AgentJob, machine
from pipeline import NODES, agent_config, pipeline_once, start_agents

from cachex_agent.config import load, parse_size

TARGETS = {"replicated_s": 0.020, "cpu_s_per_checkpoint_per_node": 0.010}


def agents_cpu(agents: AgentJob) -> float:
    """User + system seconds of every agent process (mpiexec's children's children)."""
    total = 0.0
    for proc in psutil.Process(agents.proc.pid).children(recursive=True):
        try:
            if "cachex-agent" in " ".join(proc.cmdline()):
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def written(config: Path) -> int:
    """Bytes of every node's journal directory (the journal, manifests, events)."""
    cfg = load(config, environ={})
    total = 0
    for node in range(NODES):
        root = Path(cfg.node_paths(node).journal)
        total += sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return total


#: the steps of a checkpoint as the events name them, in the order they happen
STEPS = ("committed", "capture_queued", "capture_start", "captured", "replicate_queued",
         "replicate_start", "replicated")


def steps(agents: AgentJob, ckpt: str, start: float) -> dict[str, float]:
    """Seconds from the commit to each step's event, the later node's (the coordinator's
    `committed` is node 0's alone)."""
    marks: dict[str, float] = {}
    for node in range(NODES):
        for event in agents.events(node):
            if event.get("ckpt") == ckpt and event["event"] in STEPS:
                marks[event["event"]] = max(marks.get(event["event"], 0.0), event["t"] - start)
    return marks


def series(agents: AgentJob, root: Path, config: Path, count: int, size: int
           ) -> dict[str, Any]:
    latencies: list[float] = []
    marks: list[dict[str, float]] = []
    cpu, journal = agents_cpu(agents), written(config)
    for seq in range(1, count + 1):
        ckpt = f"step_{seq:05d}"
        run = pipeline_once(agents, root, ckpt, size, 1, seq)
        latencies.append(run["replicated"])
        marks.append(steps(agents, ckpt, run["committed_at"]))
        for node in range(NODES):
            shutil.rmtree(root / f"node{node}" / "spool" / ckpt, ignore_errors=True)
    cpu = agents_cpu(agents) - cpu
    latencies.sort()
    return {"replicated_median": statistics.median(latencies),
            "replicated_p90": latencies[int(0.9 * (len(latencies) - 1))],
            "cpu_per_checkpoint_per_node": cpu / count / NODES,
            "journal_bytes_per_checkpoint_per_node": (written(config) - journal) / count / NODES,
            "steps_median": {step: statistics.median(m[step] for m in marks if step in m)
                             for step in STEPS if any(step in m for m in marks)},
            "latencies": latencies}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--size", default="1KiB", help="per node")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle agents")
    parser.add_argument("--dir", default="/dev/shm", help="spools, stages, replicas, journals")
    parser.add_argument("--pfs", default="/tmp", help="the PFS (the warm-up flush)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    size = parse_size(args.size, "--size")
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-control-", dir=args.dir))
    pfs = Path(tempfile.mkdtemp(prefix="cachex-bench-control-pfs-", dir=args.pfs))
    config = agent_config(root, pfs)
    agents = start_agents(root, config)
    results: dict[str, Any] = {**machine(), "bytes_per_node": size, "nodes": NODES}
    try:
        pipeline_once(agents, root, "step_00000", size, 1, 0)   # warm-up, flushed
        agents.wait_event(0, lambda e: e["event"] == "level_flushed"
                          and e.get("ckpt") == "step_00000", 600)
        before = agents_cpu(agents)
        time.sleep(args.idle)
        idle = (agents_cpu(agents) - before) / args.idle / NODES
        results.update(series(agents, root, config, args.checkpoints, size),
                       idle_cpu_per_second_per_node=idle)
    finally:
        agents.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pfs, ignore_errors=True)
    r = results
    print(f"{NODES} nodes, {args.checkpoints} checkpoints of {size} B per node"
          f" (load {r['load']:.1f} at the start, {r['cores']} cores)")
    print(f"  commit -> replicated: median {r['replicated_median'] * 1e3:.1f} ms,"
          f" p90 {r['replicated_p90'] * 1e3:.1f} ms"
          f" (target <= {TARGETS['replicated_s'] * 1e3:.0f} ms)")
    print(f"  agent CPU per checkpoint per node: {r['cpu_per_checkpoint_per_node'] * 1e3:.1f}"
          f" ms (target <= {TARGETS['cpu_s_per_checkpoint_per_node'] * 1e3:.0f} ms); idle"
          f" agents {r['idle_cpu_per_second_per_node'] * 1e3:.1f} ms per second per node")
    print("  from the commit to each step (median, the later node): " + ", ".join(
        f"{step} {t * 1e3:.1f}" for step, t in r["steps_median"].items()) + " ms")
    print(f"  journal and events written per checkpoint per node:"
          f" {r['journal_bytes_per_checkpoint_per_node'] / 1024:.1f} KiB")
    print("ratios")
    print(f"  replicated / target: {r['replicated_median'] / TARGETS['replicated_s']:.2f}")
    cpu_target = TARGETS["cpu_s_per_checkpoint_per_node"]
    print(f"  CPU / target: {r['cpu_per_checkpoint_per_node'] / cpu_target:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
