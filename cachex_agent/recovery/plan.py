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
may have any rank read any file, and which files a new rank reads is not knowable here
(`.metadata` is a pickle, hostile input never unpickled, and the new world's plan is the
trainer's). So it is restored once into a directory every rank reads (`cachex recover
--to DIR`, e.g. on the PFS), never whole into each of the M spools (512 nodes onto 511
were 262k moves); without `--to` such a resize is refused as a usage error (ConfigError,
exit 2) naming `--to`. Any other checkpoint's part of old node o goes to new node
o mod M, and every node gets the global files. The plan says which, and what a trainer
that cannot reshard must do. Before anything is moved, `check_space` refuses a placement
that does not fit in a target's spool.

Planning is O(N log N) for N nodes' parts: the copies are indexed once by owner (and
the journal copies of the global files by owner and holder), never scanned per owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, OperationError
from ..manifest import GlobalManifest
from ..status import human_size

PREFERENCE = {"spool": 0, "stage": 1, "replica": 2, "pfs": 3}
# every kind of copy a recovery reads, as `cachex recover --exclude` names them
KINDS = ("spool", "stage", "replica", "parity", "journal", "pfs")


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
        return kept(self.resized, self.to, move)

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


def kept(resized: bool, to: str | None, move: Move) -> bool:
    """Plan.kept, for a rank that holds its slice of the plan (slices.Share)."""
    return (not resized and to is None and move.source.kind == "spool"
            and move.source.holder == move.target == move.owner)


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
           want: str | None = None, exclude: frozenset[str] = frozenset(),
           to: str | None = None) -> Plan:
    """The plan for the newest recoverable checkpoint (or `want`), else OperationError;
    with `to`, the plan that writes every file once into that directory (`gathered`)."""
    by_ckpt: dict[str, list[Copy]] = {}
    for c in copies:
        if c.kind not in exclude:
            by_ckpt.setdefault(c.ckpt, []).append(c)
    skipped: dict[str, str] = {}
    order = sorted(manifests.values(), key=lambda m: m.seq, reverse=True)
    if want is not None:
        order = [m for m in order if m.ckpt == want]
        if not order:
            raise OperationError(f"{want}: no global manifest found in any journal or on the"
                                 " PFS")
    for manifest in order:
        held = Held(by_ckpt.get(manifest.ckpt, []))
        try:
            if to is not None:
                return gathered(Plan(manifest.ckpt, manifest.seq, manifest, [], skipped,
                                     nodes), held, nodes, to)
            if len(manifest.nodes) == nodes:
                moves, notes = _moves(manifest, held, nodes), []
            else:
                _refuse_dcp_resize(manifest, nodes)
                moves, notes = _resized_moves(manifest, held, nodes), placement_notes(
                    manifest, nodes)
        except _Unrecoverable as why:
            skipped[manifest.ckpt] = str(why)
            continue
        return Plan(manifest.ckpt, manifest.seq, manifest, moves, skipped, nodes, notes)
    reasons = "; ".join(f"{c}: {w}" for c, w in skipped.items()) or "no checkpoint known"
    raise OperationError(f"nothing recoverable: {reasons}")


def _refuse_dcp_resize(manifest: GlobalManifest, nodes: int) -> None:
    """A DCP checkpoint onto another node count goes once into a shared directory, not
    whole into every spool (module docstring): a usage error without `--to`."""
    if reshards(manifest):
        raise ConfigError(f"{manifest.ckpt}: a PyTorch DCP checkpoint of"
                          f" {len(manifest.nodes)} nodes onto {nodes}: give `cachex recover"
                          " --to DIR`, a directory every rank reads (e.g. on the PFS), and"
                          " load it from there")


class Held:
    """A checkpoint's copies indexed once: by owner, and the journal copies of the
    global files by (owner, holder), so that planning never scans every copy per part."""

    def __init__(self, copies: list[Copy]) -> None:
        self.copies = copies
        self.by_owner: dict[int, list[Copy]] = {}
        self.journal: dict[tuple[int, int], Copy] = {}
        for c in copies:
            if c.kind == "journal":
                self.journal.setdefault((c.owner, c.holder), c)
            else:
                self.by_owner.setdefault(c.owner, []).append(c)

    def of(self, owner: int) -> list[Copy]:
        return self.by_owner.get(owner, [])


class _Unrecoverable(OperationError):
    """This checkpoint cannot be recovered: choose tries the next older one."""


def _moves(manifest: GlobalManifest, held: Held, nodes: int) -> list[Move]:
    """Same node count: node i's part back to node i, the global files to every node."""
    globals_ = set(manifest.global_files)
    parts = _files_by_node(manifest)
    moves = []
    for owner in range(nodes):
        paths = parts.get(owner, ())
        if not paths:
            continue    # wrote nothing (a single file one rank saved): gets the globals
        source = _best(held.of(owner), owner, owner, paths)
        if source is None:
            raise _Unrecoverable(f"node {owner}'s files have no verified copy left"
                                 f" ({_what_exists(held.of(owner), owner)})")
        moves.append(Move(owner, owner, source, paths))
    for owner, source in [(m.owner, m.source) for m in moves]:
        shared = tuple(p for p in parts[owner] if p in globals_)
        if not shared:
            continue
        for target in range(nodes):
            if target != owner:
                moves.append(Move(target, owner, _global_source(held, target, owner, shared)
                                  or source, shared))
    return moves


