"""Real agents at N = 2, 4, 8, 16, 32 virtual nodes: what the metadata costs each agent per
checkpoint, and whether that stays flat as the job grows.

`mpiexec -n N cachex-agent` on this machine, one virtual node per rank (topology domain
`rank`), `agent.fanout = 4` so that the tree has interior nodes at these sizes (depth 3 at
32 nodes). Each checkpoint: `--files` files of `--size` bytes per node written into every
node's spool, committed by DCP's `.metadata` on node 0, replicated to a partner and
flushed (every checkpoint). Each agent emits a `counters` event when it hears a
checkpoint finalized: the bytes it received on the metadata tags (RELAY: the
coordinator's frames; COORDINATOR: reports and batches), the bytes it wrote into its
journal, its CPU seconds (every thread). Per checkpoint = (last - second) / (checkpoints
- 2), so start-up and the first checkpoint do not count.

Printed per N: the mean and the largest of the non-coordinator agents, the mean of the
leaves (agents that relay nothing and hold no global manifest; `roles`), node 0 (agent
+ coordinator), and the leaves' CPU by thread role (the `counters` event's `threads`).
Last, as JSON: the ratio at the largest N over N = 4 of the mean, the leaves' and the
largest (target <= 1.2: flat for the mean and the leaves; the largest is a metadata
holder, O(N) by design). `--burners K` runs K CPU-spinning processes beside every run,
a control for contention that is not the metadata's. On 2 cores, 32 agents contend for
the CPU, so CPU per checkpoint also grows with waiting that is not the metadata's: bytes
received and journal bytes are the cleaner measures of the path's growth, and CPU per
turn of the main loop (which polls MPI each millisecond while a peer message is due, so
its turns grow with the wall time a checkpoint takes) says whether what grows is the
work or the waiting.

    python benchmarks/scale_agents.py [--nodes 2,4,8,16,32] [--checkpoints 6]
                                      [--files 8] [--size 64KiB] [--dir /dev/shm]
                                      [--burners 0] [--json FILE]
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

from common import AgentJob, burn, commit, remove_parts, stop_burning, write_parts
from pipeline import agent_config

from cachex_agent.config import parse_size
from cachex_agent.peer.partners import metadata_holders
from cachex_agent.relay import children

RUN = "scale"
METADATA_TAGS = ("RELAY", "COORDINATOR")
TARGET = 1.2
FANOUT = 4
COPIES = 1              # peer.copies: pipeline.agent_config leaves the default


def write_config(root: Path, nodes: int) -> Path:
    (root / "pfs").mkdir()
    return agent_config(root, root / "pfs", nodes, RUN, "120s", agent={"fanout": FANOUT},
                        flush_every=1)


def checkpoint(agents: AgentJob, root: Path, nodes: int, seq: int, files: int,
               size: int) -> dict[int, dict[str, Any]]:
    """One checkpoint through every level; each node's `counters` event after it."""
    ckpt = f"step_{seq:05d}"
    write_parts(root, nodes, ckpt, size * files, files, seq)
    time.sleep(0.3)         # the watchers' look at the new files passes before the commit
    commit(root / "node0" / "spool" / ckpt)
    agents.wait_event(0, lambda e: e["event"] == "level_flushed" and e.get("ckpt") == ckpt,
                      600)
    counters = {node: agents.wait_event(node, lambda e: e["event"] == "counters"
                                        and e.get("ckpt") == ckpt, 120)
                for node in range(nodes)}
    if seq > 2:             # the spool is the trainer's: keep it small
        remove_parts(root, nodes, f"step_{seq - 2:05d}")
    return counters


def cost(first: dict[str, Any], last: dict[str, Any], intervals: int) -> dict[str, Any]:
    def metadata(e: dict[str, Any]) -> int:
        return sum(e["received"].get(tag, 0) for tag in METADATA_TAGS)

    def per(key: str, *inner: str) -> float:
        a, b = first, last
        for name in (key, *inner):
            a, b = a.get(name, 0), b.get(name, 0)
        return (b - a) / intervals

    cpu, turns = per("cpu"), per("turns")
    return {"received": (metadata(last) - metadata(first)) / intervals,
            "journal": per("journal_written"), "cpu": cpu, "cpu_sys": per("cpu_sys"),
            "turns": turns, "wall": per("t"),
            "cpu_per_turn": cpu / turns if turns else 0.0,
            "switches": per("switches", "voluntary") + per("switches", "involuntary"),
            "threads": {role: per("threads", role) for role in last["threads"]}}


