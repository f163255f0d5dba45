"""The coordinator driven in one process by N simulated nodes: its cost per checkpoint.

The real `Coordinator` (real journal, real PFS directory, real files) hears what N agents
would send it, checkpoint after checkpoint: the commit marker (a few duplicates), every
node's `captured` with a local manifest of a few files, `replicated` (sometimes a failure
naming a dead partner), `progress` and `flushed` (sometimes a transient flush error), and
now and then a failed capture or a node that never captures (the capture deadline fails
it). Between the phases the clock moves and the coordinator ticks, as the agent's loop
makes it do; its status file is rewritten as often as in a run.

No MPI: `send` queues the messages. What crossing MPI would cost is counted, not paid:
the pickled size of every distinct message once, times the ranks it goes to.

Measured per checkpoint: CPU (time.process_time) and wall time of every message and tick
(the decision and the effects carried out at once: here every lane works inline), the
CPU in the pure decision function alone (`decide`), which handler spent it, file
writes and their sizes, messages and bytes sent; peak traced memory (tracemalloc, a second
pass); the sizes of status.json, index.json, coordinator.json and the global manifest
after K checkpoints.
Printed last: the CPU per node per checkpoint at the largest N over that at 100 (1.0 is
linear), also written as JSON.

    python benchmarks/coordinator_scale.py [--nodes 10,100,1000,10000] [--checkpoints 30]
                                           [--files 3] [--no-memory] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import sys
import tempfile
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import write_config

from cachex_agent import coordinator as coordinator_module
from cachex_agent import journal as journal_module
from cachex_agent.config import load
from cachex_agent.coordinator import Coordinator
from cachex_agent.events import EventLog
from cachex_agent.journal import Journal
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import Captured

PHASE_STEP = 1.0            # simulated seconds between phases (status is due every 0.5 s)
COMMIT_TIMEOUT = 30.0
AGENT_TIMEOUT = 10.0
KEEP_PFS = 4
FILES_MEASURED = ("status.json", "index.json", "coordinator.json")


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Wire:
    """`send` for the coordinator: queues messages; counts them and their pickled bytes
    (each distinct message object pickled once, as a broadcast is one object)."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, dict[str, Any]]] = []

    def send(self, rank: int, msg: dict[str, Any]) -> None:
        self.queue.append((rank, msg))

    def drain(self) -> tuple[Counter[str], int]:
        sizes: dict[int, int] = {}
        kinds: Counter[str] = Counter()
        total = 0
        for _rank, msg in self.queue:
            if id(msg) not in sizes:
                sizes[id(msg)] = len(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
            kinds[msg["type"]] += 1
            total += sizes[id(msg)]
        self.queue.clear()
        return kinds, total


class Writes:
    """Every JSON file the coordinator and its journal write: how many, how large. The
    files are written for real; this only looks at them afterwards."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    @contextmanager
    def watching(self) -> Iterator[None]:
        real = coordinator_module.write_json

        def counted(path: Any, data: Any, compact: bool = False) -> int:
            size = real(path, data, compact)
            name = _kind(Path(path))
            self.count[name] += 1
            self.bytes[name] += size
            return size
        coordinator_module.write_json = journal_module.write_json = counted
        try:
            yield
        finally:
            coordinator_module.write_json = journal_module.write_json = real

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        out = dict(self.count), dict(self.bytes)
        self.count.clear()
        self.bytes.clear()
        return out


def _kind(path: Path) -> str:
    """status.json, index.json, coordinator.json, global manifest (PFS or journal)."""
    if path.name in FILES_MEASURED:
        return path.name
    return "pfs manifest" if path.name == "manifest.json" else f"journal {path.parent.name}"


class Simulation:
    """One coordinator, `nodes` simulated agents, `checkpoints` checkpoints."""

    def __init__(self, root: Path, nodes: int, files: int = 3, seed: int = 11,
                 path: str = "auto") -> None:
        self.root = root
        self.nodes = nodes
        self.files = files
        self.random = random.Random(seed)
        config = load(write_config(root / "cfg.toml", "sim",
                                   paths={"spool": root / "spool", "pfs": root / "pfs"},
                                   commit={"timeout": f"{COMMIT_TIMEOUT:.0f}s"},
                                   agent={"timeout": f"{AGENT_TIMEOUT:.0f}s"},
                                   keep={"pfs": KEEP_PFS}, model={"path": path}), environ={})
        self.clock = Clock()
        self.wire = Wire()
        self.writes = Writes()
        self.pfs_run = root / "pfs" / "sim"
        self.coord = Coordinator(config, list(range(nodes)), Journal(root / "journal"),
                                 self.pfs_run, EventLog(root / "events.jsonl"),
                                 self.wire.send, clock=self.clock)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.wall: defaultdict[str, float] = defaultdict(float)
        self.handled: Counter[str] = Counter()
        self.decide_cpu = 0.0

    @contextmanager
    def timing_decisions(self) -> Iterator[None]:
        """CPU spent in the pure decision function, apart from carrying effects out."""
        real = coordinator_module.decide

        def timed(state: Any, event: Any) -> Any:
            cpu = time.process_time()
            try:
                return real(state, event)
            finally:
                self.decide_cpu += time.process_time() - cpu
        coordinator_module.decide = timed      # type: ignore[assignment]
        try:
            yield
        finally:
            coordinator_module.decide = real

    # ------------------------------------------------------------ driving it
    def _deliver(self, node: int, msg: Any) -> None:
        """A report as the coordinator gets it: a dict from its uplink, typed when it
        came alone (a captured part)."""
        kind = msg["type"] if isinstance(msg, dict) else msg.TYPE
        cpu, wall = time.process_time(), time.perf_counter()
        self.coord.handle(node, msg)
        self.cpu[kind] += time.process_time() - cpu
        self.wall[kind] += time.perf_counter() - wall
        self.handled[kind] += 1

    def _tick(self, seconds: float = PHASE_STEP) -> None:
        self.clock.now += seconds
        cpu, wall = time.process_time(), time.perf_counter()
        self.coord.tick()
        self.cpu["tick"] += time.process_time() - cpu
        self.wall["tick"] += time.perf_counter() - wall

    def _manifest(self, ckpt: str, seq: int, node: int) -> dict[str, Any]:
        files = [FileEntry(f"__{node * self.files + i}_0.distcp", 64 * 1024**2 + node, 0o644,
                           f"{self.random.getrandbits(128):032x}") for i in range(self.files)]
        return LocalManifest(run="sim", ckpt=ckpt, seq=seq, node=node, host=f"nid{node:06d}",
                             rank=node, files=files, captured_at=self.clock()).to_json()

    def checkpoint(self, seq: int) -> dict[str, Any]:
        """Drive one checkpoint through every phase; what it cost."""
        ckpt = f"step_{seq:06d}"
        fate = _fate(seq)
        self._deliver(0, {"type": "marker", "ckpt": ckpt, "global_files": [".metadata"]})
        for node in self.random.sample(range(self.nodes), max(1, self.nodes // 100)):
            self._deliver(node, {"type": "marker", "ckpt": ckpt,
                                 "global_files": []})      # a duplicate: already known
        self._tick()
        silent = self.nodes - 1 if fate == "timeout" else None
        for node in range(self.nodes):
            if fate == "capture_failed" and node == self.nodes // 2:
                self._deliver(node, {"type": "capture_failed", "ckpt": ckpt,
                                     "error": "spool file vanished"})
            elif node != silent:
                self._deliver(node, Captured(node=node, ckpt=ckpt, mode="copy",
                                             manifest=self._manifest(ckpt, seq, node),
                                             duration=0.05 + self.random.random() / 50))
        self._tick()
        if fate == "timeout":
            self._tick(COMMIT_TIMEOUT + AGENT_TIMEOUT)
        for node in range(self.nodes):
            self._deliver(node, self._replicated(ckpt, node, fate == "dead_partner"))
        self._tick()
        for node in range(self.nodes):
            self._deliver(node, {"type": "progress", "ckpt": ckpt, "stage": "flush",
                                 "done": 1, "total": 2})
        self._tick()
        if fate == "flush_retry":
            self._deliver(1 % self.nodes, {"type": "flush_error", "ckpt": ckpt,
                                           "error": "EIO", "final": False})
        for node in range(self.nodes):
            self._deliver(node, {"type": "flushed", "ckpt": ckpt,
                                 "bundle": f"node-{node:05d}.h5",
                                 "duration": 0.5 + self.random.random() / 5})
        self._tick()
        return {"fate": fate, "level": getattr(self.coord.ckpts.get(ckpt), "level", None)}

    def _replicated(self, ckpt: str, node: int, dead_partner: bool) -> dict[str, Any]:
        partner = (node + 1) % self.nodes
        if dead_partner and node == 0:
            return {"type": "replicated", "ckpt": ckpt, "ok": False, "partners": [],
                    "errors": {str(partner): f"partner node {partner}: gone"},
                    "dead": [partner]}
        return {"type": "replicated", "ckpt": ckpt, "ok": True, "partners": [partner],
                "errors": {}, "duration": 0.1 + self.random.random() / 20}

    # ------------------------------------------------------------ measuring
    def sizes(self) -> dict[str, int]:
        journal = self.root / "journal"
        out = {name: _size(journal / name) for name in ("status.json", "coordinator.json")}
        out["index.json"] = _size(self.pfs_run / "index.json")
        manifests = sorted(self.pfs_run.glob("ckpt/*/manifest.json"))
        out["global manifest"] = _size(manifests[-1]) if manifests else 0
        return out


def _fate(seq: int) -> str:
    """Deterministic failures, a few in every 20 checkpoints."""
    return {3: "dead_partner", 7: "capture_failed", 11: "timeout",
            15: "flush_retry"}.get(seq % 20, "ok")


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def run(nodes: int, checkpoints: int, files: int, path: str = "auto",
        trace_memory: bool = False) -> dict[str, Any]:
    """One simulation; per-checkpoint figures and the totals."""
    with tempfile.TemporaryDirectory(prefix="cachex-coordsim-") as tmp:
        if trace_memory:
            tracemalloc.start()
        sim = Simulation(Path(tmp), nodes, files, path=path)
        rows = []
        with sim.writes.watching(), sim.timing_decisions():
            for seq in range(1, checkpoints + 1):
                before = dict(sim.cpu), dict(sim.wall)
                decided = sim.decide_cpu
                outcome = sim.checkpoint(seq)
                counts, written = sim.writes.take()
                kinds, wire_bytes = sim.wire.drain()
                rows.append({**outcome, "seq": seq,
                             "cpu": sum(sim.cpu.values()) - sum(before[0].values()),
                             "wall": sum(sim.wall.values()) - sum(before[1].values()),
                             "decide": sim.decide_cpu - decided,
                             "writes": counts, "written_bytes": written,
                             "sent": dict(kinds), "sent_bytes": wire_bytes,
                             "sizes": sim.sizes()})
        peak = tracemalloc.get_traced_memory()[1] if trace_memory else None
        if trace_memory:
            tracemalloc.stop()
        return {"nodes": nodes, "checkpoints": checkpoints, "files_per_node": files,
                "path": path, "rows": rows, "cpu_by_handler": dict(sim.cpu),
                "wall_by_handler": dict(sim.wall), "handled": dict(sim.handled),
                "peak_traced_bytes": peak, "sizes": sim.sizes()}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    rows = result["rows"]
    k = len(rows)
    nodes = result["nodes"]
    steady = rows[k // 2:]          # the second half: retention and history in force
    return {"nodes": nodes,
            "cpu_per_ckpt": sum(r["cpu"] for r in rows) / k,
            "wall_per_ckpt": sum(r["wall"] for r in rows) / k,
            "decide_per_ckpt": sum(r["decide"] for r in rows) / k,
            "cpu_per_node_ckpt_us": 1e6 * sum(r["cpu"] for r in rows) / k / nodes,
            "cpu_steady_per_ckpt": sum(r["cpu"] for r in steady) / len(steady),
            "writes_per_ckpt": sum(sum(r["writes"].values()) for r in rows) / k,
            "written_mib_per_ckpt": sum(sum(r["written_bytes"].values()) for r in rows)
            / k / 2**20,
            "messages_per_ckpt": sum(sum(r["sent"].values()) for r in rows) / k,
            "sent_mib_per_ckpt": sum(r["sent_bytes"] for r in rows) / k / 2**20,
            "peak_traced_mib": (result["peak_traced_bytes"] / 2**20
                                if result["peak_traced_bytes"] is not None else None),
            "sizes": result["sizes"],
            # what status, index and coordinator.json grew by over the last 5 checkpoints:
            # 0 once retention (keep.pfs) and the history (HISTORY) are in force
            "growth_last5": {name: rows[-1]["sizes"][name] - rows[max(0, k - 6)]["sizes"][name]
                             for name in FILES_MEASURED},
            "cpu_share": {h: round(c / max(sum(result["cpu_by_handler"].values()), 1e-9), 3)
                          for h, c in sorted(result["cpu_by_handler"].items())},
            "levels": Counter(r["level"] for r in rows)}


def _table(summaries: list[dict[str, Any]]) -> str:
    head = (f"{'nodes':>6} {'CPU/ckpt':>10} {'wall/ckpt':>10} {'decide':>10} {'CPU/node':>9}"
            f" {'writes':>7}"
            f" {'written':>9} {'msgs':>7} {'sent':>10} {'peak mem':>9} {'status':>9}"
            f" {'index':>7} {'coord.json':>10} {'global':>9}")
    lines = [head]
    for s in summaries:
        size = s["sizes"]
        peak = f"{s['peak_traced_mib']:.1f}M" if s["peak_traced_mib"] is not None else "-"
        lines.append(
            f"{s['nodes']:>6} {s['cpu_per_ckpt'] * 1e3:>8.1f}ms {s['wall_per_ckpt'] * 1e3:>8.1f}ms"
            f" {s['decide_per_ckpt'] * 1e3:>8.1f}ms"
            f" {s['cpu_per_node_ckpt_us']:>7.1f}us {s['writes_per_ckpt']:>7.1f}"
            f" {s['written_mib_per_ckpt']:>7.2f}M {s['messages_per_ckpt']:>7.0f}"
            f" {s['sent_mib_per_ckpt']:>8.1f}M {peak:>9} {_kib(size['status.json']):>9}"
            f" {_kib(size['index.json']):>7} {_kib(size['coordinator.json']):>10}"
            f" {_kib(size['global manifest']):>9}")
    return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}K" if n < 10 * 2**20 else f"{n / 2**20:.0f}M"


def ratios(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Cost per node per checkpoint at each N over that at 100 nodes (or the smallest)."""
    by = {s["nodes"]: s for s in summaries}
    base = by.get(100) or summaries[0]
    return {f"cpu_per_node_{n}_vs_{base['nodes']}":
            by[n]["cpu_per_node_ckpt_us"] / base["cpu_per_node_ckpt_us"] for n in sorted(by)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="10,100,1000,10000")
    parser.add_argument("--checkpoints", type=int, default=30)
    parser.add_argument("--files", type=int, default=3, help="files per node and checkpoint")
    parser.add_argument("--path", default="auto", choices=("auto", "peer", "direct"),
                        help="model.path: auto runs the online path choice at every commit")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    summaries, results = [], []
    for nodes in (int(n) for n in args.nodes.split(",")):
        result = run(nodes, args.checkpoints, args.files, args.path)
        if not args.no_memory:
            result["peak_traced_bytes"] = run(nodes, args.checkpoints, args.files, args.path,
                                              trace_memory=True)["peak_traced_bytes"]
        results.append(result)
        summaries.append(summary(result))
        print(_table(summaries[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(_table(summaries))
    for s in summaries:
        print(f"  {s['nodes']:>6} nodes: CPU by handler {s['cpu_share']}; levels"
              f" {dict(s['levels'])}; file growth over the last 5 checkpoints"
              f" {s['growth_last5']} bytes")
    found = ratios(summaries)
    print("ratios (CPU per node per checkpoint; 1.0 = linear): "
          + ", ".join(f"{k} {v:.2f}" for k, v in found.items()))
    if args.json:
        args.json.write_text(json.dumps({"summaries": summaries, "ratios": found,
                                         "results": results}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
