"""Which node an agent speaks for.

Failure domain `node`: one agent per hostname, node index = position of the hostname in
the sorted list of hosts. `rank`: every agent is its own node (node = rank), which is how
tests and the demo simulate many nodes on one machine. `regex:`/`file:` site mappings
group nodes into larger domains for partner choice (peer replication); the node index is
still one per host.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Topology

# What launchers (MPICH hydra, Open MPI, srun) tell each process before MPI starts
_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _launcher_number(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return default


def launch_rank() -> int:
    """This process's rank as its launcher numbered it, known before MPI starts (0 alone):
    an error every agent finds alike is then reported once, by rank 0."""
    return _launcher_number(_RANK_VARS, 0)


def agents_on_host() -> int:
    """How many agents the launcher started on this host; 1 when it does not say (srun:
    one agent per node is the rule)."""
    return max(_launcher_number(_LOCAL_SIZE_VARS, 1), 1)


def launched_size(env: dict[str, str] | None = None) -> tuple[int, str] | None:
    """How many agents the launcher started, and who says so; None when nobody does.

    An MPI launcher (Hydra sets MPI_LOCALNRANKS, Open MPI OMPI_COMM_WORLD_SIZE) forms the
    job itself: its size is the one to match (its ranks inherit the `SLURM_STEP_*` of the
    helper step it ran them in, which counts proxies, not ranks). A task started by srun
    itself is one of SLURM_STEP_NUM_TASKS; PMI_SIZE is what srun's PMI plugin says."""
    env = os.environ if env is None else env
    if "MPI_LOCALNRANKS" in env or "OMPI_COMM_WORLD_SIZE" in env:
        names: tuple[str, ...] = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
    else:
        names = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE")
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name]), name
    return None


def check_one_job(world: int, env: dict[str, str] | None = None) -> None:
    """ConfigError when MPI formed fewer or more agents than the launcher started: a PMI
    mismatch (e.g. `srun --mpi=` not matching mpi4py's MPI) starts every agent alone,
    each its own coordinator of the same run."""
    launched = launched_size(env)
    if launched is not None and launched[0] != world:
        count, name = launched
        raise ConfigError(f"MPI formed a job of {world} agent{'s' if world != 1 else ''} but"
                          f" the launcher started {count} ({name}={count}): the agents are"
                          " not one MPI job; use the `srun --mpi=` plugin (or mpiexec) of"
                          " the MPI that mpi4py was built with")


@dataclass(frozen=True)
class Placement:
    rank: int
    node: int
    host: str
    nodes: int
    hosts: tuple[str, ...]      # host of every node, by node index


def place(domain: str, rank: int, hosts_by_rank: list[str]) -> Placement:
    """Pure: the placement of `rank`, given every rank's hostname."""
    host = hosts_by_rank[rank]
    if domain == "rank":
        return Placement(rank, rank, host, len(hosts_by_rank), tuple(hosts_by_rank))
    unique = sorted(set(hosts_by_rank))
    if len(unique) != len(hosts_by_rank):
        crowded = next(h for h in unique if hosts_by_rank.count(h) > 1)
        raise ConfigError(f"topology.domain: {hosts_by_rank.count(crowded)} agents on host"
                          f" {crowded}; run one agent per node (srun --ntasks-per-node=1), or"
                          " set topology.domain = \"rank\" to simulate nodes on one machine")
    return Placement(rank, unique.index(host), host, len(unique), tuple(unique))


def check_nodes(placement: Placement, exclude: tuple[str, ...], min_nodes: int) -> None:
    """ConfigError when an agent runs on an excluded node or there are too few nodes.
    Pure on what every agent knows alike (all hosts), so all refuse together."""
    banned = sorted({h for h in placement.hosts if h in exclude})
    if banned:
        raise ConfigError(f"topology.exclude: node{'s' if len(banned) > 1 else ''}"
                          f" {', '.join(banned)} must never be used, but an agent was started"
                          " there; leave it out of the job (srun --exclude, or the template's"
                          " EXCLUDE_NODES)")
    if placement.nodes < min_nodes:
        raise ConfigError(f"topology.min_nodes: {placement.nodes} node"
                          f"{'s' if placement.nodes != 1 else ''}, fewer than the"
                          f" {min_nodes} needed to go on")


def place_in(comm, domain: str) -> Placement:  # noqa: ANN001 (mpi4py communicator)
    """Collective over `comm`: every rank learns its placement."""
    hosts = comm.allgather(socket.gethostname())
    return place(domain, comm.Get_rank(), hosts)


def place_checked(comm, topology: Topology) -> Placement:  # noqa: ANN001 (mpi4py communicator)
    """`place_in`, checked against the nodes never to use and the fewest to go on with."""
    placement = place_in(comm, topology.domain)
    check_nodes(placement, topology.exclude, topology.min_nodes)
    return placement
