"""`summary.png`, the report's first page: per checkpoint and node, the time from the
commit to each level, with what went wrong in between.

The logic is `summarize` (events -> checkpoints, rows and incidents) and `layout`
(the order in which rows and incident banners are drawn); `summary_figure` only draws.

What the events say, and how it shows:
  levels      `captured`, `replicated`, `flushed` of each node's agent, in seconds since
              the checkpoint's commit (the coordinator's `committed`, or the earliest
              `committed_at` an agent recorded: the coordinator's log may be lost with
              its node). A copy made before that reference (an earlier agent run) is
              drawn at 0 and flagged, never at negative time.
  lost        an agent run that ends without `agent_exit` or `agent_failed` while its
              node starts again (killed: SIGKILL, node loss)
  restart     an `agent_start` after the run's first start
  recovered   a node's restore by `cachex recover` (`restored`; `restore_failed` and
              `restore_cancelled` as failures): the restore's own events, kept apart
              from the agents' runs and from the checkpoint's rows
  failures    `agent_failed`, `<stage>_failed` of a node, the coordinator's `failed`
  missing     a node without any event of a checkpoint others have: its own log is gone
              (a replaced node) or it never saw the checkpoint; a row says so
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .history import LEVELS, node_streams

GAP = 10.0              # seconds: starts / losses this close are one incident
MAX_CHECKPOINTS = 12    # the latest ones
MAX_NODES = 8           # rows per checkpoint: the slowest nodes
LEVEL_COLOURS = {"captured": "#1f77b4", "replicated": "#2ca02c", "flushed": "#d62728"}
LEVEL_MEANING = {"captured": "captured (node-local stage)",
                 "replicated": "replicated (a partner holds a verified copy)",
                 "flushed": "flushed (on the PFS)"}
INCIDENT_COLOURS = {"lost": "#b2182b", "agent_failed": "#b2182b", "failed": "#b2182b",
                    "restart": "#2166ac", "log_lost": "#8a5a00", "recovered": "#1a9850"}


@dataclass(frozen=True)
class NodeRow:
    node: int
    reached: dict[str, float]       # level -> seconds since the commit, >= 0
    early: tuple[str, ...] = ()     # levels held before the commit reference (drawn at 0)
    failed: str = ""                # this node's failure of the checkpoint
    missing: bool = False           # no event of this node names the checkpoint


@dataclass
class Checkpoint:
    run: str
    ckpt: str
    commit: float                   # wall clock
    path: str                       # "peer", "direct", "" when no event says
    failed: str = ""                # the coordinator's reason
    rows: list[NodeRow] = field(default_factory=list)


@dataclass(frozen=True)
class Incident:
    t: float                        # wall clock
    kind: str                       # lost | restart | agent_failed | failed | recovered
    nodes: tuple[int, ...]
    text: str


@dataclass
class Summary:
    checkpoints: list[Checkpoint]   # in order of their commit
    incidents: list[Incident]       # in order of time
    levels: tuple[str, ...]         # levels observed, in LEVELS order
    paths: tuple[str, ...]          # paths observed
    nodes: int
    start: float                    # the first event's time


# ---------------------------------------------------------------------------- logic
def summary_from_files(files: Iterable[Path]) -> Summary:
    """One log per node: a node's journal and its PFS copy repeat the same lines (and a
    restarted agent copies its journal again), which would read as restarts."""
    return summarize(node_streams(files))


def summarize(logs: Sequence[list[dict[str, Any]]]) -> Summary:
    """Checkpoints, rows and incidents from the agents' event logs (one list per file)."""
    restores = [r for log in logs for r in log if "t" in r and r.get("stage") == "restore"]
    logs = [[r for r in log if r.get("stage") != "restore"] for log in logs]
    records = sorted((r for log in logs for r in log if "t" in r), key=lambda r: r["t"])
    nodes = max([int(r.get("nodes", 1)) for r in records if r.get("event") == "agent_start"]
                + [int(r.get("node", 0)) + 1 for r in records], default=0)
    checkpoints = _checkpoints(records)
    for c in checkpoints:
        c.rows = _rows(c, records, nodes)
    checkpoints.sort(key=lambda c: c.commit)
    levels = tuple(lv for lv in LEVELS if any(lv in row.reached or lv in row.early
                                              for c in checkpoints for row in c.rows))
    paths = tuple(sorted({c.path for c in checkpoints if c.path}))
    return Summary(checkpoints, _incidents(logs, records, checkpoints, restores), levels,
                   paths, nodes, records[0]["t"] if records else 0.0)


