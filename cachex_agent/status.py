"""What `cachex status` and `cachex ls` read: the coordinator's view, wherever it is.

The coordinator writes `status.json` into its journal (node-local) and, when the PFS
takes writes, into `<pfs>/<run>/`. Either may be the newer one; a login node sees only
the PFS copy. With no agent status at all, the PFS index still tells what was flushed.

A status file outlives its agents: one they left when killed still says `running`. The
coordinator rewrites it at least every `heartbeat.period` seconds, each time with
`heartbeat.beat` one higher. The reader's clock and the coordinator's may be far apart,
so no timestamp of the file is compared with the reader's clock (beats.py): a status
whose heartbeat the reader saw move is live; one it saw stand still for STALE_PERIODS
periods, on its own monotonic clock, reads `not running`, whatever state it recorded
(kept as `recorded_state`). Until either, a one-shot reader (`cachex status`) reads
again: about one period for live agents, STALE_PERIODS periods for dead ones.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import psutil

from .beats import Unchanged
from .config import Config
from .errors import OperationError
from .fsutil import read_json
from .index import NotAnIndex, read_index
from .layout import index_path, status_paths
from .risk import at_risk, risk_lines
from .versions import trainer_name

STALE_PERIODS = 5           # missed heartbeats before a running status is taken as dead
DEFAULT_PERIOD = 2.0        # status files written before the heartbeat existed
ACTIVE = ("running", "draining")
POLL = 0.2                  # seconds between readings of a status not yet judged


def coordinator_statuses(config: Config) -> list[dict[str, Any]]:
    """The coordinator's status files visible here. With `topology.domain = "node"` node
    0's journal path renders to this machine's own journal; only the coordinator keeps a
    status there (an agent that is not removes one an earlier job left, agent.py), so
    one found is node 0's: on another node there is none, node 0's is not visible."""
    found = []
    for path in status_paths(config.node_paths(0)):
        try:
            found.append(read_json(path))
        except (OSError, json.JSONDecodeError):
            continue
    return found


def load_status(config: Config, seen: Unchanged | None = None,
                settle: bool = False) -> dict[str, Any]:
    """The newest status with its liveness. `seen`: this reader's earlier readings of
    the heartbeat (a caller that polls, `cachex stop`); `settle`: read again until the
    liveness is known (`live` true or false, not None)."""
    seen = seen or Unchanged()
    while True:
        status = _newest_status(config)
        if status.get("heartbeat") is None and status.get("updated") is None:
            return status                   # from the PFS index: no agent status at all
        judged = with_liveness(status, seen)
        if not settle or judged["live"] is not None:
            return judged
        time.sleep(POLL)


def _newest_status(config: Config) -> dict[str, Any]:
    node0 = config.node_paths(0)
    found = coordinator_statuses(config)
    if found:
        return newest(found)
    try:
        index = read_index(node0.pfs)
    except (OSError, NotAnIndex):      # none, or not an index: an unsafe one raises
        places = ", ".join(str(p) for p in [*status_paths(node0), index_path(node0.pfs)])
        unseen = ("; node 0's journal is on node 0 only, not visible from another node"
                  if config.topology.domain != "rank" else "")
        raise OperationError(f"run {config.run}: no status found (looked in {places}"
                             f"{unseen})") from None
    rows = [{"id": r.id, "seq": r.seq, "level": r.level, "bytes": r.bytes}
            for r in index.checkpoints]
    return {"run": config.run, "state": "unknown (from the PFS index)", "checkpoints": rows,
            "updated": None}


def newest(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the journal's and the PFS's copy: the higher beat of one coordinator's life
    (its clock may have stepped between them); of two lives, the later coordinator."""
    lives = {(s.get("heartbeat") or {}).get("life") for s in statuses}
    if len(lives) == 1 and None not in lives:
        return max(statuses, key=lambda s: _count(s["heartbeat"].get("beat")))
    return max(statuses, key=order)


