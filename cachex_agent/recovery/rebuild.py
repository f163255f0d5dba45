"""`cachex recover`: bring back the newest recoverable checkpoint into every node's spool.

Collective over the recovery job (one rank per node, replacements included; or one
process for one node). Call order, every rank:
  1. manifests   each rank's whole manifests (node 0, the metadata holders, the PFS on
                 rank 0), digests, local and replica manifests gathered onto rank 0
                 only; rank 0 takes the newest whole one, or rebuilds it from the parts
                 when it matches a survivor's digest (discover.py), and sends each rank
                 only what its node looks for (slices.py)
  2. holdings    each rank lists what it holds (spool, stage, replicas, journal) whole,
                 by size, gathered onto rank 0: checksums are read once, in step 4
  3. plan        rank 0 picks the checkpoint and the source of every part; each rank is
                 sent its slice: its moves, their files, its peers' ranks
  4. moves       in the plan's order: checks in place, local copies, PFS extraction,
                 and transfers from a surviving holder to the target over MPI (raw
                 buffers, bounded waits), each file checksummed as it is moved
                 (transfer.py); files that fail come from their next copy in another
                 round (rank 0 decides from the problems gathered, scatters the
                 retries), until none fails or one has no copy left
  5. redundancy  every node's restored part is copied to its partners' replica stores
                 (a replica not read in step 4 is checked first); with erasure groups
                 (`peer.scheme` xor, rs:K+M), lost members' parts are rebuilt from their
                 group's parity into their stages between steps 2 and 3 instead
                 (erasure_recover.py), and nothing is re-replicated
Between 3 and 4 every target's free space is compared with what the plan writes there
(plan.check_space). A checkpoint of N nodes recovered onto M is placed by
plan.placement, a DCP one only into `--to` (refused without it: exit 2; plan.py says
why); its parts are not copied to partners again (the agents on the M nodes
protect the trainer's next checkpoint). With `to` (`cachex recover --to DIR`) nothing goes
into the spools: every file is written once into DIR, a directory every rank sees, by
the rank that holds its copy (a PFS bundle by node o mod M), in the spool's layout.
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
unchanged resume code picks the recovered one. Nothing the restore would replace is
removed or overwritten unless it holds the restored bytes: it is set aside too (aside.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checksum import same_bytes
from ..collective import agree, arrive
from ..config import Config
from ..errors import ConfigError, OperationError, describe
from ..flush.bundle import BundleError, extract
from ..fsutil import (
    atomic_open,
    fsync_dir,
    fsync_tree,
    is_under,
    makedirs,
    remove_temporaries,
    remove_under,
)
from ..index import pinned_current
from ..layout import (
    SPOOL_ROOT,
    bundle_path,
    ckpt_dir,
    recover_partial_dir,
    replica_dir,
    spool_file,
    spool_root_name,
)
from ..manifest import FileEntry, GlobalManifest, LocalManifest
from ..peer.partners import replication_map
from ..peer.redundancy import redundancy_of
from ..peer.store import commit_replica, partial_dir
from ..progress import Done, Progress, quiet
from ..rules import checkpoint_names, natural_key, tracker_text
from ..status import human_size
from ..topology import Placement, place_checked
from ..versions import trainer_name
from . import discover, holdings, slices, transfer
from .aside import Aside, differs, names_the_same, tree_matches
from .erasure_recover import rebuild_lost
from .plan import (
    Copy,
    Move,
    Plan,
    Space,
    bytes_needed,
    check_space,
    choose,
    next_source,
    where,
)
from .restore_handle import RestoreHandle, open_restore
from .slices import Entries, Known, Share, Work

log = logging.getLogger(__name__)
SLOWEST_RATE = 10 << 20     # bytes/s: a rank moving its part slower than this is stuck


@dataclass
class Outcome:
    plan: Plan | None               # rank 0's (the whole); None on the others
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    replicated_bytes: int = 0
    seconds: float = 0.0            # the whole recovery
    plan_seconds: float = 0.0       # listing every copy, planning
    move_seconds: float = 0.0       # bringing the files into the spools, verified
    moved_aside: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)     # files taken from another copy
    erasure: list[str] = field(default_factory=list)       # parts rebuilt from parity, or not


def recover(config: Config, comm: Any, want: str | None = None,
            exclude: frozenset[str] = frozenset(), dry_run: bool = False,
            progress: Progress | None = None, to: Path | None = None) -> Outcome:
    """`progress`: where this rank says its steps and the bytes its node receives (the
    command gives one to rank 0 only). `to`: assemble the checkpoint in that shared
    directory instead of the spools. Rank 0 holds the whole view (the manifests, every
    copy, the plan); every other rank is sent its own slice of it (slices.py)."""
    progress = progress or quiet()
    start = time.monotonic()
    placement = place_checked(comm, config.topology)
    node = placement.node
    paths = config.node_paths(node, placement.rank, placement.host)
    if to is not None:      # each rank its own directories; all refuse alike
        agree(comm, "--to", lambda: _check_to(paths, to), config.agent.timeout)
    progress.step(f"listing the copies held by {placement.nodes}"
                  f" node{'s' if placement.nodes > 1 else ''} and the PFS")
    known, manifests = _shared_manifests(comm, config, paths, exclude, placement, progress)
    copies = _all_copies(comm, config, paths, node, known, manifests, exclude)
    if want is None and comm.Get_rank() == 0:      # only rank 0 plans
        want = pinned_current(config.node_paths(0).pfs)
        if want:
            progress.step(f"{want}: pinned as current by `cachex index --current`")
    # parity rebuilds a lost member's part onto its replacement: same node count only
    same_count = [k for k, count in known.counts.items() if count == placement.nodes]
    erasure = rebuild_lost(comm, config, node, same_count,
                           {k: manifests[k] for k in same_count if k in manifests}, copies,
                           want, exclude, dry_run, _verify_bound(config, known))
    for note in erasure.notes:
        progress.step(note)
    if erasure.groups and not dry_run:      # the rebuilt parts are staged copies now
        copies = _all_copies(comm, config, paths, node, known, manifests, exclude)
    share, lead = _plan(comm, config, placement, manifests, copies, want, exclude, to)
    _check_space(comm, config, placement, share, lead, to or paths.spool)
    outcome = Outcome(lead.plan if lead else None, plan_seconds=time.monotonic() - start,
                      erasure=erasure.notes)
    if dry_run:
        return outcome
    if to is not None:
        return _gather(comm, config, node, share, lead, progress, outcome, start)
    handle = open_restore(config, placement, share.ckpt, share.seq)
    if handle.interrupted():
        progress.step(f"node {node}: an earlier restore of {share.ckpt} was cut short;"
                      " restoring it again")
    restore = _Restore(comm, config, node, share, lead, progress, handle)
    handle.submit(persist={"seq": share.seq})
    moved = handle.run(restore.run, sources=sorted({m.source.kind for m in share.work.moves
                                                    if m.target == node}))
    outcome.fallbacks = restore.notes()
    outcome.move_seconds = time.monotonic() - start - outcome.plan_seconds
    agree(comm, "set aside", lambda: _set_aside(
        restore.aside, share.ckpt, share.seq, known.seqs), config.agent.timeout)
    outcome.moved_aside = _every_rank(comm, config, restore.aside.moved)
    replicated = 0
    if share.resized:
        progress.step(f"not copying the parts to partners: they were {share.parts}"
                      f" nodes' parts, the job now has {placement.nodes} nodes")
    else:
        progress.step("copying each node's restored part to its partners")
        replicated = _rereplicate(comm, config, placement, share, lead, copies,
                                  restore.verified())
    return _totals(comm, config, moved, outcome, start, replicated)


def _every_rank(comm: Any, config: Config, lines: list[str]) -> list[str]:
    """Every rank's lines, in rank order, on every rank (what each node set aside)."""
    _arrive(comm, config, "set aside")
    return [line for part in comm.allgather(lines) for line in part]


