"""Checkpoint write time as the trainer sees it, and its coefficient of variation (CoV).

One run, three ways, the same trainer code (a separate process: numpy buffer -> files,
fsync each, a COMMITTED marker, fsync the directory; each checkpoint after `--compute`
seconds of "training" (sleep, or --busy); it keeps its newest 3 checkpoints and deletes
older ones outside the timing). The three modes alternate in `--blocks` blocks (rotated
order, so drift of the machine hits all of them); each block times count/blocks
checkpoints per mode after `--warmup` untimed ones:

  direct  the trainer writes its checkpoint straight to the contended PFS, with fsync:
          a trainer that wants its checkpoint durable before it goes on. The trainer is
          a member of the throttled group (it is a PFS client like any other).
  agent   the trainer writes to its node-local spool on tmpfs (/dev/shm) and goes on;
          `--nodes` cachex agents (mpiexec from the venv, topology.domain "rank", commit
          rule marker:*/COMMITTED) capture, replicate to the partner's cache (/tmp, local
          disk) and flush HDF5 bundles to the contended PFS. The agents are members of the
          throttled group; the trainer is not (it writes only to tmpfs).
  none    the same spool writes with no agent running: this machine's noise floor.

The checkpoint is `--size` bytes in all: each of the `--nodes` virtual nodes gets
size/nodes in `--files` files (the agent mode's layout; direct mode writes the same files
to <pfs>/direct/node<n>/step_N/).

The contended PFS (benchmarks/contention.py): a sparse ext4 image on a loop device
(direct I/O to the local disk), mounted under --workdir, with a cgroup v1 blkio throttle
of `--bps` (default 128 MiB/s) on writes to it, shared by every member of the group; plus
`--writers` (default 2) background writers in that group, each writing files of
Pareto-distributed size (minimum --writer-scale 8 MiB, --shape 1.5, capped at --writer-max
256 MiB; mean about 20 MiB) with write + fsync, then an exponential think time (--think,
mean 0.5 s), keeping their newest 2 files; together about 55 MiB/s, 43% of the cap. The
writers run throughout all phases. A write to the PFS queues behind whatever they have in
flight, first come first served, so its service time is heavy-tailed (a 64 MiB write alone
takes 0.5 s at 128 MiB/s; behind a 256 MiB file, 2 s more).

Two contention scenarios (--scenarios, default both, each with a PFS of its own):

  mild   the above: 128 MiB/s, 2 writers, Pareto shape 1.5 from 8 MiB up to 256 MiB,
         think Exp(0.5 s) after every file
  heavy  a busy shared Lustre: 96 MiB/s, 3 bursty writers (a geometric number of files,
         mean 6, back to back, then think Exp(2.5 s)), Pareto shape 1.1 from 4 MiB up
         to 1 GiB: most files are small, a few are huge, so a direct write's p99 is many
         times its median

--bps, --writers, --writer-scale, --shape, --writer-max, --think and --burst override
the scenario's value. --quick: 12 timed checkpoints per mode of 32 MiB, 0.5 s compute,
a few minutes for both scenarios.

Reported: per mode n, mean, median, p99, min, max and CoV = stdev/mean (ddof 1); the
ratios CoV(direct)/CoV(agent) (the published headline: up to 43x) and CoV(agent)/CoV(none)
(the agent must not add variance to the trainer), each with a bootstrap 90% interval;
what the agents did (time from commit to every node flushed, flush durations, drain time
at the end); what the background writers achieved.

    .venv/bin/python benchmarks/cov.py [--scenarios mild,heavy] [--quick]
                                       [--size 64MiB] [--count 30] [--blocks 3]
                                       [--compute 1.5] [--bps 128MiB] [--writers 2]
                                       [--shape 1.5] [--writer-max 256MiB] [--json out.json]

Root only (loop device, mount, cgroup). About 4 minutes with the defaults. The run ends
with the load average and a warning when other agents, benchmarks or tests ran meanwhile:
on 2 cores the spool-side figures are then mostly the neighbours' noise (2026-11-30, four
runs at load 4-13 from concurrent test runs: CoV direct 0.42-0.49, agent 0.28-0.59, none
0.35-0.61; direct/agent 0.71-1.67, agent/none 0.82-0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import private_state  # noqa: F401 (its runs are recorded apart from the user's)
import psutil
from common import BIN, MiB, make_spools, write_config
from contention import Contention, ThrottledPFS, parse_size, unavailable

from cachex_agent.fsutil import fsync_dir
from cachex_agent.layout import events_path, journal_status_path

MODES = ("direct", "agent", "none")
SCENARIOS: dict[str, dict[str, Any]] = {
    "mild": {"bps": 128 * MiB, "writers": 2, "writer_scale": 8 * MiB, "shape": 1.5,
             "writer_max": 256 * MiB, "think": 0.5, "burst": 1.0, "pfs_size": "4GiB"},
    "heavy": {"bps": 96 * MiB, "writers": 3, "writer_scale": 4 * MiB, "shape": 1.1,
              "writer_max": 1024 * MiB, "think": 2.5, "burst": 6.0, "pfs_size": "8GiB"},
}
QUICK = {"count": 12, "size": 32 * MiB, "compute": 0.5}
KEEP = 3                    # checkpoints the trainer keeps in its directory


# ---------------------------------------------------------------------- the trainer
def trainer(args: argparse.Namespace) -> int:
    """Write checkpoints into `args.dir` (a `{node}` template); times to `args.out`."""
    if args.trainer_nice:
        os.nice(args.trainer_nice)
    part = args.size // args.nodes
    sizes = [part // args.files + (1 if i < part % args.files else 0) for i in range(args.files)]
    buffer = np.frombuffer(np.random.default_rng(7).bytes(max(sizes)), dtype=np.uint8).copy()
    view = memoryview(buffer)
    roots = [Path(args.dir.format(node=n)) for n in range(args.nodes)]
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
    times: list[float] = []
    for step in range(1, args.warmup + args.count + 1):
        compute(args.compute, args.busy)
        buffer[:8] = np.frombuffer(step.to_bytes(8, "little"), dtype=np.uint8)
        name = f"step_{step:05d}"
        start = time.perf_counter()
        for root in roots:
            directory = root / name
            directory.mkdir()
            for i, size in enumerate(sizes):
                write_file(directory / f"part_{i:02d}.bin", view[:size])
            write_file(directory / "COMMITTED", memoryview(name.encode()))
            fsync_dir(directory)
            fsync_dir(root)
        elapsed = time.perf_counter() - start
        if step > args.warmup:
            times.append(elapsed)
        for root in roots:                          # the trainer's own retention
            old = root / f"step_{step - KEEP:05d}"
            if old.exists():
                shutil.rmtree(old)
    Path(args.out).write_text(json.dumps(times))
    return 0


def compute(seconds: float, busy: bool) -> None:
    if not busy:
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    a = np.ones((128, 128))
    while time.perf_counter() < end:
        a = a @ a / 128.0


def write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def trainer_argv(args: argparse.Namespace, directory: str, out: Path, count: int
                 ) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--trainer", "--dir", directory,
            "--out", str(out), "--size", str(args.size), "--nodes", str(args.nodes),
            "--files", str(args.files), "--count", str(count),
            "--warmup", str(args.warmup), "--compute", str(args.compute),
            "--trainer-nice", str(args.trainer_nice)]
    return argv + (["--busy"] if args.busy else [])


# ---------------------------------------------------------------------- processes
def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL mpiexec's group and every descendant (Hydra gives ranks sessions of their own)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def run_trainer(argv: list[str], pfs: ThrottledPFS | None, timeout: float) -> None:
    """The trainer, inside the throttled group when `pfs` is given."""
    kwargs: dict[str, Any] = {"stdin": subprocess.DEVNULL, "start_new_session": True}
    proc = pfs.popen(argv, **kwargs) if pfs is not None else subprocess.Popen(argv, **kwargs)
    try:
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"trainer exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def agent_config(root: Path, shm: Path, pfs: Path, run: str) -> Path:
    """Spools and stages on tmpfs, caches (replicas, journal) under `root` on disk; the
    trainer's COMMITTED marker commits."""
    return write_config(root / "cachex.toml", run,
                        paths={"spool": f"{shm}/node{{node}}/spool",
                               "stage": f"{shm}/node{{node}}/stage",
                               "cache": f"{root}/node{{node}}/nvme", "pfs": pfs},
                        topology={"domain": "rank"}, commit={"rule": "marker:*/COMMITTED"},
                        keep={"stage": 1, "replica": 1, "pfs": 2},
                        agent={"timeout": "60s", "log": "warning"})


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def agent_phase(args: argparse.Namespace, pfs: ThrottledPFS, work: Path, shm: Path,
                run: str, out: Path, count: int) -> dict[str, Any]:
    """Agents (inside the group) + the trainer (outside) on the spools; the agents' view."""
    work.mkdir(parents=True)
    (pfs.path / "agent").mkdir(exist_ok=True)
    config = agent_config(work, shm, pfs.path / "agent", run)
    journal = make_spools(config, args.nodes).node_paths(0).journal
    log = (work / "agents.log").open("ab")
    agents = pfs.popen([BIN / "mpiexec", "-n", str(args.nodes), BIN / "cachex-agent",
                        "--config", config], stdout=log, stderr=subprocess.STDOUT,
                       stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while read_json(journal_status_path(journal)).get("state") != "running":
            if agents.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agents did not start (exit {agents.poll()}):\n"
                                   + (work / "agents.log").read_text()[-3000:])
            time.sleep(0.1)
        run_trainer(trainer_argv(args, f"{shm}/node{{node}}/spool", out, count), None,
                    timeout=60 + (args.warmup + count) * (args.compute + 30))
        written = time.monotonic()
        # the drain flushes the backlog through the contended PFS: under the heavy tail a
        # 64 MiB write there took up to 16 s, so a block's backlog can take minutes
        stop = subprocess.run([BIN / "cachex", "stop", "--config", config, "--timeout", "1200"],
                              capture_output=True, text=True, timeout=1230)
        if stop.returncode != 0:
            raise RuntimeError(f"cachex stop: {stop.stderr.strip()}")
        agents.wait(timeout=60)
        drain = time.monotonic() - written
    finally:
        if agents.poll() is None:
            kill_tree(agents)
        log.close()
    events = [json.loads(line) for line in events_path(journal).read_text().splitlines()
              if line.strip()]
    levels = {e["ckpt"]: e["latency"] for e in events if e["event"] == "level_flushed"}
    flushes = [e["duration"] for e in events if e["event"] == "flushed"]
    bad = [e for e in events if e["event"] in ("failed", "capture_failed", "flush_error",
                                                "replicate_failed")]
    committed = {e["ckpt"] for e in events if e["event"] == "committed"}
    return {"flushed_latency": [levels[c] for c in sorted(levels)],
            "flush_duration_node0": flushes, "committed": len(committed),
            "flushed": len(levels), "problems": [f"{e['event']} {e.get('ckpt')}: "
                                                 f"{e.get('error') or e.get('reason')}"
                                                 for e in bad], "drain": drain}


