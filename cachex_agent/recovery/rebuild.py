"""`cachex recover`: bring back the newest recoverable checkpoint into every node's spool.

Collective over the recovery job (one rank per node, replacements included; or one
process for one node). Call order, every rank:
  1. manifests   every journal's global manifests (+ the PFS on rank 0), merged, shared
  2. holdings    each rank verifies what it holds (spool, stage, replicas, journal)
  3. plan        rank 0 picks the checkpoint and the source of every part; shared
  4. moves       in the plan's order: local copies, PFS extraction, and transfers from
                 a surviving holder to the target over MPI (raw buffers, bounded waits)
  5. redundancy  every node's restored part is copied to its partners' replica stores
Every step ends with an agreement: a failure anywhere fails every rank with the same
message. Every name read from a manifest, bundle or replica store is checked where it is
parsed (safepath.py): an unsafe one fails the recovery before anything is written.

Each node's checkpoint is assembled in a hidden directory of its spool
(`.<ckpt>.tmp-cachex-partial`, fsutil's name for a directory assembled before its
rename: never taken for a checkpoint by agents or resume code) and
renamed to `<spool>/<ckpt>` once every file is there, verified; then the spool is
fsynced. A crash midway leaves nothing under the real name, and the next recovery
removes the hidden directory. A node whose own spool copy is intact keeps it in place
and only gains the global files, each atomically. Newer checkpoint directories that
could not be recovered are moved aside (`.cachex-unrecoverable-<ckpt>`) so that
unchanged resume code picks the recovered one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ..checksum import CHUNK, hasher
from ..collective import agree, arrive
from ..config import Config
from ..errors import OperationError
from ..flush.bundle import extract
from ..fsutil import (
    fsync_dir,
    fsync_tree,
    makedirs,
    open_private,
    remove_temporaries,
    remove_under,
    temp_name,
    trainer_mode,
)
from ..layout import (
    bundle_path,
    ckpt_dir,
    recover_partial_dir,
    set_aside_dir,
)
from ..manifest import FileEntry, GlobalManifest, LocalManifest
from ..peer.globals import mirror_file
from ..peer.partners import replication_map
from ..peer.store import commit_replica, partial_dir
from ..stage.rules import checkpoint_names, natural_key
from ..topology import place_in
from . import holdings
from .plan import Copy, Move, Plan, choose

DATA_TAG = 21
SLOWEST_RATE = 10 << 20     # bytes/s: a rank moving its part slower than this is stuck


@dataclass
class Outcome:
    plan: Plan
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    replicated_bytes: int = 0
    seconds: float = 0.0            # the whole recovery
    plan_seconds: float = 0.0       # listing and verifying every copy, planning
    move_seconds: float = 0.0       # bringing the files into the spools
    moved_aside: list[str] = field(default_factory=list)


def recover(config: Config, comm: Any, want: str | None = None,
            exclude: frozenset[str] = frozenset(), dry_run: bool = False) -> Outcome:
    start = time.monotonic()
    placement = place_in(comm, config.topology.domain)
    node = placement.node
    paths = config.node_paths(node, placement.rank, placement.host)
    manifests = _shared_manifests(comm, config, paths, exclude)
    copies = _all_copies(comm, config, paths, node, manifests, exclude)
    plan = _plan(comm, config, manifests, copies, placement.nodes, want, exclude)
    outcome = Outcome(plan, plan_seconds=time.monotonic() - start)
    if dry_run:
        return outcome
    _arrive(comm, config, "rank exchange")
    ranks = comm.allgather((node, placement.rank))
    rank_of = dict(ranks)
    work = _work_bound(config, plan)
    moved = agree(comm, "restore", lambda: _restore(comm, config, node, rank_of, plan), work)
    outcome.move_seconds = time.monotonic() - start - outcome.plan_seconds
    outcome.moved_aside = agree(comm, "set aside", lambda: _set_aside(paths.spool, plan,
                                                                    manifests),
                                config.agent.timeout)
    replicated = agree(comm, "re-replication", lambda: _rereplicate(
        comm, config, placement, rank_of, plan, copies), work)
    _arrive(comm, config, "recovery totals")
    for part in comm.allgather(moved):
        for kind, count in part.items():
            if count:
                outcome.bytes_by_kind[kind] = outcome.bytes_by_kind.get(kind, 0) + count
    outcome.replicated_bytes = comm.allreduce(replicated)
    outcome.seconds = time.monotonic() - start
    return outcome


def _arrive(comm: Any, config: Config, step: str) -> None:
    """Before a blocking collective: a rank that never comes fails it, named."""
    arrive(comm, f"recovery {step}", config.agent.timeout)


def _work_bound(config: Config, plan: Plan) -> float:
    """How long ranks wait for the slowest one after a phase that moves data: a node's
    part may come from a slow PFS, so the bound grows with the largest part."""
    largest = max((n["bytes"] for n in plan.manifest.nodes), default=0)
    return config.agent.timeout + largest / SLOWEST_RATE


def _verify_bound(config: Config, manifests: dict[str, GlobalManifest]) -> float:
    """How long ranks wait for the slowest one while each checksums what it holds: a node
    may hold every checkpoint's bytes (spool, stage, replicas), at least SLOWEST_RATE."""
    held = sum(m.bytes for m in manifests.values())
    return config.agent.timeout + held / SLOWEST_RATE


