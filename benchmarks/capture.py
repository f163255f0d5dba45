"""Capture: the copy against `cp -r`, and the fixed cost of a small checkpoint in a real agent.

One run measures:

  copy     1 GiB in 16 files (--size, --files) on tmpfs (--dir, /dev/shm) copied to tmpfs:
           `cp -r` of the checkpoint directory against stage.capture.capture_copy (the
           agent's copy: checksums in the same pass, 0600 files, fsync, rename of the
           partial directory, fsync of the stage), alternating every repeat; the ratio is
           cp's median time over capture_copy's (>= 0.8 is the target). CPU seconds of
           both are printed too (less sensitive to a loaded machine than wall time).
  fixed    a real single-node agent (`mpiexec -n 1 cachex-agent`, commit rule dcp, the
           whole tree on --dir): checkpoints of 8 MiB (--small, in 4 files) are written
           to the spool, then the DCP marker `.metadata` renamed into place. Latency is
           the marker's rename to the agent's `captured` event; CPU is the agent
           process's user+system seconds from the marker until the coordinator's
           `level_captured` event (the whole round a capture costs the agent: watcher,
           messages, journal, checksums, copy, status), without the flush workers' threads
           (one node has no partner: model.path is direct, every checkpoint is flushed
           after its capture). The first checkpoint is a warm-up, not counted.
  idle     the same agent's CPU share over --idle seconds with nothing to do.

    python benchmarks/capture.py [--size 1GiB] [--files 16] [--repeat 5] [--dir /dev/shm]
                                 [--small 8MiB] [--checkpoints 10] [--idle 20]
                                 [--journal DIR] [--json FILE]

--journal puts the agent's journal (paths.cache) elsewhere, e.g. on a disk, where the
journal's fsyncs are part of the latency. Ratios are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from common import AgentJob, MiB, machine, write_config
from sources import write_files

from cachex_agent.agent import IDLE_AFTER
from cachex_agent.config import parse_size
from cachex_agent.stage.capture import capture_copy

#: events between the marker and `captured`: the coordinator heard it, the capture began
PHASES = ("committed", "capture_start", "captured")
TARGET_COPY = 0.8           # capture >= 0.8x cp -r
TARGET_LATENCY = 0.025      # seconds, marker to captured
TARGET_CPU = 0.030          # CPU seconds of the agent per checkpoint
TARGET_IDLE = 0.5           # percent of a core


# --------------------------------------------------------------------------- copy
def cpu_self_and_children() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(action: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its children) of `action`."""
    cpu, start = cpu_self_and_children(), time.perf_counter()
    action()
    return time.perf_counter() - start, cpu_self_and_children() - cpu


def bench_copy(root: Path, total: int, count: int, repeat: int) -> dict[str, Any]:
    src = root / "src"
    relpaths = write_files(src, total, count)
    runs: dict[str, list[tuple[float, float]]] = {"cp": [], "capture": []}
    kinds = {"cp": lambda dst: subprocess.run(["cp", "-r", str(src), str(dst)], check=True),
             "capture": lambda dst: capture_copy(src, dst, relpaths)}
    for rep in range(repeat):
        order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
        for kind in order:
            dst = root / f"dst-{kind}"
            runs[kind].append(timed(lambda kind=kind, dst=dst: kinds[kind](dst)))
            shutil.rmtree(dst)
            wall, cpu = runs[kind][-1]
            print(f"  copy {rep + 1}/{repeat} {kind:8s} {wall:6.3f} s"
                  f" ({total / MiB / wall:6.0f} MiB/s, cpu {cpu:.3f} s)", flush=True)
    shutil.rmtree(src)
    result: dict[str, Any] = {"bytes": total, "files": count}
    for kind, values in runs.items():
        result[kind] = {"wall": statistics.median(w for w, _ in values),
                        "cpu": statistics.median(c for _, c in values),
                        "walls": [w for w, _ in values]}
    result["ratio"] = result["cp"]["wall"] / result["capture"]["wall"]
    result["cpu_ratio"] = result["cp"]["cpu"] / result["capture"]["cpu"]
    return result


# -------------------------------------------------------------------------- agent
def agent_config(root: Path, journal_root: Path) -> Path:
    """One agent, the whole tree under `root` but its journal (paths.cache), committed
    by DCP's marker and flushed after every capture (no partner)."""
    root.mkdir(parents=True)
    (root / "spool").mkdir()
    (root / "pfs").mkdir()
    return write_config(root / "bench.toml", "bench",
                        paths={"spool": root / "spool", "stage": root / "stage",
                               "cache": journal_root / "cache", "pfs": root / "pfs"},
                        topology={"domain": "rank"}, commit={"rule": "dcp"},
                        model={"path": "direct"}, agent={"timeout": "30s"})


