"""Per-stage models: how long a node's part of `s` bytes takes on `N` nodes.

    t = a * N**gamma_fixed + s * N**gamma / B,    B ~ fitted (log-normal, gamma, Weibull)

`a` is the fixed cost of the stage (file creation, fsync of metadata, messages), B the
effective bandwidth, and `gamma` how much the nodes share the resource behind the stage
(0: each node has its own, as a node-local NVMe; 1: one device shared by all, as a
saturated PFS); `gamma_fixed` the same for the fixed cost (0 on separate nodes; more
where the agents share cores, as the virtual nodes of one machine do). Least squares of t
on (N**gamma_fixed, s * N**gamma) over a grid of both exponents; with a single part size
and node count `a` is 0. The exponents need samples from at least two node counts; with
one, they are 0 (a node count never seen is assumed not to change per-node bandwidth).

A loaded node is slower at every stage (a capture checksums, a flush compresses and
copies, the agents' loops poll): with the node's load per core l (the 1-minute load
average over the cores, recorded with every event), the whole time scales as

    t = (1 + beta * l) * (a * N**gamma_fixed + s * N**gamma / B)

beta is chosen on a grid as the value that leaves the least spread of log B (the part
of the times that tracks the load), and kept at 0 unless it removes a fraction R2 of
that variance with R2 >= LOAD_GAIN and an F statistic R2 / (1 - R2) * (n - 2) >= LOAD_F
(as for one regressor; about p < 0.003): on a machine whose load did not vary, or
varied without effect, the model is the one above. Predictions are at a given load,
by default the median of the samples.

Two forms of noise. In the one above (`form = "bandwidth"`) only the byte term varies:
right where moving bytes dominates, wrong where the fixed cost is most of the time and
varies as much (a loaded node's copies, checksums and polls): there the spread of B
fitted from small parts, carried to a large part by s / B, predicts it far too slow. In
the other (`form = "time"`) the whole time varies:

    t = (1 + beta * l) * (a * N**gamma_fixed + b * s * N**gamma) * e,    1/e ~ fitted

written in the same terms as the first, B = (a N^gf / b + s N^g) / t: the fixed cost as
the bytes it is worth at the per-byte cost b (weighted least squares, relative errors).
The form whose distribution gives the observed times the higher likelihood wins (the
time form pays one parameter); with one size and one node count the two are the same
and the bandwidth form is kept.

The spread of log B splits in two: a part common to every node of a checkpoint (the
PFS busy for everyone, the job's own other I/O) and a part of each node. Only the
second makes the slowest of N nodes slower than one; predictions use both (predict.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OperationError
from .distributions import FAMILIES, Fit, best_fit, fit
from .history import StageSample

MIN_SAMPLES = 3
BETAS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
LOAD_GAIN = 0.10        # fraction of var(log B) the load must explain to be kept
LOAD_F = 10.0           # and the F statistic of that fraction, for n samples
FORMS = ("bandwidth", "time")


@dataclass(frozen=True)
class StageModel:
    stage: str
    overhead: float             # a, seconds
    gamma: float
    fits: tuple[Fit, ...]       # of the effective bandwidth B (bytes/s), best first
    durations: tuple[Fit, ...]  # of the raw durations, best first (for the report)
    n: int
    ks: float                   # Kolmogorov-Smirnov distance of the chosen bandwidth fit
    mu: float = math.nan        # mean of log B
    sigma_node: float = math.nan    # spread of log B among the nodes of one checkpoint
    sigma_common: float = 0.0       # spread of log B shared by a checkpoint's nodes
    gamma_fixed: float = 0.0
    beta: float = 0.0               # time factor per unit of load per core
    load: float = 0.0               # the reference load per core (median of the samples)
    form: str = "bandwidth"         # or "time": the whole time varies, not the byte term
    per_byte: float = 0.0           # b, seconds per byte (time form)

    def factor(self, load: float | None = None) -> float:
        """How much slower than on an idle node, at `load` (default: the reference)."""
        return 1.0 + self.beta * (self.load if load is None else load)

    def fixed(self, nodes: int, load: float | None = None) -> float:
        """The part of the time that does not vary (none in the time form)."""
        if self.form == "time":
            return 0.0
        return self.overhead * nodes ** self.gamma_fixed * self.factor(load)

    @property
    def log_params(self) -> tuple[float, float, float]:
        """(mu, sigma_node, sigma_common) of log B; a model without them (hand-made or
        from an older file) takes its log-normal fit, every node independent."""
        if not math.isnan(self.mu):
            return self.mu, self.sigma_node, self.sigma_common
        lognormal = next((f for f in self.fits if f.family == "lognormal"), None)
        if lognormal is None:
            raise OperationError(f"stage {self.stage}: no log-normal fit in the model")
        return lognormal.params[0], lognormal.params[1], 0.0

    @property
    def bandwidth(self) -> Fit:
        return self.fits[0]

    def scale(self, size: float, nodes: int) -> float:
        """The bytes B divides: the part's, and in the time form the fixed cost's worth."""
        bytes_ = size * nodes ** self.gamma
        if self.form == "time":
            return bytes_ + self.overhead * nodes ** self.gamma_fixed / self.per_byte
        return bytes_

    def ppf(self, q: float | np.ndarray, size: float, nodes: int, load: float | None = None
            ) -> float | np.ndarray:
        """Quantile of one node's time (slow bandwidth = long time)."""
        variable = self.scale(size, nodes) / self.bandwidth.ppf(1.0 - np.asarray(q))
        return self.fixed(nodes, load) + self.factor(load) * variable

    def cdf(self, t: np.ndarray, size: float, nodes: int, load: float | None = None
            ) -> np.ndarray:
        over = (np.asarray(t, dtype=float) - self.fixed(nodes, load)) / self.factor(load)
        out = np.zeros_like(over)
        positive = over > 0
        # just past the fixed cost the implied bandwidth is huge: a Weibull's x**c
        # overflows to inf there and its survival is exactly 0, which is right
        with np.errstate(over="ignore"):
            out[positive] = self.bandwidth.sf(self.scale(size, nodes) / over[positive])
        return out

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "overhead": self.overhead, "gamma": self.gamma,
                "n": self.n, "ks": self.ks, "log_params": list(self.log_params),
                "gamma_fixed": self.gamma_fixed, "beta": self.beta, "load": self.load,
                "form": self.form, "per_byte": self.per_byte,
                "fits": [_fit_json(f) for f in self.fits],
                "durations": [_fit_json(f) for f in self.durations]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageModel:
        return cls(data["stage"], float(data["overhead"]), float(data["gamma"]),
                   tuple(_fit_from(f) for f in data["fits"]),
                   tuple(_fit_from(f) for f in data["durations"]), int(data["n"]),
                   float(data["ks"]), *map(float, data["log_params"]),
                   float(data.get("gamma_fixed", 0.0)), float(data.get("beta", 0.0)),
                   float(data.get("load", 0.0)), _form(data.get("form", "bandwidth")),
                   float(data.get("per_byte", 0.0)))