def _totals(comm: Any, config: Config, moved: dict[str, int], outcome: Outcome,
            start: float, replicated: int = 0) -> Outcome:
    """Every rank's bytes moved, by the kind of copy they came from, and re-replicated:
    summed on rank 0, the sums (one per kind) shared."""
    _arrive(comm, config, "recovery totals")
    summed: dict[str, int] = {}
    for part in comm.gather(moved, root=0) or []:
        for kind, count in part.items():
            if count:
                summed[kind] = summed.get(kind, 0) + count
    outcome.bytes_by_kind = comm.bcast(summed, root=0)
    outcome.replicated_bytes = comm.allreduce(replicated)
    outcome.seconds = time.monotonic() - start
    return outcome


def _gather(comm: Any, config: Config, node: int, share: Share, lead: _Lead | None,
            progress: Progress, outcome: Outcome, start: float) -> Outcome:
    """`--to DIR`: every file once into DIR; the spools, journals and replicas stay."""
    assert share.to is not None
    restore = _Restore(comm, config, node, share, lead, progress)
    moved = restore.run()
    outcome.fallbacks = restore.notes()
    outcome.move_seconds = time.monotonic() - start - outcome.plan_seconds
    outcome.moved_aside = _every_rank(comm, config, restore.aside.moved)
    return _totals(comm, config, moved, outcome, start)