class AgentRun(AgentJob):
    """One agent under mpiexec; its events file and its process."""

    def __init__(self, root: Path, journal_root: Path) -> None:
        super().__init__(agent_config(root, journal_root), 1, root / "agent.log", poll=0.002,
                         stop_timeout=30)
        self.spool = root / "spool"
        (start,) = self.started(60)
        self.process = psutil.Process(start["pid"])

    def cpu(self, flush: bool = False) -> float:
        """CPU seconds of the agent's threads (schedstat: nanoseconds, where psutil has
        10 ms ticks); without the flush workers unless `flush`: they run reniced
        (flush.nice) and their work is the flush's, not the capture's."""
        task = Path(f"/proc/{self.process.pid}/task")
        total, main_nice = 0, None
        for tid in sorted(task.iterdir(), key=lambda p: int(p.name)):
            try:
                nice = int((tid / "stat").read_text().rsplit(")", 1)[1].split()[16])
                runtime = int((tid / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue            # a thread that just ended
            main_nice = nice if main_nice is None else main_nice
            if flush or nice == main_nice:
                total += runtime
        return total / 1e9

    def checkpoint(self, ckpt: str, size: int) -> tuple[float, float, dict[str, float]]:
        """Write one checkpoint and commit it; (latency to `captured`, agent CPU s, where
        the latency went: seconds from the marker to each event on the way)."""
        directory = self.spool / ckpt
        write_files(directory, size, 4, seed=len(ckpt))
        temp = directory / ".metadata.tmp"
        temp.write_bytes(b"{}")
        time.sleep(0.2)                 # let the watcher's look at the new files pass
        cpu = self.cpu()
        start = time.time()
        os.rename(temp, directory / ".metadata")
        captured = self.wait_event(0, lambda e: e["event"] == "captured"
                                   and e["ckpt"] == ckpt, 60)
        self.wait_event(0, lambda e: e["event"] == "level_captured" and e["ckpt"] == ckpt, 60)
        used = self.cpu() - cpu
        self.wait_event(0, lambda e: e["event"] == "level_flushed" and e["ckpt"] == ckpt, 60)
        marks = {e["event"]: e["t"] - start for e in self.events()
                 if e.get("ckpt") == ckpt and e["event"] in PHASES}
        return captured["t"] - start, used, marks

    def idle(self, seconds: float) -> float:
        """CPU share (percent of one core) over `seconds` with nothing to do, from
        IDLE_AFTER on (until then the agent keeps its busy tick: work may follow)."""
        time.sleep(IDLE_AFTER)
        cpu, start = self.cpu(flush=True), time.monotonic()
        time.sleep(seconds)
        return 100 * (self.cpu(flush=True) - cpu) / (time.monotonic() - start)


def bench_agent(root: Path, journal_root: Path, size: int, count: int, idle: float
                ) -> dict[str, Any]:
    agent = AgentRun(root, journal_root)
    try:
        agent.checkpoint("step_0", size)            # warm-up: imports, first flush
        latencies, cpus, phases = [], [], []
        for i in range(1, count + 1):
            latency, cpu, marks = agent.checkpoint(f"step_{i}", size)
            latencies.append(latency)
            cpus.append(cpu)
            phases.append(marks)
            steps = ", ".join(f"{name} {1000 * marks[name]:.1f}" for name in PHASES
                              if name in marks)
            print(f"  checkpoint {i}/{count}: latency {1000 * latency:5.1f} ms,"
                  f" agent cpu {1000 * cpu:5.1f} ms (ms after the marker: {steps})",
                  flush=True)
        idle_pct = agent.idle(idle)
        print(f"  idle: {idle_pct:.2f}% of a core over {idle:g} s", flush=True)
    finally:
        agent.close()
    return {"bytes": size, "checkpoints": count,
            "latency": statistics.median(latencies), "latencies": latencies,
            "cpu": statistics.median(cpus), "cpus": cpus, "idle_percent": idle_pct,
            "phases": {name: statistics.median(m[name] for m in phases if name in m)
                       for name in PHASES if any(name in m for m in phases)}}


# --------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--small", default="8MiB")
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--journal", default=None, help="directory for the agent's journal")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--skip-agent", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-capture-", dir=args.dir))
    journal = Path(tempfile.mkdtemp(prefix="cachex-bench-journal-", dir=args.journal)
                   ) if args.journal else root
    results: dict[str, Any] = machine()
    try:
        if not args.skip_copy:
            print(f"copy: {args.size} in {args.files} files, {args.dir}", flush=True)
            results["copy"] = bench_copy(root / "copy", parse_size(args.size), args.files,
                                         args.repeat)
        if not args.skip_agent:
            print(f"fixed cost: {args.small} checkpoints through one agent", flush=True)
            results["agent"] = bench_agent(root / "agent", journal / "agent",
                                           parse_size(args.small), args.checkpoints, args.idle)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if journal != root:
            shutil.rmtree(journal, ignore_errors=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def report(results: dict[str, Any]) -> None:
    print(f"\nresults (load {results['load']:.1f} on {results['cores']} cores)")
    if "copy" in results:
        copy = results["copy"]
        for kind in ("cp", "capture"):
            print(f"  {kind:8s} median {copy[kind]['wall']:.3f} s"
                  f" ({copy['bytes'] / MiB / copy[kind]['wall']:.0f} MiB/s),"
                  f" cpu {copy[kind]['cpu']:.3f} s")
    if "agent" in results:
        agent = results["agent"]
        print(f"  8 MiB checkpoint: latency median {1000 * agent['latency']:.1f} ms"
              f" (target <= {1000 * TARGET_LATENCY:.0f}), agent cpu median"
              f" {1000 * agent['cpu']:.1f} ms (target <= {1000 * TARGET_CPU:.0f})")
        steps = ", ".join(f"{name} {1000 * t:.1f}" for name, t in agent["phases"].items())
        print(f"  medians, ms after the marker: {steps}")
        print(f"  idle agent: {agent['idle_percent']:.2f}% of a core"
              f" (target <= {TARGET_IDLE})")
    print("ratios")
    if "copy" in results:
        copy = results["copy"]
        print(f"  capture / cp -r: {copy['ratio']:.2f} (target >= {TARGET_COPY});"
              f" by cpu {copy['cpu_ratio']:.2f}")
    if "agent" in results:
        agent = results["agent"]
        print(f"  latency / target: {agent['latency'] / TARGET_LATENCY:.2f},"
              f" cpu / target: {agent['cpu'] / TARGET_CPU:.2f},"
              f" idle / target: {agent['idle_percent'] / TARGET_IDLE:.2f} (<= 1 meets it)")


if __name__ == "__main__":
    sys.exit(main())
