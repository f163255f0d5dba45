"""The window protocol on 4 ranks: real `MPI.Win`, real files, every rank an owner and a
partner. Run with and without MPIR_CVAR_NOLOCAL=1 (make test-mpi does both)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support import virtual_nodes_config

from cachex_agent.checksum import file_checksum
from cachex_agent.config import load
from cachex_agent.events import EventLog
from cachex_agent.inbox import Inbox
from cachex_agent.layout import replica_dir, replica_manifest_path
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import FileCaptured, Tag, ToNode, wire
from cachex_agent.peer.partners import incoming, partner_map, replication_map
from cachex_agent.topology import place_in

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(180)]
PEER = Tag.PEER
STREAMS = {"streams": 1}    # files in flight per partner (peer.streams), set per run below


@pytest.fixture(autouse=True, params=[1, 3], ids=["1-stream", "3-streams"])
def streams(request):
    """Every test here runs with one file in flight per partner and with three, their
    pieces in turn and the partner writing each file on a lane of its own."""
    STREAMS["streams"] = request.param
    yield request.param
    STREAMS["streams"] = 1


def all_ok(comm, ok) -> bool:
    from mpi4py import MPI
    return comm.allreduce(bool(ok), op=MPI.LAND)


def config(root: Path, extra: str):
    path = root / f"cfg-{os.getpid()}.toml"
    path.write_text(virtual_nodes_config(root, "r", f'''[agent]
timeout = "60s"
{extra}'''))
    return load(path, environ={})


def make_files(directory: Path, sizes: dict[str, int], seed: int) -> list[FileEntry]:
    rng = np.random.default_rng(seed)
    entries = []
    for name, size in sizes.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        entries.append(FileEntry(name, size, 0o640, file_checksum(path)))
    return entries


def run_replication(root: Path, cfg, sizes_of_rank, ckpts=("c1",), mapped=True,
                    damage=None, feed=None, sleep=None, pieces=None) -> dict:
    """Every rank replicates its files to its partners, serving the others meanwhile.
    `damage(source)` runs on each staged checkpoint after its manifest was made.
    `feed(replicator, manifest, source)` starts a replication its own way (a stream) and
    returns what to do once the loop has run a while (end the capture), or None; what
    another thread posts as a callable runs on the loop's thread.
    `sleep(replicator, inbox)` sleeps between turns (default: 0.5 ms).
    `pieces`: the replicator's Feed (peer/feed.py), made with the loop's wake."""
    from mpi4py import MPI

    from cachex_agent.peer.replicator import Replicator
    from cachex_agent.pump import MessagePump
    comm = MPI.COMM_WORLD
    placement = place_in(comm, "rank")
    paths = cfg.node_paths(comm.rank)
    paths.replicas.mkdir(parents=True, exist_ok=True)
    posts = Inbox()
    events = EventLog(paths.journal / "events.jsonl", node=comm.rank)
    # the agent's own message pump: the replication gets what it gets in the agent
    pump = MessagePump(comm, list(range(comm.size)), comm.rank,
                       lambda source, msg: replicator.handle(source, msg), events, tags=[PEER])
    pmap = replication_map(cfg, list(placement.hosts))
    replicator = Replicator(comm, placement.node, pmap, list(range(comm.size)), cfg, paths,
                            events, pump.send_peer, posts.put, wake=posts.wake,
                            feed=pieces(posts.wake) if pieces else None,
                            streams=STREAMS["streams"])
    results = {}
    later = []
    for seq, ckpt in enumerate(ckpts, 1):
        source = paths.stage / ckpt
        files = make_files(source, sizes_of_rank(comm.rank), seed=comm.rank * 100 + seq)
        manifest = LocalManifest(run="r", ckpt=ckpt, seq=seq, node=comm.rank, host="h",
                                 rank=comm.rank, files=files)
        if damage is not None:
            damage(source)
        if feed is None:
            replicator.replicate(manifest, source, mapped=mapped)
        else:
            later.append(feed(replicator, manifest, source))
    barrier = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pump.receive()
        while not posts.empty():
            msg = posts.get()
            if isinstance(msg, ToNode):
                pump.to_node(msg)
            elif callable(msg):
                msg()
            else:                       # a Replicated report, read as it travels
                results[msg.ckpt] = wire(msg)
        replicator.pump()
        if later and replicator.busy():     # some of the stream went out: capture ends
            for action in filter(None, later):
                action()
            later = []
        pump.test()
        if barrier is None and len(results) == len(ckpts):
            barrier = comm.Ibarrier()       # done as an owner; keep serving as a partner
        if barrier is not None and barrier.Test() and not replicator.busy():
            break
        if sleep is None:
            time.sleep(0.0005)
        else:
            sleep(replicator, posts)
    else:
        queued = {p: [(s.manifest.ckpt, s.state, len(s.free)) for s in q]
                  for p, q in replicator.queues.items()}
        print(f"rank {comm.rank}: deadline hit; results {sorted(results)}, queues {queued},"
              f" store busy {replicator.store.busy()}", file=sys.stderr, flush=True)
    # freeing is collective: every rank frees, or none (a rank stuck, or one that took a
    # slow partner for dead, would leave the others waiting in Free)
    free = comm.allreduce(len(results) == len(ckpts) and not replicator.dead, op=MPI.LAND)
    replicator.close(free=free)
    events.close()
    return results


def check_replicas(root: Path, cfg, ckpts=("c1",)) -> list[str]:
    """As a partner: every replica I hold equals its owner's source, manifest last."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    pmap = partner_map([str(n) for n in range(comm.size)], cfg.peer.stride, cfg.peer.copies)
    problems = []
    for owner in incoming(comm.rank, pmap):
        for ckpt in ckpts:
            source = cfg.node_paths(owner).stage / ckpt
            replica = replica_dir(cfg.node_paths(comm.rank).replicas, owner, ckpt)
            if not replica_manifest_path(cfg.node_paths(comm.rank).replicas, owner, ckpt).exists():
                problems.append(f"{replica}: no manifest")
                continue
            for path in sorted(source.rglob("*")):      # replicas are private (0600)
                twin = replica / path.relative_to(source)
                if path.is_file() and (not twin.is_file() or twin.read_bytes() != path.read_bytes()
                                       or (twin.stat().st_mode & 0o7777) != 0o600):
                    problems.append(f"{twin}: differs from {path}")
    return problems


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize("case", ["wraparound", "small_files", "empty_and_mixed",
                                  "unaligned_slot"])
