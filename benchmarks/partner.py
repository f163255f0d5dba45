"""The partner path against its physical floor: time, CPU, and what it costs a trainer.

Two virtual nodes on this host, each the other's partner. For every size in --sizes (per
node, --files files of random bytes) and every condition in --conditions:

  quiet     nothing of the benchmark's own beside it
  loaded    2 CPU-burning processes (`while True: pass`, the benchmark's niceness) from
            after the warm-up to the end of the condition: a node whose cores are training

Each condition starts fresh agents and warms up untimed (one checkpoint of the smallest
size through the agents, flushed to the PFS, and one raw pass); then each repeat
measures three kinds, their order reversed every other repeat:

  raw       the bytes' own cost, both nodes at once: `mpiexec -n 2` of this file in its
            raw-worker mode. Each rank is an owner and the other's partner at once, both
            roles on its main thread (interleaved, as the agent's loop does), a writer
            thread beside it. The owner maps each of its files (read-only, populated) and
            Puts it in slots of `peer.slot` bytes into the partner's window (MPI.Win
            .Allocate of peer.slots x peer.slot, the agents' defaults; every slot Put once
            untimed first, as the agents' long-lived window is warm), one Flush per slot,
            then sends a 5-number message (file, offset, n, slot, last); the partner's
            writer pwrites the slot into its file, fsyncs each file when complete and the
            directory at the end, and each slot's credit goes back. The main thread waits
            PEER_TICK (the agents' 1 ms) only when nothing moved. No begin/end
            manifests, no checksums, no capture: what moving and storing the bytes costs.
            Time from a Barrier to the later rank done; CPU is getrusage(RUSAGE_SELF)
            user+sys over that span, summed over the two ranks. The files are the same
            kind the agents get, written untimed beside each spool (node<n>/raw-spool);
            the partner writes beside the real replicas (node<n>/nvme/raw-replica).
  agents    real agents (`mpiexec -n 2 cachex-agent`, started once per condition,
            topology.domain rank, model.path peer: benchmarks/pipeline.py's config): from
            the commit (DCP's `.metadata` renamed into node 0's part) to the later of the
            two nodes' `replicated` events; CPU is both agent processes' user+sys (every
            thread, psutil) just before the commit and just after the second `replicated`
            is seen (so it includes the event polling's latency and any work the agents
            go on with after `replicated`).
  trainer   a stand-in trainer's step time: a process doing a fixed number of 512x512
            float64 matmuls per step (one BLAS thread; calibrated once at the start to
            ~50 ms a step), its median step alone (agents idle) and while the agents
            replicate a checkpoint of the size (the steps that overlap commit ->
            `replicated`).

Ratios (per size and condition; the issue's targets):

  speed              raw time / agents time             >= 0.8
  cpu                agents CPU / raw CPU               <= 1.2
  loaded_over_quiet  agents time loaded / quiet         <= 2
  trainer            step with agents / alone, loaded  <= 1.1

Spools, stages, replicas and journals live under --dir (/dev/shm); the PFS under --pfs,
which gets only the warm-up checkpoint (flush.every is large), flushed untimed. One line
per measurement while it runs, then the medians, the ratios with their targets, and last
one JSON line of everything (also written to --json).

    python benchmarks/partner.py [--sizes 64MiB,256MiB,1GiB] [--files 4] [--repeat 3]
                                 [--dir /dev/shm] [--pfs /tmp] [--conditions quiet,loaded]
                                 [--json FILE] [--nice N] [--sched other|batch|idle]
                                 [--cpus LIST] [--lease true|false]

--lease is the agents' stage.lease (false: a linked file is read into the feed's
buffers, not hashed and Put from its mapping under a read lease). --cpus is the agents'
agent.cpus (e.g. 1: both agents on CPU 1, the trainer and the burners on every CPU, as
a job whose agent step is bound to a core of its own).

On a shared machine run it under `nice` (the agents, the burners and the trainer inherit
it). Run it also with MPIR_CVAR_NOLOCAL=1 in the environment (the agents and the raw
worker inherit it).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import BIN, AgentJob, burn, machine, remove_parts, stop_burning, write_parts
from pipeline import NODES, agent_config, pipeline_once, start_agents
from sources import part_sizes

from cachex_agent.agent import PEER_TICK
from cachex_agent.config import Peer, load, parse_size
from cachex_agent.fsutil import fsync_dir

KINDS = ("raw", "agents", "trainer")
CONDITIONS = ("quiet", "loaded")
BURNERS = 2
RAW_SPOOL = "raw-spool"
RAW_REPLICA = Path("nvme") / "raw-replica"
RAW_TIMEOUT = 300.0
SLOT_TAG, CREDIT_TAG = 51, 52
END = -1                    # a slot message's file index that says "no more files"
STEP = 0.05                 # the stand-in trainer's step, quiet
MATRIX = 512
WARMUP_STEPS = 3            # trainer steps not counted (start-up, caches)
ALONE_STEPS = 20
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TARGETS = {"speed": (">=", 0.8), "cpu": ("<=", 1.2), "loaded_over_quiet": ("<=", 2.0),
           "trainer": ("<=", 1.1)}


# ------------------------------------------------------------------- raw worker
def rusage_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class Owner:
    """This rank's files into the peer's window, slot by slot; a slot is refilled only
    once the peer credited it (written to its file)."""

    def __init__(self, comm: Any, win: Any, peer: int, files: list[Path], slot: int,
                 slots: int) -> None:
        self.comm, self.win, self.peer, self.slot = comm, win, peer, slot
        self.files = deque(enumerate(files))
        self.free = deque(range(slots))
        self.slots = slots
        self.sends: list[tuple[Any, np.ndarray]] = []   # Isend and its buffer, kept alive
        self.index, self.offset = -1, 0
        self.mapping: mmap.mmap | None = None
        self.data: np.ndarray | None = None
        self.ended = False

    def pump(self) -> bool:
        """Fill every free slot; True if anything was sent."""
        from mpi4py import MPI
        moved = False
        while self.free and not self.ended:
            if self.data is None or self.offset == self.data.nbytes:
                if not self._next_file():
                    self._send(SLOT_TAG, (END, 0, 0, 0, 0))
                    self.ended = True
                    return True
                if self.data is None:   # an empty file: named, no slot
                    self._send(SLOT_TAG, (self.index, 0, 0, -1, 1))
                    moved = True
                    continue
            n = min(self.slot, self.data.nbytes - self.offset)
            k = self.free.popleft()
            piece = self.data[self.offset:self.offset + n]
            self.win.Put([piece, n, MPI.BYTE], self.peer, [k * self.slot, n, MPI.BYTE])
            self.win.Flush(self.peer)   # complete at the peer before it hears of it
            del piece
            self.offset += n
            self._send(SLOT_TAG, (self.index, self.offset - n, n, k,
                                  int(self.offset == self.data.nbytes)))
            moved = True
        return moved

    def _next_file(self) -> bool:
        """Map the next file whole, populated (one call, not a fault per page)."""
        self._unmap()
        if not self.files:
            return False
        self.index, path = self.files.popleft()
        self.offset = 0
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size:
                self.mapping = mmap.mmap(handle.fileno(), size,
                                         flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                         prot=mmap.PROT_READ)
                self.data = np.frombuffer(self.mapping, dtype=np.uint8)
        return True

    def _unmap(self) -> None:
        self.data = None        # the last view goes before the mapping can close
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    def _send(self, tag: int, numbers: tuple[int, ...]) -> None:
        from mpi4py import MPI
        buffer = np.array(numbers, dtype=np.int64)
        self.sends.append((self.comm.Isend([buffer, MPI.INT64_T], dest=self.peer, tag=tag),
                           buffer))

    def on_credit(self, k: int) -> None:
        self.free.append(k)

    def test_sends(self) -> None:
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]

    def done(self) -> bool:
        return self.ended and len(self.free) == self.slots and not self.sends


class Partner:
    """The peer's slots onto disk: the main thread hears of a slot and queues it; the
    writer thread pwrites it, fsyncs each file once complete and the directory at the
    end, and hands each slot's credit back to the main thread to send."""

    def __init__(self, comm: Any, win: Any, memory: np.ndarray, peer: int, directory: Path,
                 slot: int, wake: threading.Event) -> None:
        self.comm, self.win, self.memory, self.peer = comm, win, memory, peer
        self.directory, self.slot, self.wake = directory, slot, wake
        self.tasks: queue.Queue[tuple[int, ...] | None] = queue.Queue()
        self.credits: queue.Queue[int] = queue.Queue()
        self.sends: list[tuple[Any, np.ndarray]] = []
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="raw-writer", daemon=True)
        self.thread.start()

    def on_slot(self, numbers: np.ndarray) -> None:
        if numbers[0] == END:
            self.tasks.put(None)
            return
        self.win.Sync()     # the owner's Put is complete: make it visible here
        self.tasks.put(tuple(int(x) for x in numbers))

    def send_credits(self) -> bool:
        from mpi4py import MPI
        sent = False
        while not self.credits.empty():
            buffer = np.array([self.credits.get_nowait(), 0, 0, 0, 0], dtype=np.int64)
            self.sends.append((self.comm.Isend([buffer, MPI.INT64_T], dest=self.peer,
                                               tag=CREDIT_TAG), buffer))
            sent = True
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]
        return sent

    def done(self) -> bool:
        return self.finished.is_set() and self.credits.empty() and not self.sends

    def _run(self) -> None:
        fds: dict[int, int] = {}
        try:
            while (task := self.tasks.get()) is not None:
                index, offset, n, k, last = task
                if index not in fds:
                    fds[index] = os.open(self.directory / f"f{index:03d}",
                                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                if n:
                    view = memoryview(self.memory[k * self.slot:k * self.slot + n])
                    done = 0
                    while done < n:
                        done += os.pwrite(fds[index], view[done:], offset + done)
                if last:
                    os.fsync(fds[index])
                    os.close(fds.pop(index))
                if k >= 0:
                    self.credits.put(k)
                    self.wake.set()
            fsync_dir(self.directory)
        except BaseException as exc:    # noqa: BLE001 (the main loop reports it)
            self.error = exc
        finally:
            for fd in fds.values():
                os.close(fd)
            self.finished.set()
            self.wake.set()


def raw_loop(comm: Any, owner: Owner, partner: Partner, wake: threading.Event,
             deadline: float) -> None:
    """Both roles until this rank's bytes are all credited and the peer's all on disk.
    The loop waits PEER_TICK (the agents' poll while a peer message is due) only when
    nothing moved; a credit from the writer ends the wait at once."""
    from mpi4py import MPI
    status = MPI.Status()
    numbers = np.zeros(5, dtype=np.int64)
    while not (owner.done() and partner.done()):
        if partner.error is not None:
            raise partner.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {comm.rank}: not done in {RAW_TIMEOUT:.0f}s")
        moved = owner.pump()
        # MPICH's first Iprobe may only drive progress (as MessagePump._probe): ask twice
        while any(comm.Iprobe(source=owner.peer, tag=MPI.ANY_TAG, status=status)
                  for _ in range(2)):
            comm.Recv([numbers, MPI.INT64_T], source=owner.peer, tag=status.Get_tag())
            if status.Get_tag() == SLOT_TAG:
                partner.on_slot(numbers)
            else:
                owner.on_credit(int(numbers[0]))
            moved = True
        moved = partner.send_credits() or moved
        owner.test_sends()
        if not moved and wake.wait(PEER_TICK):
            wake.clear()


def raw_worker(root: Path, ckpt: str, slot: int, slots: int, timeout: float) -> int:
    """One rank of the raw pass; rank 0 prints {"seconds", "cpu"} as a JSON line."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        print("the raw worker runs on 2 ranks", file=sys.stderr)
        return 2
    # only the main thread calls MPI (the writer touches window memory, no MPI call);
    # mpi4py asks for MULTIPLE by default, as it does in the agents
    if MPI.Query_thread() < MPI.THREAD_FUNNELED:
        print(f"MPI thread level {MPI.Query_thread()} < FUNNELED", file=sys.stderr)
        comm.Abort(2)
    try:
        elapsed, cpu = raw_pass(comm, root, ckpt, slot, slots, timeout)
    except BaseException:       # noqa: BLE001 (never leave the peer waiting: end the job)
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    times = comm.gather((elapsed, cpu))
    if comm.rank == 0:
        print(json.dumps({"seconds": max(t for t, _ in times), "cpu": sum(c for _, c in times),
                          "ranks": times}), flush=True)
    return 0


def warm_window(comm: Any, win: Any, peer: int, slot: int, slots: int) -> None:
    """Untimed: Put every slot of the peer's window once. The agents' windows live as
    long as the job and are warm after its first checkpoint; a fresh one would charge
    the raw pass a page fault per page, in both processes, on first use."""
    from mpi4py import MPI
    zeros = np.zeros(slot, dtype=np.uint8)
    for k in range(slots):
        win.Put([zeros, slot, MPI.BYTE], peer, [k * slot, slot, MPI.BYTE])
        win.Flush(peer)
    comm.Barrier()


def raw_pass(comm: Any, root: Path, ckpt: str, slot: int, slots: int, timeout: float
             ) -> tuple[float, float]:
    """This rank's (seconds, CPU seconds) from the Barrier to both of its roles done."""
    from mpi4py import MPI
    rank, peer = comm.rank, 1 - comm.rank
    base = root / f"node{rank}"
    files = sorted(p for p in (base / RAW_SPOOL / ckpt).iterdir() if p.is_file())
    directory = base / RAW_REPLICA / ckpt
    directory.mkdir(parents=True)
    win = MPI.Win.Allocate(slots * slot, disp_unit=1, comm=comm)
    memory = np.frombuffer(win.tomemory(), dtype=np.uint8)
    win.Lock_all()      # one passive-target epoch for the whole run, as ReceiveWindow
    warm_window(comm, win, peer, slot, slots)
    wake = threading.Event()
    owner = Owner(comm, win, peer, files, slot, slots)
    partner = Partner(comm, win, memory, peer, directory, slot, wake)
    comm.Barrier()
    cpu, start = rusage_cpu(), time.perf_counter()
    raw_loop(comm, owner, partner, wake, time.monotonic() + timeout)
    elapsed, cpu = time.perf_counter() - start, rusage_cpu() - cpu
    partner.thread.join(10)
    del memory, partner
    win.Unlock_all()
    win.Free()
    return elapsed, cpu


def raw_once(root: Path, ckpt: str, total: int, files: int, seed: int, slot: int,
             slots: int) -> dict[str, float]:
    """The raw pass over a part written untimed beside each spool; all of it removed after."""
    write_parts(root, NODES, ckpt, total, files, seed, RAW_SPOOL)
    try:
        os.sync()
        proc = subprocess.run(
            [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(Path(__file__).resolve()),
             "--raw-worker", "--root", str(root), "--ckpt", ckpt, "--slot", str(slot),
             "--slots", str(slots)], capture_output=True, text=True, timeout=RAW_TIMEOUT + 60)
        if proc.returncode != 0:
            raise SystemExit(f"raw worker exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        check_raw_replicas(root, ckpt)
        return result
    finally:
        remove_parts(root, NODES, ckpt, RAW_SPOOL)
        for node in range(NODES):
            shutil.rmtree(root / f"node{node}" / RAW_REPLICA, ignore_errors=True)


def check_raw_replicas(root: Path, ckpt: str) -> None:
    """Each partner holds the other's files, byte for byte in size."""
    for node in range(NODES):
        sent = sorted(p.stat().st_size for p in (root / f"node{node}" / RAW_SPOOL / ckpt)
                      .iterdir())
        held = sorted(p.stat().st_size for p in (root / f"node{1 - node}" / RAW_REPLICA / ckpt)
                      .iterdir())
        if sent != held:
            raise SystemExit(f"raw: node {1 - node} holds {held}, node {node} sent {sent}")


# ---------------------------------------------------------------------- agents
def agents_cpu(procs: list[psutil.Process]) -> float:
    """User + system seconds of the agent processes, every thread."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def agent_processes(agents: AgentJob) -> list[psutil.Process]:
    return [psutil.Process(agents.wait_event(n, lambda e: e["event"] == "agent_start", 60)
                           ["pid"]) for n in range(NODES)]


def agents_once(agents: AgentJob, procs: list[psutil.Process], root: Path, ckpt: str,
                total: int, files: int, seed: int) -> dict[str, float]:
    """Commit -> the later `replicated` (pipeline_once), the agents' CPU over it."""
    before: list[float] = []
    run = pipeline_once(agents, root, ckpt, total, files, seed,
                        before_commit=lambda: before.append(agents_cpu(procs)))
    cpu = agents_cpu(procs) - before[0]
    remove_parts(root, NODES, ckpt)
    return {"seconds": run["replicated"], "cpu": cpu}


# --------------------------------------------------------------------- trainer
def trainer_worker(matmuls: int) -> int:
    """Steps of `matmuls` matmuls forever; each step's start and end (wall clock, the
    events' clock) on a line of its own."""
    rng = np.random.default_rng(5)
    a, b = rng.random((MATRIX, MATRIX)), rng.random((MATRIX, MATRIX))
    c = np.empty_like(a)
    while True:
        start = time.time()
        for _ in range(matmuls):
            np.matmul(a, b, out=c)
        print(f"{start:.6f} {time.time():.6f}", flush=True)


def calibrate() -> int:
    """Matmuls per step for a STEP-long step: the trainer itself, one matmul a step, on
    the machine as it is now (before any agent or burner)."""
    trainer = Trainer(1)
    try:
        trainer.wait_steps(WARMUP_STEPS + 10)
    finally:
        steps = trainer.stop()
    return max(1, round(STEP / statistics.median(e - s for s, e in steps)))


class Trainer:
    """The stand-in trainer in a process of its own; `steps` grows as it prints them."""

    def __init__(self, matmuls: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--trainer-worker",
             "--matmuls", str(matmuls)], stdout=subprocess.PIPE, text=True,
            env={**os.environ, **ONE_THREAD})
        self.steps: list[tuple[float, float]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            start, end = line.split()
            self.steps.append((float(start), float(end)))

    def wait_steps(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.steps) < count:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"trainer: {len(self.steps)} of {count} steps"
                                 f" (exit {self.proc.returncode})")
            time.sleep(0.005)

    def stop(self) -> list[tuple[float, float]]:
        self.proc.kill()
        self.proc.wait(10)
        self.reader.join(10)
        return self.steps[WARMUP_STEPS:]


def trainer_once(agents: AgentJob, root: Path, ckpt: str, total: int, files: int, seed: int,
                 matmuls: int) -> dict[str, list[float]]:
    """Step seconds alone (ALONE_STEPS), then those overlapping commit -> `replicated`."""
    trainer = Trainer(matmuls)
    try:
        trainer.wait_steps(WARMUP_STEPS + ALONE_STEPS)
    finally:
        alone = trainer.stop()
    trainer = Trainer(matmuls)
    try:
        trainer.wait_steps(WARMUP_STEPS)
        committed: list[float] = []
        run = pipeline_once(agents, root, ckpt, total, files, seed,
                            before_commit=lambda: committed.append(time.time()))
        begin, end = committed[0], committed[0] + run["replicated"]
        count = len(trainer.steps)
        trainer.wait_steps(count + 1)       # the step under way at `replicated` ends
    finally:
        steps = trainer.stop()
        remove_parts(root, NODES, ckpt)
    during = [e - s for s, e in steps if s < end and e > begin]
    return {"alone": [e - s for s, e in alone], "with": during}


# ------------------------------------------------------------------------ main
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64MiB,256MiB,1GiB", help="per node")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="spools, stages, replicas, journals")
    parser.add_argument("--pfs", default="/tmp", help="the PFS (the warm-up flush, untimed)")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--nice", type=int, default=0, help="the agents' agent.nice")
    parser.add_argument("--sched", default="other", help="the agents' agent.sched")
    parser.add_argument("--cpus", default="", help="the agents' agent.cpus")
    parser.add_argument("--lease", choices=("true", "false"), default="true",
                        help="the agents' stage.lease (false: linked files read, not mapped)")
    hidden = argparse.SUPPRESS      # the modes this file runs itself in
    parser.add_argument("--raw-worker", action="store_true", help=hidden)
    parser.add_argument("--root", help=hidden)
    parser.add_argument("--ckpt", help=hidden)
    parser.add_argument("--slot", type=int, help=hidden)
    parser.add_argument("--slots", type=int, help=hidden)
    parser.add_argument("--trainer-worker", action="store_true", help=hidden)
    parser.add_argument("--matmuls", type=int, default=1, help=hidden)
    args = parser.parse_args(argv)
    conditions = args.conditions.split(",")
    if not set(conditions) <= set(CONDITIONS):
        parser.error(f"--conditions: one or more of {', '.join(CONDITIONS)}")
    return args


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def condition_run(args: argparse.Namespace, condition: str, sizes: list[str], matmuls: int
                  ) -> dict[str, dict[str, Any]]:
    """Fresh agents for the condition; every size's repeats of the three kinds."""
    root = Path(tempfile.mkdtemp(prefix="cachex-bench-partner-", dir=args.dir))
    pfs = Path(tempfile.mkdtemp(prefix="cachex-bench-partner-pfs-", dir=args.pfs))
    burners: list[subprocess.Popen] = []
    agents: AgentJob | None = None
    out: dict[str, dict[str, Any]] = {}
    try:
        config = agent_config(root, pfs, agent={"nice": args.nice, "sched": args.sched,
                                                "cpus": args.cpus},
                              stage={"lease": args.lease == "true"})
        peer = load(config, environ={}).peer
        agents = start_agents(root, config)
        procs = agent_processes(agents)
        smallest = min(parse_size(s, "--sizes") for s in sizes)
        pipeline_once(agents, root, "step_00000", smallest, args.files, 0)     # warm-up
        agents.wait_event(0, lambda e: e["event"] == "level_flushed"
                          and e.get("ckpt") == "step_00000", 600)
        remove_parts(root, NODES, "step_00000")
        raw_once(root, "step_00000", smallest, args.files, 0, peer.slot, peer.slots)
        if condition == "loaded":
            burners = burn(BURNERS)
            time.sleep(0.5)
        seq = 0
        for name in sizes:
            total = parse_size(name, "--sizes")
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
            for rep in range(1, args.repeat + 1):
                for kind in KINDS if rep % 2 else tuple(reversed(KINDS)):
                    seq += 1
                    ckpt = f"step_{seq:05d}"
                    os.sync()
                    if kind == "raw":
                        run = raw_once(root, ckpt, total, args.files, seq, peer.slot,
                                       peer.slots)
                        line = f"{run['seconds']:.3f} s, CPU {run['cpu']:.3f} s"
                    elif kind == "agents":
                        run = agents_once(agents, procs, root, ckpt, total, args.files, seq)
                        line = (f"commit -> replicated {run['seconds']:.3f} s,"
                                f" CPU {run['cpu']:.3f} s")
                    else:
                        run = trainer_once(agents, root, ckpt, total, args.files, seq, matmuls)
                        line = (f"step {1e3 * statistics.median(run['alone']):.1f} ms alone,"
                                f" {1e3 * statistics.median(run['with']):.1f} ms over the"
                                f" replication ({len(run['with'])} steps)")
                    runs[kind].append(run)
                    print(f"  {name} {condition} {rep}/{args.repeat} {kind:7s} {line}",
                          flush=True)
            out[name] = summary(runs)
    finally:
        stop_burning(burners)
        if agents is not None:
            agents.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pfs, ignore_errors=True)
    return out


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of one size in one condition; the trainer's steps pooled over repeats."""
    alone = [s for r in runs["trainer"] for s in r["alone"]]
    during = [s for r in runs["trainer"] for s in r["with"]]
    return {
        "raw": {"seconds": median_of(runs["raw"], "seconds"), "cpu": median_of(runs["raw"], "cpu"),
                "runs": runs["raw"]},
        "agents": {"seconds": median_of(runs["agents"], "seconds"),
                   "cpu": median_of(runs["agents"], "cpu"), "runs": runs["agents"]},
        "trainer": {"alone": statistics.median(alone), "with": statistics.median(during),
                    "steps_alone": len(alone), "steps_with": len(during)}}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per size: each condition's speed, cpu, trainer; loaded_over_quiet if both ran."""
    out: dict[str, dict[str, Any]] = {}
    for name, by_condition in results.items():
        size: dict[str, Any] = {}
        for condition, r in by_condition.items():
            size[condition] = {"speed": r["raw"]["seconds"] / r["agents"]["seconds"],
                               "cpu": r["agents"]["cpu"] / r["raw"]["cpu"],
                               "trainer": r["trainer"]["with"] / r["trainer"]["alone"]}
        if {"quiet", "loaded"} <= set(by_condition):
            size["loaded_over_quiet"] = (by_condition["loaded"]["agents"]["seconds"]
                                         / by_condition["quiet"]["agents"]["seconds"])
        out[name] = size
    return out


