"""The metadata path at Frontier's size: what the coordinator and one agent pay per
checkpoint at N = 100, 1,000, 10,000 simulated nodes, every send paid as the run pays it.

One process: the real `Coordinator` (real journal, real PFS directory, its lanes inline so
their CPU counts) hears N agents' reports; the agents observed here (an interior node of
the broadcast tree, a leaf, a metadata holder) take what reaches them as the real agent
does (`relay.parse`, their next hops, `relay.message`, `messages.decode`, the journal
write). What crossing MPI costs is paid, not counted once per distinct message:
  - a `captured` report (the part's manifest) is pickled by its agent (mpi4py's `isend`
    pickles on each call) and unpickled and checked (`messages.decode`) by the coordinator;
  - every other report goes up the same tree (uplink.py): each node pickles one batch of
    its subtree's reports for its parent, which unpickles and checks it, adds its own and
    sends one batch on; the observed agents do it with the real `Uplink`, the coordinator
    hears a batch from each of its children (every node's marker, replicated and flushed
    reports are sent: one batch per level per hop, as when a level's reports arrive
    together);
  - every direct send of the coordinator is pickled on its own;
  - a relay frame is pickled once (relay.frame) and its bytes counted on every hop.
Each node's part: `--files` files (8: one DCP shard per GPU), a partner replica.

With `--stalled F` (issue 43) a share F of the nodes (not node 0, not the observed agents)
stalls in each checkpoint after its marker: it sends nothing until the checkpoint's other
reports are in. Their parents report each one silent (`silence`), the coordinator makes
them suspect and routes the tree around them (their children's reports go through other
parents), status must name exactly them; then they speak again (`Heard`) and their
reports come straight to node 0, and the checkpoint must be decided.

Measured per checkpoint: the coordinator's CPU (time.process_time: decoding, deciding,
carrying out the effects, the lanes' file writes) and bytes sent; per observed agent,
bytes received and sent, CPU, and journal bytes written. Printed last, and written as
JSON (--json): the targets of issue 24 and whether they hold. With
`--recovery`, benchmarks/scale_recovery.py's plan and message figures at the same N.

    python benchmarks/scale.py [--nodes 100,1000,10000] [--checkpoints 4] [--files 8]
                               [--fanout 16] [--stalled 0.01] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import write_config
from coordinator_scale import Clock

from cachex_agent import relay
from cachex_agent.config import load
from cachex_agent.coordinator import Coordinator
from cachex_agent.decisions import skipped
from cachex_agent.events import EventLog
from cachex_agent.journal import Journal
from cachex_agent.layout import JOURNAL_STATE, journal_global_manifest_path
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import (
    Captured,
    Finalized,
    HoldManifest,
    ManifestReady,
    Tag,
    decode,
    wire,
)
from cachex_agent.model.distributions import scipy_module
from cachex_agent.peer.partners import metadata_holders
from cachex_agent.uplink import Uplink

PICKLE = pickle.HIGHEST_PROTOCOL
TARGETS = {"agent_cpu_s": 0.050, "agent_received_bytes": 64 * 1024,
           "coordinator_sent_bytes_per_node": 2 * 1024, "coordinator_cpu_s": 2.0}


class Observed:
    """One agent as the run makes it: what reaches it, what it does with it."""

    def __init__(self, root: Path, node: int, nodes: int, role: str) -> None:
        self.node, self.nodes, self.role = node, nodes, role
        self.journal = Journal(root / f"journal-{node}")
        self.received = self.sent = self.journal_bytes = 0
        self.cpu = 0.0

    def frame(self, frame: bytes, source: str) -> None:
        cpu = time.process_time()
        self.received += len(frame)
        route, body = relay.parse(bytearray(frame), self.nodes, source)
        self.sent += len(frame) * len(relay.next_hops(route, self.node, self.nodes))
        msg = decode(relay.message(body), source, Tag.RELAY)
        if isinstance(msg, ManifestReady):
            self._journaled(lambda: self.journal.update(msg.ckpt, **{"global":
                                                                     msg.digest.to_json()}))
        elif isinstance(msg, Finalized):
            self._journaled(lambda: self.journal.set_stage(
                msg.ckpt, "commit", "done", **{"global": msg.digest.to_json()}))
        elif isinstance(msg, HoldManifest):
            self._journaled(lambda: self.journal.save_global(msg.manifest), msg.manifest.ckpt)
        self.cpu += time.process_time() - cpu

    def report(self, msg: dict[str, Any]) -> bytes:
        cpu = time.process_time()
        data = pickle.dumps(msg, PICKLE)
        self.sent += len(data)
        self.cpu += time.process_time() - cpu
        return data

    def _journaled(self, write: Callable[[], None], whole: str | None = None) -> None:
        write()
        path = (journal_global_manifest_path(self.journal.root, whole) if whole
                else self.journal.root / JOURNAL_STATE)
        self.journal_bytes += path.stat().st_size

    def take(self) -> dict[str, Any]:
        out = {"node": self.node, "role": self.role, "received": self.received,
               "sent": self.sent, "cpu": self.cpu, "journal_bytes": self.journal_bytes}
        self.received = self.sent = self.journal_bytes = 0
        self.cpu = 0.0
        return out


class Simulation:
    def __init__(self, root: Path, nodes: int, files: int, fanout: int,
                 stalled: float = 0.0) -> None:
        self.root, self.nodes, self.files, self.fanout = root, nodes, files, fanout
        self.stalled_share = stalled
        self.random = random.Random(7)
        config = load(write_config(root / "cfg.toml", "scale",
                                   paths={"spool": root / "spool", "pfs": root / "pfs"},
                                   agent={"fanout": fanout}, model={"path": "peer"},
                                   keep={"pfs": 2}), environ={})
        # once per run, at the first forecast (the model lane): a checkpoint's cost here
        # only by chance of which one comes first
        scipy_module("stats")
        self.clock = Clock()
        self.holders = metadata_holders([str(n) for n in range(nodes)], config.peer.copies)
        self.coord = Coordinator(config, list(range(nodes)), Journal(root / "journal-0"),
                                 root / "pfs" / "scale", EventLog(root / "events.jsonl"),
                                 self._send, clock=self.clock, forward=self._forward,
                                 holders=self.holders)
        leaf = next(n for n in range(nodes - 1, 0, -1) if n not in self.holders)
        self.observed = {n: Observed(root, n, nodes, role) for n, role in
                         ((1, "interior"), (leaf, "leaf"), (self.holders[0], "holder"))}
        self.coord_cpu = 0.0
        self.coord_sent = 0
        self.coord_messages = 0
        self.frames: list[tuple[bytes, list[int], bool]] = []

    # ------------------------------------------------------- the coordinator's MPI
    def _send(self, rank: int, msg: dict[str, Any]) -> None:
        self.coord_sent += len(pickle.dumps(msg, PICKLE))      # isend pickles each call

    def _forward(self, frame: bytes, hops: list[int], local: bool) -> None:
        self.coord_sent += len(frame) * len(hops)
        self.frames.append((frame, hops, local))

    def _deliver_frames(self) -> None:
        """Frames reach every node their route reaches: each observed agent takes its copy."""
        for frame, _hops, _local in self.frames:
            route, _ = relay.parse(frame, self.nodes, "coordinator")
            for node, agent in self.observed.items():
                if route.kind == "tree" or node in route.chain:
                    agent.frame(frame, "relay frame from its parent")
        self.frames.clear()

    def _hear(self, node: int, msg: Captured) -> None:
        """An agent's report: pickled by the agent, unpickled and checked here."""
        agent = self.observed.get(node)
        cpu = time.process_time()
        msg = wire(replace(msg, node=node))     # the manifest as its JSON text
        if agent is not None:
            agent.cpu += time.process_time() - cpu
        data = agent.report(msg) if agent else pickle.dumps(msg, PICKLE)
        cpu = time.process_time()
        raw = decode(pickle.loads(data), f"message from rank {node}", Tag.COORDINATOR)
        self.coord.handle(node, raw)
        self.coord_cpu += time.process_time() - cpu

    def _skip(self) -> tuple[int, ...]:
        """The nodes the coordinator's newest tree leaves out (suspect or dead)."""
        return skipped(self.coord.state)

    def _level(self, make: Callable[[int], dict[str, Any]],
               withheld: frozenset[int] = frozenset()) -> None:
        """One report from every node but the `withheld` (stalled), up the tree: leaves
        first, each node's batch pickled once for its parent; the coordinator decodes
        its children's batches, and those of the nodes the tree leaves out."""
        skip = self._skip()
        up: dict[int, bytes] = {}
        for node in range(self.nodes - 1, 0, -1):   # a child's number > its parent's
            if node not in withheld:
                up[node] = self._batch(node, {**make(node), "node": node}, up, skip)
        cpu = time.process_time()
        self.coord.handle(0, {**make(0), "node": 0})    # node 0's own: in its process
        for child in [*relay.children(0, self.nodes, self.fanout, skip),
                      *(n for n in skip if n in up)]:
            self._heard_batch(child, up.pop(child))
        self.coord_cpu += time.process_time() - cpu

    def _heard_batch(self, child: int, data: bytes) -> None:
        raw = decode(pickle.loads(data), f"message from rank {child}", Tag.COORDINATOR)
        self.coord_messages += 1
        self.coord.heard(child)
        for report in raw["reports"]:
            self.coord.handle(report["node"], report)

    def _batch(self, node: int, own: dict[str, Any], up: dict[int, bytes],
               skip: tuple[int, ...] = ()) -> bytes:
        """What `node` sends its parent: its own report and its children's batches,
        reduced by the real Uplink; CPU and bytes counted for the observed agents."""
        agent = self.observed.get(node)
        cpu = time.process_time()
        link = Uplink(node, self.nodes, self.fanout)
        link.reroute(skip)
        link.add(own)
        for kid in relay.children(node, self.nodes, self.fanout, skip):
            if kid not in up:
                continue            # stalled: its parent holds nothing of it
            data = up.pop(kid)
            if agent is not None:
                agent.received += len(data)
            for report in decode(pickle.loads(data), f"message from rank {kid}",
                                 Tag.COORDINATOR)["reports"]:
                link.add(report)
        data = pickle.dumps({"type": "batch", "node": node, "reports": link.due()}, PICKLE)
        if agent is not None:
            agent.sent += len(data)
            agent.cpu += time.process_time() - cpu
        return data

    def _tick(self, seconds: float = 1.0) -> None:
        self.clock.now += seconds
        cpu = time.process_time()
        self.coord.tick()
        self.coord_cpu += time.process_time() - cpu
        self._deliver_frames()

    def _manifest(self, ckpt: str, seq: int, node: int) -> dict[str, Any]:
        files = [FileEntry(f"__{node * self.files + i}_0.distcp", (64 << 20) + node, 0o644,
                           f"{self.random.getrandbits(128):032x}") for i in range(self.files)]
        if node == 0:
            files.append(FileEntry(".metadata", 1 << 20, 0o644, "0" * 32))
        return LocalManifest(run="scale", ckpt=ckpt, seq=seq, node=node, host=f"nid{node:06d}",
                             rank=node, files=files, captured_at=self.clock()).to_json()

    def checkpoint(self, seq: int) -> dict[str, Any]:
        ckpt = f"step_{seq:06d}"
        for agent in self.observed.values():
            agent.journal.set_stage(ckpt, "capture", "done", seq=seq)   # not metadata
            agent.take()
        self.coord_cpu, self.coord_sent, self.coord_messages = 0.0, 0, 0
        self._level(lambda node: {"type": "marker", "ckpt": ckpt,
                                  "global_files": [".metadata"] if node == 0 else []})
        self._tick()
        stalled = self._stall()
        for node in range(self.nodes):
            if node not in stalled:
                self._captured(ckpt, seq, node)
        self._tick()
        self._level(self._replicated(ckpt), stalled)
        self._tick()
        self._level(self._flushed(ckpt), stalled)
        self._tick()
        named = {r["node"] for r in self.coord.status()["silent"]}
        for node in sorted(stalled):        # back: straight to node 0 (left out of the tree)
            self._captured(ckpt, seq, node)
            self._heard_batch(node, pickle.dumps(
                {"type": "batch", "node": node, "reports": [
                    {**self._replicated(ckpt)(node), "node": node},
                    {**self._flushed(ckpt)(node), "node": node}]}, PICKLE))
        self._tick()
        level = self.coord.ckpts[ckpt].level
        return {"seq": seq, "level": level, "coordinator_cpu": self.coord_cpu,
                "coordinator_sent": self.coord_sent, "coordinator_heard": self.coord_messages,
                "stalled": len(stalled), "named": named == stalled,
                "silent_after": len(self.coord.status()["silent"]),
                "agents": [a.take() for a in self.observed.values()]}

    def _captured(self, ckpt: str, seq: int, node: int) -> None:
        self._hear(node, Captured(ckpt=ckpt, mode="copy",
                                  manifest=self._manifest(ckpt, seq, node), duration=0.05,
                                  global_files=[".metadata"] if node == 0 else []))

    def _replicated(self, ckpt: str) -> Callable[[int], dict[str, Any]]:
        return lambda node: {"type": "replicated", "ckpt": ckpt, "ok": True,
                             "partners": [(node + 1) % self.nodes], "errors": {},
                             "duration": 0.1, "dead": []}

    def _flushed(self, ckpt: str) -> Callable[[int], dict[str, Any]]:
        return lambda node: {"type": "flushed", "ckpt": ckpt,
                             "bundle": f"node-{node:05d}.h5", "duration": 0.5}

    def _stall(self) -> frozenset[int]:
        """This checkpoint's stalled nodes. Each one's parent finds it silent and says so
        up the tree (one batch per parent), then one tick reroutes around them all; one
        whose parent stalled too is found by its new parent after that reroute."""
        count = round(self.stalled_share * self.nodes)
        if not count:
            return frozenset()
        candidates = [n for n in range(1, self.nodes) if n not in self.observed]
        stalled = frozenset(self.random.sample(candidates, count))
        left = set(stalled)
        while left:
            skip = self._skip()
            by_parent: dict[int, list[dict[str, Any]]] = {}
            for node in sorted(left):
                parent = relay.parent(node, self.nodes, self.fanout, skip)
                if parent not in stalled:
                    by_parent.setdefault(parent, []).append(
                        {"type": "silence", "node": parent, "peer": node, "seconds": 3.0,
                         "ended": False, "holds": "reports"})
                    left.discard(node)
            cpu = time.process_time()
            for parent, reports in by_parent.items():
                self._heard_batch(parent, pickle.dumps(
                    {"type": "batch", "node": parent, "reports": reports}, PICKLE))
            self.coord_cpu += time.process_time() - cpu
            self._tick()
        return stalled


