"""Collective steps fail together: every rank raises the same error naming the ranks.

`agree` turns one rank's failure (of any type: a bug is a failure too) into the same
error on every rank instead of a hang in the others' next collective. `arrive` bounds
the wait for the others before a blocking collective: a rank that never comes (dead,
stuck) fails the step with its rank named instead of blocking every other rank forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import CachexError, ConfigError, OperationError
from .messages import Tag

T = TypeVar("T")
_POLL = 0.001


def agree(comm, step: str, action: Callable[[], T],  # noqa: ANN001 (mpi4py comm)
          timeout: float | None = None) -> T:
    """Run `action` on every rank; if any rank fails, all raise one error listing them.
    With `timeout`, the agreement waits at most that long for the slowest rank."""
    result: T | None = None
    failure = None
    try:
        result = action()
    except Exception as exc:        # noqa: BLE001 (every rank must hear of any failure)
        failure = _failure(exc)
    if timeout is not None:
        arrive(comm, step, timeout)
    # a count first (a reduction: a few bytes a rank), the list of N only on a failure
    if not comm.allreduce(int(failure is not None)):
        return result  # type: ignore[return-value]
    failures = [(rank, f) for rank, f in enumerate(comm.allgather(failure)) if f]
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


def _failure(exc: Exception) -> tuple[str, str, int]:
    if isinstance(exc, CachexError):
        return (type(exc).__name__, str(exc), exc.exit_code)
    # an unexpected type: its name says where to look (a bug, not bad input)
    return (type(exc).__name__, f"{type(exc).__name__}: {exc}", 1)


def arrive(comm: Any, step: str, timeout: float) -> None:
    """A barrier that gives up after `timeout` seconds, naming the ranks that never came.

    Every rank tells rank 0 it arrived; rank 0 answers everyone once all arrived, or,
    at its deadline, answers the ranks present with the list of those missing. Ranks
    other than 0 wait a little longer than rank 0 does, so they hear its answer."""
    if comm.Get_size() == 1:
        return
    if comm.Get_rank() == 0:
        _gather_arrivals(comm, step, timeout)
    else:
        _report_arrival(comm, step, timeout)


def _gather_arrivals(comm: Any, step: str, timeout: float) -> None:
    pending = {rank: comm.irecv(source=rank, tag=Tag.ARRIVE) for rank in range(1, comm.Get_size())}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for rank, request in list(pending.items()):
            done, _msg = request.test()
            if done:
                del pending[rank]
        if pending:
            time.sleep(_POLL)
    missing = sorted(pending)
    for request in pending.values():
        request.Cancel()
    answer = {"step": step, "missing": missing}
    sends = [comm.isend(answer, dest=rank, tag=Tag.ARRIVE)
             for rank in range(1, comm.Get_size()) if rank not in pending]
    _wait_all(sends, timeout)
    if missing:
        raise OperationError(_missing_text(step, missing, timeout))


def _report_arrival(comm: Any, step: str, timeout: float) -> None:
    sent = comm.isend({"step": step}, dest=0, tag=Tag.ARRIVE)
    request = comm.irecv(source=0, tag=Tag.ARRIVE)
    deadline = time.monotonic() + 2 * timeout
    while time.monotonic() < deadline:
        done, answer = request.test()
        if done:
            _wait_all([sent], timeout)      # rank 0 answered: it has the arrival
            if answer["missing"]:
                raise OperationError(_missing_text(step, answer["missing"], timeout))
            return
        time.sleep(_POLL)
    request.Cancel()
    raise OperationError(f"{step}: rank 0 did not answer within {2 * timeout:.0f}s")


def _missing_text(step: str, missing: list[int], timeout: float) -> str:
    ranks = ", ".join(map(str, missing))
    return f"{step}: rank{'s' if len(missing) > 1 else ''} {ranks} did not arrive within" \
           f" {timeout:.0f}s"


def _wait_all(requests: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while requests and time.monotonic() < deadline:
        requests = [r for r in requests if not r.Test()]
        if requests:
            time.sleep(_POLL)


def wait(request: Any, timeout: float, name: str) -> None:
    """Test in a tight loop first (a chunk takes milliseconds, and the progress of a
    shared-memory transfer happens inside these calls), then poll gently."""
    deadline = time.monotonic() + timeout
    spins = 0
    while not request.Test():
        spins += 1
        if spins > 20000:
            if time.monotonic() > deadline:
                request.Cancel()
                raise OperationError(f"{name} did not answer within {timeout:.0f}s")
            time.sleep(0.0002)
