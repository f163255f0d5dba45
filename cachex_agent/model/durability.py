"""When a checkpoint is durable, and how much work a failure loses.

A level holds for the checkpoint when it holds on all N nodes: with per-node time
distribution F, the checkpoint's is F_D(t) = F(t)^N, and its q-quantile is
t_q = F^-1(q^(1/N)). With checkpoint period T and time to durability D (survival
S(t) = 1 - F_D(t)), the expected work lost to a failure at a uniformly random time is

    E[L] = T/2 + sum_{j>=1} integral_0^T prod_{i=0}^{j-1} S(u + iT) du

which is T/2 + E[D] when D < T always.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Cdf = Callable[[np.ndarray], np.ndarray]
Ppf = Callable[[np.ndarray], np.ndarray]


def quantile_of_max(ppf: Ppf, q: float | np.ndarray, nodes: int) -> float | np.ndarray:
    """The q-quantile (or quantiles) of the largest of `nodes` independent durations."""
    probabilities = np.asarray(q, dtype=float)
    if np.any((probabilities <= 0) | (probabilities >= 1)) or nodes < 1:
        raise ValueError(f"need 0 < q < 1 and nodes >= 1, got q={q}, nodes={nodes}")
    out = np.asarray(ppf(probabilities ** (1.0 / nodes)), dtype=float)
    return float(out) if out.ndim == 0 else out


def cdf_of_max(cdf: Cdf, t: np.ndarray, nodes: int) -> np.ndarray:
    return np.asarray(cdf(np.asarray(t, dtype=float))) ** nodes


def expected_lost_work(survival: Callable[[np.ndarray], np.ndarray], period: float,
                       points: int = 2000, tol: float = 1e-9, max_terms: int = 10_000
                       ) -> float:
    """E[L] for a failure at a uniform time, checkpoints every `period` seconds.

    Term j is the chance that the j most recent checkpoints are all still not durable,
    integrated over the failure's phase u in [0, T) (trapezoid rule on `points`)."""
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    u = np.linspace(0.0, period, points)
    product = np.ones_like(u)
    total = period / 2.0
    for i in range(max_terms):
        product = product * np.asarray(survival(u + i * period))
        term = float(np.trapezoid(product, u))
        total += term
        if term < tol * period:
            break
    return total


def exact_lost_work(samples: np.ndarray, period: float) -> float:
    """E[L] as expected_lost_work, for D given by samples, without the trapezoid's error.

    With the samples' survival S, each product of S(u + iT) is a step function of the
    phase u, constant between the points D_k - iT: summed exactly over those pieces. An
    optimum over T is where W is flat, and the trapezoid's error, which moves with T as
    D's steps cross its grid, would move it by percents."""
    if period <= 0:
        raise ValueError(f"period must be > 0, got {period}")
    ordered = np.sort(np.asarray(samples, dtype=float))
    terms = int(ordered[-1] // period) + 1         # beyond, S(u + iT) = 0 on all of [0, T)
    cuts = (ordered[:, None] - period * np.arange(terms)[None, :]).ravel()
    edges = np.unique(np.concatenate([[0.0, period], cuts[(cuts > 0) & (cuts < period)]]))
    middle, width = (edges[:-1] + edges[1:]) / 2, np.diff(edges)
    product = np.ones_like(middle)
    total = period / 2.0
    for i in range(terms):
        product = product * (1.0 - np.searchsorted(ordered, middle + i * period, side="right")
                             / ordered.size)
        total += float(np.sum(product * width))
    return total