def test_replicas_are_byte_identical(mpi_tmp_path, case, mapped):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    sizes = {
        # a file 6x bigger than the whole window (2 slots of 64 KiB): wrap-around, reuse
        "wraparound": lambda rank: {"big.bin": 768 * 1024 + rank, "tail.bin": 100},
        "small_files": lambda rank: {f"d{i % 7}/f{i:04d}": 10 + i % 50 for i in range(2000)},
        "empty_and_mixed": lambda rank: {"empty": 0, "a/empty2": 0, "x": 65536, "y": 65537,
                                          ".metadata": 3},
        # with a slot of 5000 bytes, pieces start off page boundaries: mapped from below
        "unaligned_slot": lambda rank: {"a": 5000 * 7 + 1 + rank, "b": 4999, "c": 0},
    }[case]
    slot = "5000" if case == "unaligned_slot" else '"64KiB"'
    cfg = config(mpi_tmp_path, f'[peer]\nslot = {slot}\nslots = 2\n')
    results = run_replication(mpi_tmp_path, cfg, sizes, ckpts=("c1", "c2"), mapped=mapped)
    ok = all(r["ok"] for r in results.values()) and len(results) == 2
    assert all_ok(comm, ok), results
    problems = check_replicas(mpi_tmp_path, cfg, ckpts=("c1", "c2"))
    assert all_ok(comm, not problems), problems[:5]


