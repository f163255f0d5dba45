"""Which node an agent speaks for.

Failure domain `node`: one agent per hostname, node index = position of the hostname in
the sorted list of hosts. `rank`: every agent is its own node (node = rank), which is how
tests and the demo simulate many nodes on one machine. `regex:`/`file:` site mappings
group nodes into larger domains for partner choice (peer replication); the node index is
still one per host.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from .errors import ConfigError


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


def place_in(comm, domain: str) -> Placement:  # noqa: ANN001 (mpi4py communicator)
    """Collective over `comm`: every rank learns its placement."""
    hosts = comm.allgather(socket.gethostname())
    return place(domain, comm.Get_rank(), hosts)