# ---------------------------------------------------------------------- statistics
def cov(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1) / np.mean(x))


def bootstrap_ratio(a: np.ndarray, b: np.ndarray, rounds: int = 4000) -> tuple[float, float]:
    """90% interval of cov(a)/cov(b), resampling each independently."""
    rng = np.random.default_rng(0)
    ia = rng.integers(0, len(a), (rounds, len(a)))
    ib = rng.integers(0, len(b), (rounds, len(b)))
    sa, sb = a[ia], b[ib]
    with np.errstate(divide="ignore", invalid="ignore"):    # a resample of equal values
        ratio = (sa.std(axis=1, ddof=1) / sa.mean(axis=1)) / (sb.std(axis=1, ddof=1)
                                                             / sb.mean(axis=1))
    ratio = ratio[np.isfinite(ratio)]
    return float(np.percentile(ratio, 5)), float(np.percentile(ratio, 95))


def describe(x: np.ndarray) -> str:
    return (f"mean {np.mean(x) * 1e3:8.1f} ms  median {np.median(x) * 1e3:8.1f}"
            f"  p99 {np.percentile(x, 99) * 1e3:8.1f}  min {np.min(x) * 1e3:7.1f}"
            f"  max {np.max(x) * 1e3:8.1f}  CoV {cov(x):.3f}")