FALLBACK = 0.5      # the loop's sleep when no peer message is due; a wake ends it


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_the_loop_polls_only_while_a_peer_message_is_due(mpi_tmp_path, streamed):
    """The agent's wait: 1 ms polls only while `waits_on_peer`, else a sleep on the inbox
    that the writer (credits, acks, running dry) and the capture end. A sleep that ran
    out while busy with a peer message waiting was a message the policy did not see
    coming. Checked with a policy that never polls: 15 missed in all for whole parts
    (each miss costs FALLBACK; other wake-ups hide most), which fails here; streamed,
    where the owner's capture wakes the loops too, it missed only 2 and the streamed case
    checks that the stream completes under the policy. The agent's policy missed none."""
    from mpi4py import MPI

    from cachex_agent.agent import peer_tick
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')
    missed = []

    def sleep(replicator, inbox) -> None:
        busy = replicator.busy()
        due = peer_tick(replicator)     # the agent's own choice (Agent._tick)
        if due is not None:
            inbox.wait(due)
        elif not inbox.wait(FALLBACK) and busy and comm.iprobe(source=MPI.ANY_SOURCE,
                                                               tag=PEER):
            missed.append(time.monotonic())
    sizes = lambda rank: {"a.bin": 40 * 65536 + rank, "b": 5, "c.bin": 10 * 65536}  # noqa: E731
    results = run_replication(mpi_tmp_path, cfg, sizes, ckpts=("c1", "c2"), sleep=sleep,
                              feed=stream if streamed else None)
    ok = all(r["ok"] for r in results.values()) and len(results) == 2
    assert all_ok(comm, ok), results
    assert all_ok(comm, not check_replicas(mpi_tmp_path, cfg, ckpts=("c1", "c2")))
    counts = comm.allgather(len(missed))
    print(f"missed per rank: {counts}")
    assert sum(counts) <= 2, f"peer messages missed per rank: {counts}"


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_staged_file_shorter_than_its_manifest_fails_that_replica(mpi_tmp_path, mapped):
    """Cut after its checksum was taken: the owner names the file, the agent lives on (a
    mapping past the end would be SIGBUS), and the partner keeps nothing of it."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')

    def cut(source: Path) -> None:
        os.truncate(source / "big.bin", 100_000)
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"a": 10, "big.bin": 300_000},
                              mapped=mapped, damage=cut)
    errors = list(results["c1"]["errors"].values())
    ok = (not results["c1"]["ok"] and len(errors) == 1 and "big.bin" in errors[0]
          and "shorter than its manifest" in errors[0])
    assert all_ok(comm, ok), results
    partner = cfg.node_paths(comm.rank).replicas
    owner = (comm.rank - 1) % comm.size
    assert all_ok(comm, not replica_manifest_path(partner, owner, "c1").exists())
    assert all_ok(comm, not replica_dir(partner, owner, "c1").exists())


def test_two_owners_write_to_one_partner(mpi_tmp_path):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size < 3:
        pytest.fail("needs 3 ranks for 2 copies in distinct domains")
    cfg = config(mpi_tmp_path, '[peer]\ncopies = 2\nslot = "32KiB"\nslots = 3\n')
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"s.bin": 300_000 + rank})
    assert all_ok(comm, results["c1"]["ok"] and len(results["c1"]["partners"]) == 2), results
    problems = check_replicas(mpi_tmp_path, cfg)
    assert all_ok(comm, not problems), problems[:5]


def test_retention_keeps_the_newest_replicas(mpi_tmp_path):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\n[keep]\nreplica = 1\n')
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"s": 1000},
                              ckpts=("c1", "c2", "c3"))
    assert all_ok(comm, len(results) == 3 and all(r["ok"] for r in results.values())), results
    owner = (comm.rank - 1) % comm.size
    replicas = cfg.node_paths(comm.rank).replicas
    kept = sorted(p.name for p in (replicas / f"node-{owner:05d}").glob("*.manifest.json"))
    assert all_ok(comm, kept == ["c3.manifest.json"]), kept
    assert all_ok(comm, not (replicas / f"node-{owner:05d}" / "c1").exists())


def stream(replicator, manifest: LocalManifest, source: Path):
    """As the capture thread does: each file posted as copied; the end comes later."""
    header = replace(manifest, files=[])
    for index, entry in enumerate(manifest.files):
        replicator.file_captured(FileCaptured(header, index, entry, source, source))
    return lambda: replicator.captured(manifest, source, True)


def replica_events(cfg, kind: str) -> list[dict]:
    """This rank's events named `kind` (as owner and as partner)."""
    from mpi4py import MPI
    path = cfg.node_paths(MPI.COMM_WORLD.rank).journal / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]