def _files_by_node(manifest: GlobalManifest) -> dict[int, tuple[str, ...]]:
    """Every node's paths in one pass (node_files per node is a scan of every file)."""
    parts: dict[int, list[str]] = {}
    for e in manifest.files:
        parts.setdefault(e["node"], []).append(e["path"])
    return {node: tuple(paths) for node, paths in parts.items()}


def _best(copies: list[Copy], owner: int, target: int, paths: tuple[str, ...]) -> Copy | None:
    """`copies`: the owner's (Held.of), so this is O(copies of one part)."""
    wanted = set(paths)
    whole = [c for c in copies if c.owner == owner and c.kind != "journal"
             and wanted <= set(c.paths)]
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


def _global_source(held: Held, target: int, owner: int, paths: tuple[str, ...]
                   ) -> Copy | None:
    """The target's own journal copy of the global files, when it has them all."""
    c = held.journal.get((owner, target))
    return c if c is not None and set(paths) <= set(c.paths) else None


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
    others come besides): o -> o mod M (a DCP resize goes to `--to`, not to nodes)."""
    if nodes < 1:
        raise OperationError(f"a recovery needs at least one node, not {nodes}")
    old = range(len(manifest.nodes))
    if len(manifest.nodes) == nodes:
        return {t: [t] for t in range(nodes)}
    return {t: [o for o in old if o % nodes == t] for t in range(nodes)}


def placement_notes(manifest: GlobalManifest, nodes: int) -> list[str]:
    """What the plan of a resize says: where the parts go and what the trainer does."""
    old = len(manifest.nodes)
    head = f"written by {old} nodes, recovered onto {nodes}:"
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


def _resized_moves(manifest: GlobalManifest, held: Held, nodes: int) -> list[Move]:
    """Each new node's parts (`placement`, o -> o mod M), each path once, each old part
    from the copy the target holds itself when there is one; the global files of the
    other parts from the target's own journal copy when it has them. O(N + M x globals'
    owners): only the parts with global files go to every target."""
    _paths_once(manifest)
    globals_ = set(manifest.global_files)
    files = _files_by_node(manifest)
    shared_by = {o: tuple(p for p in ps if p in globals_) for o, ps in files.items()}
    shared_by = {o: ps for o, ps in shared_by.items() if ps}
    best = _BestFor(held)
    moves: list[Move] = []
    for target, owners in placement(manifest, nodes).items():
        taken: set[str] = set()
        for owner in [*owners, *(o for o in sorted(shared_by) if o not in owners)]:
            paths = tuple(p for p in (files.get(owner, ()) if owner in owners
                                      else shared_by[owner]) if p not in taken)
            taken.update(paths)
            moves += _deliver(held, target, owner, paths, globals_, best)
    return moves


class _BestFor:
    """_best, remembered: for a target that holds no copy of a part the answer is the
    same for every such target, so each part is ranked about once, not once a target."""

    def __init__(self, held: Held) -> None:
        self.held = held
        self.known: dict[tuple[int, tuple[str, ...], int | None], Copy | None] = {}

    def __call__(self, owner: int, target: int, paths: tuple[str, ...]) -> Copy | None:
        mine = any(c.holder == target for c in self.held.of(owner))
        key = (owner, paths, target if mine else None)
        if key not in self.known:
            self.known[key] = _best(self.held.of(owner), owner, target, paths)
        return self.known[key]


def _deliver(held: Held, target: int, owner: int, paths: tuple[str, ...],
             globals_: set[str], best: _BestFor) -> list[Move]:
    if not paths:
        return []
    shared = tuple(p for p in paths if p in globals_)
    journal = _global_source(held, target, owner, shared) if shared else None
    rest = paths if journal is None else tuple(p for p in paths if p not in globals_)
    moves = [Move(target, owner, journal, shared)] if journal is not None else []
    if rest:
        source = best(owner, target, rest)
        if source is None:
            raise _Unrecoverable(f"node {owner}'s files have no verified copy left"
                                 f" ({_what_exists(held.of(owner), owner)})")
        moves.insert(0, Move(target, owner, source, rest))
    return moves


def gathered(plan: Plan, copies: list[Copy] | Held, nodes: int, to: str) -> Plan:
    """`--to DIR`: the plan's checkpoint with every path written once into DIR, by the
    node that holds the best copy of its part (spool, stage, replica, the PFS); a PFS
    bundle is extracted by node o mod M, so the ranks share that work. A part with no
    copy left makes the checkpoint unrecoverable (choose tries the next older one)."""
    first = paths_once(plan.manifest) if not isinstance(copies, Held) else _paths_once(
        plan.manifest)
    held = copies if isinstance(copies, Held) else Held(
        [c for c in copies if c.ckpt == plan.ckpt])    # names repeat across ckpts
    moves = []
    for owner, all_paths in sorted(_files_by_node(plan.manifest).items()):
        paths = tuple(p for p in all_paths if first[p] == owner)
        source = _best(held.of(owner), owner, -2, paths) if paths else None  # -2: no node
        if paths and source is None:
            raise _Unrecoverable(f"node {owner}'s files have no verified copy left"
                                 f" ({_what_exists(held.of(owner), owner)})")
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