# ----------------------------------------------------------------------- phases
def _shared_manifests(comm: Any, config: Config, paths: Any, exclude: frozenset[str]
                      ) -> dict[str, GlobalManifest]:
    def own() -> dict[str, GlobalManifest]:
        mine = holdings.journal_manifests(paths)
        if comm.Get_rank() == 0 and "pfs" not in exclude:
            mine = {**holdings.pfs_manifests(paths.pfs), **mine}
        return mine
    mine = agree(comm, "manifests", own, config.agent.timeout)
    merged: dict[str, GlobalManifest] = {}
    for rank, text in enumerate(comm.allgather(holdings.to_json(mine))):
        for ckpt, manifest in holdings.from_json(text, f"manifests of rank {rank}").items():
            if ckpt not in merged or manifest.committed_at > merged[ckpt].committed_at:
                merged[ckpt] = manifest
    return merged


def _all_copies(comm: Any, config: Config, paths: Any, node: int,
                manifests: dict[str, GlobalManifest], exclude: frozenset[str]) -> list[Copy]:
    bound = _verify_bound(config, manifests)
    mine = agree(comm, "holdings", lambda: holdings.local_copies(paths, node, manifests,
                                                                 exclude), bound)
    copies = [c for part in comm.allgather(mine) for c in part]
    if "pfs" not in exclude:
        copies += agree(comm, "PFS holdings", lambda: holdings.pfs_copies(
            paths.pfs, manifests), bound)
    return copies


def _plan(comm: Any, config: Config, manifests: dict[str, GlobalManifest],
          copies: list[Copy], nodes: int, want: str | None, exclude: frozenset[str]) -> Plan:
    """Rank 0 decides; every rank gets the plan, or raises the same error."""
    answer: Plan | str = ""
    if comm.Get_rank() == 0:
        try:
            answer = _checked_plan(config, manifests, copies, nodes, want, exclude)
        except OperationError as exc:
            answer = str(exc)
    _arrive(comm, config, "plan")
    answer = comm.bcast(answer, root=0)
    if isinstance(answer, str):
        raise OperationError(answer)
    return answer


def _checked_plan(config: Config, manifests: dict[str, GlobalManifest], copies: list[Copy],
                  nodes: int, want: str | None, exclude: frozenset[str]) -> Plan:
    """A PFS bundle is verified only when a plan needs it; a bad one is dropped."""
    pfs = config.node_paths(0).pfs
    while True:
        plan = choose(manifests, copies, nodes, want, exclude)
        bad = [m.source for m in plan.moves if m.source.kind == "pfs"
               and not holdings.bundle_ok(pfs, plan.manifest, m.source.owner)]
        if not bad:
            return plan
        copies = [c for c in copies if c not in bad]