def test_a_part_streamed_while_captured_is_replicated_byte_for_byte(mpi_tmp_path):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')
    sizes = {"big.bin": 768 * 1024, "empty": 0, "d/small": 100, "last": 65537}
    results = run_replication(mpi_tmp_path, cfg, lambda rank: sizes, ckpts=("c1", "c2"),
                              feed=stream)
    assert all_ok(comm, len(results) == 2 and all(r["ok"] for r in results.values())), results
    problems = check_replicas(mpi_tmp_path, cfg, ckpts=("c1", "c2"))
    assert all_ok(comm, not problems), problems[:5]
    # c2 waited behind c1 until its capture had ended: then it goes whole
    started = {e["ckpt"]: e["streamed"] for e in replica_events(cfg, "replica_start")}
    assert all_ok(comm, started["c1"]), started


def test_a_capture_that_starts_over_is_sent_again_from_its_final_manifest(mpi_tmp_path):
    """The first attempt's files went out; the part changed: the second attempt posts
    from index 0 again, and the replica is the final capture, byte for byte."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')

    def start_over(replicator, manifest, source):
        header = replace(manifest, files=[])
        for index, entry in enumerate(manifest.files):
            replicator.file_captured(FileCaptured(header, index, entry, source, source))

        def second_attempt():
            temp = source / "new.tmp"      # a new inode, as a new capture attempt writes
            temp.write_bytes(os.urandom(300_000))
            temp.rename(source / "a.bin")
            files = [FileEntry(e.path, (source / e.path).stat().st_size, e.mode,
                               file_checksum(source / e.path)) for e in manifest.files]
            final = replace(manifest, files=files)
            for index, entry in enumerate(files):
                replicator.file_captured(FileCaptured(header, index, entry, source, source))
            replicator.captured(final, source, True)
        return second_attempt
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"a.bin": 200_000, "b": 5},
                              feed=start_over)
    assert all_ok(comm, results["c1"]["ok"]), results
    problems = check_replicas(mpi_tmp_path, cfg)
    assert all_ok(comm, not problems), problems[:5]
    assert all_ok(comm, replica_events(cfg, "replicate_restart")), "no restart"


def test_a_final_manifest_other_than_the_files_streamed_is_never_kept(mpi_tmp_path):
    """The partner's own check: an owner that ends a stream with a manifest naming other
    files (here it skips its own comparison) gets no replica."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')

    def lie(replicator, manifest, source):
        stream(replicator, manifest, source)
        torn = replace(manifest, files=[replace(manifest.files[0], checksum="0" * 32)])

        def end():
            handle = replicator.handles[manifest.ckpt]
            handle.stream.final = (torn, source, True)      # not `finish`: no check here
        return end
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"a.bin": 200_000},
                              feed=lie)
    assert all_ok(comm, not results["c1"]["ok"]), results
    failed = replica_events(cfg, "replica_failed")
    assert all_ok(comm, failed and "a.bin: checksum differs from the owner's"
                  in failed[0]["error"]), failed
    partner = cfg.node_paths(comm.rank).replicas
    owner = (comm.rank - 1) % comm.size
    assert all_ok(comm, not replica_manifest_path(partner, owner, "c1").exists())
    assert all_ok(comm, not replica_dir(partner, owner, "c1").exists())


