"""Peer replication throughput: the real Replicator vs the physical limits (raw Put, raw write).

Two ranks on one host: rank 0 is the owner, rank 1 its partner (topology.domain "rank").
One run measures, alternating the three kinds every repeat (rotated) so drift of the disk
hits all of them, each after os.sync() and a Barrier:

  put        raw MPI bandwidth: a window of slots x slot bytes on rank 1; rank 0, inside one
             Lock_all epoch opened at set-up, does Put(slot bytes) + Flush(1) into the slots
             in turn until `size` bytes moved. Rank 1 meanwhile loops on Iprobe + sleep(1 ms),
             the agent's tick while it is busy.
  write      raw disk bandwidth: rank 1 writes the checkpoint's file sizes under its replica
             directory with os.pwrite in slot-size chunks (from a pre-filled random buffer),
             fsyncs each file when it is complete (as the replica store does), then the
             directory once.
  replicate  the real thing: rank 0 calls Replicator.replicate() on a checkpoint staged in
             /dev/shm; both ranks then drive their Replicator the way agent.py does (inbox
             drained, the agent's MessagePump receives, pump(), sends tested, sleep(1 ms)
             while busy, else agent.poll) until the owner's `replicated` post. That
             includes Put + Flush per slot, slot/credit messages, the partner's writer
             thread (xxh3-128 per file, pwrite, fsync per file, checksum check, directory
             fsyncs, rename, manifest).

  tcp        (--tcp) raw TCP bandwidth between the two ranks' hosts: one connection, opened
             at set-up over --iface (default: UCX_NET_DEVICES, else lo); rank 0 sends `size`
             bytes in slot-size sendall() calls, rank 1 recv_into()s and discards them,
             then answers one byte that stops rank 0's clock. The limit of MPI over TCP
             (benchmarks/replicate_tcp.py runs the ranks on two namespaced nodes).

The replica of each repeat is removed afterwards, outside the timing, so keep.replica never
evicts inside a timed run.

File mix (the staged checkpoint): six small files (0 B, 100 B, 4 KiB, 64 KiB + 1, 1 MiB,
3 MiB - 1: metadata, RNG state, config-like), then sizes doubling from 16 MiB while they
fit, then the remainder as one last file. At 1 GiB: 16, 32, 64, 128, 256, 512 MiB and one of
~11.9 MiB; 13 files in all, none but the doubling ones a multiple of the slot.

    mpiexec -n 2 python benchmarks/replicate.py [--size 1GiB] [--slot 16MiB] [--slots 4]
                                                [--dir DIR] [--cache DIR] [--repeat 3]
                                                [--streams K]
                                                [--tcp [--iface IF]] [--profile]
                                                [--tick peer,busy,spin] [--back-to-back N]
                                                [--json FILE]

--dir is where the partner's replicas go: a disk by default (/tmp); `--dir /dev/shm` is
the tmpfs mode of issue 11's target (>= 0.8x), where the protocol, not the disk, is what
is left to see. Run both also with MPIR_CVAR_NOLOCAL=1 (no shared memory between the
ranks: the closest one host gets to two nodes). --profile adds the partner's pwrite/fsync
split to every repeat and a breakdown of the last replicate run (owner read/Put/wait,
writer pwrite/fsync/xxh3/idle, start-up, credit latency). A disk shared with other work is
noisy (the same raw 1 GiB write took 2.1-3.3 s here): for decisions use a quiet machine
and --repeat 5.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import GiB, MiB, write_config
from sources import write_sources

from cachex_agent.config import Config, load, parse_size
from cachex_agent.events import EventLog
from cachex_agent.fsutil import fsync_dir
from cachex_agent.layout import events_path
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.messages import Ack, Credit, Replicated, Tag, ToNode

PEER = Tag.PEER
CTRL = 9            # this benchmark's own "stop idling" message
BUSY_TICK = 0.001   # the partner's Iprobe tick while it idles in the raw Put
TICKS = ("peer", "busy", "spin")     # Driver.sleep
SMALL = [0, 100, 4096, 64 * 1024 + 1, MiB, 3 * MiB - 1]


def human(size: int) -> str:
    return f"{size // MiB} MiB" if size % MiB == 0 else f"{size / 1024:.0f} KiB"


def file_sizes(total: int, smallest: int = 16 * MiB) -> list[int]:
    """SMALL (as far as they fit), doubling sizes from `smallest`, then the remainder."""
    sizes: list[int] = []
    for size in SMALL:
        if sum(sizes) + size <= total // 8:
            sizes.append(size)
    size = smallest
    while sum(sizes) + size <= total:
        sizes.append(size)
        size *= 2
    if total > sum(sizes):
        sizes.append(total - sum(sizes))
    return sizes


def make_sources(root: Path, sizes: list[int]) -> list[FileEntry]:
    return write_sources(root, [(f"rank{i % 4}/shard_{i:03d}.bin" if size >= 16 * MiB
                                 else f"meta/{i:03d}.dat", size) for i, size in enumerate(sizes)])


def agent_config(root: Path, stage: Path, slot: int, slots: int, cache: str | None = None
                 ) -> Path:
    """Both ranks' configuration (the Driver's Replicator reads it; no agent runs)."""
    return write_config(root / "bench.toml", "bench",
                        paths={"spool": f"{root}/node{{node}}/spool",
                               "stage": f"{stage}/node{{node}}",
                               "cache": f"{cache or root}/node{{node}}/cache",
                               "pfs": root / "pfs"},
                        topology={"domain": "rank"}, peer={"slot": slot, "slots": slots},
                        agent={"timeout": "60s"})


# ---------------------------------------------------------------------- profiling
class Trace:
    """Timestamps (time.monotonic: one clock for both processes on one host)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self.marks: dict[str, list[float]] = {}

    def span(self, name: str, start: float, end: float) -> None:
        self.spans.setdefault(name, []).append((start, end))

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, []).append(time.monotonic())

    def timed(self, name: str, function: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return function(*args, **kwargs)
            finally:
                self.span(name, start, time.monotonic())
        return wrapper

    def clear(self) -> None:
        self.spans.clear()
        self.marks.clear()


class _TimedOs:
    """Stands in for `os` inside peer/store.py: times pwrite and fsync, passes the rest."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace
        self.pwrite = trace.timed("pwrite", os.pwrite)
        self.fsync = trace.timed("fsync", os.fsync)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _TimedHasher:
    def __init__(self, trace: Trace, inner: Any) -> None:
        self._trace, self._inner = trace, inner

    def update(self, data: Any) -> None:
        start = time.monotonic()
        self._inner.update(data)
        self._trace.span("xxh3", start, time.monotonic())

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


def instrument(replicator: Any, trace: Trace, rank: int) -> None:
    """Benchmark-only wrappers (instance attributes and the store module's globals)."""
    from cachex_agent.peer import replicator as replicator_module
    from cachex_agent.peer import store as store_module
    if rank == 0:
        replicator.window.put = trace.timed("put", replicator.window.put)
        original = replicator_module.Sender.next_chunk
        replicator_module.Sender.next_chunk = (     # type: ignore[method-assign]
            lambda self, buffer: trace.timed("read", original)(self, buffer))
        on_credit = replicator.on_credit
        replicator.on_credit = lambda p, s: (trace.mark("credit_in"), on_credit(p, s))
    else:
        store = replicator.store
        store_module.os = _TimedOs(trace)
        make = store_module.hasher
        store_module.hasher = lambda: _TimedHasher(trace, make())
        for name in ("_do_begin", "_do_write", "_do_end", "_commit"):
            setattr(store, name, trace.timed(name, getattr(store, name)))


def disk_split(trace: Trace, kind: str) -> str:
    """The partner's time in pwrite and fsync during the run just finished."""
    prefix = "raw_" if kind == "write" else ""
    pwrite = busy_time(trace.spans.get(f"{prefix}pwrite", []))
    fsync = busy_time(trace.spans.get(f"{prefix}fsync", []))
    return f" (pwrite {pwrite:.2f} + fsync {fsync:.2f})"


def busy_time(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def profile_report(owner: Trace, partner: Trace, start: float, end: float,
                   nbytes: int) -> list[str]:
    total = end - start
    lines = [f"profile of the last replicate run ({total:.3f}s):"]
    read, put = busy_time(owner.spans.get("read", [])), busy_time(owner.spans.get("put", []))
    puts = owner.spans.get("put", [])
    lines.append(f"  owner main thread: read/map of /dev/shm {read:.3f}s, Put+Flush {put:.3f}s"
                 f" ({len(puts)} slots, {nbytes / MiB / put if put else 0:.0f} MiB/s while"
                 f" in Put), the rest {total - read - put:.3f}s waiting (credits, ticks)")
    writer = {k: busy_time(partner.spans.get(k, []))
              for k in ("_do_begin", "_do_write", "_do_end", "_commit", "pwrite", "fsync",
                        "xxh3")}
    busy = writer["_do_begin"] + writer["_do_write"] + writer["_do_end"]
    lines.append(f"  partner writer thread: busy {busy:.3f}s ({100 * busy / total:.0f}%):"
                 f" pwrite {writer['pwrite']:.3f}s, fsync {writer['fsync']:.3f}s"
                 f" ({len(partner.spans.get('fsync', []))} files),"
                 f" xxh3 {writer['xxh3']:.3f}s, begin {writer['_do_begin']:.3f}s,"
                 f" end/commit {writer['_do_end']:.3f}s (commit {writer['_commit']:.3f}s)")
    raw_pwrite = busy_time(partner.spans.get("raw_pwrite", []))
    raw_fsync = busy_time(partner.spans.get("raw_fsync", []))
    lines.append(f"  for comparison, the last raw write: pwrite {raw_pwrite:.3f}s,"
                 f" fsync {raw_fsync:.3f}s")
    writes = partner.spans.get("_do_write", [])
    begin_in, begins = partner.marks.get("begin_in", []), partner.spans.get("_do_begin", [])
    begin_out, slot_out = owner.marks.get("begin_out", []), owner.marks.get("slot_out", [])
    if begin_out and slot_out:
        lines.append(f"  start-up: owner sent begin after {1e3 * (begin_out[0] - start):.1f} ms,"
                     f" its first slot after {1e3 * (slot_out[0] - start):.1f} ms")
    if begin_in and begins and writes:
        lines.append(f"  start-up: partner received begin after {1e3 * (begin_in[0] - start):.1f}"
                     f" ms, writer ran begin {1e3 * (begins[0][0] - start):.1f}-"
                     f"{1e3 * (begins[0][1] - start):.1f} ms, first slot"
                     f" {1e3 * (writes[0][0] - start):.1f} ms")
    if writes:
        first, last = writes[0][0], writes[-1][1]
        gaps = [b[0] - a[1] for a, b in zip(writes, writes[1:], strict=False)]
        lines.append(f"  first slot reached the writer after {first - start:.3f}s; writer idle"
                     f" between slots {sum(gaps):.3f}s (max gap {max(gaps, default=0):.4f}s);"
                     f" last write done {end - last:.3f}s before the end")
    ends = partner.spans.get("_do_end", [])
    for end in ends[:-1]:       # back to back: the writer's gap from one part to the next
        before = [w[1] for w in writes if w[1] <= end[0]]
        after = [w[0] for w in writes if w[0] >= end[1]]
        if before and after:
            lines.append(f"  between checkpoints: the writer's last slot of one to the first"
                         f" of the next {1e3 * (min(after) - max(before)):.1f} ms (the end"
                         f" and commit {1e3 * (end[1] - end[0]):.1f} ms of it)")
    # credit round trip: writer posts it -> partner main thread sends it -> owner hears it
    posted, sent = partner.marks.get("credit_post", []), partner.marks.get("credit_send", [])
    heard = owner.marks.get("credit_in", [])
    if posted and sent and heard and len(posted) == len(sent) == len(heard):
        to_send = statistics.median(s - p for p, s in zip(posted, sent, strict=True))
        to_owner = statistics.median(h - s for s, h in zip(sent, heard, strict=True))
        lines.append(f"  credit latency (median): writer post -> partner sends {1e3 * to_send:.2f}"
                     f" ms, -> owner hears {1e3 * to_owner:.2f} ms")
    slots_in, handled = partner.marks.get("slot_in", []), writes
    if slots_in and len(slots_in) == len(handled):
        lag = statistics.median(w[0] - s for s, w in zip(slots_in, handled, strict=True))
        lines.append(f"  slot message received -> writer starts on it (median) {1e3 * lag:.2f} ms")
    return lines


# ---------------------------------------------------------------------- the kinds
def idle_until_stopped(comm: Any) -> None:
    """The partner during `put`: an idle agent-like loop that keeps calling into MPI."""
    from mpi4py import MPI
    while not comm.iprobe(source=0, tag=CTRL, status=MPI.Status()):
        time.sleep(BUSY_TICK)
    comm.recv(source=0, tag=CTRL)


def raw_put(comm: Any, win: Any, data: np.ndarray, size: int, slot: int, slots: int
            ) -> float | None:
    from mpi4py import MPI
    comm.Barrier()
    if comm.rank == 1:
        idle_until_stopped(comm)
        return None
    start = time.perf_counter()
    done, k = 0, 0
    while done < size:
        n = min(slot, size - done)
        win.Put([data[:n], n, MPI.BYTE], 1, [(k % slots) * slot, n, MPI.BYTE])
        win.Flush(1)
        done, k = done + n, k + 1
    elapsed = time.perf_counter() - start
    comm.send("stop", dest=1, tag=CTRL)
    return elapsed


def interface_address(iface: str) -> str:
    for address in psutil.net_if_addrs().get(iface, []):
        if address.family == socket.AF_INET:
            return address.address
    raise RuntimeError(f"--iface {iface}: no IPv4 address on this host")


def tcp_connection(comm: Any, iface: str) -> socket.socket:
    """Rank 0's connection to rank 1, over rank 1's address on `iface` (untimed)."""
    if comm.rank == 1:
        with socket.create_server((interface_address(iface), 0)) as server:
            comm.send(server.getsockname()[:2], dest=0)
            server.settimeout(60)
            connection = server.accept()[0]
    else:
        connection = socket.create_connection(comm.recv(source=1), timeout=60)
    connection.settimeout(300)
    return connection


def raw_tcp(comm: Any, connection: socket.socket, data: np.ndarray, size: int, slot: int
            ) -> float | None:
    comm.Barrier()
    if comm.rank == 1:
        buffer, received = bytearray(slot), 0
        while received < size:
            n = connection.recv_into(buffer)
            if not n:
                raise RuntimeError("tcp: connection closed")
            received += n
        connection.sendall(b"k")
        return None
    view = memoryview(data)
    start = time.perf_counter()
    done = 0
    while done < size:
        n = min(slot, size - done)
        connection.sendall(view[:n])
        done += n
    if connection.recv(1) != b"k":
        raise RuntimeError("tcp: no answer from rank 1")
    return time.perf_counter() - start


def raw_write(comm: Any, directory: Path, sizes: list[int], pool: np.ndarray, slot: int,
              trace: Trace | None = None) -> float | None:
    comm.Barrier()
    if comm.rank == 0:
        return None
    start = time.perf_counter()
    position = 0
    for i, size in enumerate(sizes):
        fd = os.open(directory / f"f{i:03d}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            while offset < size:
                n = min(slot, size - offset)
                if position + n > pool.nbytes:
                    position = 0
                view = memoryview(pool[position:position + n])
                done = 0
                begun = time.monotonic()
                while done < n:
                    done += os.pwrite(fd, view[done:], offset + done)
                if trace is not None:
                    trace.span("raw_pwrite", begun, time.monotonic())
                offset, position = offset + n, position + n
            begun = time.monotonic()
            os.fsync(fd)
            if trace is not None:
                trace.span("raw_fsync", begun, time.monotonic())
        finally:
            os.close(fd)
    fsync_dir(directory)
    elapsed = time.perf_counter() - start
    for path in directory.iterdir():
        path.unlink()
    fsync_dir(directory)
    return elapsed


class Driver:
    """Both ranks' Replicator, driven like agent.py's main loop (Agent._step: inbox, then
    the agent's own MessagePump's receive, then pump; then the sleep of `--tick`, on the
    agent's Inbox), so a change to the agent's message path shows up here."""

    def __init__(self, comm: Any, cfg: Config, trace: Trace | None, tick: str = "peer",
                 streams: int = 1) -> None:
        from cachex_agent.inbox import Inbox
        from cachex_agent.peer.partners import replication_map
        from cachex_agent.peer.replicator import Replicator
        from cachex_agent.pump import MessagePump
        from cachex_agent.topology import place_in
        self.comm, self.cfg, self.trace, self.tick = comm, cfg, trace, tick
        self.paths = cfg.node_paths(comm.rank)
        self.paths.replicas.mkdir(parents=True, exist_ok=True)
        self.posts = Inbox()    # the agent's: a post ends the loop's sleep at once
        self.events = EventLog(events_path(self.paths.journal), node=comm.rank)
        self.messages = MessagePump(comm, list(range(comm.size)), comm.rank, self.deliver,
                                    self.events, tags=[PEER])
        post = self.posts.put
        if trace is not None and comm.rank == 1:
            def post(msg: Any) -> None:
                if isinstance(msg, ToNode) and isinstance(msg.message, Credit):
                    trace.mark("credit_post")
                self.posts.put(msg)
        placement = place_in(comm, "rank")
        self.replicator = Replicator(comm, placement.node,
                                     replication_map(cfg, list(placement.hosts)),
                                     list(range(comm.size)), cfg, self.paths, self.events,
                                     self.send, post, wake=self.posts.wake,
                                     streams=streams)
        if trace is not None:
            instrument(self.replicator, trace, comm.rank)
        self.results: list[Replicated] = []
        self.back_to_back = 1     # checkpoints queued at once per replicate run
        self.finished = 0.0
        self.cpu: list[dict[str, float]] = []     # per replicate run: main thread, process

    def send(self, rank: int, msg: Any) -> None:
        if self.trace is not None:
            self.trace.mark(f"{msg.TYPE}_out")
        self.messages.send_peer(rank, msg)

    def deliver(self, source: int, msg: Any) -> None:
        if self.trace is not None:
            self.trace.mark(f"{msg.TYPE}_in")
        self.replicator.handle(source, msg)
        if isinstance(msg, Ack):        # the post happened inside handle(): stop the clock
            self.finished = time.perf_counter()
            if self.trace is not None:
                self.trace.mark("end")

    def step(self) -> None:
        while not self.posts.empty():
            msg = self.posts.get()
            if isinstance(msg, ToNode):
                if self.trace is not None and isinstance(msg.message, Credit):
                    self.trace.mark("credit_send")
                self.send(msg.node, msg.message)
            elif isinstance(msg, Replicated):
                self.results.append(msg)
        self.messages.receive()
        self.replicator.pump()
        self.messages.test()

    def replicate(self, entries: list[FileEntry], source: Path, seq: int) -> float | None:
        """Collective; the owner's time from replicate() to the last `replicated` post
        (`back_to_back` checkpoints of the same files queued at once)."""
        comm = self.comm
        ckpts = [f"step_{seq:05d}_{k}" for k in range(self.back_to_back)]
        self.results = []
        comm.Barrier()
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.mark("start")
        if comm.rank == 0:
            for k, ckpt in enumerate(ckpts):
                self.replicator.replicate(LocalManifest(
                    run="bench", ckpt=ckpt, seq=seq * self.back_to_back + k, node=0,
                    host="bench", rank=0, files=entries), source)
        barrier = comm.Ibarrier() if comm.rank == 1 else None
        deadline = time.monotonic() + 300
        main_cpu, process_cpu, steps = time.thread_time(), time.process_time(), 0
        while time.monotonic() < deadline:
            self.step()
            if barrier is None and len(self.results) == len(ckpts):
                barrier = comm.Ibarrier()   # done as the owner; the partner may still be busy
            if (barrier is not None and barrier.Test() and not self.replicator.busy()
                    and not self.messages.test()):
                break
            self.posts.wait(self.sleep())
            steps += 1
        else:
            raise RuntimeError(f"rank {comm.rank}: replication did not finish in 300 s")
        self.cpu.append({"main": time.thread_time() - main_cpu,
                         "process": time.process_time() - process_cpu, "steps": steps})
        if comm.rank == 0:
            if not all(r.ok for r in self.results):
                raise RuntimeError(f"replication failed: {self.results}")
            return self.finished - start
        for ckpt in ckpts:
            self._check_and_remove(ckpt, entries)
        return None

    def sleep(self) -> float:
        """The loop's sleep between steps: `peer` is agent.py's (`Agent._tick`: 1 ms only
        while a peer message is due), `busy` the one before it (1 ms while anything of the
        replication is in flight), `spin` none while busy."""
        from cachex_agent.agent import PEER_TICK
        if self.tick == "peer":
            return PEER_TICK if self.replicator.waits_on_peer() else self.cfg.agent.poll
        if not self.replicator.busy():
            return self.cfg.agent.poll
        return PEER_TICK if self.tick == "busy" else 0.0

    def _check_and_remove(self, ckpt: str, entries: list[FileEntry]) -> None:
        from cachex_agent.layout import replica_dir, replica_manifest_path, replica_owner_dir
        root = self.paths.replicas
        replica = replica_dir(root, 0, ckpt)
        if not replica_manifest_path(root, 0, ckpt).is_file():
            raise RuntimeError(f"{replica}: no manifest after the ack")
        for entry in entries:
            if (replica / entry.path).stat().st_size != entry.size:
                raise RuntimeError(f"{replica / entry.path}: wrong size")
        replica_manifest_path(root, 0, ckpt).unlink()
        shutil.rmtree(replica)
        fsync_dir(replica_owner_dir(root, 0))

    def close(self) -> None:
        self.replicator.close()
        self.events.close()


# ---------------------------------------------------------------------- main
def tcp_ratios(rate: dict[str, float]) -> dict[str, float]:
    """Replication against what the network and the partner's disk allow; MPI's own
    Put against the same network."""
    return {"tcp_ratio": rate["replicate"] / min(rate["tcp"], rate["write"]),
            "put_vs_tcp": rate["put"] / rate["tcp"]}


def cpu_report(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per rank, the median over repeats of each CPU figure of a replicate run."""
    return [{key: statistics.median(run[rank][key] for run in runs) for key in runs[0][rank]}
            for rank in range(len(runs[0]))]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--slot", default="16MiB")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--streams", type=int, default=1,
                        help="files in flight to the partner, its write lanes (peer.streams)")
    parser.add_argument("--dir", help="where the partner's cache (replicas) lives"
                                      " (default: a new directory under /tmp)")
    parser.add_argument("--cache", help="where each rank's cache lives, when not under --dir"
                                        " (a node-local directory: benchmarks/replicate_tcp.py)")
    parser.add_argument("--tcp", action="store_true", help="also measure a raw TCP stream")
    parser.add_argument("--iface", default=os.environ.get("UCX_NET_DEVICES", "lo").split(",")[0],
                        help="the interface of the TCP stream (default: UCX_NET_DEVICES, else lo)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="checkpoints (the same files) queued at once per replicate run;"
                             " rates count all their bytes")
    parser.add_argument("--tick", default="peer",
                        help="the main loop's sleep while replicating, comma-separated to"
                             f" alternate several in one run: {', '.join(TICKS)}"
                             " (Driver.sleep)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds of all three first")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--profile", action="store_true",
                        help="pwrite/fsync per repeat and a breakdown of the last replicate run"
                             " (adds a little overhead)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    args = parse(argv)
    if comm.size != 2:
        if comm.rank == 0:
            print("run on exactly 2 ranks: mpiexec -n 2 python benchmarks/replicate.py",
                  file=sys.stderr)
        return 2
    size, slot = parse_size(args.size, "--size"), parse_size(args.slot, "--slot")
    slots = args.slots
    sizes = file_sizes(size)
    root = stage = None
    if comm.rank == 0:
        root = Path(tempfile.mkdtemp(prefix="cachex-bench-repl-", dir=args.dir or "/tmp"))
        stage = Path(tempfile.mkdtemp(prefix="cachex-bench-repl-", dir="/dev/shm"))
    root, stage = comm.bcast((root, stage))
    driver = win = None
    try:
        entries: list[FileEntry] = []
        if comm.rank == 0:
            agent_config(root, stage, slot, slots, args.cache)
            source = stage / "src"
            entries = make_sources(source, sizes)
        comm.Barrier()
        cfg = load(root / "bench.toml", environ={})
        trace = Trace() if args.profile else None
        ticks = args.tick.split(",")
        if not set(ticks) <= set(TICKS):
            raise SystemExit(f"--tick: one or more of {', '.join(TICKS)}")
        driver = Driver(comm, cfg, trace, streams=args.streams)
        driver.back_to_back = args.back_to_back
        win = MPI.Win.Allocate(slots * slot if comm.rank == 1 else 1, disp_unit=1, comm=comm)
        win.Lock_all()
        rng = np.random.default_rng(2)
        pool = (np.frombuffer(rng.bytes(min(size, GiB)), dtype=np.uint8) if comm.rank == 1
                else np.frombuffer(rng.bytes(slot), dtype=np.uint8))
        connection = tcp_connection(comm, args.iface) if args.tcp else None
        raw_dir = driver.paths.replicas / "raw-write"
        raw_dir.mkdir(exist_ok=True)
        if comm.rank == 0:
            print(f"{len(sizes)} files, {size / GiB:.2f} GiB, sizes:"
                  f" {[round(s / MiB, 3) for s in sizes]} MiB; slot {human(slot)} x {slots};"
                  f" {args.streams} stream(s);"
                  f" files under {root};"
                  f" MPIR_CVAR_NOLOCAL={os.environ.get('MPIR_CVAR_NOLOCAL', '')!r};"
                  f" agent.poll {cfg.agent.poll}s", flush=True)

        seq = 0

        def run(kind: str) -> float | None:
            nonlocal seq
            os.sync()
            if kind == "put":
                return raw_put(comm, win, pool, size, slot, slots)
            if kind == "tcp":
                assert connection is not None
                return raw_tcp(comm, connection, pool, size, slot)
            if kind == "write":
                if trace is not None:
                    trace.spans.pop("raw_pwrite", None)
                    trace.spans.pop("raw_fsync", None)
                return raw_write(comm, raw_dir, sizes, pool, slot, trace)
            seq += 1
            driver.tick = kind.partition(":")[2] or ticks[0]
            if trace is not None:
                raw = {k: trace.spans.get(k, []) for k in ("raw_pwrite", "raw_fsync")}
                trace.clear()
                trace.spans.update(raw)
            return driver.replicate(entries, stage / "src", seq)

        replicates = (["replicate"] if len(ticks) == 1
                      else [f"replicate:{tick}" for tick in ticks])
        kinds = ["put", "write", *replicates, *(["tcp"] if args.tcp else [])]
        cpu: dict[str, list[list[dict[str, float]]]] = {k: [] for k in replicates}
        for _ in range(args.warmup):
            for kind in kinds:
                run(kind)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(args.repeat):
            split: dict[str, str] = {}
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                elapsed = comm.bcast(run(kind), root=0 if kind != "write" else 1)
                times[kind].append(elapsed)
                if kind in cpu:
                    cpu[kind].append(comm.gather(driver.cpu[-1]))
                if trace is not None and kind != "put":
                    split[kind] = comm.bcast(disk_split(trace, kind), root=1)
            if comm.rank == 0:
                print(f"repeat {r + 1}: " + "  ".join(f"{k} {times[k][-1]:.3f}s{split.get(k, '')}"
                                                      for k in kinds), flush=True)
        traces = comm.gather(trace) if trace is not None else None
        if comm.rank == 0:
            moved = {k: size * (args.back_to_back if k.startswith("replicate") else 1)
                     for k in kinds}
            rate = {k: moved[k] / MiB / statistics.median(v) for k, v in times.items()}
            best = {k: moved[k] / MiB / min(v) for k, v in times.items()}
            for kind in kinds:
                print(f"{kind:10s} median {rate[kind]:8.1f} MiB/s   best {best[kind]:8.1f} MiB/s")
            if traces is not None:
                owner, partner = traces
                for line in profile_report(owner, partner, owner.marks["start"][-1],
                                           owner.marks["end"][-1],
                                           size * args.back_to_back):
                    print(line)
            limit = min(rate["put"], rate["write"])
            ratios = {k: rate[k] / limit for k in replicates}
            rate["replicate"] = rate[replicates[0]]
            tcp = tcp_ratios(rate) if args.tcp else {}
            cpu_median = {k: cpu_report(runs) for k, runs in cpu.items()}
            if args.json:
                Path(args.json).write_text(json.dumps({
                    "date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()[0],
                    "bytes": size, "slot": slot, "slots": slots, "dir": str(root),
                    "nolocal": os.environ.get("MPIR_CVAR_NOLOCAL", ""), "seconds": times,
                    "median_mib_s": rate, "ratio": ratios[replicates[0]], "ratios": ratios,
                    "cpu": cpu_median, **tcp}, indent=1) + "\n")
            for kind in replicates:
                owner, partner = cpu_median[kind]
                print(f"{kind} CPU per run (median): owner main thread {owner['main']:.3f}s,"
                      f" process {owner['process']:.3f}s, {owner['steps']:.0f} steps;"
                      f" partner main thread {partner['main']:.3f}s, process"
                      f" {partner['process']:.3f}s, {partner['steps']:.0f} steps")
            for kind in replicates:
                print(f"{kind} ratio: {ratios[kind]:.2f}  (replication"
                      f" {rate[kind]:.1f} MiB/s vs min(raw Put {rate['put']:.1f} MiB/s,"
                      f" raw write {rate['write']:.1f} MiB/s) = {limit:.1f} MiB/s,"
                      f" {size / GiB:.2f} GiB, slot {human(slot)} x {slots})")
            if tcp:
                print(f"tcp ratio: {tcp['tcp_ratio']:.2f}  (replication vs min(raw TCP"
                      f" {rate['tcp']:.1f} MiB/s over {args.iface}, raw write); raw Put/raw"
                      f" TCP {tcp['put_vs_tcp']:.2f}")
        comm.Barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        shutil.rmtree(stage, ignore_errors=True)     # one host: either rank can clean up
        shutil.rmtree(root, ignore_errors=True)
        comm.Abort(1)
    if driver is not None:
        driver.close()
    if win is not None:
        win.Unlock_all()
        win.Free()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
