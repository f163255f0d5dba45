"""What waiting for an MPI message costs in CPU: a thread blocked in `recv` against the
agent's way (an Iprobe every PEER_TICK, sleeping in between), over the same wall time.

Two ranks; rank 0 waits, rank 1 sends once the time is up. Rank 0's process CPU share
over --seconds, alternating the two kinds --repeat times:

  blocked   a second thread in `comm.recv` (MPI_THREAD_MULTIPLE) while the main thread
            sleeps: how MPICH waits (it polls its progress engine; no sleep)
  tick      the main thread: Iprobe, then sleep PEER_TICK, until the message is there

The ratio printed last is blocked / tick: how many times dearer a thread parked in MPI is
than the agent's 1 ms poll, on this machine in this run.

    mpiexec -n 2 python benchmarks/mpi_wait.py [--seconds 3] [--repeat 2] [--json FILE]

Run it also with MPIR_CVAR_NOLOCAL=1 in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cachex_agent.agent import PEER_TICK

TAG = 41


def blocked(comm: Any, seconds: float) -> float:
    """Rank 0's CPU share while a thread waits in recv for `seconds`."""
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(comm.recv(source=1, tag=TAG)))
    cpu, wall = time.process_time(), time.monotonic()
    thread.start()
    time.sleep(seconds)
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    comm.send("go", dest=1, tag=TAG + 1)
    thread.join(60)
    if thread.is_alive() or not got:
        raise RuntimeError("the message never came")
    return share


def tick(comm: Any, seconds: float) -> float:
    from mpi4py import MPI
    cpu, wall = time.process_time(), time.monotonic()
    while time.monotonic() - wall < seconds:
        comm.iprobe(source=1, tag=TAG, status=MPI.Status())
        time.sleep(PEER_TICK)
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    comm.send("go", dest=1, tag=TAG + 1)
    comm.recv(source=1, tag=TAG)
    return share


def answer(comm: Any) -> None:
    """Rank 1: send once rank 0's time is up, polling every 10 ms meanwhile (a rank 1
    blocked in recv would spin too, and take CPU from the rank measured)."""
    from mpi4py import MPI
    while not comm.iprobe(source=0, tag=TAG + 1, status=MPI.Status()):
        time.sleep(0.01)
    comm.recv(source=0, tag=TAG + 1)
    comm.send("x", dest=0, tag=TAG)


def main() -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if comm.size != 2:
        print("run on 2 ranks: mpiexec -n 2 python benchmarks/mpi_wait.py", file=sys.stderr)
        return 2
    kinds = {"blocked": blocked, "tick": tick}
    shares: dict[str, list[float]] = {k: [] for k in kinds}
    load = os.getloadavg()[0]
    for repeat in range(args.repeat):
        order = list(kinds) if repeat % 2 == 0 else list(reversed(kinds))
        for kind in order:
            comm.Barrier()
            if comm.rank == 0:
                shares[kind].append(kinds[kind](comm, args.seconds))
            else:
                answer(comm)
    if comm.rank == 0:
        median = {k: statistics.median(v) for k, v in shares.items()}
        thread = MPI.Query_thread()
        print(f"load {load:.1f}, thread level {thread}"
              f" (MULTIPLE={MPI.THREAD_MULTIPLE}),"
              f" MPIR_CVAR_NOLOCAL={os.environ.get('MPIR_CVAR_NOLOCAL', '')!r}")
        for kind, values in shares.items():
            print(f"  {kind:8s} {100 * median[kind]:6.2f}% of a core"
                  f" ({', '.join(f'{100 * v:.2f}' for v in values)})")
        ratio = median["blocked"] / median["tick"] if median["tick"] else float("inf")
        print(f"ratio blocked / tick: {ratio:.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d"), "load": load, "shares": shares,
                 "ratio": ratio, "nolocal": os.environ.get("MPIR_CVAR_NOLOCAL", "")},
                indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