def linked_capture(threads: list, rewrite: bool = False):
    """A `feed` hook: the part is moved to a spool beside the stage and captured by hard
    link in a thread of its own, as the agent's capture does, its pieces fed to the
    replication as they are hashed. `rewrite`: the capture's posts wait until the
    trainer has rewritten a file in place (same inode, other bytes): the replication
    then reads what the capture did not feed, and those are not the bytes hashed."""
    from cachex_agent.stage.capture import Plan, capture_copy

    def start(replicator, manifest, source):
        spool = source.parent / f"spool-{manifest.ckpt}"
        source.rename(spool)
        relpaths = [e.path for e in manifest.files]
        header = replace(manifest, files=[])
        held: list = []

        def post(action):
            (held.append if rewrite else replicator.post)(action)

        def on_file(index, entry, partial):
            msg = FileCaptured(header, index, entry, partial, source)
            post(lambda: replicator.file_captured(msg))

        def capture():
            replicator.feed.begin(manifest.ckpt)
            try:
                entries = capture_copy(spool, source, relpaths, on_file=on_file,
                                       plan=Plan(frozenset(relpaths)), sink=replicator.feed)
            finally:
                replicator.feed.stop()
            final = replace(manifest, files=entries)
            post(lambda: replicator.captured(final, source, True))
            if rewrite:
                with open(spool / relpaths[0], "r+b") as handle:
                    handle.write(bytes(255 - b for b in handle.read(16)))
                for action in held:
                    replicator.post(action)
        threads.append(threading.Thread(target=capture, name="capture"))
        threads[-1].start()     # the loop runs meanwhile: it Puts what the capture feeds
    return start


def test_a_part_captured_by_link_is_fed_to_its_partner_as_it_is_hashed(mpi_tmp_path):
    """One read on the owner: the pieces Put are the capture's hashed buffers."""
    from mpi4py import MPI

    from cachex_agent.peer.feed import Feed
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')
    sizes = {"big.distcp": 768 * 1024 + 3, "empty": 0, "d/small": 100, ".metadata": 5000}
    feeds = []

    def pieces(wake):
        feeds.append(Feed(cfg.peer.slot, count=2, wait=5.0, wake=wake))
        return feeds[0]
    threads: list[threading.Thread] = []
    results = run_replication(mpi_tmp_path, cfg, lambda rank: sizes,
                              feed=linked_capture(threads), pieces=pieces)
    threads[0].join(60)
    assert all_ok(comm, results["c1"]["ok"]), results
    problems = check_replicas(mpi_tmp_path, cfg)
    assert all_ok(comm, not problems), problems[:5]
    started = replica_events(cfg, "replica_start")
    assert all_ok(comm, started and started[0]["streamed"]), started
    # every non-empty piece went through the feed (none was read again)
    assert all_ok(comm, feeds[0].served == 13 + 1 + 1), feeds[0].served


def test_a_linked_file_rewritten_before_it_is_read_again_is_never_a_replica(mpi_tmp_path):
    """Nothing fed (no buffers): the replication reads the trainer's file, which was
    rewritten in place after its hash; the partner's hash differs from the final
    manifest's and the owner's error says why."""
    from mpi4py import MPI

    from cachex_agent.peer.feed import Feed
    comm = MPI.COMM_WORLD
    cfg = config(mpi_tmp_path, '[peer]\nslot = "64KiB"\nslots = 2\n')
    threads: list[threading.Thread] = []
    results = run_replication(mpi_tmp_path, cfg, lambda rank: {"a.distcp": 200_000},
                              feed=linked_capture(threads, rewrite=True),
                              pieces=lambda wake: Feed(cfg.peer.slot, count=0, wait=0.0,
                                                       wake=wake))
    threads[0].join(60)
    assert all_ok(comm, not results["c1"]["ok"]), results
    error = results["c1"]["errors"]
    assert all_ok(comm, any("a.distcp: checksum differs from the capture's" in e
                            and "rewrote" in e for e in error.values())), error
    partner = cfg.node_paths(comm.rank).replicas
    owner = (comm.rank - 1) % comm.size
    assert all_ok(comm, not replica_manifest_path(partner, owner, "c1").exists())
