"""Which checkpoint to recover and where each node's files come from. Pure, no MPI.

Every rank reports the verified copies it holds (`Copy`); rank 0 merges them with the
PFS and picks the newest checkpoint whose every part has a source, preferring, for the
part of node `o`: a copy already on node `o` (its spool, then its stage), a replica on
another surviving node (moved over MPI), then the PFS bundle. The global files (written
by one node only) come with that node's part, and to every other node from its own
journal copy or from the same source. When the newest checkpoint cannot be recovered,
the reason is kept and the next older one is tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import OperationError
from ..manifest import GlobalManifest

PREFERENCE = {"spool": 0, "stage": 1, "replica": 2, "pfs": 3}


@dataclass(frozen=True)
class Copy:
    """A verified copy of `owner`'s part of `ckpt` (or of its global files) on `holder`.

    kind: spool | stage | replica | journal (global files only) | pfs (holder -1) |
    parity (no files: the holder's share of its erasure group's parity, which rebuilds
    a lost member's part into its stage before the plan, recovery/erasure_recover.py)."""

    ckpt: str
    owner: int
    kind: str
    holder: int
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Move:
    """Bring `paths` of `owner`'s part from `source` to `target`'s spool."""

    target: int
    owner: int
    source: Copy
    paths: tuple[str, ...]

    @property
    def local(self) -> bool:
        return self.source.holder in (self.target, -1)     # own copy, or read the PFS


@dataclass
class Plan:
    ckpt: str
    seq: int
    manifest: GlobalManifest
    moves: list[Move]
    skipped: dict[str, str] = field(default_factory=dict)     # newer ckpt -> why not

    def describe(self) -> list[str]:
        lines = [f"{ckpt}: not recoverable: {why}" for ckpt, why in self.skipped.items()]
        lines.append(f"recovering {self.ckpt} (seq {self.seq}) on {len(self.manifest.nodes)}"
                     " nodes:")
        for move in self.moves:
            count = f"{len(move.paths)} file{'s' if len(move.paths) != 1 else ''}"
            lines.append(f"  node {move.target}: {count} of node {move.owner} from"
                         f" {where(move.source, move.target)}")
        return lines


def where(copy: Copy, target: int) -> str:
    """The copy as node `target` sees it: its own spool, replica on node 3, the PFS."""
    return ("its own " + copy.kind if copy.holder == target
            else "the PFS bundle" if copy.kind == "pfs"
            else f"{copy.kind} on node {copy.holder}")


def choose(manifests: dict[str, GlobalManifest], copies: list[Copy], nodes: int,
           want: str | None = None, exclude: frozenset[str] = frozenset()) -> Plan:
    """The plan for the newest recoverable checkpoint (or `want`), else OperationError."""
    usable = [c for c in copies if c.kind not in exclude]
    skipped: dict[str, str] = {}
    order = sorted(manifests.values(), key=lambda m: m.seq, reverse=True)
    if want is not None:
        order = [m for m in order if m.ckpt == want]
        if not order:
            raise OperationError(f"{want}: no global manifest found in any journal or on the"
                                 " PFS")
    for manifest in order:
        try:
            moves = _moves(manifest, [c for c in usable if c.ckpt == manifest.ckpt], nodes)
        except _Unrecoverable as why:
            skipped[manifest.ckpt] = str(why)
            continue
        return Plan(manifest.ckpt, manifest.seq, manifest, moves, skipped)
    reasons = "; ".join(f"{c}: {w}" for c, w in skipped.items()) or "no checkpoint known"
    raise OperationError(f"nothing recoverable: {reasons}")


class _Unrecoverable(Exception):
    pass


def _moves(manifest: GlobalManifest, copies: list[Copy], nodes: int) -> list[Move]:
    if len(manifest.nodes) != nodes:
        raise _Unrecoverable(f"written by {len(manifest.nodes)} nodes, this recovery runs on"
                             f" {nodes} (one rank per node, replacements included)")
    globals_ = set(manifest.global_files)
    moves = []
    for owner in range(nodes):
        paths = tuple(e.path for e in manifest.node_files(owner))
        if not paths:
            continue    # wrote nothing (a single file one rank saved): gets the globals
        source = _best(copies, owner, owner, paths)
        if source is None:
            raise _Unrecoverable(f"node {owner}'s files have no verified copy left"
                                 f" ({_what_exists(copies, owner)})")
        moves.append(Move(owner, owner, source, paths))
    for owner, source in [(m.owner, m.source) for m in moves]:
        shared = tuple(p for p in (e.path for e in manifest.node_files(owner)) if p in globals_)
        if not shared:
            continue
        for target in range(nodes):
            if target != owner:
                moves.append(Move(target, owner, _global_source(copies, target, owner, shared)
                                  or source, shared))
    return moves


def _best(copies: list[Copy], owner: int, target: int, paths: tuple[str, ...]) -> Copy | None:
    whole = [c for c in copies if c.owner == owner and c.kind != "journal"
             and set(paths) <= set(c.paths)]
    if not whole:
        return None
    return min(whole, key=lambda c: (c.holder != target, PREFERENCE[c.kind], c.holder))


def next_source(copies: list[Copy], target: int, owner: int, path: str,
                tried: set[Copy]) -> Copy | None:
    """Where `target` takes `path` of `owner`'s part from after the copies in `tried`
    failed for it: its own copies first, then the plan's order of kinds."""
    left = [c for c in copies if c.owner == owner and path in c.paths and c not in tried
            and (c.kind != "journal" or c.holder == target)]
    if not left:
        return None
    return min(left, key=lambda c: (c.holder != target, PREFERENCE.get(c.kind, 1), c.holder))


def _global_source(copies: list[Copy], target: int, owner: int, paths: tuple[str, ...]
                   ) -> Copy | None:
    """The target's own journal copy of the global files, when it has them all."""
    for c in copies:
        if c.owner == owner and c.holder == target and c.kind == "journal" \
                and set(paths) <= set(c.paths):
            return c
    return None


def _what_exists(copies: list[Copy], owner: int) -> str:
    kinds = sorted({f"{c.kind} on node {c.holder}" if c.holder >= 0 else c.kind
                    for c in copies if c.owner == owner and c.kind != "journal"})
    return ("copies that do not cover its files: " + ", ".join(kinds) if kinds
            else "no spool, stage, replica or PFS copy")
