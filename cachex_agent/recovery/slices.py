"""What rank 0 tells each rank of a recovery: that rank's slice, never the whole.

Rank 0 alone holds the merged manifests, every rank's holdings and the plan (at 10,000
nodes: tens of megabytes). Every other rank is sent (comm.scatter) only what it acts on,
each list built in one pass over the whole:
  - `Known`: what its node looks for of each checkpoint (holdings.Wanted) and the facts
    of fixed size every rank needs (each checkpoint's sequence and node count, the bytes
    of all of them: the bound of the holdings' checks);
  - `Share`: the plan's facts and its node's `Work`: the moves where the node is the
    target or the source's holder, the manifest entries of their files, the ranks of its
    peers; and the files of the replicas it holds of the checkpoint (checked before they
    are re-replicated);
  - a `Work` per round of retries (the next copy of each file that failed), decided on
    rank 0 from the problems gathered there;
  - its sends and receives of the re-replication (`Job`).
So the bytes a rank receives do not grow with the job's size (but for the sends of a
node that holds what many nodes need, e.g. global files no journal kept: those are its
data). Pure, no MPI; benchmarks/scale_recovery.py measures the slices at 10,000 nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..manifest import FileEntry, GlobalManifest
from .discover import Found
from .holdings import Parts, Wanted, wanted
from .plan import Copy, Move, Plan, bytes_needed, kept

Entries = dict[tuple[int, str], FileEntry]     # (owner, path) -> its manifest entry


@dataclass
class Known:
    """One rank's view of the merged manifests."""

    seqs: dict[str, int]            # every known checkpoint's sequence
    counts: dict[str, int]          # and node count
    held: int                       # the bytes of all of them
    wants: dict[str, Wanted]        # what this rank's node looks for


def known_by_rank(manifests: dict[str, GlobalManifest], reports: list[Found],
                  hosts: tuple[str, ...]) -> list[Known]:
    """Each report's rank's view (reports in rank order; `hosts`: by node index)."""
    indexed = {ckpt: Parts(m) for ckpt, m in manifests.items()}
    seqs = {ckpt: m.seq for ckpt, m in manifests.items()}
    counts = {ckpt: len(m.nodes) for ckpt, m in manifests.items()}
    held = sum(m.bytes for m in manifests.values())
    views = []
    for report in reports:
        replicas: dict[str, set[int]] = {}
        for part in report.parts:       # parsed by discover.merge already
            replicas.setdefault(part["ckpt"], set()).add(part["node"])
        host = hosts[report.node] if report.node < len(hosts) else ""
        views.append(Known(seqs, counts, held, {
            ckpt: wanted(parts, report.node, host, replicas.get(ckpt, set()))
            for ckpt, parts in indexed.items()}))
    return views


@dataclass
class Work:
    """One rank's moves of a round, and what it needs to carry them out."""

    moves: list[Move]
    files: list[tuple[int, FileEntry]]      # (owner, entry) of every path of the moves
    ranks: dict[int, int]                   # node -> rank, of the nodes in the moves
    anywhere: bool                          # some rank moves: every rank runs the round
    bad: list[Copy] = field(default_factory=list)   # copies held here that failed a file

    def entries(self) -> Entries:
        return {(owner, e.path): e for owner, e in self.files}


def split(moves: list[Move], entries: Entries, rank_of: dict[int, int], size: int,
          bad: dict[int, list[Copy]] | None = None) -> list[Work]:
    """Each rank's share of `moves`, in their order (so every rank meets its peers in
    one order), in one pass; `bad`: by node, the failed copies it holds."""
    works = [Work([], [], {}, bool(moves)) for _ in range(size)]
    files: list[dict[tuple[int, str], FileEntry]] = [{} for _ in range(size)]
    for move in moves:
        nodes = {move.target, move.source.holder} - {-1}
        for node in nodes:
            rank = rank_of[node]
            works[rank].moves.append(move)
            works[rank].ranks.update((n, rank_of[n]) for n in nodes)
            files[rank].update(((move.owner, p), entries[(move.owner, p)])
                               for p in move.paths)
    for node, copies in (bad or {}).items():
        works[rank_of[node]].bad = copies
    for work, mine in zip(works, files, strict=True):
        work.files = [(owner, e) for (owner, _), e in mine.items()]
    return works


@dataclass
class Share:
    """One rank's slice of the plan."""

    ckpt: str
    seq: int
    run: str
    to: str | None
    resized: bool
    files: int                      # the checkpoint's file count
    parts: int                      # its node count
    largest: int                    # bytes: the largest part, or a target's writes
    work: Work
    held: dict[int, list[FileEntry]] = field(default_factory=dict)   # replica owner ->

    def kept(self, move: Move) -> bool:
        return kept(self.resized, self.to, move)


def index(manifest: GlobalManifest) -> Entries:
    return {(e["node"], e["path"]): FileEntry(e["path"], e["size"], e["mode"], e["checksum"])
            for e in manifest.files}


def plan_shares(plan: Plan, copies: list[Copy], rank_of: dict[int, int], size: int
                ) -> list[Share]:
    """Every rank's slice of `plan`, by rank."""
    parts = Parts(plan.manifest)
    largest = max([n["bytes"] for n in plan.manifest.nodes]
                  + list(bytes_needed(plan).values()) + [0])
    held: list[dict[int, list[FileEntry]]] = [{} for _ in range(size)]
    for c in copies:
        if c.kind == "replica" and c.ckpt == plan.ckpt and c.holder in rank_of:
            held[rank_of[c.holder]][c.owner] = parts.of(c.owner)
    entries = {(owner, e.path): e for owner, files in parts.files.items() for e in files}
    works = split(plan.moves, entries, rank_of, size)
    return [Share(plan.ckpt, plan.seq, plan.manifest.run, plan.to, plan.resized,
                  len(plan.manifest.files), parts.count, largest, work, held[rank])
            for rank, work in enumerate(works)]


@dataclass(frozen=True)
class Job:
    """A part sent to a partner again (re-replication), as one end of it sees it."""

    owner: int
    partner: int
    peer: int                       # the other end's rank
    files: list[FileEntry]
    part: dict[str, Any]            # the owner's manifest node entry (host, rank)


def replication_jobs(manifest: GlobalManifest, pmap: list[list[int]],
                     held: set[tuple[int, int]], rank_of: dict[int, int], size: int
                     ) -> list[list[Job]]:
    """Each rank's sends and receives, in one order for all: by owner, then partner;
    `held`: the (owner, partner) pairs whose replica is intact already."""
    parts = Parts(manifest)
    jobs: list[list[Job]] = [[] for _ in range(size)]
    for owner in range(parts.count):
        for partner in pmap[owner]:
            if (owner, partner) in held:
                continue
            files, part = parts.of(owner), parts.nodes[owner]
            jobs[rank_of[owner]].append(Job(owner, partner, rank_of[partner], files, part))
            jobs[rank_of[partner]].append(Job(owner, partner, rank_of[owner], files, part))
    return jobs
