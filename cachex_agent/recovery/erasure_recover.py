"""`cachex recover` with erasure groups (`peer.scheme` xor or rs:K+M): before the plan,
rebuild the parts of lost members from their group's survivors.

A member is lost for a checkpoint when its part has no copy of its own left (spool,
stage, replica) or it holds no parity share of it. Rank 0 looks at the checkpoints from
the newest (or the one asked for): while every member has its part, nothing is rebuilt;
a group that lost no more members than its M is rebuilt, each lost member's part written
into its replacement's stage (private, each file renamed once its checksum matches), so
that the plan (plan.py) then takes it from there like any staged copy, checked again as
it moves into the spool. Then the group encodes the checkpoint again (from the
survivors' parts and the rebuilt ones in the stages), so the replacements hold their
parity share too. A group that lost more falls back, with one line, to the PFS bundle
when there is one, else to an older checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpi4py import MPI

from ..collective import agree, arrive
from ..config import Config
from ..errors import CachexError
from ..manifest import GlobalManifest, LocalManifest
from ..peer.encode_exchange import encode_part
from ..peer.parity import ParityManifest
from ..peer.redundancy import redundancy_of
from ..safepath import UnsafeInput
from . import holdings
from .erasure_rebuild import rebuild_parts
from .plan import Copy

OWN = ("spool", "stage", "replica")
Groups = dict[str, dict[tuple[int, ...], tuple[int, str]]]     # ckpt -> group -> (M, scheme)


@dataclass
class Rebuild:
    """What rank 0 decided: the checkpoint, the groups to rebuild (node numbers in
    member order, and the lost members' places), and one line per decision."""

    ckpt: str | None = None
    groups: list[tuple[list[int], list[int]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def rebuild_lost(comm: Any, config: Config, node: int, ckpts: list[str],
                 manifests: dict[str, GlobalManifest], copies: list[Copy], want: str | None,
                 exclude: frozenset[str], dry_run: bool, bound: float) -> Rebuild:
    """Collective: decide (rank 0) and rebuild; every rank returns the same decision, its
    notes saying what was rebuilt and what falls back. `ckpts`: the checkpoints of the
    job's node count; `manifests` and `copies`: rank 0's whole view of them (the other
    ranks: none, and their own copies)."""
    if not redundancy_of(config).parity or "parity" in exclude:
        return Rebuild()
    paths = config.node_paths(node)
    mine = agree(comm, "erasure groups", lambda: _groups_held(paths.parity, ckpts),
                 config.agent.timeout)
    arrive(comm, "recovery erasure groups", config.agent.timeout)
    groups: Groups = {}
    for part in comm.gather(mine, root=0) or []:       # rank 0 decides alone
        for ckpt, (group, m, scheme) in part.items():
            groups.setdefault(ckpt, {})[tuple(group)] = (m, scheme)
    decision = _decide(manifests, copies, groups, want) if comm.Get_rank() == 0 else None
    arrive(comm, "recovery erasure plan", config.agent.timeout)
    decision = comm.bcast(decision, root=0)
    assert decision is not None
    if dry_run or not decision.groups:
        return decision
    failed = _run(comm, config, node, decision, copies, bound)
    decision.notes += failed
    return decision


def _groups_held(root: Path, ckpts: list[str]) -> dict[str, tuple[list[int], int, str]]:
    """(group, M, scheme) of every checkpoint this node holds a parity manifest of."""
    found = {}
    for ckpt in ckpts:
        try:
            parity = ParityManifest.load(root, ckpt)
        except UnsafeInput:
            raise
        except (OSError, ValueError, CachexError):  # none, or unreadable: not held
            continue
        found[ckpt] = (list(parity.group), parity.m, parity.scheme)
    return found


def _decide(manifests: dict[str, GlobalManifest], copies: list[Copy], groups: Groups,
            want: str | None) -> Rebuild:
    order = sorted(manifests.values(), key=lambda m: m.seq, reverse=True)
    notes: list[str] = []
    for manifest in order:
        if want is not None and manifest.ckpt != want:
            continue
        ours = [c for c in copies if c.ckpt == manifest.ckpt]
        lost = [o for o in range(len(manifest.nodes)) if not _own_part(manifest, ours, o)]
        if not lost:
            break
        group_of = {n: (list(g), m, scheme)
                    for g, (m, scheme) in groups.get(manifest.ckpt, {}).items() for n in g}
        plan, fallback = _rebuildable(manifest, ours, lost, group_of)
        notes += fallback
        if plan and not fallback:
            return Rebuild(manifest.ckpt, plan, notes + [
                f"{manifest.ckpt}: erasure group of nodes {g} ({group_of[g[0]][2]})"
                f" rebuilds node{'s' if len(m) > 1 else ''}"
                f" {', '.join(str(g[i]) for i in m)} from the survivors' data and parity;"
                " then encodes the group again"
                for g, m in plan])
        if all(_on_pfs(ours, o) for o in lost):
            break           # the plan takes the lost parts from the PFS
    return Rebuild(notes=notes)


def _own_part(manifest: GlobalManifest, copies: list[Copy], owner: int) -> bool:
    paths = {e.path for e in manifest.node_files(owner)}
    return not paths or any(c.owner == owner and c.kind in OWN and paths <= set(c.paths)
                            for c in copies)


def _on_pfs(copies: list[Copy], owner: int) -> bool:
    return any(c.owner == owner and c.kind == "pfs" for c in copies)


def _rebuildable(manifest: GlobalManifest, copies: list[Copy], lost: list[int],
                 group_of: dict[int, tuple[list[int], int, str]]
                 ) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """The groups to rebuild (group, lost places) and a line per group that cannot be."""
    parity = {c.holder for c in copies if c.kind == "parity"}
    plan, notes = [], []
    done: set[tuple[int, ...]] = set()
    for owner in lost:
        if owner not in group_of:
            notes.append(f"{manifest.ckpt}: node {owner}'s part has no copy and no parity"
                         " of its group survives")
            continue
        group, m, _scheme = group_of[owner]
        if tuple(group) in done:
            continue
        done.add(tuple(group))
        gone = [i for i, n in enumerate(group) if n not in parity
                or not _own_part(manifest, copies, n)]
        if len(gone) > m:
            names = ", ".join(str(group[i]) for i in gone)
            notes.append(f"{manifest.ckpt}: erasure group of nodes {group} lost nodes {names}:"
                         f" more than the {m} it rebuilds; their parts come from the PFS"
                         " bundle, else an older checkpoint")
            continue
        plan.append((group, gone))
    return plan, notes


def _run(comm: Any, config: Config, node: int, decision: Rebuild, copies: list[Copy],
         bound: float) -> list[str]:
    """Every group of the decision rebuilds on a communicator of its own (this node's
    place in it its place in the group); the lines of the groups that failed."""
    assert decision.ckpt is not None
    mine = next(((g, lost) for g, lost in decision.groups if node in g), None)
    arrive(comm, "recovery erasure rebuild", config.agent.timeout)
    color = decision.groups.index(mine) if mine else MPI.UNDEFINED
    group_comm = comm.Split(color, mine[0].index(node) if mine else 0)

    def rebuild() -> str | None:
        if mine is None:
            return None
        paths = config.node_paths(node)
        own = next((c for c in copies if c.ckpt == decision.ckpt and c.owner == node
                    and c.holder == node and c.kind in ("spool", "stage")), None)
        source = holdings.source_dir(config, own) if own else None
        dest = paths.stage_dir(decision.ckpt)
        try:
            rebuilt = rebuild_parts(group_comm, mine[1], paths.parity, source, dest,
                                    decision.ckpt, bound)
        except CachexError as exc:      # the same on every member: the plan falls back
            group_comm.Free()
            return f"{decision.ckpt}: {exc}"
        try:
            _encode_again(group_comm, config, decision.ckpt, mine[0], node, rebuilt,
                          source or dest, bound)
        except CachexError as exc:      # the parts are back; their protection is not
            return f"{decision.ckpt}: rebuilt, but not encoded again: {exc}"
        finally:
            group_comm.Free()
        return None
    failures = agree(comm, "erasure rebuild", rebuild, 2 * bound)
    arrive(comm, "recovery erasure rebuilt", config.agent.timeout)
    failed = comm.gather(failures, root=0)      # the lines once, not every rank's to all
    return comm.bcast(sorted({f for f in failed if f}) if failed else None, root=0)


def _encode_again(comm: Any, config: Config, ckpt: str, group: list[int], node: int,
                  rebuilt: LocalManifest | None, source: Path, bound: float) -> None:
    """The group encodes the rebuilt checkpoint as the agents did: a survivor's part is
    the one its parity manifest lists, a replacement's the one just rebuilt."""
    root = config.node_paths(node).parity
    part = rebuilt or ParityManifest.load(root, ckpt).parts[group.index(node)]
    encode_part(comm, group, config.peer.scheme, part, source, root, bound)