def _check_to(paths: Any, to: Path) -> None:
    """`--to` apart from cachex's directories, neither in nor above them: a checkpoint
    written there would be taken for the trainer's (the spool) or removed as cachex's or
    another run's (the stage, cache and PFS roots hold every run's directory)."""
    for key, root in (("paths.spool", paths.spool), ("paths.stage", paths.stage.parent),
                      ("paths.cache", paths.cache.parent), ("paths.pfs", paths.pfs.parent)):
        if Path(to).resolve() == Path(root).resolve() or is_under(root, to) \
                or is_under(to, root):
            raise ConfigError(f"--to {to}: overlaps {key} ({root}); give a directory of"
                              " its own")


def _check_space(comm: Any, config: Config, placement: Placement, share: Share,
                 lead: _Lead | None, directory: Path) -> None:
    """Every rank measures where it writes; rank 0 checks the whole placement, so all
    refuse alike (one line naming the node and the path) before anything moves."""
    def measure() -> Space:
        probe = directory
        while not probe.exists() and probe != probe.parent:     # made by the restore
            probe = probe.parent
        found = os.statvfs(probe)
        shared = "to" if share.to is not None else f"{placement.host}:{os.stat(probe).st_dev}"
        return Space(placement.node, str(directory), found.f_bavail * found.f_frsize, shared)
    mine = agree(comm, "free space", measure, config.agent.timeout)
    _arrive(comm, config, "free space")
    spaces = comm.gather(mine, root=0)
    _decided_on_rank0(comm, config, "free space", lambda: check_space(
        bytes_needed(lead.plan), spaces) if lead else None)


def _arrive(comm: Any, config: Config, step: str) -> None:
    """Before a blocking collective: a rank that never comes fails it, named."""
    arrive(comm, f"recovery {step}", config.agent.timeout)


def _work_bound(config: Config, share: Share) -> float:
    """How long ranks wait for the slowest one after a phase that moves data: a node's
    part may come from a slow PFS, so the bound grows with the largest part (a resize:
    the most a target writes, several parts)."""
    return config.agent.timeout + share.largest / SLOWEST_RATE


def _verify_bound(config: Config, known: Known) -> float:
    """How long ranks wait for the slowest one while each checksums what it holds: a node
    may hold every checkpoint's bytes (spool, stage, replicas), at least SLOWEST_RATE."""
    return config.agent.timeout + known.held / SLOWEST_RATE


# ----------------------------------------------------------------------- phases
@dataclass
class _Lead:
    """Rank 0's whole view of the restore: the plan, every copy, every node's rank."""

    plan: Plan
    copies: list[Copy]
    rank_of: dict[int, int]
    entries: Entries = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.entries = slices.index(self.plan.manifest)
        self.copies = [c for c in self.copies if c.ckpt == self.plan.ckpt]


def _shared_manifests(comm: Any, config: Config, paths: Any, exclude: frozenset[str],
                      placement: Placement, progress: Progress
                      ) -> tuple[Known, dict[str, GlobalManifest]]:
    """Each rank's manifests, digests and parts gathered onto rank 0 only, merged there
    (discover.py); each rank is sent what its node looks for (slices.Known). Rank 0's
    merged manifests besides ({} on the others)."""
    node = placement.node
    mine = agree(comm, "manifests", lambda: discover.found_here(
        paths, node, comm.Get_rank() == 0 and "pfs" not in exclude), config.agent.timeout)
    _arrive(comm, config, "manifests")
    reports = comm.gather(mine, root=0)
    merged: list[discover.Merged] = []

    def decide() -> list[Any]:
        merged.append(discover.merge(reports))
        views = slices.known_by_rank(merged[0].manifests, reports, placement.hosts)
        return [(view, merged[0].notes if rank == 0 else []) for rank, view in
                enumerate(views)]
    known, notes = _decided_on_rank0(comm, config, "merged manifests", decide, scatter=True)
    for note in notes:
        progress.step(note)
    return known, merged[0].manifests if merged else {}