def run(nodes: int, checkpoints: int, files: int, fanout: int, stalled: float = 0.0
        ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cachex-scale-") as tmp:
        sim = Simulation(Path(tmp), nodes, files, fanout, stalled)
        rows = [sim.checkpoint(seq) for seq in range(1, checkpoints + 1)]
    steady = rows[1:] or rows          # the first pays imports and first-time set-up
    per_role: dict[str, dict[str, float]] = {}
    for row in steady:
        for agent in row["agents"]:
            into = per_role.setdefault(agent["role"], Counter())
            for key in ("received", "sent", "cpu", "journal_bytes"):
                into[key] += agent[key] / len(steady)
    return {"nodes": nodes, "files_per_node": files, "fanout": fanout,
            "depth": relay.depth(nodes, fanout), "holders": sim.holders,
            "levels": Counter(r["level"] for r in rows),
            "stalled_per_checkpoint": rows[-1]["stalled"],
            "stalled_named": all(r["named"] for r in rows),
            "silent_after_resume": max(r["silent_after"] for r in rows),
            "coordinator_cpu": sum(r["coordinator_cpu"] for r in steady) / len(steady),
            "coordinator_sent": sum(r["coordinator_sent"] for r in steady) / len(steady),
            # batches up the tree per checkpoint (marker, replicated, flushed); `captured`
            # reports come straight, one per node
            "coordinator_batches": sum(r["coordinator_heard"] for r in steady) / len(steady),
            "agents": {role: dict(v) for role, v in per_role.items()}}


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 24's targets at this N: per non-holder agent and for the coordinator."""
    agents = [v for role, v in result["agents"].items() if role != "holder"]
    checks = {"agent_cpu_s": max(a["cpu"] for a in agents),
              "agent_received_bytes": max(a["received"] for a in agents),
              "coordinator_sent_bytes_per_node": result["coordinator_sent"] / result["nodes"],
              "coordinator_cpu_s": result["coordinator_cpu"]}
    return {key: {"measured": round(value, 6), "target": TARGETS[key],
                  "ratio": round(value / TARGETS[key], 4), "holds": value <= TARGETS[key]}
            for key, value in checks.items()}


def _line(r: dict[str, Any]) -> str:
    a = r["agents"]
    return (f"{r['nodes']:>6} depth {r['depth']}  coordinator {r['coordinator_cpu']:7.3f} s CPU"
            f" {r['coordinator_sent'] / r['nodes']:7.0f} B/node sent"
            f" {r['coordinator_batches']:4.0f} batches heard | "
            + "  ".join(f"{role} {v['received'] / 1024:6.1f} KiB in {v['cpu'] * 1e3:6.2f} ms"
                        f" journal {v['journal_bytes'] / 1024:7.1f} KiB"
                        for role, v in a.items()))


def machine_speed() -> float:
    """CPU seconds of a fixed pure-Python loop, taken before and after the runs: this
    VM's speed drifts by half within an hour, and the coordinator's CPU with it."""
    start = time.process_time()
    sum(range(30_000_000))
    return round(time.process_time() - start, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000,10000")
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--recovery", action="store_true")
    parser.add_argument("--stalled", type=float, default=0.0,
                        help="share of the nodes stalled (not dead) in each checkpoint")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    speed = [machine_speed()]
    for nodes in (int(n) for n in args.nodes.split(",")):
        result = run(nodes, args.checkpoints, args.files, args.fanout, args.stalled)
        result["targets"] = targets(result)
        print(_line(result), flush=True)
        if args.stalled:
            print(f"{nodes:>6} stalled {result['stalled_per_checkpoint']} a checkpoint:"
                  f" named {result['stalled_named']}, levels {dict(result['levels'])},"
                  f" silent after they spoke {result['silent_after_resume']}", flush=True)
        results.append(result)
    if args.recovery:
        from scale_recovery import recovery_scale
        for result in results:
            result["recovery"] = recovery_scale(result["nodes"])
            print(f"{result['nodes']:>6} recovery {json.dumps(result['recovery'])}", flush=True)
    speed.append(machine_speed())
    print(f"reference loop (sum(range(30_000_000))): {speed[0]:.2f} s before, {speed[1]:.2f} s"
          " after (0.51 s on this VM's fastest hour)")
    summary = {"date": time.strftime("%Y-%m-%d"), "results": results,
               "reference_loop_s": speed, "targets_at_largest": results[-1]["targets"]}
    print(json.dumps(summary["targets_at_largest"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
