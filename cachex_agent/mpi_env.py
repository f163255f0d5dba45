"""The MPI environment, settled before MPI_Init.

The PyPI `mpich` wheel (MPICH 5, `ch4:ucx,ofi`) uses UCX by default. At MPI_Init the
first rank of each node publishes its UCX address through PMI as a fixed 4096 bytes,
most of them whatever memory follows UCX's real address, hex-encoded in segments of
511 bytes. Under Slurm's `--mpi=pmi2` plugin MPICH speaks the PMI-1 wire protocol, and
slurmstepd (22.05 and later) takes each PMI-1 request from one read of at most 1024
bytes. A segment of incompressible memory makes a request of about 1080 bytes: the
plugin rejects it ("value not properly terminated in client request") and MPI_Init
never returns. What follows UCX's address changes from one start to the next, so a
step hangs now and then; CI saw it in a `cachex recover` step after a node loss.
MPICH's OFI module publishes its real address (16 bytes over TCP) and stays far below
the limit; the peer tests pass on it (docs/jobs.md). A choice the user made is kept.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import MutableMapping

NETMOD = "MPIR_CVAR_CH4_NETMOD"


def wheel_mpich() -> bool:
    """The PyPI `mpich` wheel is installed, so mpi4py loads its libmpi."""
    try:
        importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def choose_netmod(environ: MutableMapping[str, str] | None = None,
                  wheel: bool | None = None) -> str | None:
    """Set MPICH's network module to OFI where UCX's address can hang MPI_Init (the
    wheel's MPICH in a Slurm step with the pmi2 plugin, the user having chosen none);
    returns a line saying so, or None when nothing was changed."""
    environ = os.environ if environ is None else environ
    if NETMOD in environ or environ.get("SLURM_MPI_TYPE") != "pmi2" \
            or "PMI_FD" not in environ:
        return None
    if not (wheel_mpich() if wheel is None else wheel):
        return None
    environ[NETMOD] = "ofi"
    return (f"{NETMOD}=ofi: the wheel's MPICH under srun --mpi=pmi2 (UCX's 4096-byte"
            " address overflows Slurm's 1024-byte PMI-1 requests; docs/jobs.md)")
