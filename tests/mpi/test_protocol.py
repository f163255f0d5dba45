"""MPI pieces on several ranks: `mpiexec -n 4 python -m pytest --with-mpi tests/mpi`.

Every assertion that depends on other ranks is agreed first (allreduce of a flag), so a
failure on one rank fails the test on all of them instead of hanging the others.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from support import virtual_nodes_config

from cachex_agent.collective import agree, arrive
from cachex_agent.config import load
from cachex_agent.errors import CachexError, ConfigError, OperationError
from cachex_agent.topology import place_in

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.timeout(120)]


def all_ok(comm, ok: bool) -> bool:
    from mpi4py import MPI
    return comm.allreduce(bool(ok), op=MPI.LAND)


def test_a_failing_rank_fails_every_rank_with_its_name():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD

    def step():
        if comm.rank == 1:
            raise ConfigError("paths.pfs: /x: no such directory")
        return comm.rank
    with pytest.raises(ConfigError) as caught:
        agree(comm, "start-up", step)
    assert "rank 1" in str(caught.value) and "/x" in str(caught.value)
    assert agree(comm, "fine", lambda: comm.rank * 2) == comm.rank * 2


def test_the_same_error_on_every_rank_is_said_once():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD

    def step():
        raise ConfigError("peer.slot: too big" if comm.rank != 2 else "peer.slot: other")
    with pytest.raises(ConfigError) as caught:
        agree(comm, "memory check", step)
    message = str(caught.value)
    assert message.count("peer.slot: too big") == 1, message
    if comm.size == 4:
        assert message == ("memory check failed on 4 of 4 agents: ranks 0-1,3:"
                           " peer.slot: too big; rank 2: peer.slot: other")


def test_an_unexpected_error_on_one_rank_fails_every_rank_naming_it():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD

    def step():
        if comm.rank == 1:
            return {}["missing"]        # a bug, not a CachexError
        return comm.rank
    with pytest.raises(CachexError) as caught:
        agree(comm, "peer set-up", step, timeout=30)
    assert "rank 1: KeyError: 'missing'" in str(caught.value)


def test_arrive_names_a_rank_that_never_comes():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    raised = ""
    if comm.rank != 1:              # rank 1 is stuck elsewhere
        with pytest.raises(OperationError) as caught:
            arrive(comm, "recovery plan", 2.0)
        raised = str(caught.value)
    comm.barrier()
    expected = "recovery plan: rank 1 did not arrive within 2s"
    assert all_ok(comm, comm.rank == 1 or raised == expected), raised
    arrive(comm, "recovery totals", 30.0)     # everyone here: passes


def test_placement_by_rank_and_by_host():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    placement = place_in(comm, "rank")
    assert (placement.node, placement.nodes) == (comm.rank, comm.size)
    with pytest.raises(ConfigError, match="agents on host"):
        place_in(comm, "node")          # all ranks share this host: one agent per node


def write_config(root: Path, extra: str = "") -> Path:
    path = root / f"cachex-{os.getpid()}.toml"      # one per rank: no rank reads a torn one
    path.write_text(virtual_nodes_config(root, "m", f'''[commit]
rule = "dcp"
scan = "0.5s"
[agent]
timeout = "20s"
{extra}'''))
    return path


def trainer_thread(root: Path, rank: int, size: int, steps: list[str]) -> None:
    """What a trainer does: shards on every node, `.metadata` last on node 0."""
    for step in steps:
        shard = root / f"node{rank}" / "spool" / step / f"__{rank}_0.distcp"
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_bytes(bytes([rank]) * (100_000 + rank) + step.encode())
        if rank == 0:
            shards = [root / f"node{r}" / "spool" / step / f"__{r}_0.distcp" for r in range(size)]
            deadline = time.monotonic() + 30
            while not all(s.exists() for s in shards) and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.1)                 # the other ranks close their files
            (shard.parent / ".metadata").write_text(json.dumps({"step": step}))


def stop_when_flushed(root: Path, steps: list[str]) -> None:
    index = root / "pfs" / "m" / "index.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            rows = json.loads(index.read_text())["checkpoints"]
            if {r["id"] for r in rows if r["state"] == "valid"} >= set(steps):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    (root / "pfs" / "m" / "control").mkdir(parents=True, exist_ok=True)
    (root / "pfs" / "m" / "control" / "stop").write_text("{}")


def test_agents_commit_capture_and_flush_together(mpi_tmp_path):
    from mpi4py import MPI

    from cachex_agent.agent import Agent
    from cachex_agent.rules import quiescence
    comm = MPI.COMM_WORLD
    root = mpi_tmp_path
    for rank in range(comm.size):
        (root / f"node{rank}" / "spool").mkdir(parents=True, exist_ok=True)
    (root / "pfs").mkdir(exist_ok=True)
    config = load(write_config(root), environ={})
    comm.Barrier()
    agent = Agent(config, comm)
    # this job's agents on this host are known non-writers: the writer check skips them
    skipped = set(quiescence._skipped)
    quiescence.skip_processes([])
    everyone = {str(pid) for pid in comm.allgather(os.getpid())}
    # MPIR_CVAR_NOLOCAL: MPI treats every rank as another host's, and so does the agent
    local = {str(os.getpid())} if os.environ.get("MPIR_CVAR_NOLOCAL") == "1" else everyone
    assert all_ok(comm, skipped == local), skipped
    steps = ["step_00001", "step_00002"]
    threads = [threading.Thread(target=trainer_thread, args=(root, comm.rank, comm.size, steps))]
    if comm.rank == 0:
        threads.append(threading.Thread(target=stop_when_flushed, args=(root, steps)))
    for thread in threads:
        thread.start()
    code = agent.run()              # returns once the coordinator says exit
    for thread in threads:
        thread.join(30)
    gm = json.loads((root / "pfs/m/ckpt/step_00002/manifest.json").read_text())
    ok = (code == 0 and len(gm["nodes"]) == comm.size and gm["global_files"] == [".metadata"]
          and {f["path"] for f in gm["files"] if f["node"] == comm.rank} >= {
              f"__{comm.rank}_0.distcp"})
    assert all_ok(comm, ok), gm
    journal = json.loads((root / f"node{comm.rank}/nvme/m/journal/state.json").read_text())
    stages = journal["ckpts"]["step_00002"]["stages"]
    assert all_ok(comm, stages["capture"] == "done" and stages["commit"] == "done"), stages


def test_bad_directory_on_one_rank_is_a_config_error_everywhere(mpi_tmp_path):
    from mpi4py import MPI

    from cachex_agent.agent import Agent
    comm = MPI.COMM_WORLD
    root = mpi_tmp_path
    (root / "pfs").mkdir(exist_ok=True)
    for rank in range(comm.size):
        if rank != comm.size - 1:       # the last node's spool parent is missing
            (root / f"node{rank}").mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    config = load(write_config(root), environ={})
    with pytest.raises(CachexError) as caught:
        Agent(config, comm)
    assert caught.value.exit_code == 2
    assert f"rank {comm.size - 1}" in str(caught.value) and "paths.spool" in str(caught.value)
