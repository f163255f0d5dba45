"""`cachex-agent --check`: the agents' start-up checks without starting, and the plan.

Run exactly as the agents will run (same launcher, same configuration): every check an
agent makes before it touches data, collectively, plus what only a dry run can say (the
MPI library each agent loaded, whether the run lock would be granted). Rank 0 prints
the plan; exit 0, or 2 with one line per failed check. Nothing is written but the
agents' own directories (created as the agents would) and a probe file in each.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .collective import agree
from .config import Config, upfront_memory
from .errors import ConfigError
from .layout import run_lock_path
from .mpi_env import NETMOD
from .node_dirs import prepare_dirs, probe_writable
from .peer.encoder import erasure_groups
from .peer.partners import replication_map
from .runlock import REFRESH, blocking_holder, stale_after
from .topology import place_checked

# what says a site MPI is installed next to the one mpi4py loaded
_SITE_MPI_VARS = ("CRAY_MPICH_DIR", "CRAY_MPICH_BASEDIR", "I_MPI_ROOT", "MPI_HOME",
                  "OMPI_HOME", "MPICH_HOME", "MVAPICH2_HOME")
_SITE_MPI_MODULES = ("cray-mpich", "openmpi", "mvapich", "impi", "intel-mpi", "mpich",
                     "hpcx")


def loaded_mpi_library() -> str:
    """The path of the libmpi this process mapped (the one mpi4py uses)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return "unknown"


def is_wheel_mpi(library: str, prefix: str = sys.prefix) -> bool:
    """A libmpi inside this Python environment came from a PyPI wheel (e.g. `mpich`)."""
    return library.startswith(os.path.realpath(prefix) + os.sep) or (
        library.startswith(prefix + os.sep))


def site_mpi_hint(env: dict[str, str] | None = None) -> str | None:
    """What says this system has an MPI of its own, or None."""
    env = os.environ if env is None else env
    for name in _SITE_MPI_VARS:
        if env.get(name):
            return f"{name}={env[name]}"
    modules = env.get("LOADEDMODULES", "")
    for module in modules.split(":"):
        if module.split("/")[0].lower().startswith(_SITE_MPI_MODULES):
            return f"module {module} is loaded"
    return None


def mpi_warning(library: str, env: dict[str, str] | None = None) -> str | None:
    """The PyPI wheel's MPI on a system that has a site MPI: it will not use the fast
    network (it goes over TCP or shared memory only)."""
    hint = site_mpi_hint(env)
    if hint is None or not is_wheel_mpi(library):
        return None
    return (f"the MPI of a PyPI wheel ({library}) runs here while the system has its own"
            f" ({hint}): replication would not use the fast network; build mpi4py against"
            " the site MPI (docs/jobs.md)")


def check(config: Config, comm: Any) -> list[str]:
    """Every check, collectively; the plan's lines on rank 0 (others: [])."""
    placement = place_checked(comm, config.topology)
    erasure_groups(comm, config, list(placement.hosts))     # as the agents, before any dir
    paths = agree(comm, "paths", lambda: prepare_dirs(config, placement))
    library = loaded_mpi_library()

    def lock_free() -> None:
        # a few refreshes tell a live holder; the agents wait out the rest of a stale one
        holder = blocking_holder(paths.pfs, stale_after(config.agent.timeout),
                                 patience=3 * REFRESH)
        if holder is not None:
            raise ConfigError(f"{run_lock_path(paths.pfs)}: {holder}")
        probe_writable(paths.pfs, "paths.pfs")
    agree(comm, "run lock", lock_free if placement.rank == 0 else lambda: None)
    mine = {"node": placement.node, "host": placement.host, "mpi": library,
            "warning": mpi_warning(library), "spool": str(paths.spool),
            "stage": str(paths.stage), "cache": str(paths.cache)}
    every = comm.gather(mine, root=0)
    if placement.rank != 0:
        return []
    return _plan(config, placement, paths, every)


def _plan(config: Config, placement: Any, paths: Any, every: list[dict[str, Any]]
          ) -> list[str]:
    pmap = replication_map(config, list(placement.hosts))
    lines = [f"run {config.run}: {placement.nodes} nodes, one agent each; coordinator on"
             f" {placement.hosts[0]}; PFS {paths.pfs} (writable, run lock free)",
             f"write path: model.path = {config.model.path}; commit rule"
             f" {config.commit.rule}; up-front memory per agent"
             f" {upfront_memory(config) / 2**20:.0f} MiB"]
    for item in sorted(every, key=lambda i: i["node"]):
        partners = pmap[item["node"]] if pmap else []
        lines.append(f"node {item['node']} on {item['host']}: spool {item['spool']}, stage"
                     f" {item['stage']}, cache {item['cache']};"
                     f" replicas to {', '.join(map(str, partners)) or 'none (flush-only)'}")
    libraries = sorted({i["mpi"] for i in every})
    netmod = os.environ.get(NETMOD)
    lines.append(f"MPI library: {', '.join(libraries)}"
                 + (f"; {NETMOD}={netmod}" if netmod else ""))
    lines += [f"warning: node {i['node']}: {i['warning']}" for i in every if i["warning"]]
    return lines