def order(status: dict[str, Any]) -> tuple[int, float]:
    """Sorts a run's coordinators' statuses oldest first: by the run lock's count of its
    coordinators (runlock.next_generation), never by two hosts' clocks; `updated` (the
    writer's clock) only between statuses of one generation, which are one host's, or
    of none (written before generations were counted, or where the count was lost)."""
    updated = status.get("updated")
    return (_count((status.get("heartbeat") or {}).get("generation")),
            updated if type(updated) in (int, float) else 0.0)


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def with_liveness(status: dict[str, Any], seen: Unchanged) -> dict[str, Any]:
    """Add whether agents are live (None: not known yet) and `heartbeat.age`, the
    seconds this reader has seen the heartbeat unchanged; a `running` status whose
    heartbeat stood still for STALE_PERIODS periods becomes `not running`."""
    beat = dict(status.get("heartbeat") or {})
    period = beat.get("period", DEFAULT_PERIOD)
    beat["age"] = seen.see((beat.get("life"), beat.get("beat"), beat.get("t"),
                            status.get("updated")))
    recorded = status.get("state")
    live = seen.live(beat["age"], STALE_PERIODS * period) if recorded in ACTIVE else False
    state = "not running" if recorded in ACTIVE and live is False else recorded
    judged = {**status, "heartbeat": beat, "live": live, "state": state,
              "recorded_state": recorded}
    return {**judged, "at_risk": at_risk(judged), "superseded": superseded(judged)}


def superseded(status: dict[str, Any]) -> dict[str, int]:
    """Per trainer's name, the saves that never became part of a version of their own
    (a newer save came first: versions.py), as the versions status lists count them."""
    counts: dict[str, int] = {}
    for row in status.get("checkpoints") or []:
        if row.get("superseded"):
            name = trainer_name(row["id"])
            counts[name] = counts.get(name, 0) + row["superseded"]
    return counts


#: why `ls` has no path or rule for a checkpoint (only the PFS index was found)
FROM_INDEX = ("path and rule unknown: no status file is visible here, and the PFS index"
              " keeps neither")


def listing(status: dict[str, Any]) -> dict[str, Any]:
    """The `ls --json` shape: every checkpoint, oldest first, as `status` has it: id,
    seq, level, bytes, path and rule (null when not known; `unknown` says why)."""
    rows = [{"id": r["id"], "seq": r["seq"], "level": r["level"], "bytes": r["bytes"],
             "path": r.get("path"), "rule": r.get("rule")} for r in status["checkpoints"]]
    from_index = status.get("heartbeat") is None and status.get("updated") is None
    unknown = FROM_INDEX if from_index else None
    return {"run": status["run"], "redundancy": status.get("redundancy"),
            "unknown": unknown, "checkpoints": rows}


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_ls(status: dict[str, Any]) -> str:
    """A status (`load_status`) as `ls` prints it."""
    status = listing(status)
    scheme = scheme_note(status.get("redundancy"))
    width = 10 + (len(scheme) + 1 if scheme else 0)
    lines = [f"{'checkpoint':<24} {'level':<{width}} {'size':>10}  {'path':<6}  rule"]
    for row in status["checkpoints"]:
        level = f"{row['level']} {scheme}" if scheme and row["level"] == "replicated" \
            else row["level"]
        unsure = "?" if status["unknown"] else "-"
        lines.append(f"{row['id']:<24} {level:<{width}} {human_size(row['bytes']):>10}"
                     f"  {row['path'] or unsure:<6}  {row['rule'] or unsure}")
    if status["unknown"]:
        lines.append(f"? {status['unknown']}")
    return "\n".join(lines)


def scheme_note(redundancy: dict[str, Any] | None) -> str:
    """`(xor 4)`, `(rs:4+2)`: how a `replicated` checkpoint is held; empty for a copy
    (and for status files written before the scheme was recorded)."""
    if not redundancy or "group" not in redundancy:     # whole copies on partners
        return ""
    scheme = redundancy["scheme"]
    # rs:K+M names its group's size; xor does not
    return f"({scheme})" if "+" in scheme else f"({scheme} {redundancy['group']})"


def redundancy_line(redundancy: dict[str, Any] | None) -> str | None:
    """What `replicated` means in this run, for `cachex status`."""
    if not redundancy:
        return None
    survives = redundancy.get("survives", 1)
    lost = f"{survives} lost node{'s' if survives != 1 else ''}"
    if "group" not in redundancy:
        return (f"replicated: a full copy of each node's part on"
                f" {redundancy.get('copies', 1)} partner(s); survives {lost}")
    group = redundancy["group"]
    larger = sorted({n for n in redundancy.get("sizes") or [] if n != group})
    extra = (f" ({', '.join(map(str, larger))} where the nodes left over joined a group:"
             " more data members, the same parity)" if larger else "")
    return (f"replicated: {redundancy['scheme']} parity over groups of {group}"
            f" nodes{extra}; each group survives {lost}")