def _all_copies(comm: Any, config: Config, paths: Any, node: int, known: Known,
                manifests: dict[str, GlobalManifest], exclude: frozenset[str]) -> list[Copy]:
    """Each rank's copies; rank 0 gets every rank's (and reads the PFS's) to plan."""
    bound = _verify_bound(config, known)
    mine = agree(comm, "holdings", lambda: holdings.local_copies(
        paths, node, known.wants, exclude), bound)
    every = comm.gather(mine, root=0)
    lead = comm.Get_rank() == 0
    copies = [c for part in every for c in part] if lead else mine
    return copies + agree(comm, "PFS holdings", lambda: holdings.pfs_copies(
        paths.pfs, manifests) if lead and "pfs" not in exclude else [], bound)


def _plan(comm: Any, config: Config, placement: Placement,
          manifests: dict[str, GlobalManifest], copies: list[Copy], want: str | None,
          exclude: frozenset[str], to: Path | None = None) -> tuple[Share, _Lead | None]:
    """Rank 0 decides; every rank gets its slice of the plan (and rank 0 the whole of
    it: `_Lead`), or raises the same error."""
    _arrive(comm, config, "rank exchange")
    ranks = comm.gather((placement.node, placement.rank), root=0)
    lead: list[_Lead] = []

    def decide() -> list[Share]:
        plan = choose(manifests, copies, placement.nodes, want, exclude,
                      None if to is None else str(to))
        lead.append(_Lead(plan, copies, dict(ranks)))
        return slices.plan_shares(plan, copies, lead[0].rank_of, comm.Get_size())
    share = _decided_on_rank0(comm, config, "plan", decide, scatter=True)
    return share, lead[0] if lead else None


def _decided_on_rank0(comm: Any, config: Config, step: str, decide: Callable[[], Any],
                      scatter: bool = False) -> Any:
    """What rank 0's `decide` returns, on every rank (`scatter`: its list, one item to
    each rank); or its error raised on every rank (a usage error stays one: exit 2
    everywhere)."""
    answer: Any = None
    if comm.Get_rank() == 0:
        try:
            answer = decide()
        except ConfigError as exc:
            answer = _Refused(True, str(exc))
        except OperationError as exc:
            answer = _Refused(False, str(exc))
        if scatter and isinstance(answer, _Refused):
            answer = [answer] * comm.Get_size()
    _arrive(comm, config, step)
    answer = comm.scatter(answer, root=0) if scatter else comm.bcast(answer, root=0)
    if isinstance(answer, _Refused):
        raise (ConfigError if answer.usage else OperationError)(answer.text)
    return answer


@dataclass(frozen=True)
class _Refused:
    """Rank 0's decision failed: the error every rank raises."""

    usage: bool             # a ConfigError (exit 2), else an OperationError
    text: str


# ---------------------------------------------------------------------- restore
#: a file that did not arrive intact: (target, owner, path, the copy it came from, why,
#: said by the copy's holder); the holder's reason is the more precise one
Problem = tuple[int, int, str, Copy, str, bool]