def roles(nodes: int) -> dict[str, list[int]]:
    """Which agents do what: `leaves` relay nothing and hold no global manifest (the
    agent every job has most of), `holders` keep the whole global manifest (O(N) by
    design, a few whatever the size), `interior` relay to children."""
    holders = metadata_holders([str(n) for n in range(nodes)], COPIES)
    interior = [n for n in range(1, nodes) if n not in holders and children(n, nodes, FANOUT)]
    leaves = [n for n in range(1, nodes) if n not in holders and n not in interior]
    return {"leaves": leaves, "holders": holders, "interior": interior}


def averaged(costs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in costs[0] if k != "threads"]
    out: dict[str, Any] = {k: statistics.fmean(c[k] for c in costs) for k in keys}
    out["threads"] = {role: statistics.fmean(c["threads"].get(role, 0.0) for c in costs)
                      for role in costs[0]["threads"]}
    return out


def run(nodes: int, checkpoints: int, files: int, size: int, base: Path) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="cachex-scale-agents-", dir=base))
    try:
        config = write_config(root, nodes)
        agents = AgentJob(config, nodes, root / "agents.log", poll=0.05)
        try:
            agents.started(300)
            rows = [checkpoint(agents, root, nodes, seq, files, size)
                    for seq in range(1, checkpoints + 1)]
        finally:
            agents.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    intervals = checkpoints - 2
    per_node = {node: cost(rows[1][node], rows[-1][node], intervals) for node in range(nodes)}
    others = [per_node[n] for n in range(1, nodes)]
    out = {"nodes": nodes, "coordinator": per_node[0], "mean": averaged(others),
           "largest": {k: max(o[k] for o in others) for k in others[0] if k != "threads"}}
    by_role = roles(nodes)
    for role, members in by_role.items():
        out[role] = averaged([per_node[n] for n in members]) if members else None
    out["roles"] = {role: len(members) for role, members in by_role.items()}
    return out


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The largest N over N = 4 (or the smallest above 2), per measure."""
    base = next((r for r in results if r["nodes"] == 4), results[0])
    top = results[-1]
    out: dict[str, Any] = {"over": [base["nodes"], top["nodes"]], "target": TARGET}
    for which in ("mean", "leaves", "largest"):
        for key in ("received", "journal", "cpu", "cpu_per_turn"):
            low, high = (base[which] or {}).get(key), (top[which] or {}).get(key)
            out[f"{which}_{key}"] = round(high / low, 3) if low and high is not None else None
    # the holders' O(N) is by design (a few of them): `flat` is about every other agent
    out["flat"] = all(v is not None and v <= TARGET for k, v in out.items()
                      if k.startswith(("mean_", "leaves_")) and not k.endswith("_per_turn"))
    return out


def _line(r: dict[str, Any]) -> str:
    def part(name: str, c: dict[str, Any] | None) -> str:
        if c is None:
            return f"{name} -"
        return (f"{name} {c['received'] / 1024:5.1f} KiB in, journal {c['journal'] / 1024:5.1f}"
                f" KiB, {c['cpu'] * 1e3:5.1f} ms CPU ({c['cpu_sys'] * 1e3:4.1f} sys) in"
                f" {c['turns']:4.0f} turns")
    head = (f"{r['nodes']:>3} nodes, {r['mean']['wall']:5.2f} s/ckpt | "
            + " | ".join(part(name, r[key]) for name, key in (
                ("mean", "mean"), (f"{r['roles']['leaves']} leaves", "leaves"),
                ("largest", "largest"), ("node 0", "coordinator"))))
    threads = r["leaves"]["threads"] if r["leaves"] else r["mean"]["threads"]
    return head + "\n      leaves' CPU by thread (ms): " + ", ".join(
        f"{role} {seconds * 1e3:.1f}" for role, seconds in sorted(threads.items())
        if seconds > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2,4,8,16,32")
    parser.add_argument("--checkpoints", type=int, default=6)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--size", default="64KiB", help="each file's size")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--burners", type=int, default=0,
                        help="CPU-spinning processes beside every run (a control: the"
                        " same N on a busy machine)")
    args = parser.parse_args()
    if args.checkpoints < 3:
        parser.error("--checkpoints: at least 3 (the first two are not counted)")
    results = []
    burners = burn(args.burners)
    try:
        for nodes in (int(n) for n in args.nodes.split(",")):
            results.append(run(nodes, args.checkpoints, args.files, parse_size(args.size),
                               args.dir))
            print(_line(results[-1]), flush=True)
    finally:
        stop_burning(burners)
    summary = {"date": time.strftime("%Y-%m-%d"), "results": results,
               "ratios": ratios(results)}
    print(json.dumps(summary["ratios"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
