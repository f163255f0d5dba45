"""Stage-duration distributions: fit log-normal, gamma and Weibull, compare by AIC/BIC.

Pure numerics (numpy, scipy); the data are positive durations in seconds (or
bandwidths) taken from the agents' events. Each fit reports its log-likelihood, AIC,
BIC and the Kolmogorov-Smirnov distance as the goodness of fit.

scipy is imported on first use, not with the module: it is the `[model]` extra, and
importing it costs seconds per agent start (2.3 of 3.6 s here), times every node.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OperationError

FAMILIES = ("lognormal", "gamma", "weibull")


@dataclass(frozen=True)
class Fit:
    family: str
    params: tuple[float, ...]       # lognormal (mu, sigma); gamma (k, theta); weibull (k, lam)
    n: int
    loglik: float

    @property
    def aic(self) -> float:
        return 2 * len(self.params) - 2 * self.loglik

    @property
    def bic(self) -> float:
        return len(self.params) * math.log(self.n) - 2 * self.loglik

    @property
    def frozen(self) -> Any:
        """The scipy.stats frozen distribution (for plots: building one costs about a
        millisecond, its docstrings; the methods below call the family directly)."""
        family, args = self._family()
        return family(*args[:-1], scale=args[-1])

    def _family(self) -> tuple[Any, tuple[float, ...]]:
        """The scipy.stats family and its (shape, scale)."""
        stats = scipy_module("stats")
        a, b = self.params
        if self.family == "lognormal":
            return stats.lognorm, (b, math.exp(a))
        if self.family == "gamma":
            return stats.gamma, (a, b)
        return stats.weibull_min, (a, b)

    def _call(self, method: str, x: Any) -> Any:
        family, (shape, scale) = self._family()
        return getattr(family, method)(x, shape, scale=scale)

    def cdf(self, t: float | np.ndarray) -> float | np.ndarray:
        return self._call("cdf", t)

    def sf(self, t: float | np.ndarray) -> float | np.ndarray:
        return self._call("sf", t)

    def ppf(self, q: float | np.ndarray) -> float | np.ndarray:
        return self._call("ppf", q)

    def logpdf(self, x: np.ndarray) -> np.ndarray:
        return self._call("logpdf", x)

    def mean(self) -> float:
        family, (shape, scale) = self._family()
        return float(family.mean(shape, scale=scale))

    def ks(self, data: np.ndarray) -> float:
        """Kolmogorov-Smirnov distance between the fit and the data."""
        return float(scipy_module("stats").kstest(data, self.cdf).statistic)


def fit(data: np.ndarray | list[float], family: str) -> Fit:
    """Maximum-likelihood fit of one family to positive data (location fixed at 0)."""
    x = _positive(data)
    if family == "lognormal":
        logs = np.log(x)
        mu, sigma = float(logs.mean()), float(logs.std())      # closed-form MLE
        params: tuple[float, ...] = (mu, max(sigma, 1e-12))
    elif family == "gamma":
        k, _loc, theta = scipy_module("stats").gamma.fit(x, floc=0)
        params = (float(k), float(theta))
    elif family == "weibull":
        k, _loc, lam = scipy_module("stats").weibull_min.fit(x, floc=0)
        params = (float(k), float(lam))
    else:
        raise OperationError(f"unknown distribution family {family!r} (known: {FAMILIES})")
    shell = Fit(family, params, len(x), 0.0)
    return Fit(family, params, len(x), float(np.sum(shell.logpdf(x))))


def best_fit(data: np.ndarray | list[float], criterion: str = "aic") -> list[Fit]:
    """Every family, best first by `criterion` (aic or bic)."""
    fits = [fit(data, family) for family in FAMILIES]
    return sorted(fits, key=lambda f: getattr(f, criterion))


def _positive(data: np.ndarray | list[float]) -> np.ndarray:
    x = np.asarray(data, dtype=float)
    if x.size < 3:
        raise OperationError(f"need at least 3 observations to fit, got {x.size}")
    if np.any(x <= 0) or not np.all(np.isfinite(x)):
        raise OperationError("durations must be positive and finite")
    return x


def scipy_module(name: str) -> Any:
    """`scipy.<name>`, or an OperationError saying which extra provides it."""
    try:
        return importlib.import_module(f"scipy.{name}")
    except ImportError:
        raise OperationError("the durability model needs scipy: pip install"
                             " 'cachex-agent[model]'") from None


def have_scipy() -> bool:
    return importlib.util.find_spec("scipy") is not None