def _restore(comm: Any, config: Config, node: int, rank_of: dict[int, int], plan: Plan
             ) -> dict[str, int]:
    """Transfers first, in the plan's order on every rank (so no rank waits on another
    that is busy extracting from a slow PFS), then the moves each node does alone; a
    node's own part before the global files of others. Files land in a hidden partial
    directory, renamed into place at the end (module docstring)."""
    moved: dict[str, int] = {}
    spool = config.node_paths(node).spool
    final = ckpt_dir(spool, plan.ckpt)
    in_place = any(m.target == m.owner == m.source.holder == node and m.source.kind == "spool"
                   for m in plan.moves)
    remove_temporaries(spool)           # what a recovery killed midway left
    directory = final if in_place else makedirs(recover_partial_dir(spool, plan.ckpt))
    entries = {(e["node"], e["path"]): _entry(e) for e in plan.manifest.files}
    ordered = sorted(plan.moves, key=lambda m: (m.local, m.owner != m.target))
    for move in ordered:
        files = [entries[(move.owner, p)] for p in move.paths]
        if move.target == node:
            n = _receive_move(comm, config, move, files, directory, rank_of)
            moved[move.source.kind] = moved.get(move.source.kind, 0) + n
        elif move.source.holder == node:
            _send_files(comm, config, move.source, files, rank_of[move.target])
    if in_place:
        fsync_dir(final)
    else:
        expected = [entries[(m.owner, p)] for m in plan.moves if m.target == node
                    for p in m.paths]
        _put_in_place(spool, directory, final, expected)
    return moved


def _put_in_place(spool: Path, partial: Path, final: Path, expected: list[FileEntry]) -> None:
    """Every file arrived, checksummed on the way: make the tree durable, then rename
    it to the checkpoint's name (replacing a copy that was not intact) and fsync the
    spool, so the name only ever shows a whole checkpoint."""
    missing = [e.path for e in expected if not (partial / e.path).is_file()
               or (partial / e.path).stat().st_size != e.size]
    if missing:
        raise OperationError(f"{partial}: {len(missing)} files missing or short after the"
                             f" restore (first: {missing[0]})")
    fsync_tree(partial)
    if final.exists() or final.is_symlink():
        remove_under(spool, final)
    os.rename(partial, final)
    fsync_dir(spool)


def _receive_move(comm: Any, config: Config, move: Move, files: list[FileEntry],
                  spool: Path, rank_of: dict[int, int]) -> int:
    source = move.source
    if source.kind in ("spool",) and source.holder == move.target:
        return 0                                    # already in place, verified
    if source.kind == "pfs":
        pfs = config.node_paths(0).pfs
        extract(bundle_path(pfs, source.ckpt, source.owner), spool, only=set(move.paths))
    elif source.holder == move.target:
        directory = holdings.source_dir(config, source)
        for entry in files:
            _copy_in(directory / entry.path, spool / entry.path, entry)
    else:
        _receive_files(comm, config, files, spool, rank_of[source.holder], source.holder)
    return sum(e.size for e in files)


# -------------------------------------------------------------------- transfers
def _send_files(comm: Any, config: Config, source: Copy, files: list[FileEntry],
                dest: int) -> None:
    directory = holdings.source_dir(config, source)
    buffer = np.empty(CHUNK, dtype=np.uint8)
    for entry in files:
        with open(directory / entry.path, "rb", buffering=0) as handle:
            left = entry.size
            while left:
                n = handle.readinto(memoryview(buffer)[:min(left, CHUNK)])
                if not n:
                    raise OperationError(f"{directory / entry.path}: shorter than its manifest")
                _wait(comm.Isend([buffer[:n], MPI.BYTE], dest, DATA_TAG), config, dest)
                left -= n


def _receive_files(comm: Any, config: Config, files: list[FileEntry], spool: Path,
                   source_rank: int, source_node: int, trainer_modes: bool = True) -> None:
    """`trainer_modes`: the files get the trainer's permission bits (a spool), else they
    stay private (a replica store)."""
    buffer = np.empty(CHUNK, dtype=np.uint8)
    for entry in files:
        target = spool / entry.path
        makedirs(target.parent)
        temp = temp_name(target)
        digest = hasher()
        with open_private(temp, buffering=0) as out:
            left = entry.size
            while left:
                n = min(left, CHUNK)
                _wait(comm.Irecv([buffer[:n], MPI.BYTE], source_rank, DATA_TAG), config,
                      source_rank, f"node {source_node}")
                digest.update(memoryview(buffer)[:n])
                out.write(memoryview(buffer)[:n])
                left -= n
            os.fsync(out.fileno())
        _finish_file(temp, target, entry, digest.hexdigest(), trainer_modes)


