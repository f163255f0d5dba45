"""Peak RSS of real agents at large parts, against the bound idle + window + flush buffers.

Real agents (`mpiexec -n NODES cachex-agent`, one virtual node per rank, commit rule dcp,
model.path peer: every checkpoint is captured, replicated to the partner and flushed)
take --checkpoints checkpoints of --size per node in --files files. Spool and stage are
on --shm (tmpfs, as on a compute node); the replicas (paths.cache) and the PFS on --disk.
Each agent's /proc/<pid>/status is sampled every 20 ms from start to stop:

  idle   VmRSS once every agent is running and has settled (--settle seconds)
  peak   VmHWM at the end (the kernel's own high-water mark, no sampling gap), and the
         largest RssAnon / RssFile / RssShmem seen, to say what the peak was made of
  bound  idle + window + flush buffers + 64 MiB, with window and flush buffers from
         config.upfront_memory (the receive window and send buffer, one flush.chunk
         per flush thread and for capture)

MPICH runs with MPIR_CVAR_NOLOCAL=1 (the agents talk as if on different hosts): with
shared memory (--shared-memory), both windows of two agents on one host sit in one
shared segment and each agent's Puts touch its partner's window, so each agent's RSS also
counts the partner's window (64 MiB at the defaults), which no agent on a node of its own
maps. The ratio peak / bound is printed last (<= 1 meets the target), also as JSON (--json).
Between two large checkpoints a small one (1 MiB) is committed: keep.stage = 1 then
evicts the previous large capture, so the stage holds one part per node, not two
(tmpfs needed: NODES x size x (spool + stage); --spool DIR puts the spool elsewhere, e.g.
on a disk when tmpfs is short: the agent reads it through the same 1 MiB buffer). Everything
created is removed.

    python benchmarks/memory.py [--nodes 2] [--size 4GiB] [--files 4] [--checkpoints 2]
                                [--shm /dev/shm] [--spool DIR] [--disk /var/tmp]
                                [--shared-memory]
                                [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from common import AgentJob, GiB, MiB, machine, make_spools, write_config

from cachex_agent.config import load, parse_size, upfront_memory

SLACK = 64 * MiB            # the target's allowance on top of the up-front buffers
FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
RUN = "mem"


def agent_config(spool: Path, shm: Path, disk: Path, timeout: float) -> Path:
    """Spools under `spool`, stages on tmpfs, replicas and the PFS on `disk`; the peer
    path, every checkpoint flushed."""
    (disk / "pfs").mkdir()
    return write_config(disk / "bench.toml", RUN,
                        paths={"spool": f"{spool}/node{{node}}/spool",
                               "stage": f"{shm}/node{{node}}/stage",
                               "cache": f"{disk}/node{{node}}/cache", "pfs": disk / "pfs"},
                        topology={"domain": "rank"}, commit={"rule": "dcp"},
                        model={"path": "peer"}, agent={"timeout": f"{timeout:g}s"})


def status(pid: int) -> dict[str, int]:
    """The FIELDS of /proc/<pid>/status, in bytes."""
    values = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                values[key] = int(rest.split()[0]) * 1024
    return values


class Sampler(threading.Thread):
    """Largest value of each FIELD per pid, sampled every `period` seconds."""

    def __init__(self, pids: list[int], period: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pids, self.period = pids, period
        self.peak: dict[int, dict[str, int]] = {pid: dict.fromkeys(FIELDS, 0) for pid in pids}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            for pid in self.pids:
                try:
                    now = status(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                peak = self.peak[pid]
                for key, value in now.items():
                    peak[key] = max(peak[key], value)


def write_part(directory: Path, size: int, files: int, seed: int) -> None:
    """`size` bytes in `files` files; 64 MiB blocks of random bytes, each block's first
    8 bytes made unique so no two blocks (or parts) are alike."""
    directory.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(min(64 * MiB, size)))
    per_file, counter = size // files, seed << 32
    for i in range(files):
        left = per_file if i < files - 1 else size - per_file * (files - 1)
        with open(directory / f"__{i}_0.distcp", "wb", buffering=0) as out:
            while left:
                counter += 1
                block[:8] = counter.to_bytes(8, "little")
                n = min(left, len(block))
                out.write(memoryview(block)[:n])
                left -= n


class Agents(AgentJob):
    """NODES agents under mpiexec, their pids, their events."""

    def __init__(self, spool: Path, shm: Path, disk: Path, nodes: int, timeout: float,
                 shared_memory: bool) -> None:
        self.spool_root = spool
        config = agent_config(spool, shm, disk, timeout)
        make_spools(config, nodes)
        super().__init__(config, nodes, disk / "agents.log",
                         env={"MPIR_CVAR_NOLOCAL": "0" if shared_memory else "1"}, poll=0.1)
        self.pids = [event["pid"] for event in self.started(120)]

    def spool(self, node: int) -> Path:
        return self.spool_root / f"node{node}" / "spool"

    def checkpoint(self, ckpt: str, size: int, files: int, seq: int, timeout: float) -> float:
        """Write the part of every node, commit (DCP marker on node 0), wait until the
        coordinator says flushed; seconds from the marker. The spool copy is removed."""
        for node in range(self.nodes):
            write_part(self.spool(node) / ckpt, size, files, seed=seq * 64 + node)
        temp = self.spool(0) / ckpt / ".metadata.tmp"
        temp.write_bytes(b"{}")
        start = time.monotonic()
        os.rename(temp, temp.with_name(".metadata"))
        self.wait_event(0, lambda e: e["event"] == "level_flushed" and e["ckpt"] == ckpt,
                        timeout)
        elapsed = time.monotonic() - start
        for node in range(self.nodes):
            shutil.rmtree(self.spool(node) / ckpt, ignore_errors=True)
        return elapsed


def fits(shm: Path, nodes: int, size: int, copies: int) -> str | None:
    """Why NODES x `copies` parts of `size` do not fit in tmpfs and memory, or None."""
    need = copies * nodes * size + GiB
    free_shm = shutil.disk_usage(shm).free
    available = psutil.virtual_memory().available
    if need > free_shm or need + 2 * GiB > available:
        return (f"{nodes} nodes x {size / GiB:g} GiB x {copies} (stage, spool) needs"
                f" {need / GiB:.1f} GiB of tmpfs; {shm} has {free_shm / GiB:.1f} GiB free,"
                f" memory {available / GiB:.1f} GiB available (try --spool on a disk,"
                " --size 2GiB or --nodes 1)")
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = parse_size(args.size, "--size")
    spool_on_shm = args.spool is None or Path(args.spool) == Path(args.shm)
    problem = fits(Path(args.shm), args.nodes, size, 2 if spool_on_shm else 1)
    if problem:
        raise SystemExit(f"memory.py: {problem}")
    shm = Path(tempfile.mkdtemp(prefix="cachex-bench-mem-", dir=args.shm))
    disk = Path(tempfile.mkdtemp(prefix="cachex-bench-mem-", dir=args.disk))
    spool = shm if spool_on_shm else Path(tempfile.mkdtemp(prefix="cachex-bench-mem-spool-",
                                                            dir=args.spool))
    agents = sampler = None
    try:
        agents = Agents(spool, shm, disk, args.nodes, args.timeout, args.shared_memory)
        sampler = Sampler(agents.pids)
        sampler.start()
        cfg = load(agents.config, environ={})
        time.sleep(args.settle)
        at_idle = [status(pid) for pid in agents.pids]
        idle = [s["VmRSS"] for s in at_idle]
        print(f"{args.nodes} agents, idle MiB: " + "; ".join(
            ", ".join(f"{k} {s[k] / MiB:.0f}" for k in FIELDS) for s in at_idle), flush=True)
        times = []
        for i in range(1, args.checkpoints + 1):
            if i > 1:       # lets keep.stage = 1 evict the previous large capture
                agents.checkpoint(f"step_{i - 1:05d}b", MiB, 1, 2 * i - 1, args.timeout)
            seconds = agents.checkpoint(f"step_{i:05d}", size, args.files, 2 * i,
                                        args.timeout)
            times.append(seconds)
            print(f"  checkpoint {i}/{args.checkpoints}: {size / GiB:g} GiB per node"
                  f" flushed after {seconds:.1f} s", flush=True)
        final = [status(pid) for pid in agents.pids]
    finally:
        if sampler is not None:
            sampler.done.set()
        if agents is not None:
            agents.close()
        for directory in {shm, disk, spool}:
            shutil.rmtree(directory, ignore_errors=True)
    upfront = upfront_memory(cfg)
    flush = (cfg.flush.concurrency + 1) * cfg.flush.chunk
    per_agent = []
    for node, pid in enumerate(agents.pids):
        seen = sampler.peak[pid]
        peak = max(final[node]["VmHWM"], seen["VmRSS"])
        bound = idle[node] + upfront + SLACK
        per_agent.append({"node": node, "idle": idle[node], "peak": peak, "bound": bound,
                          "ratio": peak / bound, "over_idle": peak - idle[node],
                          "peak_anon": seen["RssAnon"], "peak_file": seen["RssFile"],
                          "peak_shmem": seen["RssShmem"], "idle_status": at_idle[node]})
    return {**machine(), "nodes": args.nodes, "size": size,
            "shared_memory": args.shared_memory, "spool": "shm" if spool_on_shm else "disk",
            "files": args.files, "checkpoints": args.checkpoints, "seconds": times,
            "window": upfront - flush, "flush_buffers": flush, "slack": SLACK,
            "agents": per_agent}


def report(results: dict[str, Any]) -> None:
    print(f"\nresults (load {results['load']:.1f} on {results['cores']} cores):"
          f" {results['nodes']} nodes, {results['size'] / GiB:g} GiB parts in"
          f" {results['files']} files, {results['checkpoints']} checkpoints, spool on"
          f" {results['spool']},"
          f" {'shared memory' if results['shared_memory'] else 'MPIR_CVAR_NOLOCAL=1'}; window"
          f" {results['window'] / MiB:.0f} MiB, flush buffers"
          f" {results['flush_buffers'] / MiB:.0f} MiB, slack {results['slack'] / MiB:.0f} MiB")
    for a in results["agents"]:
        print(f"  agent {a['node']}: idle {a['idle'] / MiB:.0f} MiB, peak"
              f" {a['peak'] / MiB:.0f} MiB (+{a['over_idle'] / MiB:.0f}), bound"
              f" {a['bound'] / MiB:.0f} MiB; largest anon {a['peak_anon'] / MiB:.0f},"
              f" file {a['peak_file'] / MiB:.0f}, shmem {a['peak_shmem'] / MiB:.0f} MiB")
    print("ratios (peak RSS / bound, <= 1 meets the target)")
    for a in results["agents"]:
        print(f"  agent {a['node']}: {a['ratio']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--size", default="4GiB", help="part size per node")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--checkpoints", type=int, default=2)
    parser.add_argument("--shm", default="/dev/shm", help="the stage goes here")
    parser.add_argument("--spool", default=None,
                        help="the spool goes here (default: --shm, as a trainer's tmpfs)")
    parser.add_argument("--disk", default="/var/tmp", help="replicas and PFS go here")
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--shared-memory", action="store_true",
                        help="let MPICH use shared memory between the agents")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = run(args)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