def _key(rec: dict[str, Any]) -> tuple[str, str]:
    return rec.get("run", ""), rec["ckpt"]


def _checkpoints(records: list[dict[str, Any]]) -> list[Checkpoint]:
    """Every checkpoint any agent captured or the coordinator committed."""
    out: dict[tuple[str, str], Checkpoint] = {}
    for rec in records:
        kind = rec.get("event")
        if "ckpt" not in rec or not isinstance(rec["ckpt"], str):
            continue
        key = _key(rec)
        if kind == "committed":
            seen = out.setdefault(key, Checkpoint(*key, rec["t"], ""))
            seen.commit = min(seen.commit, rec["t"])
            seen.path = rec.get("path") or seen.path
        elif kind == "captured":
            at = float(rec.get("committed_at") or rec["t"])
            seen = out.setdefault(key, Checkpoint(*key, at, ""))
            seen.commit = min(seen.commit, at)
        elif kind == "failed" and key in out:
            out[key].failed = str(rec.get("reason", "failed"))
    for c in out.values():
        if not c.path:      # the coordinator's log is gone: what the agents did says it
            mine = [r for r in records if r.get("ckpt") == c.ckpt and r.get("run", "") == c.run]
            if any(r.get("event") == "replicated" for r in mine):
                c.path = "peer"
    return list(out.values())


def _rows(c: Checkpoint, records: list[dict[str, Any]], nodes: int) -> list[NodeRow]:
    """One row per node of the run, also for a node that left no event of `c`."""
    mine: dict[int, list[dict[str, Any]]] = {n: [] for n in range(nodes)}
    for rec in records:
        if rec.get("ckpt") == c.ckpt and rec.get("run", "") == c.run and "node" in rec:
            mine.setdefault(int(rec["node"]), []).append(rec)
    rows = []
    for node, recs in sorted(mine.items()):
        own = [r for r in recs if r.get("event") not in ("committed", "failed", "drain")
               and not str(r.get("event", "")).startswith("level_")
               and not (r.get("event") == "evicted" and r.get("owner") is not None)
               and not str(r.get("event", "")).startswith("replica_")]
        reached: dict[str, float] = {}
        early: list[str] = []
        for r in own:
            level = r.get("event")
            if level in LEVELS and level not in reached and level not in early:
                if r["t"] < c.commit:
                    early.append(level)
                else:
                    reached[level] = r["t"] - c.commit
        failed = next((f"{r['event']}: {r.get('error') or r.get('reason') or ''}".rstrip(": ")
                       for r in own if str(r.get("event", "")).endswith("_failed")), "")
        rows.append(NodeRow(node, reached, tuple(early), failed, missing=not own))
    return rows


def _incidents(logs: Sequence[list[dict[str, Any]]], records: list[dict[str, Any]],
               checkpoints: list[Checkpoint], restores: list[dict[str, Any]]
               ) -> list[Incident]:
    first = min((r["t"] for r in records if r.get("event") == "agent_start"), default=0.0)
    found: list[Incident] = []
    for log in logs:
        found.extend(_agent_runs(log, first))
    found.extend(_restored(restores))
    found.extend(Incident(c.commit, "failed", (), f"{c.ckpt} failed: {c.failed}")
                 for c in checkpoints if c.failed)
    return _grouped(sorted(found, key=lambda i: i.t))


def _agent_runs(log: list[dict[str, Any]], first: float) -> list[Incident]:
    """One log's losses, failures and restarts: its agent runs split at `agent_start`."""
    runs: list[list[dict[str, Any]]] = [[]]
    for rec in log:
        # what an agent logs before its agent_start (stale files removed) is its run's
        if rec.get("event") == "agent_start" and _started(runs[-1]):
            runs.append([])
        runs[-1].append(rec)
    out = []
    for i, run in enumerate(runs):
        start = next((r for r in run if r.get("event") == "agent_start"), None)
        node = int(run[0].get("node", 0)) if run else 0
        late = start is not None and start["t"] > first + GAP
        if start is not None and (i > 0 or late):
            out.append(Incident(start["t"], "restart", (node,), "agents restarted"))
            if i == 0:      # its log's first start, well after the others' first
                out.append(Incident(start["t"], "log_lost", (node,),
                                    "first events of this log: the node's earlier log is"
                                    " gone (a replaced node?)"))
        ended = {r.get("event") for r in run}
        for r in run:
            if r.get("event") == "agent_failed":
                out.append(Incident(r["t"], "agent_failed", (node,),
                                    f"agent failed in {r.get('where', '?')}:"
                                    f" {r.get('error', '')}"))
        if not ended & {"agent_exit", "agent_failed"} and i + 1 < len(runs):
            out.append(Incident(run[-1]["t"], "lost", (node,),
                                "agents ended without agent_exit (killed or node lost)"))
    return out