def format_status(status: dict[str, Any]) -> str:
    updated = status.get("updated")
    # the coordinator's clock, shown as it is: the reader's may differ
    when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(updated))
            + " (coordinator's clock)") if updated else "unknown"
    state = status["state"]
    if state == "not running":
        state = (f"not running (heartbeat unchanged for {status['heartbeat']['age']:.0f} s;"
                 f" the status said {status['recorded_state']}"
                 f"{stopped_note(status['heartbeat'])})")
    lines = [f"run {status['run']}: agents {state}, {status.get('nodes', '?')} nodes,"
             f" updated {when}", *risk_lines(status), format_ls(status)]
    meaning = redundancy_line(status.get("redundancy"))
    if meaning:
        lines.append(f"  {meaning}")
    lines.extend(f"  note: {note}" for note in status.get("notes") or [])
    lines.extend(f"  superseded: {name}: {count} save(s) replaced by a newer one before"
                 " they became a version of their own"
                 for name, count in sorted(superseded(status).items()))
    lines.extend(silent_lines(status.get("silent") or []))
    for row in status["checkpoints"]:
        lines.extend(_details(row, status.get("nodes")))
    return "\n".join(lines)


def stopped_note(beat: dict[str, Any]) -> str:
    """A heartbeat that stands still is a coordinator gone or stalled; on its own host
    the two can be told apart: its process is there, stopped or in uninterruptible
    sleep (a hung file system). Elsewhere nothing can tell, and nothing is said."""
    if beat.get("host") != socket.gethostname() or type(beat.get("pid")) is not int:
        return ""
    try:
        process = psutil.Process(beat["pid"])
        state = process.status()
        ours = any("cachex" in part for part in process.cmdline())
    except (psutil.Error, OSError):
        return ""
    if ours and state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP,
                          psutil.STATUS_DISK_SLEEP):
        return (f"; the coordinator's process {beat['pid']} on this host is {state}:"
                " stalled, not gone; it goes on when it runs again")
    return ""


def silent_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each node the coordinator found silent (slow is not dead: docs/levels.md), for how
    long by the coordinator's clock, who waited on it, and what waits on it."""
    out = []
    for row in rows:
        since = f" for {row['seconds']:.0f} s" if row.get("seconds") is not None else ""
        by = ", ".join(map(str, row.get("by") or []))
        held = [f"its {', '.join(row['holds'])}"] if row.get("holds") else []
        if row.get("relays_for"):
            held.append(f"the reports of the {row['subtree']} node(s) it relays for"
                        f" (children {', '.join(map(str, row['relays_for']))}: sent around"
                        f" it)")
        held += row.get("waiting") or []
        out.append(f"  silent: node {row['node']} {row['state']}{since}"
                   + (f" (found by node {by})" if by else "")
                   + (f"; holds up {'; '.join(held)}" if held else ""))
    return out


def _details(row: dict[str, Any], nodes: int | None) -> list[str]:
    out = []
    if row["level"] in ("written", "captured", "replicated") and nodes:
        out.append(f"  {row['id']}: captured on {row.get('nodes_captured', 0)}/{nodes} nodes,"
                   f" replicated on {row.get('nodes_replicated', 0)}/{nodes},"
                   f" flushed on {row.get('nodes_flushed', 0)}/{nodes}"
                   + ("" if row.get("flush", True) else " (not flushed: flush.every)"))
    for node, progress in sorted((row.get("progress") or {}).items()):
        share = progress["done"] / progress["total"] if progress["total"] else 1.0
        out.append(f"  {row['id']}: node {node} {progress['stage']} {share:.0%}"
                   f" of {human_size(progress['total'])}")
    for node, capture in sorted((row.get("capture") or {}).items()):
        out.append(f"  {row['id']}: node {node} captured by {capture['mode']}:"
                   f" {capture['reason']}")
    for where, error in sorted((row.get("errors") or {}).items()):
        out.append(f"  {row['id']}: node {where}: {error}")
    if row.get("reason"):
        out.append(f"  {row['id']}: failed: {row['reason']}")
    return out
