"""Failure rates per kind, each with where it comes from and how sure it is.

Three kinds, as in plan.py: a trainer crash, a node loss, the loss of the allocation.
Two sources:

- configuration: `model.crash_rate`, `model.job_rate` (per hour) and `model.node_rate`
  (per node-hour, i.e. 1 / the node MTBF); the built-in value is the site default;
- the run's own history on the PFS: the failures the job recorded at each relaunch
  (`<pfs>/<run>/failures.jsonl`, `cachex advise --record`), drills left out, over the hours
  the agents ran (each agent's own clock, from its events).

They are combined as a Gamma-Poisson update: the configured rate is a prior worth
PRIOR_FAILURES failures, i.e. Gamma(shape w, rate w / lambda0); k failures in E hours give
Gamma(w + k, w / lambda0 + E). Its mean is the rate used, its 5% and 95% quantiles the
interval shown. With no history the interval is the prior's: wide, and said to be.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Model as ModelConfig
from ..errors import ConfigError, OperationError
from ..fsutil import fsync_dir, makedirs
from .history import node_streams

KINDS = ("crash", "node", "job")
KEYS = {"crash": "model.crash_rate", "node": "model.node_rate", "job": "model.job_rate"}
FAILURES_FILE = "failures.jsonl"
PRIOR_FAILURES = 1.0        # the configured rate weighs as much as one observed failure
LEVEL = {"crash": "captured", "node": "replicated", "job": "flushed"}


@dataclass(frozen=True)
class KindRate:
    kind: str
    configured: float           # per hour (crash, job) or per node-hour (node)
    default: bool               # the configured value is the built-in one
    failures: int               # recorded in the run's history, drills excluded
    drills: int
    exposure: float             # hours (node-hours for node) the history covers
    rate: float                 # combined, same unit as `configured`
    low: float                  # 90% interval
    high: float

    @property
    def unit(self) -> str:
        return "per node-hour" if self.kind == "node" else "per hour"

    @property
    def from_defaults_only(self) -> bool:
        return self.default and self.failures == 0

    def source(self) -> str:
        where = "site default" if self.default else "configured"
        mtbf = (f", MTBF {1 / self.configured:.3g} h" if self.kind == "node" and self.configured
                else "")
        hours = "node-hours" if self.kind == "node" else "h"
        drills = f", {self.drills} drill(s) excluded" if self.drills else ""
        return (f"{where} {KEYS[self.kind]} = {self.configured:g} {self.unit}{mtbf};"
                f" history {self.failures} in {self.exposure:.3g} {hours}{drills}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "unit": self.unit, "rate": self.rate, "low": self.low,
                "high": self.high, "configured": self.configured, "default": self.default,
                "key": KEYS[self.kind], "failures": self.failures, "drills": self.drills,
                "exposure": self.exposure, "protected_by": LEVEL[self.kind]}


@dataclass(frozen=True)
class Exposure:
    hours: float                # the longest any one agent ran, summed over its starts
    node_hours: float           # every agent's, summed


def combine(kind: str, configured: float, default: bool, failures: int, drills: int,
            exposure: float) -> KindRate:
    """The Gamma-Poisson update of the configured rate by the history."""
    from scipy import stats
    shape = failures + (PRIOR_FAILURES if configured > 0 else 0.0)
    rate = (PRIOR_FAILURES / configured if configured > 0 else 0.0) + exposure
    if shape == 0 or rate == 0:
        return KindRate(kind, configured, default, failures, drills, exposure, 0.0, 0.0, 0.0)
    low, high = stats.gamma.ppf([0.05, 0.95], shape, scale=1.0 / rate)
    return KindRate(kind, configured, default, failures, drills, exposure, shape / rate,
                    float(low), float(high))


def failure_rates(model: ModelConfig, records: Sequence[dict[str, Any]], exposure: Exposure
                  ) -> dict[str, KindRate]:
    defaults = ModelConfig()
    out = {}
    for kind in KINDS:
        key = KEYS[kind].split(".")[1]
        mine = [r for r in records if r["kind"] == kind]
        lost = sum(int(r.get("lost", 1)) for r in mine if not r.get("drill"))
        out[kind] = combine(kind, getattr(model, key), getattr(model, key) ==
                            getattr(defaults, key), lost, sum(bool(r.get("drill")) for r in mine),
                            exposure.node_hours if kind == "node" else exposure.hours)
    return out


def exposure(files: Iterable[Path]) -> Exposure:
    """Hours the agents ran, from each agent's own events (its clock only): a stream
    split at each `agent_start`, each piece from its first event to its last."""
    spans = []
    for records in node_streams(files):
        total, start, last = 0.0, None, None
        for rec in records:
            t = float(rec.get("t", 0.0))
            if rec.get("event") == "agent_start" or start is None:
                total += (last - start) if start is not None and last is not None else 0.0
                start = t
            last = t
        if start is not None and last is not None:
            total += last - start
        spans.append(total / 3600.0)
    return Exposure(max(spans, default=0.0), sum(spans))


# ------------------------------------------------------------ the recorded failures
def failures_path(pfs_run: Path) -> Path:
    return pfs_run / FAILURES_FILE


def read_failures(path: Path) -> list[dict[str, Any]]:
    """The recorded failures; a line that is not one (torn, edited) is an error naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise OperationError(f"{path}: {exc.strerror}") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            valid = rec.get("kind") in KINDS and int(rec.get("lost", 1)) >= 0
        except (ValueError, TypeError, AttributeError):
            valid = False
        if not valid:
            raise OperationError(f"{path}:{number}: not a failure record ({line[:60]!r})")
        out.append(rec)
    return out


def record_failure(path: Path, kind: str, lost: int, drill: bool) -> None:
    """Append one failure durably (fsync the file, and the directory when new)."""
    if kind not in KINDS:
        raise ConfigError(f"--record: {kind!r} is not one of {', '.join(KINDS)}")
    if lost < 0:
        raise ConfigError(f"--lost: {lost} is negative")
    new = not path.exists()
    makedirs(path.parent)
    line = json.dumps({"kind": kind, "lost": lost, "drill": drill}, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())     # one short write: O_APPEND keeps it whole
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(path.parent)