def _restored(restores: list[dict[str, Any]]) -> list[Incident]:
    """Each node's restore that ended: recovered, or why not."""
    out = []
    for r in restores:
        node = (int(r.get("node", 0)),)
        if r.get("event") == "restored":
            out.append(Incident(r["t"], "recovered", node, f"{r.get('ckpt')} restored by"
                                " cachex recover"))
        elif r.get("event") in ("restore_failed", "restore_cancelled"):
            out.append(Incident(r["t"], "failed", node, f"restore of {r.get('ckpt')}"
                                f" {r.get('state')}: {r.get('error', '')}".rstrip(": ")))
    return out


def _started(run: list[dict[str, Any]]) -> bool:
    return any(r.get("event") == "agent_start" for r in run)


def _grouped(incidents: list[Incident]) -> list[Incident]:
    """The same incident on several nodes within GAP seconds: one, naming the nodes."""
    out: list[Incident] = []
    for inc in incidents:
        prev = next((o for o in reversed(out) if o.kind == inc.kind and o.text == inc.text
                     and inc.t - o.t <= GAP and inc.nodes), None)
        if prev is None:
            out.append(inc)
        else:
            out[out.index(prev)] = Incident(prev.t, prev.kind,
                                            tuple(sorted({*prev.nodes, *inc.nodes})), prev.text)
    return out


def incident_text(inc: Incident, start: float) -> str:
    who = ""
    if inc.nodes:
        who = ("node " if len(inc.nodes) == 1 else "nodes ") + ", ".join(map(str, inc.nodes))
        who += ": "
    return f"{who}{inc.text}  ({inc.t - start:.1f} s after the first event)"


def layout(summary: Summary, max_checkpoints: int = MAX_CHECKPOINTS
           ) -> list[tuple[str, Any]]:
    """Top to bottom, oldest first: ("checkpoint", Checkpoint) and ("incident", Incident)
    at the place in time where they happened (an incident between the last commit
    before it and the first after it)."""
    shown = summary.checkpoints[-max_checkpoints:]
    since = shown[0].commit if len(shown) < len(summary.checkpoints) else -float("inf")
    items: list[tuple[str, Any]] = []
    pending = [i for i in summary.incidents if i.t >= since]
    for c in shown:
        while pending and pending[0].t < c.commit:
            items.append(("incident", pending.pop(0)))
        items.append(("checkpoint", c))
    items.extend(("incident", i) for i in pending)
    return items


def shown_rows(c: Checkpoint, max_nodes: int = MAX_NODES) -> list[NodeRow]:
    """Every node, or the `max_nodes` slowest (missing and failed ones first)."""
    if len(c.rows) <= max_nodes:
        return c.rows
    slowest = sorted(c.rows, key=lambda r: (not r.missing, not r.failed,
                                            -max(r.reached.values(), default=0.0)))
    return sorted(slowest[:max_nodes], key=lambda r: r.node)


# ----------------------------------------------------------------------------- plot
def summary_figure(summary: Summary) -> Figure:
    items = layout(summary)
    slots = sum(len(shown_rows(x)) if kind == "checkpoint" else 1 for kind, x in items)
    fig = Figure(figsize=(11.0, min(max(4.5, 1.8 + 0.24 * slots), 16.0)), layout="constrained")
    ax = fig.add_subplot()
    fig.suptitle("Time from each checkpoint's commit to each level, per node", fontsize=13)
    if not summary.checkpoints:
        ax.text(0.5, 0.5, "no checkpoint in the events", ha="center", va="center",
                transform=ax.transAxes, color="#666666")
        ax.set_axis_off()
        return fig
    ax.set_title(_subtitle(summary, items), fontsize=9, color="#333333")
    ticks, labels, y = [], [], 0.0
    for kind, item in items:
        if kind == "incident":
            _banner(ax, y, item, summary.start)
            y += 1
            continue
        rows = shown_rows(item)
        for i, row in enumerate(rows):
            _row(ax, y, row)
            ticks.append(y)
            labels.append((f"{item.ckpt}{_path_tag(item, summary)}   " if i == 0 else "")
                          + f"node {row.node}")
            y += 1
        if item.failed:
            ax.text(0.0, y - len(rows) - 0.5, f" FAILED: {item.failed}", color="#b2182b",
                    fontsize=8, fontweight="bold", va="center", transform=_data_y(ax))
        ax.axhline(y - 0.5, color="#bbbbbb", lw=0.6)
    _axes(ax, ticks, labels, y, summary)
    return fig