class _Restore:
    """Every node's files into its spool, each checked as it is moved; collective.

    Rounds: the plan's moves, then, for every file that did not arrive intact, the next
    copy of that file (plan.next_source), until every file is in or one has no copy
    left. Files land in a hidden partial directory renamed into place at the end (module
    docstring). Transfers come first in a round, in the same order on every rank (so no
    rank waits on another busy extracting from a slow PFS), then the moves each node does
    alone; a node's own part before the global files of others."""

    def __init__(self, comm: Any, config: Config, node: int, share: Share,
                 lead: _Lead | None, progress: Progress,
                 handle: RestoreHandle | None = None) -> None:
        """`share`: this rank's slice of the plan; `lead`: the whole (rank 0), whose
        retries it decides. `handle`: this node's restore (None: `--to`, which has
        none), whose `check` raises when it was cancelled (inside each round's
        agreement, so every rank fails the round alike)."""
        self.comm, self.config, self.node = comm, config, node
        self.plan, self.lead, self.progress = share, lead, progress
        self.handle = handle
        self.check: Callable[[], None] = handle.check if handle is not None else _go_on
        self.work = share.work
        self.entries = share.work.entries()
        self.spool = config.node_paths(node).spool if share.to is None else Path(share.to)
        self.name = trainer_name(share.ckpt)       # every version goes back under it
        self.final = ckpt_dir(self.spool, self.name)
        self.in_place = any(m.target == node and share.kept(m) for m in share.work.moves)
        self.directory = self.final if self.in_place else recover_partial_dir(self.spool,
                                                                              self.name)
        self.aside = Aside(self.spool, node)    # what the restore would replace, kept
        self.used: list[Copy] = []
        self.bad: set[Copy] = set()     # held here, failed a file (told by rank 0)
        self.failed: dict[tuple[int, int, str], dict[Copy, str]] = {}     # rank 0's
        self.taken: dict[tuple[int, int, str], Copy] = {}

    def run(self) -> dict[str, int]:
        try:
            return self._run()
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        """A refused or failed restore takes its partial directory with it: the spool
        may be /dev/shm, and nothing but the next recover would sweep it."""
        if self.in_place or (self.plan.to is not None and self.comm.Get_rank() != 0):
            return              # the checkpoint's own directory, or rank 0's to remove
        try:
            remove_under(self.spool, self.directory)
        except OSError as exc:
            log.warning("%s not removed: %s", self.directory, describe(exc))

    def _run(self) -> dict[str, int]:
        bound = _work_bound(self.config, self.plan)
        agree(self.comm, "restore", self._prepare, self.config.agent.timeout)
        if self.plan.to is not None:
            agree(self.comm, "restore", self._shared, self.config.agent.timeout)
        moved: dict[str, int] = {}
        work = self.work
        total = self._incoming(work.moves)
        self.progress.step(f"restoring {self.plan.ckpt}: {self.plan.files} files;"
                           f" node {self.node} reads {human_size(total)}")
        self.progress.start(f"node {self.node}", total)
        while work.anywhere:        # the same on every rank: all run each round
            self.used += [m.source for m in work.moves]
            mine = agree(self.comm, "restore", lambda w=work: self._round(w.moves, moved),
                         bound)
            _arrive(self.comm, self.config, "restore check")
            found = self.comm.gather(mine, root=0)
            work = _decided_on_rank0(self.comm, self.config, "restore retries",
                                     lambda f=found: self._retries(
                                         [p for part in f for p in part]), scatter=True)
            self.entries.update(work.entries())
            self.work.ranks.update(work.ranks)      # a retry's peers may be new to this rank
            self.bad = set(work.bad)
            self.progress.add_total(self._incoming(work.moves))
        self.progress.finish()
        agree(self.comm, "restore", self._complete, bound)
        return moved

    def _incoming(self, moves: list[Move]) -> int:
        """The bytes this node reads (checks in place included) to carry out `moves`."""
        return sum(self.entries[(m.owner, p)].size for m in moves if m.target == self.node
                   for p in m.paths)

    def _prepare(self) -> None:
        if self.plan.to is None:
            remove_temporaries(self.spool)      # what a recovery killed midway left
            makedirs(self.directory)
        elif self.comm.Get_rank() == 0:         # one directory for all: rank 0 makes it
            makedirs(self.spool)
            remove_under(self.spool, self.directory)
            makedirs(self.directory)

    def _shared(self) -> None:
        """Each rank writes its files into the `--to` directory rank 0 made."""
        if not self.directory.is_dir():
            raise OperationError(f"node {self.node}: {self.plan.to} is not shared: no"
                                 f" {self.directory.name} that node 0 made there")

    def _round(self, moves: list[Move], moved: dict[str, int]) -> list[Problem]:
        self.check()
        found: list[Problem] = []
        for move in sorted(moves, key=lambda m: (m.local, m.owner != m.target)):
            files = [self.entries[(move.owner, p)] for p in move.paths]
            if move.target == self.node:
                problems = self._receive(move, files)
                if not self.plan.kept(move):
                    moved[move.source.kind] = moved.get(move.source.kind, 0) + sum(
                        e.size for e in files if e.path not in problems)
            elif move.source.holder == self.node:
                problems = transfer.send_files(
                    self.comm, holdings.source_dir(self.config, move.source), files,
                    self.work.ranks[move.target], self.config.agent.timeout,
                    f"node {move.target}", stop=self._stopping, handle=self.handle)
            else:
                continue
            found += [(move.target, move.owner, path, move.source, why,
                       move.source.holder == self.node) for path, why in problems.items()]
        self.check()        # a signal that stopped this rank's transfers fails its round
        return found

    def _stopping(self) -> bool:
        """Before each file of a transfer between ranks: was this rank asked to stop?
        Its peer hears it and stops too, at that file (transfer._Ends); the rank goes on
        to its next transfers (each stops at its first file, so no peer is left waiting
        for it) and fails its round at the end."""
        try:
            self.check()
        except OperationError:
            return True
        return False

    def _checked(self, count: Done) -> Done:
        """Counts the bytes, then stops if a signal asked for it: a node's own moves (a
        check in place, a local copy, a PFS extraction) stop within one file, not at
        the round's end. The raise fails this rank's round, and the round's agreement
        fails it on every rank alike."""
        def done(size: int) -> None:
            count(size)
            self.check()
        return done

    def _receive(self, move: Move, files: list[FileEntry]) -> transfer.Problems:
        source, timeout = move.source, self.config.agent.timeout
        # a transfer between ranks stops with its peer, before a file (`stop`): a raise
        # in the middle of the stream would leave the sender waiting out agent.timeout
        done = self._checked(self.progress.advance) if move.local else self.progress.advance
        if self.plan.kept(move):
            return transfer.check_in_place(self.directory, files, done)
        if self.in_place:       # the trainer's own directory: nothing of it overwritten
            self._keep_differing(files)
        if source.kind == "pfs":
            return _extract(bundle_path(self.config.node_paths(0).pfs, source.ckpt,
                                        source.owner), self.directory, files, done)
        if source.holder == move.target:
            return transfer.copy_local(holdings.source_dir(self.config, source), files,
                                       self.directory, done=done)
        return transfer.receive_files(self.comm, files, self.directory,
                                      self.work.ranks[source.holder], timeout,
                                      f"node {source.holder}", done=done,
                                      stop=self._stopping)

    def _keep_differing(self, files: list[FileEntry]) -> None:
        """Files of the checkpoint directory kept in place that are about to be written
        (a copy found bad, a global file) go aside first unless they hold those bytes."""
        for entry in files:
            if differs(self.directory / entry.path, entry):
                self.aside.inside(self.name, entry.path,
                                  "differs from the restored file")

    def _retries(self, found: list[Problem]) -> list[Work]:
        """Rank 0: the next copy of each file that failed (every rank's problems, in
        rank order), each rank's share of them; OperationError when one has none left."""
        assert self.lead is not None
        for target, owner, path, copy, why, said_by_holder in found:
            reasons = self.failed.setdefault((target, owner, path), {})
            if said_by_holder or copy not in reasons:
                reasons[copy] = why
        groups: dict[tuple[int, int, Copy], list[str]] = {}
        for key in dict.fromkeys((target, owner, path) for target, owner, path, *_ in found):
            target, owner, path = key
            source = next_source(self.lead.copies, target, owner, path,
                                 set(self.failed[key]))
            if source is None:
                tried = "; ".join(f"{where(c, target)}: {w}" for c, w in self.failed[key].items())
                raise OperationError(f"node {owner}'s file {path!r} (for node {target}) has"
                                     f" no intact copy left ({tried})")
            self.taken[key] = source
            groups.setdefault((target, owner, source), []).append(path)
        moves = [Move(t, o, c, tuple(paths)) for (t, o, c), paths in groups.items()]
        bad: dict[int, list[Copy]] = {}
        for copy in {c for reasons in self.failed.values() for c in reasons}:
            bad.setdefault(copy.holder, []).append(copy)
        return slices.split(moves, self.lead.entries, self.lead.rank_of,
                            self.comm.Get_size(), bad)

    def _complete(self) -> None:
        """Every file arrived, checksummed on the way: make the tree durable, then rename
        it to the checkpoint's name (replacing a copy that was not intact) and fsync the
        spool, so the name only ever shows a whole checkpoint."""
        if self.in_place:
            fsync_tree(self.final)
            _hoist_root_files(self.spool, self.final, self.name, self.aside)
            return
        if self.plan.to is not None and self.lead is None:
            return                              # rank 0 renames the shared directory
        if self.lead is not None and self.plan.to is not None:     # every rank's files
            expected = [self.lead.entries[(m.owner, p)] for m in self.lead.plan.moves
                        for p in m.paths]
        else:
            expected = [self.entries[(m.owner, p)] for m in self.work.moves
                        if m.target == self.node for p in m.paths]
        _put_in_place(self.spool, self.directory, self.final, expected, self.aside)

    def notes(self) -> list[str]:
        """Each file taken from another copy than planned, and why."""
        return [f"node {t}: {path} of node {o}: "
                + "; ".join(f"{where(c, t)}: {why}" for c, why in reasons.items())
                + f"; taken from {where(self.taken[(t, o, path)], t)}"
                for (t, o, path), reasons in self.failed.items()]

    def verified(self) -> set[Copy]:
        """Copies this rank read or sent whole during the restore with no file failing."""
        return {c for c in self.used if c not in self.bad}


