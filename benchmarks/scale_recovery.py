"""`cachex recover`'s planning and messages at N simulated nodes, in one process.

N nodes of a DCP checkpoint, 8 shards per node, `.metadata` on node 0; each node holds
its part in its spool and its partner's (node - 1) part as a replica; the whole global
manifest is in the journals of node 0 and of the metadata holders
(peer.partners.metadata_holders), every other journal keeps the digest. Two scenarios:
N -> N (nothing lost), and N -> N-1 (node 0 lost with its journal, no spare: restored
once into `--to DIR`).

Timed (`plan_seconds`): rank 0's work, with the functions recovery/rebuild.py calls:
parsing every rank's report and merging them (discover.merge), each rank's view of them
(slices.known_by_rank), planning (plan.choose) and each rank's slice of the plan
(slices.plan_shares). Measured (`by_message`): every message of the recovery's metadata
path, each rank's part of it pickled as mpi4py pickles it, the largest and the mean over
the ranks: what each rank sends to rank 0 (gather: its report, holdings, free space,
problems, intact replicas, bytes moved) and what it is sent (scatter: its view, its
slice of the plan, of the retries, of the re-replication; bcast: the free-space answer
and the totals, a few bytes). `per_rank`: their sums per rank, the largest and the
mean, of what it is sent (rank 0's own slices included, not what its gathers bring in:
`rank0_gathered`) and of what it sends (`sent_*`: a metadata holder's report carries the
whole manifest, by design, discover.py); `agreements`: the recovery's agreements
(collective.agree: one reduced count per step, log2 N messages of a few bytes).
Outside recovery/ and not counted: the placement (topology.place_in allgathers every
hostname, `placement_allgather`).
`before_bytes_per_node`: what the broadcasts and allgathers cost before each rank got
its slice (the merged manifests and the plan to every rank, the holdings and the rank
table to every rank), computed from the same objects.

    python benchmarks/scale_recovery.py [--nodes 100,1000,10000] [--json FILE]

The last line: the ratios of the per-rank figures at the largest N to the smallest
(flat: about 1).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import time
from pathlib import Path
from typing import Any

from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.peer.partners import metadata_holders
from cachex_agent.recovery import discover, slices
from cachex_agent.recovery.plan import Copy, Space, bytes_needed, check_space, choose

FILES = 8
CKPT = "step_00100"


def _parts(nodes: int) -> list[LocalManifest]:
    parts = []
    for node in range(nodes):
        files = [FileEntry(f"__{node * FILES + k}_0.distcp", 64 << 20, 0o644,
                           f"{node:024x}{k:08x}") for k in range(FILES)]
        if node == 0:
            files.append(FileEntry(".metadata", 1 << 20, 0o644, "m" * 32))
        parts.append(LocalManifest(run="r", ckpt=CKPT, seq=100, node=node, host=f"h{node}",
                                   rank=node, files=files))
    return parts


def _reports(parts: list[LocalManifest], whole: GlobalManifest, lost: set[int]
             ) -> list[discover.Found]:
    """What each surviving rank reports (discover.found_here's result, built in memory)."""
    nodes = len(parts)
    holders = {0, *metadata_holders([str(n) for n in range(nodes)], 1)}
    digest = whole.digest().to_json()
    reports = []
    for node in range(nodes):
        if node in lost:
            continue
        # the survivors are the job's nodes 0..: node k runs as node len(reports)
        found = discover.Found(len(reports), digests={CKPT: digest})
        if node in holders:
            found.manifests = {CKPT: whole.to_json()}
        found.parts = [parts[node].to_json(), parts[(node - 1) % nodes].to_json()]
        reports.append(found)
    return reports


def _copies(parts: list[LocalManifest], lost: set[int]) -> list[list[Copy]]:
    """Each surviving rank's holdings as holdings.local_copies reports them."""
    nodes = len(parts)
    per_rank = []
    for node in range(nodes):
        if node in lost:
            continue
        own = tuple(e.path for e in parts[node].files)
        owner = (node - 1) % nodes
        holder = len(per_rank)      # its node index in the recovery's job
        held = [Copy(CKPT, node, "spool", holder, own),
                Copy(CKPT, owner, "replica", holder,
                     tuple(e.path for e in parts[owner].files))]
        if node:
            held.append(Copy(CKPT, 0, "journal", holder, (".metadata",)))
        per_rank.append(held)
    return per_rank


def _size(message: Any) -> int:
    return len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _spread(name: str, kind: str, slices_: list[Any]) -> dict[str, Any]:
    sizes = [_size(x) for x in slices_]
    return {"message": name, "kind": kind, "sizes": sizes}


AGREEMENTS = 14     # collective.agree calls of a recovery without erasure (rebuild.py)


def _messages(reports: list[discover.Found], copies: list[list[Copy]], merged: Any,
              views: list[slices.Known], plan: Any, shares: list[slices.Share],
              rank_of: dict[int, int]) -> list[dict[str, Any]]:
    """Every rank's part of every message of the metadata path, as rebuild.py sends it."""
    ranks = len(reports)
    nodes = [r.node for r in reports]
    first = [(view, merged.notes if rank == 0 else []) for rank, view in enumerate(views)]
    spaces = [Space(n, "/spool", 1 << 50, f"h{n}:1") for n in nodes]
    check_space(bytes_needed(plan), spaces)
    retries = slices.split([], slices.index(plan.manifest), rank_of, ranks)
    out = [_spread("reports", "gather", reports), _spread("views", "scatter", first),
           _spread("holdings", "gather", copies),
           _spread("rank table", "gather", [(n, r) for r, n in enumerate(nodes)]),
           _spread("plan", "scatter", shares), _spread("free space", "gather", spaces),
           _spread("free space answer", "bcast", [None] * ranks),
           _spread("problems", "gather", [[] for _ in nodes]),
           _spread("retries", "scatter", retries)]
    if not plan.resized and plan.to is None:
        intact = [[(c.owner, c.holder) for c in held if c.kind == "replica"]
                  for held in copies]
        pmap = [[(o + 1) % len(plan.manifest.nodes)] for o in range(len(plan.manifest.nodes))]
        jobs = slices.replication_jobs(plan.manifest, pmap, {p for i in intact for p in i},
                                       rank_of, ranks)
        out += [_spread("intact replicas", "gather", intact),
                _spread("re-replication", "scatter", jobs)]
    moved = [{"spool": 512 << 20} for _ in nodes]
    out += [_spread("bytes moved", "gather", moved),
            _spread("totals", "bcast", [{"spool": ranks * (512 << 20)}] * ranks),
            _spread("replicated", "allreduce",
                    [[0] * math.ceil(math.log2(max(ranks, 2)))] * ranks)]
    return out


def _figures(messages: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """Per message and per rank, what it is sent (scatter, bcast, reductions) apart from
    what it sends to rank 0 (gather)."""
    got, sent = [0] * ranks, [0] * ranks
    by_message = {}
    for m in messages:
        sizes = m.pop("sizes")
        into = sent if m["kind"] == "gather" else got
        for rank, size in enumerate(sizes):
            into[rank] += size
        by_message[m["message"]] = {"kind": m["kind"], "max": max(sizes),
                                    "mean": round(sum(sizes) / ranks)}
    agreements = AGREEMENTS * math.ceil(math.log2(max(ranks, 2))) * _size(0)
    return {"by_message": by_message,
            "per_rank": {"max": max(got) + agreements,
                         "mean": round(sum(got) / ranks) + agreements,
                         "sent_max": max(sent), "sent_mean": round(sum(sent) / ranks)},
            "agreements": agreements, "rank0_gathered": sum(sent)}


def scenario(nodes: int, onto: int) -> dict[str, Any]:
    parts = _parts(nodes)
    whole = GlobalManifest.build(parts, [".metadata"], {}, {n: f"b{n}" for n in range(nodes)})
    lost = set() if onto == nodes else {0}
    reports = _reports(parts, whole, lost)
    copies = _copies(parts, lost)
    ranks = len(reports)
    hosts = tuple(f"h{n}" for n in range(nodes) if n not in lost)
    rank_of = {r.node: rank for rank, r in enumerate(reports)}
    start = time.perf_counter()
    merged = discover.merge(reports)
    views = slices.known_by_rank(merged.manifests, reports, hosts)
    every = [c for held in copies for c in held]
    plan = choose(merged.manifests, every, onto,
                  to=None if onto == nodes else "/pfs/restore")
    shares = slices.plan_shares(plan, every, rank_of, ranks)
    plan_seconds = time.perf_counter() - start
    start = time.perf_counter()
    figures = _figures(_messages(reports, copies, merged, views, plan, shares, rank_of),
                       ranks)
    message_seconds = time.perf_counter() - start
    before = (sum(_size(r) for r in reports) + (_size(merged) + _size(plan)) * (ranks - 1)
              + sum(_size(h) for h in copies) * (ranks - 1)
              + _size([(n, n) for n in range(ranks)]) * ranks)
    return {"nodes": nodes, "onto": onto, "moves": len(plan.moves),
            "plan_seconds": round(plan_seconds, 3),
            "message_seconds": round(message_seconds, 3), **figures,
            "placement_allgather": _size(list(hosts)),
            "before_bytes_per_node": before // ranks,
            "before_manifest_bytes": len(json.dumps(whole.to_json())) * nodes * nodes,
            "rebuilt": bool(merged.notes)}


def recovery_scale(nodes: int) -> dict[str, Any]:
    """N -> N and N -> N-1 at `nodes` (benchmarks/scale.py imports this)."""
    return {"same": scenario(nodes, nodes), "one_fewer": scenario(nodes, nodes - 1)}


def flatness(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per-rank bytes at the largest N over the smallest, per scenario."""
    low, high = rows[0], rows[-1]
    return {f"{case} {stat}": round(high[case]["per_rank"][stat]
                                     / low[case]["per_rank"][stat], 2)
            for case in ("same", "one_fewer")
            for stat in ("max", "mean", "sent_max", "sent_mean")}


def line(row: dict[str, Any]) -> str:
    s, f = row["same"], row["one_fewer"]
    return (f"{s['nodes']:>6} N->N {s['moves']} moves, plan {s['plan_seconds']:.3f} s,"
            f" messages {s['message_seconds']:.3f} s, per rank received max"
            f" {s['per_rank']['max']} B mean {s['per_rank']['mean']} B, sent max"
            f" {s['per_rank']['sent_max']} B mean {s['per_rank']['sent_mean']} B (before:"
            f" {s['before_bytes_per_node']} B per node) |"
            f" N->N-1 {f['moves']} moves, plan {f['plan_seconds']:.3f} s, per rank received"
            f" max {f['per_rank']['max']} B mean {f['per_rank']['mean']} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000,10000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        row = recovery_scale(nodes)
        rows.append(row)
        print(line(row), flush=True)
        print(json.dumps(row), flush=True)
    print(json.dumps({"per_rank_ratio_largest_to_smallest": flatness(rows)}))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