# ---------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=64 * MiB,
                        help="bytes per checkpoint, all nodes together (default 64MiB)")
    parser.add_argument("--count", type=int, default=30, help="timed checkpoints per mode")
    parser.add_argument("--blocks", type=int, default=3,
                        help="the modes alternate in this many blocks, rotated (default 3)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed checkpoints at the start of every block and mode")
    parser.add_argument("--compute", type=float, default=1.5,
                        help="seconds of training between checkpoints (default 1.5)")
    parser.add_argument("--busy", action="store_true",
                        help="compute by keeping one core busy instead of sleeping")
    parser.add_argument("--nodes", type=int, default=2, help="virtual nodes = agents")
    parser.add_argument("--files", type=int, default=4, help="files per node")
    parser.add_argument("--scenarios", default="mild,heavy",
                        help=f"contention scenarios, in order (of {', '.join(SCENARIOS)})")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--bps", type=parse_size, help="write bandwidth cap of the PFS")
    parser.add_argument("--writers", type=int, help="background writers")
    parser.add_argument("--writer-scale", type=parse_size,
                        help="smallest background file (Pareto scale)")
    parser.add_argument("--shape", type=float,
                        help="Pareto shape of the background file sizes")
    parser.add_argument("--writer-max", type=parse_size, help="largest background file")
    parser.add_argument("--burst", type=float, help="background files per burst (mean)")
    parser.add_argument("--trainer-nice", type=int, default=0,
                        help="nice value of the trainer in every mode (default 0)")
    parser.add_argument("--think", type=float,
                        help="background writers' mean think time (s)")
    parser.add_argument("--pfs-size", help="size of the PFS image (sparse)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="which modes, in this order (default direct,agent,none)")
    parser.add_argument("--workdir", default="/tmp",
                        help="for the PFS image and the agents' caches (default /tmp)")
    parser.add_argument("--json", help="write every sample and figure here")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if f"--{key}" not in (argv if argv is not None else sys.argv):
                setattr(args, key, value)
    return args


def scenario_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """`args` with the scenario's contention where the command line did not set it."""
    values = vars(args).copy()
    for key, value in SCENARIOS[name].items():
        if values.get(key) is None:
            values[key] = value
    return argparse.Namespace(**values, scenario=name)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.trainer:
        return trainer(args)
    reason = unavailable()
    if reason:
        print(f"cov.py: {reason}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not set(modes) <= set(MODES) or not modes:
        print(f"cov.py: --modes: choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    if not set(scenarios) <= set(SCENARIOS) or not scenarios:
        print(f"cov.py: --scenarios: choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    began = time.monotonic()
    figures: dict[str, Any] = {}
    for name in scenarios:
        figures[name] = run_scenario(scenario_args(args, name), modes)
    summary(figures, time.monotonic() - began)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


def run_scenario(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    """Every mode under one scenario's contention; its figures."""
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="cachex-cov-", dir=args.workdir))
    shm = Path(tempfile.mkdtemp(prefix="cachex-cov-", dir="/dev/shm"))
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    agents: dict[str, Any] = {}
    neighbours: set[int] = set()
    load = [os.getloadavg()[0]]
    try:
        with ThrottledPFS(work, size=args.pfs_size, write_bps=args.bps) as pfs, \
                Contention(pfs, writers=args.writers, scale=args.writer_scale,
                           shape=args.shape, max_size=args.writer_max,
                           think=args.think, burst=args.burst) as contention:
            print(f"\n[{args.scenario}] PFS {pfs.path} ({pfs.loop}, {pfs.device}): write cap"
                  f" {args.bps / MiB:.0f} MiB/s, {args.writers} background writers"
                  f" (Pareto >= {args.writer_scale / MiB:.0f} MiB, shape {args.shape},"
                  f" <= {args.writer_max / MiB:.0f} MiB, bursts of {args.burst:g},"
                  f" think Exp({args.think}s)); checkpoint {args.size / MiB:.0f} MiB ="
                  f" {args.nodes} nodes x {args.files} files; {args.count} timed per mode in"
                  f" {args.blocks} blocks (+{args.warmup} untimed each), compute"
                  f" {args.compute}s {'busy' if args.busy else 'sleep'}, trainer nice"
                  f" {args.trainer_nice}", flush=True)
            time.sleep(2)                   # let the writers get going
            for block in range(args.blocks):
                count = args.count // args.blocks + (block < args.count % args.blocks)
                for mode in modes[block % len(modes):] + modes[:block % len(modes)]:
                    neighbours |= other_benchmarks()
                    load.append(os.getloadavg()[0])
                    phase = time.monotonic()
                    times[mode] += run_phase(args, mode, block, count, pfs, work, shm, agents)
                    print(f"block {block + 1} {mode:6s} {describe(np.array(times[mode][-count:]))}"
                          f"   ({time.monotonic() - phase:.0f}s)", flush=True)
        samples = contention.samples()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    figures = report(args, {m: np.array(t) for m, t in times.items()}, agents, samples,
                     time.monotonic() - began)
    figures["load"] = [min(load), max(load)]
    print(f"load average (1 min) during the run: {min(load):.1f}-{max(load):.1f}")
    if neighbours:
        figures["neighbours"] = len(neighbours)
        print(f"WARNING: {len(neighbours)} other agent/writer/benchmark processes ran beside"
              f" this one (pids {sorted(neighbours)[:8]}...): the machine was shared")
    return figures


def summary(figures: dict[str, Any], elapsed: float) -> None:
    """The ratios of every scenario, last."""
    print(f"\nCoV ratios, bootstrap 90% intervals ({elapsed:.0f} s in all):")
    for name, f in figures.items():
        line = [f"{name:6s}"]
        if "direct" in f:
            line.append(f"direct p99/median {f['direct']['p99'] / f['direct']['median']:.1f}")
        for key, what in (("direct/agent", "direct/agent"), ("agent/none", "agent/none")):
            if key in f:
                low, high = f[key]["interval90"]
                line.append(f"{what} {f[key]['ratio']:.2f} ({low:.2f}-{high:.2f})")
        print("  ".join(line) + f"  load {f['load'][0]:.1f}-{f['load'][1]:.1f}")
    print("published: direct/agent up to 43x; agent/none should be near 1")


def run_phase(args: argparse.Namespace, mode: str, block: int, count: int, pfs: ThrottledPFS,
              work: Path, shm: Path, agents: dict[str, Any]) -> list[float]:
    """One mode for `count` timed checkpoints; the trainer's times."""
    out = work / f"{mode}-{block}.json"
    os.sync()
    timeout = 60 + (args.warmup + count) * (args.compute + 60)
    if mode == "direct":
        run_trainer(trainer_argv(args, f"{pfs.path}/direct/node{{node}}", out, count), pfs,
                    timeout)
        shutil.rmtree(pfs.path / "direct", ignore_errors=True)
    elif mode == "agent":
        seen = agent_phase(args, pfs, work / f"agent-{block}", shm / f"agent-{block}",
                           f"cov{block}", out, count)
        shutil.rmtree(shm / f"agent-{block}", ignore_errors=True)
        shutil.rmtree(work / f"agent-{block}", ignore_errors=True)
        shutil.rmtree(pfs.path / "agent", ignore_errors=True)
        agents.setdefault("drains", []).append(seen.pop("drain"))
        for key, value in seen.items():         # lists and counts: add up the blocks
            agents[key] = agents.get(key, type(value)()) + value
    else:
        run_trainer(trainer_argv(args, f"{shm}/none/node{{node}}", out, count), None, timeout)
        shutil.rmtree(shm / "none", ignore_errors=True)
    return json.loads(out.read_text())


def other_benchmarks() -> set[int]:
    """Agents, background writers or benchmarks on this machine that are not ours."""
    me = psutil.Process()
    ours = {me.pid} | {p.pid for p in me.children(recursive=True) + me.parents()}
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in ours and ("cachex-agent" in line or "benchmarks/" in line
                                             or "pytest" in line):
            found.add(proc.info["pid"])
    return found


def report(args: argparse.Namespace, times: dict[str, np.ndarray], agents: dict[str, Any],
           samples: list[Any], elapsed: float) -> dict[str, Any]:
    print()
    for mode, x in times.items():
        print(f"{mode:6s} n {len(x):3d}  {describe(x)}")
    figures: dict[str, Any] = {mode: {"cov": cov(x), "mean": float(np.mean(x)),
                                      "median": float(np.median(x)),
                                      "p99": float(np.percentile(x, 99)),
                                      "samples": x.tolist()} for mode, x in times.items()}
    for a, b, what in (("direct", "agent", "direct/agent (published: up to 43x)"),
                       ("agent", "none", "agent/none (1 = the agent adds no variance)")):
        if a in times and b in times:
            low, high = bootstrap_ratio(times[a], times[b])
            ratio = cov(times[a]) / cov(times[b])
            figures[f"{a}/{b}"] = {"ratio": ratio, "interval90": [low, high]}
            print(f"CoV ratio {what}: {ratio:.2f}  (bootstrap 90% {low:.2f}-{high:.2f})")
    if "direct" in times and "agent" in times:
        print(f"mean ratio direct/agent: {np.mean(times['direct']) / np.mean(times['agent']):.1f}"
              f" (the trainer's stall per checkpoint)")
    if agents:
        latency = np.array(agents["flushed_latency"])
        flush = np.array(agents["flush_duration_node0"])
        period = args.compute + float(np.mean(times["agent"]))
        print(f"agents: {agents['flushed']}/{agents['committed']} checkpoints flushed;"
              f" commit -> every node flushed: median {np.median(latency):.2f}s"
              f" p99 {np.percentile(latency, 99):.2f}s max {np.max(latency):.2f}s"
              f" (checkpoint period {period:.2f}s); node 0's flushes: median"
              f" {np.median(flush):.2f}s max {np.max(flush):.2f}s CoV {cov(flush):.2f};"
              f" drain after the last checkpoint of each block"
              f" {', '.join(f'{d:.1f}' for d in agents['drains'])}s")
        for problem in agents["problems"]:
            print(f"  agent problem: {problem}")
        figures["agents"] = agents
    if samples:
        span = samples[-1].t - samples[0].t or 1.0
        total = sum(s.size for s in samples)
        rate = np.array([s.seconds / (s.size / MiB) for s in samples])
        print(f"background writers: {len(samples)} files, {total / MiB:.0f} MiB"
              f" ({total / MiB / span:.1f} MiB/s of the {args.bps / MiB:.0f} MiB/s cap);"
              f" s/MiB median {np.median(rate):.4f} p99 {np.percentile(rate, 99):.4f}"
              f" (alone: {MiB / args.bps:.4f})")
    print(f"elapsed {elapsed:.0f}s")
    figures["contention"] = {k: getattr(args, k) for k in SCENARIOS["mild"]}
    return figures


if __name__ == "__main__":
    sys.exit(main())
