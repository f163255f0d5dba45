"""`cachex recover`'s planning and messages at N simulated nodes, in one process.

N nodes of a DCP checkpoint, 8 shards per node, `.metadata` on node 0; each node holds
its part in its spool and its partner's (node - 1) part as a replica; the whole global
manifest is in the journals of node 0 and of the metadata holders
(peer.partners.metadata_holders), every other journal keeps the digest. Two scenarios:
N -> N (nothing lost), and N -> N-1 (node 0 lost with its journal, no spare: restored
once into `--to DIR`).

Timed (`plan_seconds`): rank 0's work, as recovery/rebuild.py does it: parsing every
rank's report and merging them (discover.merge), then planning (plan.choose). Measured
(`bytes`): every message of the recovery's metadata path, pickled as mpi4py pickles it,
counted once per receiving rank (a bcast or allgather is paid by every rank that
receives it): the reports gathered onto rank 0, the merged manifests and the plan
broadcast, the holdings and rank table allgathered. `before_manifest_bytes`: what the
former allgather of every journal's manifests cost when every agent kept the whole
manifest (N x N copies of it), computed from its size, not sent.

    python benchmarks/scale_recovery.py [--nodes 100,1000,10000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest  # noqa: E402
from cachex_agent.peer.partners import metadata_holders  # noqa: E402
from cachex_agent.recovery import discover  # noqa: E402
from cachex_agent.recovery.plan import Copy, choose  # noqa: E402

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
        found = discover.Found(node, digests={CKPT: digest})
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
        held = [Copy(CKPT, node, "spool", node, own),
                Copy(CKPT, owner, "replica", node, tuple(e.path for e in parts[owner].files))]
        if node:
            held.append(Copy(CKPT, 0, "journal", node, (".metadata",)))
        per_rank.append(held)
    return per_rank


def _size(message: Any) -> int:
    return len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def scenario(nodes: int, onto: int) -> dict[str, Any]:
    parts = _parts(nodes)
    whole = GlobalManifest.build(parts, [".metadata"], {}, {n: f"b{n}" for n in range(nodes)})
    lost = set() if onto == nodes else {0}
    reports = _reports(parts, whole, lost)
    copies = _copies(parts, lost)
    ranks = len(reports)
    start = time.perf_counter()
    merged = discover.merge(reports)
    plan = choose(merged.manifests, [c for held in copies for c in held], onto,
                  to=None if onto == nodes else "/pfs/restore")
    plan_seconds = time.perf_counter() - start
    start = time.perf_counter()
    gathered = [_size(r) for r in reports]                  # each to rank 0
    shared = _size(merged) * (ranks - 1)                    # bcast: every other rank
    holdings = sum(_size(h) for h in copies) * (ranks - 1)  # allgather: all to each
    plan_bytes = _size(plan) * (ranks - 1)
    rank_table = _size([(n, n) for n in range(ranks)]) * ranks
    message_seconds = time.perf_counter() - start
    to_one = max(_size(merged), sum(gathered)) + sum(_size(h) for h in copies) \
        + _size(plan) + _size([(n, n) for n in range(ranks)])
    total = sum(gathered) + shared + holdings + plan_bytes + rank_table
    return {"nodes": nodes, "onto": onto, "moves": len(plan.moves),
            "plan_seconds": round(plan_seconds, 3),
            "message_seconds": round(message_seconds, 3),
            "total_message_bytes": total, "bytes_per_node": total // ranks,
            "max_bytes_to_one_rank": to_one,
            "by_message": {"reports_to_rank0": sum(gathered), "merged_bcast": shared,
                           "holdings_allgather": holdings, "plan_bcast": plan_bytes,
                           "rank_table_allgather": rank_table},
            "before_manifest_bytes": len(json.dumps(whole.to_json())) * nodes * nodes,
            "rebuilt": bool(merged.notes)}


def recovery_scale(nodes: int) -> dict[str, Any]:
    """N -> N and N -> N-1 at `nodes` (benchmarks/scale.py imports this)."""
    return {"same": scenario(nodes, nodes), "one_fewer": scenario(nodes, nodes - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="100,1000,10000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        row = recovery_scale(nodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
