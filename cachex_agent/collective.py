"""Collective steps fail together: every rank raises the same error naming the ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .errors import CachexError, ConfigError

T = TypeVar("T")


def agree(comm, step: str, action: Callable[[], T]) -> T:  # noqa: ANN001 (mpi4py comm)
    """Run `action` on every rank; if any rank fails, all raise one error listing them."""
    result: T | None = None
    failure = None
    try:
        result = action()
    except CachexError as exc:
        failure = (type(exc).__name__, str(exc), exc.exit_code)
    failures = [(rank, f) for rank, f in enumerate(comm.allgather(failure)) if f]
    if not failures:
        return result  # type: ignore[return-value]
    code = max(f[2] for _, f in failures)
    by_text: dict[str, list[int]] = {}      # the same error on many agents is said once
    for rank, f in failures:
        by_text.setdefault(f[1], []).append(rank)
    text = "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in by_text.items())
    error = ConfigError if code == 2 else CachexError
    raise error(f"{step} failed on {len(failures)} of {comm.Get_size()} agents: {text}"
                if comm.Get_size() > 1 else failures[0][1][1])


def _ranks(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0-2,5`: runs of consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    spans = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {spans}" if len(ranks) == 1 else f"ranks {spans}"