def _extract(bundle: Path, directory: Path, files: list[FileEntry],
             done: Done) -> transfer.Problems:
    failed: transfer.Problems = {}
    try:
        extract(bundle, directory, only={e.path for e in files}, failed=failed, done=done)
    except (BundleError, OSError) as exc:       # the whole bundle: every file from elsewhere
        return {e.path: describe(exc) for e in files}
    return failed


def _put_in_place(spool: Path, partial: Path, final: Path, expected: list[FileEntry],
                  aside: Aside) -> None:
    """Every file arrived, checksummed on the way: make the tree durable, then rename
    it to the checkpoint's name and fsync the spool, so the name only ever shows a whole
    checkpoint. What stood under the name goes aside unless it held exactly these files
    (a copy not taken in place, e.g. `--exclude spool`, may still be the user's newest)."""
    missing = [e.path for e in expected if not (partial / e.path).is_file()
               or (partial / e.path).stat().st_size != e.size]
    if missing:
        raise OperationError(f"{partial}: {len(missing)} files missing or short after the"
                             f" restore (first: {missing[0]})")
    fsync_tree(partial)
    single = _hoist_root_files(spool, partial, final.name, aside)
    if single:          # the checkpoint was that one file: no directory of its name
        remove_under(spool, partial)
        return
    if os.path.lexists(final):
        own = [e for e in expected if spool_root_name(e.path) is None]
        if final.is_dir() and not final.is_symlink() and tree_matches(final, own):
            remove_under(spool, final)
        else:
            aside.entry(final.name, "differs from the restored checkpoint")
    os.rename(partial, final)
    fsync_dir(spool)