def _copy_in(source: Path, target: Path, entry: FileEntry) -> None:
    makedirs(target.parent)
    mirror_file(source, target, entry.checksum, entry.mode)


def _finish_file(temp: Path, target: Path, entry: FileEntry, checksum: str,
                 trainer_modes: bool) -> None:
    if checksum != entry.checksum:
        temp.unlink(missing_ok=True)
        raise OperationError(f"{target}: checksum differs from the manifest after transfer")
    if trainer_modes:
        os.chmod(temp, trainer_mode(entry.mode))
    os.replace(temp, target)


def _wait(request: Any, config: Config, peer: int, name: str | None = None) -> None:
    deadline = time.monotonic() + config.agent.timeout
    while not request.Test():
        if time.monotonic() > deadline:
            request.Cancel()
            raise OperationError(f"{name or f'rank {peer}'} did not answer within"
                                 f" {config.agent.timeout:.0f}s")
        time.sleep(0.0002)


# ------------------------------------------------------------------- redundancy
def _rereplicate(comm: Any, config: Config, placement: Any, rank_of: dict[int, int],
                 plan: Plan, copies: list[Copy]) -> int:
    """Each node's part goes to its partners again, unless they hold it verified."""
    pmap = replication_map(config, list(placement.hosts))
    if pmap is None:
        return 0
    held = {(c.owner, c.holder) for c in copies if c.kind == "replica" and c.ckpt == plan.ckpt}
    node, moved = placement.node, 0
    entries = {(e["node"], e["path"]): _entry(e) for e in plan.manifest.files}
    for owner in range(placement.nodes):
        files = [entries[(owner, e.path)] for e in plan.manifest.node_files(owner)]
        spool_copy = Copy(plan.ckpt, owner, "spool", owner, tuple(e.path for e in files))
        for partner in pmap[owner]:
            if (owner, partner) in held:
                continue
            if node == owner:
                _send_files(comm, config, spool_copy, files, rank_of[partner])
            elif node == partner:
                root = config.node_paths(node).replicas
                moved += _receive_replica(comm, config, root, plan, owner, files,
                                          rank_of[owner])
    return moved


def _receive_replica(comm: Any, config: Config, root: Path, plan: Plan, owner: int,
                     files: list[FileEntry], owner_rank: int) -> int:
    partial = partial_dir(root, owner, plan.ckpt)
    remove_under(root, partial)
    makedirs(partial)
    _receive_files(comm, config, files, partial, owner_rank, owner, trainer_modes=False)
    part = next(n for n in plan.manifest.nodes if n["node"] == owner)
    manifest = LocalManifest(run=plan.manifest.run, ckpt=plan.ckpt, seq=plan.seq, node=owner,
                             host=part["host"], rank=part["rank"], files=files)
    commit_replica(root, manifest, partial)
    return manifest.bytes


def _set_aside(spool: Path, plan: Plan, manifests: dict[str, GlobalManifest]) -> list[str]:
    """Checkpoint directories newer than the recovered one (by sequence, or by name for
    those no manifest knows) would be taken by the trainer's resume: move them aside."""
    newer_seq = {c for c, m in manifests.items() if m.seq > plan.seq}
    newer = [name for name in checkpoint_names(spool) if name in newer_seq or (
        name not in manifests and natural_key(name) > natural_key(plan.ckpt))]
    for ckpt in newer:
        aside = set_aside_dir(spool, ckpt)
        remove_under(spool, aside)
        os.rename(ckpt_dir(spool, ckpt), aside)
    if newer:
        fsync_dir(spool)
    return newer


def _entry(data: dict[str, Any]) -> FileEntry:
    return FileEntry(data["path"], data["size"], data["mode"], data["checksum"])