def fit_stage(samples: Sequence[StageSample], criterion: str = "aic",
              families: Sequence[str] = FAMILIES, forms: Sequence[str] = FORMS
              ) -> StageModel | None:
    """The stage's model from its samples, of the likelier of `forms`; None when there
    are too few."""
    if len(samples) < MIN_SAMPLES:
        return None
    size = np.array([s.bytes for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    nodes = np.array([s.nodes for s in samples], dtype=float)
    loads = np.array([np.nan if s.load is None else s.load for s in samples], dtype=float)
    beta, (overhead, gamma_fixed, gamma, bandwidth) = _load_effect(size, seconds, nodes, loads)
    form, per_byte = "bandwidth", 0.0
    t = seconds / (1.0 + beta * loads) if beta else seconds
    timed = _time_form(size, t, nodes) if "time" in forms else None
    if timed is not None:
        a, gf, g, b = timed
        speed = (a * nodes ** gf / b + size * nodes ** g) / t
        likelier = _loglik(speed, t) - 1.0 > _loglik(bandwidth, t - overhead * nodes ** gamma_fixed)
        if likelier or "bandwidth" not in forms:
            form, per_byte = "time", b
            overhead, gamma_fixed, gamma, bandwidth = a, gf, g, speed
    fits = _ranked(bandwidth, criterion, families)
    durations = _ranked(seconds, criterion, families)
    logs = np.log(bandwidth)
    sigma_node, sigma_common = _split_spread(logs, [(s.run, s.ckpt) for s in samples])
    reference = float(np.median(loads)) if beta else 0.0
    return StageModel(samples[0].stage, overhead, gamma, tuple(fits), tuple(durations),
                      len(samples), fits[0].ks(bandwidth), float(logs.mean()), sigma_node,
                      sigma_common, gamma_fixed, beta, reference, form, per_byte)


def _form(value: Any) -> str:
    if value not in FORMS:
        raise OperationError(f"unknown stage form {value!r} in the model")
    return str(value)


def _loglik(bandwidth: np.ndarray, variable: np.ndarray) -> float:
    """Log-likelihood, up to a constant both forms share, of the times whose varying
    part is `variable` = x / B with log B normal at its own mean and spread: each time's
    density is the normal density of log B over the time's varying part (the Jacobian)."""
    sigma = max(float(np.std(np.log(bandwidth))), 1e-9)
    return float(-len(bandwidth) * math.log(sigma) - np.sum(np.log(variable)))


def _time_form(size: np.ndarray, seconds: np.ndarray, nodes: np.ndarray
               ) -> tuple[float, float, float, float] | None:
    """(a, gamma_fixed, gamma, b) of t = a N^gf + b s N^g by least squares of the
    relative error over a grid of the exponents, a and b >= 0; None without two sizes
    or two node counts (then it is the bandwidth form)."""
    grid, varied = _exponents(size, nodes)
    if not varied:
        return None
    best = (math.inf, 0.0, 0.0, 0.0, 0.0)
    for gamma_fixed in grid:
        for gamma in grid:
            columns = np.column_stack([nodes ** gamma_fixed, size * nodes ** gamma])
            a, b = _nonnegative(columns / seconds[:, None], np.ones_like(seconds))
            if b <= 0:
                continue
            sse = float(np.sum((1.0 - columns @ np.array([a, b]) / seconds) ** 2))
            if sse < best[0] - 1e-15:
                best = (sse, a, float(gamma_fixed), float(gamma), b)
    return None if math.isinf(best[0]) else best[1:]


def _nonnegative(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of y on two columns with both coefficients >= 0."""
    a, b = np.linalg.lstsq(x, y, rcond=None)[0]
    if a >= 0 and b >= 0:
        return float(a), float(b)
    only_b = max(float(x[:, 1] @ y / (x[:, 1] @ x[:, 1])), 0.0)
    return 0.0, only_b


Unloaded = tuple[float, float, float, np.ndarray]      # a, gamma_fixed, gamma, B


def _load_effect(size: np.ndarray, seconds: np.ndarray, nodes: np.ndarray, loads: np.ndarray
                 ) -> tuple[float, Unloaded]:
    """beta and the fit of the times brought to an idle node, t / (1 + beta l): the beta
    of BETAS that leaves the least var(log B), if what it removes passes LOAD_GAIN and
    LOAD_F; else 0."""
    def unloaded(beta: float) -> Unloaded:
        t = seconds / (1.0 + beta * loads) if beta else seconds
        a, gamma_fixed, gamma = _overhead_and_gamma(size, t, nodes)
        return a, gamma_fixed, gamma, size * nodes ** gamma / (t - a * nodes ** gamma_fixed)
    plain = unloaded(0.0)
    if np.isnan(loads).any() or np.ptp(loads) <= 0:
        return 0.0, plain
    spread = {0.0: float(np.var(np.log(plain[3])))}
    fits = {0.0: plain}
    for beta in BETAS[1:]:
        fits[beta] = unloaded(beta)
        spread[beta] = float(np.var(np.log(fits[beta][3])))
    best = min(spread, key=lambda b: spread[b])
    explained = 1.0 - spread[best] / spread[0.0] if spread[0.0] > 0 else 0.0
    needed = max(LOAD_GAIN, LOAD_F / (LOAD_F + len(seconds) - 2))
    return (best, fits[best]) if explained >= needed else (0.0, plain)


def _split_spread(logs: np.ndarray, keys: list[tuple[str, str]]) -> tuple[float, float]:
    """Within-checkpoint (pooled) and between-checkpoint standard deviations of log B.
    Without two nodes of one checkpoint, all of it counts as the nodes' own."""
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for value, key in zip(logs, keys, strict=True):
        groups[key].append(value)
    within = [np.asarray(g) - np.mean(g) for g in groups.values() if len(g) > 1]
    dof = sum(len(w) - 1 for w in within)
    total = float(np.var(logs))
    if dof < 2:
        return math.sqrt(total), 0.0
    node = sum(float(np.sum(w * w)) for w in within) / dof
    return math.sqrt(node), math.sqrt(max(total - node, 0.0))


def _ranked(data: np.ndarray, criterion: str, families: Sequence[str]) -> list[Fit]:
    if tuple(families) == FAMILIES:
        return best_fit(data, criterion)
    return sorted((fit(data, f) for f in families), key=lambda f: getattr(f, criterion))


def _overhead_and_gamma(size: np.ndarray, seconds: np.ndarray, nodes: np.ndarray
                        ) -> tuple[float, float, float]:
    """(a, gamma_fixed, gamma): least squares of t = a N^gf + b s N^g over a grid of the
    exponents, `a` kept within [0, 0.9 min t / N^gf] so every sample keeps a positive
    bandwidth."""
    grid, varied = _exponents(size, nodes)
    best = (math.inf, 0.0, 0.0, 0.0)
    for gamma_fixed in grid:
        for gamma in grid:
            fixed, x = nodes ** gamma_fixed, size * nodes ** gamma
            a = 0.0
            if varied:
                a = float(np.linalg.lstsq(np.column_stack([fixed, x]), seconds, rcond=None)[0][0])
                a = min(max(a, 0.0), 0.9 * float(np.min(seconds / fixed)))
            b = float(np.sum((seconds - a * fixed) * x) / np.sum(x * x))
            sse = float(np.sum((seconds - a * fixed - b * x) ** 2))
            if sse < best[0] - 1e-15:
                best = (sse, a, float(gamma_fixed), float(gamma))
    return best[1], best[2], best[3]


def _exponents(size: np.ndarray, nodes: np.ndarray) -> tuple[np.ndarray, bool]:
    """The sharing exponents to try (0 alone with one node count), and whether the sizes
    or node counts vary enough to tell a fixed cost from the per-byte one."""
    varied_n = np.ptp(np.log(nodes)) > 1e-9
    varied_s = np.ptp(np.log(size)) > math.log(1.5)
    return (np.linspace(0.0, 1.0, 11) if varied_n else np.zeros(1)), varied_n or varied_s


def _fit_json(f: Fit) -> dict[str, Any]:
    return {"family": f.family, "params": list(f.params), "n": f.n, "loglik": f.loglik,
            "aic": f.aic, "bic": f.bic}


def _fit_from(data: dict[str, Any]) -> Fit:
    if data["family"] not in FAMILIES:
        raise OperationError(f"unknown distribution family {data['family']!r} in the model")
    return Fit(data["family"], tuple(float(p) for p in data["params"]), int(data["n"]),
               float(data["loglik"]))