def _hoist_root_files(spool: Path, tree: Path, ckpt: str, aside: Aside) -> bool:
    """The spool-root files captured with the checkpoint (layout.SPOOL_ROOT) go back to
    the spool root: a single-file checkpoint under its name, a tracker rewritten to name
    the recovered checkpoint (its captured text named it, or a newer save the trainer
    made meanwhile). What stands there with other bytes goes aside first (a newer save
    under the same name, a tracker naming another checkpoint). True when `ckpt` itself
    was such a file."""
    held = tree / SPOOL_ROOT
    if not held.is_dir():
        return False
    single = False
    for path in sorted(held.iterdir()):
        text = tracker_text(path.name, ckpt)
        if text is not None:
            # rewritten with the mode the trainer gave it (restored on the captured copy)
            with atomic_open(path, mode=path.stat().st_mode) as handle:
                handle.write(f"{text}\n".encode())
        target = spool / path.name
        if os.path.lexists(target) and not (same_bytes(target, path) if text is None
                                            else names_the_same(target, text)):
            aside.entry(path.name, "differs from what was restored")
        os.replace(path, target)
        single = single or path.name == ckpt
    held.rmdir()
    fsync_dir(spool)
    fsync_dir(tree)
    return single


# ------------------------------------------------------------------- redundancy
def _rereplicate(comm: Any, config: Config, placement: Any, share: Share,
                 lead: _Lead | None, copies: list[Copy], verified: set[Copy]) -> int:
    """Each node's part goes to its partners again, unless they hold it intact: rank 0
    hears which are, and tells each rank its own sends and receives."""
    pmap = replication_map(config, list(placement.hosts))
    if pmap is None or not redundancy_of(config).replicas:
        return 0
    work = _work_bound(config, share)
    held = agree(comm, "re-replication", lambda: _intact_replicas(
        config, placement.node, share, copies, verified), work)
    _arrive(comm, config, "re-replication")
    every = comm.gather(held, root=0)
    jobs = _decided_on_rank0(comm, config, "re-replication", lambda: slices.replication_jobs(
        lead.plan.manifest, pmap, {pair for part in every for pair in part}, lead.rank_of,
        comm.Get_size()) if lead else None, scatter=True)
    return agree(comm, "re-replication", lambda: _send_parts(
        comm, config, placement.node, share, jobs), work)


