"""The coordinator's figures for the dashboards sites already run: a Prometheus text-format
file in node_exporter's textfile-collector convention (`metrics.path`, ending `.prom`,
replaced whole by a rename so the collector never reads half of one).

Every figure comes from the status the coordinator has just written (its own clock
only) and from its lanes' queues. Gauges describe now; `cachex_checkpoints_failed_total`
counts the failures this coordinator saw since it started (a counter: Prometheus takes a
restart's drop to zero as a reset). Every metric is documented in docs/commands.md.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import Config, job_id, render
from .errors import ConfigError
from .fsutil import atomic_open
from .risk import at_risk, newest_flush

LEVELS = ("written", "captured", "replicated", "flushed", "failed", "evicted", "purged")
LATENCY_LEVELS = ("captured", "replicated", "flushed")
#: read by a collector that runs as another user (node_exporter): figures, no data
MODE = 0o644

#: name -> (type, help); the order of the file
METRICS: dict[str, tuple[str, str]] = {
    "cachex_up": ("gauge", "1 while the agents run (running or draining), else 0"),
    "cachex_nodes": ("gauge", "Nodes (agents) in the run"),
    "cachex_heartbeats_total": ("counter", "Status writes of this coordinator (its heartbeat)"),
    "cachex_work_at_risk_seconds": (
        "gauge", "Training lost if `loss` came now: since the commit of the newest"
                 " checkpoint that outlives it (NaN: none does yet)"),
    "cachex_newest_checkpoint_seq": (
        "gauge", "Sequence number of the newest checkpoint that outlives `loss`"),
    "cachex_checkpoints": ("gauge", "Checkpoints in the status, by level"),
    "cachex_checkpoints_in_flight": ("gauge", "Checkpoints on their way to their last level"),
    "cachex_checkpoints_failed_total": (
        "counter", "Checkpoints that ended failed, seen by this coordinator"),
    "cachex_level_latency_seconds": (
        "gauge", "Commit to `level` of the newest checkpoint that reached it"),
    "cachex_level_bytes": ("gauge", "Size of the newest checkpoint that reached `level`"),
    "cachex_flush_bandwidth_bytes_per_second": (
        "gauge", "Bytes over capture-to-flushed of the newest flushed checkpoint"),
    "cachex_silent_nodes": (
        "gauge", "Nodes silent past agent.timeout (suspect) or taken for dead, by state"),
    "cachex_lane_pending": (
        "gauge", "Writes queued on the coordinator's lanes (pfs, journal, model)"),
    "cachex_advised_interval_seconds": (
        "gauge", "The save interval that loses least time (`cachex advise`), by `path`"
                 " (tier, or direct_to_pfs: the trainer writing to the PFS itself)"),
    "cachex_expected_waste_seconds_per_hour": (
        "gauge", "Expected time lost per hour of run (blocked saves and recomputation),"
                 " by `path` and `interval` (now, advised)"),
    "cachex_failure_rate": (
        "gauge", "Failure rate the advice uses, by `kind` (per hour; node: per node-hour)"),
}


class MetricsFile:
    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self._failed: set[str] = set()

    def text(self, status: dict[str, Any], pending: dict[str, int]) -> str:
        """The file's contents for this status and the lanes' queue depths."""
        rows = status.get("checkpoints") or []
        self._failed.update(r["id"] for r in rows if r["level"] == "failed")
        lines: list[str] = []
        for name, samples in _samples(status, rows, pending, len(self._failed)):
            kind, about = METRICS[name]
            lines += [f"# HELP {name} {about}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{self._labels(labels)} {_number(value)}"
                      for labels, value in samples]
        return "\n".join(lines) + "\n"

    def write(self, text: str) -> None:
        with atomic_open(self.path, mode=MODE) as handle:
            handle.write(text.encode())

    def _labels(self, labels: dict[str, str]) -> str:
        pairs = {"run": self.run, **labels}
        return "{" + ",".join(f'{k}="{_escaped(v)}"' for k, v in pairs.items()) + "}"


Samples = list[tuple[dict[str, str], float]]


def _samples(status: dict[str, Any], rows: list[dict[str, Any]], pending: dict[str, int],
             failed: int) -> Iterator[tuple[str, Samples]]:
    risk = at_risk({**status, "heartbeat": {**(status.get("heartbeat") or {}), "age": 0.0}})
    yield "cachex_up", [({}, float(status.get("state") in ("running", "draining")))]
    yield "cachex_nodes", [({}, status.get("nodes", 0))]
    yield "cachex_heartbeats_total", [({}, (status.get("heartbeat") or {}).get("beat", 0))]
    if risk is not None:
        losses = {"node": risk["node_loss"], "allocation": risk["allocation_end"]}
        yield "cachex_work_at_risk_seconds", [
            ({"loss": k}, math.nan if v["seconds"] is None else v["seconds"])
            for k, v in losses.items()]
        seqs = {r["id"]: r["seq"] for r in rows}
        yield "cachex_newest_checkpoint_seq", [
            ({"loss": k}, seqs[v["ckpt"]]) for k, v in losses.items() if v["ckpt"]]
        yield "cachex_checkpoints_in_flight", [({}, len(risk["in_flight"]))]
    yield "cachex_checkpoints", [
        ({"level": level}, sum(r["level"] == level for r in rows)) for level in LEVELS]
    yield "cachex_checkpoints_failed_total", [({}, failed)]
    newest = {level: _newest_at(rows, level) for level in LATENCY_LEVELS}
    yield "cachex_level_latency_seconds", [
        ({"level": level}, r["times"][level] - r["times"]["written"])
        for level, r in newest.items() if r is not None]
    yield "cachex_level_bytes", [({"level": level}, r["bytes"])
                                 for level, r in newest.items() if r is not None]
    flush = newest_flush(rows)
    yield "cachex_flush_bandwidth_bytes_per_second", (
        [({}, (flush[0].get("bytes") or 0) / flush[2])] if flush else [])
    silent = [r.get("state") for r in status.get("silent") or []]
    yield "cachex_silent_nodes", [({"state": state}, silent.count(state))
                                  for state in ("suspect", "dead")]
    yield "cachex_lane_pending", [({"lane": lane}, n) for lane, n in sorted(pending.items())]
    yield from _advice_samples(status.get("advice"))


def _advice_samples(advice: Any) -> Iterator[tuple[str, Samples]]:
    """The last `cachex advise` (advice.json), when the status carries it."""
    if not isinstance(advice, dict):
        return
    paths = {p: advice.get(key) for p, key in (("tier", "tier"), ("direct_to_pfs",
                                                                   "direct_to_pfs"))}
    paths = {p: v for p, v in paths.items() if isinstance(v, dict)}
    yield "cachex_advised_interval_seconds", [({"path": p}, v["interval"])
                                              for p, v in paths.items()]
    yield "cachex_expected_waste_seconds_per_hour", [
        ({"path": p, "interval": when}, v[f"waste_per_hour_{when}"])
        for p, v in paths.items() for when in ("now", "advised")]
    yield "cachex_failure_rate", [({"kind": k}, r["rate"])
                                  for k, r in (advice.get("rates") or {}).items()]


def _newest_at(rows: list[dict[str, Any]], level: str) -> dict[str, Any] | None:
    """The newest row with both its commit time and `level`'s time."""
    timed = [r for r in rows if isinstance((r.get("times") or {}).get(level), (int, float))
             and isinstance(r["times"].get("written"), (int, float))]
    return max(timed, key=lambda r: r["seq"], default=None)


def _number(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def metrics_file(config: Config) -> MetricsFile | None:
    """The coordinator's metrics file (None: `metrics.path` is empty); a ConfigError
    naming the key when its directory is missing or not writable."""
    if not config.metrics.path:
        return None
    values = {"run": config.run, "host": socket.gethostname(), "job": job_id()}
    path = Path(render(config.metrics.path, values, "metrics.path"))
    if not path.parent.is_dir():
        raise ConfigError(f"metrics.path: the directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"metrics.path: the directory {path.parent} is not writable")
    return MetricsFile(path, config.run)
