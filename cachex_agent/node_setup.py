"""What an agent sets up before its main loop, each step collective where it must be.

The agent (agent.py) calls these in order: where it runs and beside whom, its
priority and CPUs, its directories, the run lock, what an earlier life left, the
replicator (collective: the window) and the ranks of the nodes. Every step that can fail
on one rank goes through `collective.agree`, so a bad directory on one node is the same
one-line configuration error on every rank, never a hang.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

from .cleanup import remove_stale
from .collective import agree
from .config import Config
from .events import EventLog
from .executor import Workers
from .flush.flusher import Flusher
from .handles import StageLog
from .inbox import Inbox
from .index import NotAnIndex, read_index
from .journal import Journal
from .layout import (
    NodePaths,
    events_path,
    journal_status_path,
    journal_stop_file,
    pfs_stop_file,
)
from .peer.feed import Feed
from .peer.globals import GlobalFiles
from .peer.mirror import Mirror
from .peer.partners import domains_of, metadata_holders, replication_map
from .peer.redundancy import Protector, redundancy_of
from .peer.replicator import Replicator
from .priority import lower_process, streams
from .rules import CommitRule
from .rules.quiescence import pid_namespace, skip_processes
from .runlock import RunLock, stale_after
from .stage.remover import Remover
from .stage.watch import SpoolWatcher
from .stage.worker import CaptureWorker
from .topology import Placement
from .uplink import Uplink

log = logging.getLogger(__name__)


def lower_priority(comm: Any, config: Config) -> None:
    """This job's agents on this host never write a checkpoint: the writer check skips
    them; and they take the priority the configuration asks for."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = pid_namespace()
        here = [pid for ns, pid in local.allgather((mine, os.getpid())) if ns == mine]
    finally:
        local.Free()
    skip_processes(here)
    for problem in lower_process(config.agent.nice, config.agent.sched, here):
        log.warning("agent.nice/agent.sched: %s", problem)


def open_state(comm: Any, config: Config, place: Placement, paths: NodePaths
               ) -> tuple[Journal, StageLog, RunLock | None]:
    """The journal, the events (journal first, then event) and on node 0 the run lock,
    taken before any agent touches the PFS: a second job on this run removes nothing."""
    journal = agree(comm, "journal", lambda: Journal(paths.journal, (paths.stage, paths.spool)))
    events = EventLog(events_path(paths.journal), run=config.run, node=place.node,
                      rank=place.rank, host=place.host)
    lock = agree(comm, "run lock", lambda: RunLock.acquire(
        paths.pfs, stale_after(config.agent.timeout)) if place.rank == 0 else None)
    if place.rank != 0:     # a status here says this host coordinates: not this job
        journal_status_path(paths.journal).unlink(missing_ok=True)
    clear_stale(paths, place.node, place.rank == 0, events)
    return journal, StageLog(events, journal), lock


def workers(config: Config, place: Placement, paths: NodePaths, journal: Journal,
            stages: StageLog, rule: CommitRule, inbox: Inbox, on_marker: Callable[[str], None],
            on_again: Callable[[str], bool],
            flusher: Flusher, protector: Protector | None, globals_: GlobalFiles,
            uplink: Uplink) -> Workers:
    """The threads and parts that work on checkpoints (the executor's `Workers`)."""
    watcher = SpoolWatcher(paths.spool, rule, on_marker, scan=config.commit.scan,
                           on_again=on_again)
    capture = CaptureWorker(config, paths, place, rule, journal, stages, inbox.put,
                            watcher.first_seen, watcher.removed,
                            protector.feed if protector else None)
    mirror = Mirror(journal, paths, place.node, stages.events, config.commit.mirror)
    return Workers(capture, watcher, flusher, Remover(), protector, globals_, mirror, uplink)


def ranks_by_node(comm: Any, node: int) -> list[int]:
    pairs = comm.allgather((node, comm.rank))
    return [rank for _node, rank in sorted(pairs)]


def holders(config: Config, placement: Placement) -> list[int]:
    """The nodes that keep the whole global manifest (metadata holders)."""
    domains = domains_of(config.topology.domain, list(placement.hosts))
    return metadata_holders(domains, config.peer.copies)


def clear_stale(paths: NodePaths, node: int, coordinator: bool, events: EventLog) -> None:
    """Before any thread writes: what an earlier life of this node left half-done."""
    removed = remove_stale(paths, node, coordinator=coordinator)
    if removed:
        log.info("removed %d stale temporaries of an earlier agent", len(removed))
        events.emit("stale_removed", count=len(removed), paths=removed)


def make_replicator(comm: Any, config: Config, placement: Placement, paths: NodePaths,
                    ranks: list[int], stages: StageLog, send_peer: Callable[..., None],
                    post: Callable[[Any], None], wake: Callable[[], None], cpus: int,
                    clock: Callable[[], float]) -> Replicator | None:
    """Collective (the window): every rank takes the same decision from the config."""
    pmap = replication_map(config, list(placement.hosts))
    if pmap is None or not redundancy_of(config).replicas:
        return None         # flush-only (asked for, or one failure domain), or erasure
    # one partner: the capture hands a linked file's pieces to the replication as it
    # hashes them (one read of the bytes, peer/feed.py); with more, the feed's buffers
    # would wait for the slowest partner
    feed = Feed(config.peer.slot, wake=wake) if len(pmap[placement.node]) == 1 else None
    return Replicator(comm, placement.node, pmap, ranks, config, paths, stages.events,
                      send_peer, post, stages, wake=wake, feed=feed,
                      streams=streams(config.peer.streams, cpus), clock=clock)


def committed_now(rule: CommitRule, spool: Path) -> set[str]:
    """The checkpoints committed in the spool as the agent starts (an earlier run's)."""
    try:
        return set(rule.committed(spool))
    except OSError:
        return set()


def known(journal: Journal, pfs: Path) -> set[str]:
    """Checkpoints this node already heard of: its journal, and for a node without one
    (replaced), those the PFS index lists."""
    ids = set(journal.entries)
    if not ids:
        try:
            ids = read_index(pfs).ids()
        except (OSError, NotAnIndex):  # none, or not an index: an unsafe one raises
            pass
    return ids


def stop_files(paths: NodePaths, coordinator: bool) -> list[Path]:
    files = [journal_stop_file(paths.journal)]
    return [*files, pfs_stop_file(paths.pfs)] if coordinator else files