def _data_y(ax: Axes) -> Any:
    return ax.get_yaxis_transform()     # x in axes fraction, y in data


def _path_tag(c: Checkpoint, summary: Summary) -> str:
    return f" ({c.path})" if len(summary.paths) > 1 and c.path else ""


def _row(ax: Axes, y: float, row: NodeRow) -> None:
    if row.missing:
        ax.text(0.01, y, "no events from this node for this checkpoint (its log was lost"
                " with the node, or it never saw it)", transform=_data_y(ax), va="center",
                fontsize=7.5, color="#777777", style="italic")
        return
    # longest first: each later (shorter) bar is drawn over it, so each level's colour
    # ends where that level was reached even when flush finishes before replication
    for level, t in sorted(row.reached.items(), key=lambda kv: -kv[1]):
        ax.barh(y, max(t, 0.0), left=0.0, height=0.7, color=LEVEL_COLOURS[level],
                edgecolor="white", linewidth=0.5)
    for level in row.early:
        ax.plot(0.0, y, marker=">", color=LEVEL_COLOURS[level], ms=7, clip_on=False)
    notes = []
    if row.early:
        notes.append(f"{', '.join(row.early)} before this commit (earlier agent run),"
                     " drawn at 0")
    if row.failed:
        notes.append(row.failed)
    if notes:
        end = max(row.reached.values(), default=0.0)
        ax.text(end, y, "  " + "; ".join(notes), va="center", fontsize=7,
                color="#b2182b" if row.failed else "#555555")
        if row.failed:
            ax.plot(end, y, marker="x", color="#b2182b", ms=7, mew=2)


def _banner(ax: Axes, y: float, inc: Incident, start: float) -> None:
    colour = INCIDENT_COLOURS.get(inc.kind, "#b2182b")
    ax.axhspan(y - 0.45, y + 0.45, color=colour, alpha=0.12, lw=0)
    mark = {"restart": "\u21bb ", "log_lost": "? ", "recovered": "\u2713 "}.get(inc.kind,
                                                                             "\u2717 ")
    ax.text(0.5, y, mark + incident_text(inc, start), transform=_data_y(ax), ha="center",
            va="center", fontsize=8.5, color=colour, fontweight="bold")


def _subtitle(summary: Summary, items: list[tuple[str, Any]]) -> str:
    shown = sum(kind == "checkpoint" for kind, _ in items)
    count = len(summary.checkpoints)
    failed = sum(bool(c.failed) for c in summary.checkpoints)
    lost = sorted({n for i in summary.incidents if i.kind in ("lost", "agent_failed")
                   for n in i.nodes})
    parts = [f"{'the last ' + str(shown) + ' of ' if shown < count else ''}{count}"
             f" checkpoint{'s' if count != 1 else ''} on {summary.nodes} node"
             f"{'s' if summary.nodes != 1 else ''}",
             f"path{'s' if len(summary.paths) > 1 else ''}: {', '.join(summary.paths) or '?'}",
             f"{failed} failed", "agents lost or failed on "
             + (f"node{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
                if lost else "no node")]
    return ";  ".join(parts) + "   (each bar ends when the level holds on that node)"


def _axes(ax: Axes, ticks: list[float], labels: list[str], end: float,
          summary: Summary) -> None:
    ax.set_yticks(ticks, labels, fontsize=7.5)
    ax.set_ylim(end - 0.5, -0.5)            # oldest at the top, like a log
    ax.set_xlim(left=0.0)
    ax.set_xlabel("seconds since the checkpoint's commit")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    handles = [Patch(color=LEVEL_COLOURS[lv], label=LEVEL_MEANING[lv]) for lv in summary.levels]
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize=8, framealpha=0.9,
                  title="level reached", title_fontsize=8)