def _intact_replicas(config: Config, node: int, share: Share, copies: list[Copy],
                     verified: set[Copy]) -> list[tuple[int, int]]:
    """(owner, this node) for each replica of the plan's checkpoint this node holds
    intact: read during the restore, or now (only its size was checked before)."""
    root = config.node_paths(node).replicas
    intact = []
    for copy in copies:
        if copy.kind == "replica" and copy.ckpt == share.ckpt and copy.holder == node and (
                copy in verified or not transfer.check_in_place(
                    replica_dir(root, copy.owner, copy.ckpt), share.held.get(copy.owner, []))):
            intact.append((copy.owner, node))
    return intact


def _send_parts(comm: Any, config: Config, node: int, share: Share,
                jobs: list[slices.Job]) -> int:
    moved = 0
    spool = config.node_paths(node).spool

    def restored(path: str) -> Path:        # a spool-root file is at the root
        return spool_file(spool, share.ckpt, path)
    for job in jobs:
        if node == job.owner:
            problems = transfer.send_files(comm, spool, job.files, job.peer,
                                           config.agent.timeout, f"node {job.partner}",
                                           locate=restored)
            _fail_on(problems, f"node {job.owner}'s restored part")
        else:
            root = config.node_paths(node).replicas
            moved += _receive_replica(comm, config, root, share, job)
    return moved


def _go_on() -> None:
    """A restore without a handle (`--to`) is never cancelled."""


def _fail_on(problems: transfer.Problems, what: str) -> None:
    if problems:
        path, why = next(iter(problems.items()))
        raise OperationError(f"{what}: {len(problems)} files not sent or received intact"
                             f" (first: {path}: {why})")


def _receive_replica(comm: Any, config: Config, root: Path, share: Share,
                     job: slices.Job) -> int:
    owner = job.owner
    partial = partial_dir(root, owner, share.ckpt)
    remove_under(root, partial)
    makedirs(partial)
    _fail_on(transfer.receive_files(comm, job.files, partial, job.peer, config.agent.timeout,
                                    f"node {owner}", trainer_modes=False),
             f"node {owner}'s part, re-replicated")
    manifest = LocalManifest(run=share.run, ckpt=share.ckpt, seq=share.seq, node=owner,
                             host=job.part["host"], rank=job.part["rank"], files=job.files)
    commit_replica(root, manifest, partial)
    return manifest.bytes


def _set_aside(aside: Aside, ckpt: str, seq: int, seqs: dict[str, int]) -> None:
    """Checkpoint directories newer than the recovered one (by sequence, or by name for
    those no manifest knows) would be taken by the trainer's resume: move them aside
    (an earlier recovery's set-aside copy stays). `seqs`: every known checkpoint's
    sequence; a name's newest version counts for the directory of that name, except
    the recovered one's own name, which the restore just filled."""
    newest: dict[str, int] = {}
    for other, other_seq in seqs.items():
        name = trainer_name(other)
        newest[name] = max(newest.get(name, other_seq), other_seq)
    restored = trainer_name(ckpt)
    for name in sorted(checkpoint_names(aside.spool), key=natural_key):
        if name != restored and (newest.get(name, -1) > seq or (
                name not in newest and natural_key(name) > natural_key(restored))):
            aside.entry(name, "newer than the recovered checkpoint, not recoverable")
