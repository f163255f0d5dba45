"""Saves under one name (issue 44): every save a version, flushed or superseded.

Four virtual nodes on this host (`mpiexec -n 4 cachex-agent`, rule `torch`, topology
"rank", the peer path, keep.stage 1). Every --period seconds each node's "trainer"
rewrites its own `ckpt.pt` in place (--size of random bytes, torch.save's way: the
same inode truncated and written), --saves rounds: the four at once (one thread each, as
the ranks of one step), or with --stagger S one after another, S seconds apart, the
node that starts a round moving on by one each round. Meanwhile node 0's stage is
listed every 50 ms: how many versions it holds at once. After the last round the agents
drain. Printed, not asserted: each version's level (`cachex ls --json`), the nodes'
saves in flushed versions (each flushed version's non-empty parts, from its PFS
manifest) and those reported superseded (`status --json`: a newer save came first), of
rounds x nodes saves; the most versions held in the stage at once (the target: at most
2, the one in flight and the newest flushed), and the time from the last round's end
to its version's `flushed`.

    python benchmarks/versions.py [--saves 10] [--size 64MiB] [--period 2] [--stagger 0]
                                  [--dir /dev/shm] [--pfs /tmp] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from common import BIN, AgentJob, machine, make_spools, node_tree, write_config

from cachex_agent.config import parse_size

NODES = 4
RUN = "bench"
NAME = "ckpt.pt"


def save_in_place(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:     # O_TRUNC: the same inode, as torch.save
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_round(spools: list[Path], data: list[bytes], stagger: float, round_: int
               ) -> None:
    """Every node's save of one round: at once (the ranks of one step), or one after
    another `stagger` seconds apart, starting with node `round_` mod NODES."""
    if not stagger:
        writers = [threading.Thread(target=save_in_place, args=pair)
                   for pair in zip(spools, data, strict=True)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()
        return
    for k in range(NODES):
        node = (round_ + k) % NODES
        start = time.monotonic()
        save_in_place(spools[node], data[node])
        if k < NODES - 1:
            time.sleep(max(0.0, stagger - (time.monotonic() - start)))


def watch_stage(stage: Path, stop: threading.Event, most: list[int]) -> None:
    while not stop.wait(0.05):
        try:
            held = [p for p in stage.iterdir() if p.name.split("@v")[0] == NAME]
        except FileNotFoundError:
            continue
        most[0] = max(most[0], len(held))


def run(args: argparse.Namespace) -> dict:
    size = parse_size(args.size)
    root = Path(tempfile.mkdtemp(prefix="cx-versions-", dir=args.dir))
    pfs = Path(tempfile.mkdtemp(prefix="cx-versions-pfs-", dir=args.pfs))
    config = write_config(root / "bench.toml", RUN, paths=node_tree(root, pfs),
                          topology={"domain": "rank"}, model={"path": "peer"},
                          commit={"rule": "torch", "settle": "0.5s"},
                          keep={"stage": 1, "replica": 1}, agent={"timeout": "60s"})
    cfg = make_spools(config, NODES)
    job = AgentJob(config, NODES, root / "agents.log")
    most, stop = [0], threading.Event()
    try:
        job.started(120)
        watcher = threading.Thread(target=watch_stage, args=(
            cfg.node_paths(0).stage, stop, most), daemon=True)
        watcher.start()
        ends = []
        for round_ in range(args.saves):
            begin = time.monotonic()
            data = [os.urandom(size) for _ in range(NODES)]
            spools = [cfg.node_paths(node).spool / NAME for node in range(NODES)]
            save_round(spools, data, args.stagger, round_)
            ends.append(time.time())
            time.sleep(max(0.0, args.period - (time.monotonic() - begin)))
        time.sleep(3 * args.period)     # the last save's version committed before the drain
    finally:
        job.close()
        stop.set()
    try:
        return summary(args, config, pfs, job, ends, most[0])
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(pfs, ignore_errors=True)


def summary(args: argparse.Namespace, config: Path, pfs: Path, job: AgentJob,
            ends: list[float], most: int) -> dict:
    status = json.loads(subprocess.run(
        [str(BIN / "cachex"), "status", "--json", "--config", str(config)],
        capture_output=True, text=True, check=True).stdout)
    rows = [r for r in status["checkpoints"] if r["id"].split("@v")[0] == NAME]
    flushed = {e["ckpt"]: e["t"] for e in job.events(0) if e["event"] == "flushed"}
    newest = rows[-1]["id"] if rows else None
    return {**machine(), "rounds": args.saves, "size": parse_size(args.size),
            "period": args.period, "stagger": args.stagger,
            "versions": [(r["id"], r["level"]) for r in rows],
            "flushed": sum(r["level"] == "flushed" for r in rows),
            "saves": args.saves * NODES,
            "saves_flushed": sum(parts(pfs, r["id"]) for r in rows if r["level"] == "flushed"),
            "saves_superseded": status.get("superseded", {}).get(NAME, 0),
            "most_in_stage": most,
            # node 0's events and the saves' ends are both this host's clock
            "last_save_to_newest_flushed_s": round(flushed[newest] - ends[-1], 2)
            if newest in flushed else None}


def parts(pfs: Path, ckpt: str) -> int:
    """The non-empty parts of a flushed version: the nodes' saves it holds."""
    manifest = json.loads((pfs / RUN / "ckpt" / ckpt / "manifest.json").read_text())
    return sum(node["files"] > 0 for node in manifest["nodes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--size", default="64MiB")
    p.add_argument("--period", type=float, default=2.0)
    p.add_argument("--stagger", type=float, default=0.0,
                   help="seconds between one node's save and the next's within a round")
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--pfs", default="/tmp")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="leave the nodes' directories")
    args = p.parse_args()
    if (NODES - 1) * args.stagger >= args.period:
        p.error(f"--stagger {args.stagger}: a round's {NODES} saves must fit in --period")
    result = run(args)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
