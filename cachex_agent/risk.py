"""Work at risk now: how much training a node loss, or the end of the allocation, would
cost if it came at this moment, and which checkpoint training would resume from.

Read from a status (status.json) on the coordinator's clock alone: "now" is the
heartbeat's time plus the seconds this reader has seen that heartbeat unchanged (its own
monotonic clock: a duration, never a time of the reader's), and each checkpoint's commit
time is the coordinator's too. A reader whose clock is off by an hour gets the same
figures.

A node loss is survived by the newest checkpoint that is `replicated` (under the run's
scheme: any `survives` lost nodes, of each group for an erasure scheme) or `flushed`;
the end of the allocation, which takes every node-local copy with it, only by the newest
`flushed` one.
"""

from __future__ import annotations

from typing import Any

from .forecasts import in_flight

NODE_LOSS = ("replicated", "flushed")
ALLOCATION_END = ("flushed",)


def at_risk(status: dict[str, Any]) -> dict[str, Any] | None:
    """`{"now", "node_loss", "allocation_end", "in_flight"}`, each loss `{"ckpt", "level",
    "seconds"}` (`ckpt` and `seconds` None: no checkpoint survives it yet; `seconds` None
    alone: its commit time is not known); None for a status without a heartbeat (read
    from the PFS index: no clock to measure from). `in_flight`: per checkpoint on its way,
    `{"ckpt", "level", "next"}`, `next` the model's seconds from now to each later level
    (`median`, `p95`; negative: overdue), or None: no prediction yet."""
    beat = status.get("heartbeat") or {}
    if not isinstance(beat.get("t"), (int, float)):
        return None
    now = beat["t"] + (beat.get("age") or 0.0)
    rows = status.get("checkpoints") or []
    return {"now": now, "node_loss": _newest(rows, NODE_LOSS, now),
            "allocation_end": _newest(rows, ALLOCATION_END, now),
            "in_flight": [_coming(row, now) for row in rows if in_flight(row)]}


def _coming(row: dict[str, Any], now: float) -> dict[str, Any]:
    predicted = row.get("predicted")
    after = None if not predicted else {
        level: {q: t - now for q, t in times.items()} for level, times in predicted.items()}
    return {"ckpt": row["id"], "level": row["level"], "next": after}


def _newest(rows: list[dict[str, Any]], levels: tuple[str, ...], now: float
            ) -> dict[str, Any]:
    held = [r for r in rows if r.get("level") in levels]
    if not held:
        return {"ckpt": None, "seconds": None}
    newest = max(held, key=lambda r: r["seq"])
    # a coordinator that rebuilt its state from the PFS index knows no commit time
    written = (newest.get("times") or {}).get("written")
    seconds = max(0.0, now - written) if isinstance(written, (int, float)) else None
    return {"ckpt": newest["id"], "level": newest["level"], "seconds": seconds}


def survives(redundancy: dict[str, Any] | None) -> str:
    """Which node losses a `replicated` checkpoint outlives in this run."""
    redundancy = redundancy or {}
    count = redundancy.get("survives", 1)
    nodes = f"any {count} lost node{'s' if count != 1 else ''}"
    if "group" not in redundancy:      # whole copies on partners
        return nodes
    return f"{nodes} of each group of {redundancy.get('group', '?')}"


def risk_lines(status: dict[str, Any]) -> list[str]:
    """What `cachex status` opens with."""
    risk = status.get("at_risk")
    if not risk:
        return []
    node, end = risk["node_loss"], risk["allocation_end"]
    beyond = survives(status.get("redundancy"))
    return [
        "at risk now (the coordinator's clock):",
        f"  a node lost: {_cost(node)}"
        + (f" (replicated: outlives {beyond}; beyond that, the allocation's figure)"
           if node["ckpt"] and node["level"] == "replicated" else ""),
        f"  the allocation ending: {_cost(end)}",
        *(f"  {c['ckpt']} ({c['level']}): {_expected(c['next'])}"
          for c in risk.get("in_flight") or [])]


def _expected(after: dict[str, dict[str, float]] | None) -> str:
    if not after:
        return "no prediction yet (the model needs a few checkpoints' stage times)"
    return "; ".join(f"{level} {_when(t['median'])} (95%: {_when(t['p95'])})"
                     for level, t in after.items())


def _when(seconds: float) -> str:
    return f"in {_duration(seconds)}" if seconds >= 0 else f"{_duration(-seconds)} overdue"


def _cost(loss: dict[str, Any]) -> str:
    if loss["ckpt"] is None:
        return "all training so far (no checkpoint outlives it yet)"
    if loss["seconds"] is None:
        return f"the training since {loss['ckpt']} (its commit time is not known here)"
    return f"{_duration(loss['seconds'])} of training since {loss['ckpt']} was committed"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def newest_flush(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], str, float] | None:
    """The newest flushed checkpoint with its times, when its flush started (`captured`,
    else `written`) and the seconds from then to `flushed`: both times the coordinator's,
    so no clock is set against another (`cachex watch`'s bandwidth line, the metrics)."""
    for row in sorted(rows, key=lambda r: r.get("seq") or 0, reverse=True):
        times = row.get("times") or {}
        start_name = "captured" if "captured" in times else "written"
        start, end = times.get(start_name), times.get("flushed")
        if all(isinstance(t, (int, float)) for t in (start, end)) and end > start:
            return row, start_name, end - start
    return None
