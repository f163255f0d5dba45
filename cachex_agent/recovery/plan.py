"""Which checkpoint to recover and where each node's files come from. Pure, no MPI.

Every rank reports the verified copies it holds (`Copy`); rank 0 merges them with the
PFS and picks the newest checkpoint whose every part has a source, preferring, for the
part of node `o`: a copy already on node `o` (its spool, then its stage), a replica on
another surviving node (moved over MPI), then the PFS bundle. The global files (written
by one node only) come with that node's part, and to every other node from its own
journal copy or from the same source. When the newest checkpoint cannot be recovered,
the reason is kept and the next older one is tried.

A recovery onto M nodes of a checkpoint written by N (`placement`): a checkpoint in
PyTorch DCP's layout (`.metadata` beside `*.distcp` files), which DCP's `load` reshards,
goes whole to every node, since any rank may read any file; any other checkpoint's part
of old node o goes to new node o mod M, and every node gets the global files. The plan
says which, and what a trainer that cannot reshard must do. Before anything is moved,
`check_space` refuses a placement that does not fit in a target's spool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import OperationError
from ..manifest import GlobalManifest
from ..status import human_size

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
    nodes: int = 0                  # the recovery's node count (0: the checkpoint's)
    notes: list[str] = field(default_factory=list)           # how a resize places parts
    to: str | None = None           # `--to DIR`: one shared directory, not the spools

    @property
    def resized(self) -> bool:
        return self.nodes not in (0, len(self.manifest.nodes))

    def kept(self, move: Move) -> bool:
        """A part checked where it lies, in its own node's spool. Not on a resize: each
        node's checkpoint is then assembled aside whole, so that its name (and the
        `.metadata` a mirror left there) never shows a checkpoint half restored."""
        return (not self.resized and self.to is None and move.source.kind == "spool"
                and move.source.holder == move.target == move.owner)

    def describe(self) -> list[str]:
        lines = [f"{ckpt}: not recoverable: {why}" for ckpt, why in self.skipped.items()]
        lines.append(f"recovering {self.ckpt} (seq {self.seq}) on"
                     f" {self.nodes or len(self.manifest.nodes)} nodes"
                     + (f" into {self.to}:" if self.to else ":"))
        lines += [f"  {note}" for note in self.notes]
        if len(self.moves) > DETAIL:
            return lines + _per_target(self.moves)
        for move in self.moves:
            lines.append(f"  node {move.target}: {_files(len(move.paths))} of node"
                         f" {move.owner} from {where(move.source, move.target)}")
        return lines


DETAIL = 64     # moves: more (a resize of many nodes) are said in one line per target


def _files(count: int) -> str:
    return f"{count} file{'s' if count != 1 else ''}"


def _per_target(moves: list[Move]) -> list[str]:
    """`node 0: 4100 files of 512 nodes: 8 from its own spool, 4088 from spool on 510
    other nodes, ...`: the kinds of copies each target reads, not every move."""
    counts: dict[int, dict[str, list[Any]]] = {}
    for move in moves:
        own = move.source.holder == move.target
        label = ("its own " + move.source.kind if own else "the PFS bundles"
                 if move.source.kind == "pfs" else f"{move.source.kind} on")
        entry = counts.setdefault(move.target, {}).setdefault(label, [0, set(), set()])
        entry[0] += len(move.paths)
        entry[1].add(move.owner)
        entry[2].add(move.source.holder)
    lines = []
    for target, labels in sorted(counts.items()):
        total = sum(n for n, _, _ in labels.values())
        owners = len(set().union(*(o for _, o, _ in labels.values())))
        said = ", ".join(f"{n} from {label}" + (f" {len(h)} other node{'s' if len(h) > 1 else ''}"
                                                if label.endswith(" on") else "")
                         for label, (n, _, h) in labels.items())
        lines.append(f"  node {target}: {_files(total)} of {owners} nodes: {said}")
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
        mine = [c for c in usable if c.ckpt == manifest.ckpt]
        try:
            if len(manifest.nodes) == nodes:
                moves, notes = _moves(manifest, mine, nodes), []
            else:
                moves, notes = _resized_moves(manifest, mine, nodes), placement_notes(
                    manifest, nodes)
        except _Unrecoverable as why:
            skipped[manifest.ckpt] = str(why)
            continue
        return Plan(manifest.ckpt, manifest.seq, manifest, moves, skipped, nodes, notes)
    reasons = "; ".join(f"{c}: {w}" for c, w in skipped.items()) or "no checkpoint known"
    raise OperationError(f"nothing recoverable: {reasons}")


class _Unrecoverable(Exception):
    pass


def _moves(manifest: GlobalManifest, copies: list[Copy], nodes: int) -> list[Move]:
    """Same node count: node i's part back to node i, the global files to every node."""
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
    failed for it: its own copies first, then the plan's order of kinds. `copies` are
    the plan's checkpoint's (file names repeat across checkpoints)."""
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


# ------------------------------------------------------------ another node count
def reshards(manifest: GlobalManifest) -> bool:
    """PyTorch DCP's layout (`.metadata` at the top beside `*.distcp` files): DCP's
    `load` reads whatever files its metadata names for this rank's shards, so with
    another world size any rank may read any file."""
    paths = [e["path"] for e in manifest.files]
    return ".metadata" in paths and any(p.endswith(".distcp") for p in paths)


def placement(manifest: GlobalManifest, nodes: int) -> dict[int, list[int]]:
    """New node -> the old nodes whose whole part it gets (the global files of the
    others come besides): every old node for a DCP checkpoint, else o -> o mod M."""
    if nodes < 1:
        raise OperationError(f"a recovery needs at least one node, not {nodes}")
    old = range(len(manifest.nodes))
    if reshards(manifest) or len(manifest.nodes) == nodes:
        return {t: (list(old) if reshards(manifest) else [t]) for t in range(nodes)}
    return {t: [o for o in old if o % nodes == t] for t in range(nodes)}


def placement_notes(manifest: GlobalManifest, nodes: int) -> list[str]:
    """What the plan of a resize says: where the parts go and what the trainer does."""
    old = len(manifest.nodes)
    head = f"written by {old} nodes, recovered onto {nodes}:"
    if reshards(manifest):
        return [f"{head} PyTorch DCP layout, every node gets all {len(_paths_once(manifest))}"
                " files (DCP's load reshards onto the new world size)"]
    where = placement(manifest, nodes)
    pairs = [f"old node {o} -> node {t}" for t, owners in where.items()
             for o in owners if o != t]
    moved = ", ".join(pairs[:8] + ([f"{len(pairs) - 8} more"] if len(pairs) > 8 else []))
    empty = [t for t, owners in where.items() if not owners]
    notes = [f"{head} old node o goes to node o mod {nodes}"
             + (f" ({moved})" if moved else "") + "; global files to every node"]
    if empty:
        notes.append(f"nodes {', '.join(map(str, empty))} get only the global files")
    notes.append("not a DCP layout, so no resharding is known: resume with the framework's"
                 f" own conversion to {nodes} nodes (e.g. DeepSpeed's universal checkpoint),"
                 f" or on {old} nodes; `cachex recover --to DIR` gathers every file in one"
                 " directory for such a tool")
    return notes


class Collision(OperationError):
    """One path, different contents on two nodes: the parts cannot share a directory."""


def paths_once(manifest: GlobalManifest) -> dict[str, int]:
    """Every path of the checkpoint -> the first node that holds it (a global file
    mirrored to every node is taken once); Collision when two nodes hold different
    files under one path."""
    first: dict[str, tuple[int, str]] = {}
    for entry in manifest.files:
        seen = first.setdefault(entry["path"], (entry["node"], entry["checksum"]))
        if seen[1] != entry["checksum"]:
            raise Collision(f"{entry['path']}: nodes {seen[0]} and {entry['node']} hold"
                            " different files under this path")
    return {path: node for path, (node, _) in first.items()}


def _paths_once(manifest: GlobalManifest) -> dict[str, int]:
    try:
        return paths_once(manifest)
    except Collision as exc:
        raise _Unrecoverable(f"{exc}: they cannot share one node's spool") from None


def _resized_moves(manifest: GlobalManifest, copies: list[Copy], nodes: int) -> list[Move]:
    """Each new node's files (`placement`), each path once, each old part from the copy
    the target holds itself when there is one; the global files from the target's own
    journal copy when it has them. Linear in targets x old nodes (indexes, not scans:
    a DCP resize of 1000 nodes plans a million moves)."""
    _paths_once(manifest)
    globals_ = set(manifest.global_files)
    old = range(len(manifest.nodes))
    files = {o: [e.path for e in manifest.node_files(o)] for o in old}
    held: dict[int, list[Copy]] = {o: [] for o in old}
    for copy in copies:
        held.setdefault(copy.owner, []).append(copy)
    best = _BestFor(held)
    moves: list[Move] = []
    for target, owners in placement(manifest, nodes).items():
        whole, taken = set(owners), set()
        for owner in [*owners, *(o for o in old if o not in whole)]:
            paths = [p for p in files[owner] if p not in taken
                     and (owner in whole or p in globals_)]
            taken.update(paths)
            moves += _deliver(held[owner], target, owner, tuple(paths), globals_, best)
    return moves


class _BestFor:
    """_best, remembered: for a target that holds no copy of a part the answer is the
    same for every such target, so each part is ranked about once, not once a target."""

    def __init__(self, held: dict[int, list[Copy]]) -> None:
        self.held = held
        self.holders = {o: {c.holder for c in cs} for o, cs in held.items()}
        self.known: dict[tuple[int, tuple[str, ...], int | None], Copy | None] = {}

    def __call__(self, owner: int, target: int, paths: tuple[str, ...]) -> Copy | None:
        key = (owner, paths, target if target in self.holders[owner] else None)
        if key not in self.known:
            self.known[key] = _best(self.held[owner], owner, target, paths)
        return self.known[key]


def _deliver(copies: list[Copy], target: int, owner: int, paths: tuple[str, ...],
             globals_: set[str], best: _BestFor) -> list[Move]:
    if not paths:
        return []
    shared = tuple(p for p in paths if p in globals_)
    journal = _global_source(copies, target, owner, shared) if shared else None
    rest = paths if journal is None else tuple(p for p in paths if p not in globals_)
    moves = [Move(target, owner, journal, shared)] if journal is not None else []
    if rest:
        source = best(owner, target, rest)
        if source is None:
            raise _Unrecoverable(f"node {owner}'s files have no verified copy left"
                                 f" ({_what_exists(copies, owner)})")
        moves.insert(0, Move(target, owner, source, rest))
    return moves


def gathered(plan: Plan, copies: list[Copy], nodes: int, to: str) -> Plan:
    """`--to DIR`: the plan's checkpoint with every path written once into DIR, by the
    node that holds the best copy of its part (spool, stage, replica, the PFS); a PFS
    bundle is extracted by node o mod M, so the ranks share that work."""
    first = paths_once(plan.manifest)
    copies = [c for c in copies if c.ckpt == plan.ckpt]    # names repeat across ckpts
    moves = []
    for owner in range(len(plan.manifest.nodes)):
        paths = tuple(e.path for e in plan.manifest.node_files(owner) if first[e.path] == owner)
        source = _best(copies, owner, -2, paths) if paths else None   # -2: no node prefered
        if paths and source is None:        # choose() found one: only when it is unused
            raise OperationError(f"node {owner}'s files have no verified copy left")
        if source is not None:
            writer = source.holder if 0 <= source.holder < nodes else owner % nodes
            moves.append(Move(writer, owner, source, paths))
    notes = [f"into {to}: every file once, in the spool's layout, written by the node"
             " that holds its copy (a PFS bundle by node o mod"
             f" {nodes}); the spools stay as they are"]
    return Plan(plan.ckpt, plan.seq, plan.manifest, moves, plan.skipped, nodes, notes, to)


# ------------------------------------------------------------------ free space
@dataclass(frozen=True)
class Space:
    """A target's spool (or the `--to` directory) as its node sees it: free bytes for
    an unprivileged writer; `shared` names its file system (host and device), the same
    for targets that write to one."""

    node: int
    path: str
    free: int
    shared: str


def bytes_needed(plan: Plan) -> dict[int, int]:
    """The bytes each target writes: every file it receives, but not a file checked in
    place in its own spool (the copy that stays)."""
    sizes = {(e["node"], e["path"]): e["size"] for e in plan.manifest.files}
    needed: dict[int, int] = {}
    for move in plan.moves:
        needed[move.target] = needed.get(move.target, 0) + (0 if plan.kept(move) else sum(
            sizes[(move.owner, p)] for p in move.paths))
    return needed


def check_space(needed: dict[int, int], spaces: list[Space]) -> None:
    """OperationError naming the node and the path when a placement does not fit.
    Targets whose directories share one file system share its free space."""
    groups: dict[str, list[Space]] = {}
    for space in spaces:
        groups.setdefault(space.shared, []).append(space)
    for group in groups.values():
        want = sum(needed.get(s.node, 0) for s in group)
        free = min(s.free for s in group)
        if want > free:
            nodes = sorted(s.node for s in group if needed.get(s.node, 0))
            first = next(s for s in group if s.node == nodes[0])
            who = (f"node {nodes[0]}" if len(nodes) == 1 else
                   f"nodes {', '.join(map(str, nodes))} (one file system)")
            raise OperationError(f"{who}: {first.path} needs {human_size(want)} ({want} bytes),"
                                 f" {human_size(free)} ({free} bytes) free: the placement does"
                                 " not fit; free space or recover onto more nodes")