def target(key: str, value: float) -> str:
    sign, bound = TARGETS[key]
    met = value >= bound if sign == ">=" else value <= bound
    return f"{key} {value:.2f} (target {sign} {bound:g}{'' if met else ', missed'})"


def report(results: dict[str, dict[str, Any]], table: dict[str, dict[str, Any]]) -> None:
    print("\nresults (medians)")
    for name, by_condition in results.items():
        for condition, r in by_condition.items():
            print(f"  {name} {condition}: raw {r['raw']['seconds']:.3f} s (CPU"
                  f" {r['raw']['cpu']:.3f} s), agents {r['agents']['seconds']:.3f} s (CPU"
                  f" {r['agents']['cpu']:.3f} s), trainer step {1e3 * r['trainer']['alone']:.1f}"
                  f" ms alone, {1e3 * r['trainer']['with']:.1f} ms with agents")
    print("ratios")
    for name, size in table.items():
        for condition in CONDITIONS:
            if condition in size:
                r = size[condition]
                # the trainer's target is the loaded one; quiet is printed for comparison
                print(f"  {name} {condition}: {target('speed', r['speed'])},"
                      f" {target('cpu', r['cpu'])}, " + (target("trainer", r["trainer"])
                      if condition == "loaded" else f"trainer {r['trainer']:.2f}"))
        if "loaded_over_quiet" in size:
            print(f"  {name}: {target('loaded_over_quiet', size['loaded_over_quiet'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.raw_worker:
        return raw_worker(Path(args.root), args.ckpt, args.slot, args.slots, RAW_TIMEOUT)
    if args.trainer_worker:
        return trainer_worker(args.matmuls)
    sizes = args.sizes.split(",")
    matmuls = calibrate()
    header: dict[str, Any] = {
        **machine(), "nodes": NODES, "files": args.files, "repeat": args.repeat, "dir": args.dir,
        "agent_nice": args.nice, "agent_sched": args.sched, "agent_cpus": args.cpus,
        "stage_lease": args.lease == "true",
        "file_sizes": {s: part_sizes(parse_size(s, "--sizes"), args.files) for s in sizes},
        "matmuls_per_step": matmuls, "burners": BURNERS, "slot": Peer().slot,
        "slots": Peer().slots,
        "nolocal": os.environ.get("MPIR_CVAR_NOLOCAL", "")}
    print(f"{NODES} nodes x {sizes} per node in {args.files} files under {args.dir};"
          f" trainer step {matmuls} x {MATRIX}^2 matmul; load {header['load']:.1f};"
          f" MPIR_CVAR_NOLOCAL={header['nolocal']!r}", flush=True)
    results: dict[str, dict[str, Any]] = {name: {} for name in sizes}
    for condition in args.conditions.split(","):
        for name, summary_ in condition_run(args, condition, sizes, matmuls).items():
            results[name][condition] = summary_
    table = ratios(results)
    report(results, table)
    everything = {**header, "results": results, "ratios": table}
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1) + "\n")
    print(json.dumps(everything))
    return 0


if __name__ == "__main__":
    sys.exit(main())
