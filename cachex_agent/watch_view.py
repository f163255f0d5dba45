"""`cachex watch`: the run's status redrawn every few seconds, sized for a plain
80-column terminal over ssh.

`frame` is pure (a status in, lines out), so what a frame says is tested without a
terminal. Every time on screen is the coordinator's own clock as it wrote it, or the
difference of two of its times: this host's clock may be far from the coordinator's
(status.py), so nothing is measured against time.time(). Liveness is judged by one
`Unchanged` kept across frames, as `cachex stop` does while it waits.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .beats import Unchanged
from .config import Config
from .errors import CachexError
from .risk import newest_flush, risk_lines
from .status import human_size, load_status, silent_lines

CLEAR = "\x1b[H\x1b[2J"     # home, erase the screen: understood by any terminal over ssh
WIDTH, HEIGHT = 80, 24      # when the output is not a terminal (or says 0x0)
BAR = 20
MAX_RISK = 6                # the headline figures and a forecast or so; status has all
MAX_PROBLEMS = 5            # errors are cut before the checkpoints lose their room
PROBLEM_ID = 24             # an id's room on an error's line, leaving some for the error
LEGEND = "# flushed = replicated - captured . not yet"
ORDER = ("written", "captured", "replicated", "flushed")


# ------------------------------------------------------------------------ the frame
def frame(status: dict[str, Any], width: int = WIDTH, height: int = HEIGHT) -> list[str]:
    """One screen of `status` (`load_status`): header, work at risk, the newest
    checkpoints (newest last) with a bar per node, the flush bandwidth, errors; at most
    `height - 1` lines when that leaves room for 3 checkpoints, none wider than `width`."""
    rows = status.get("checkpoints") or []
    top = [*_header(status), *_risk(status),
           *(line.strip() for line in silent_lines(status.get("silent") or []))]
    bottom = [bandwidth_line(rows), *_problems(rows)]
    room = max(3, height - 2 - len(top) - len(bottom))     # the legend, the cursor's line
    shown = rows[-room:]
    idw = max(8, width - 46)
    lines = [*top, _legend(len(rows), len(shown)),
             *(_row(row, status.get("nodes"), idw) for row in shown), *bottom]
    return [fit(line, width) for line in lines]


def fit(line: str, width: int) -> str:
    """Printable and at most `width` columns: a status's texts (errors from the PFS)
    must not move the cursor or send escape sequences to the reader's terminal."""
    line = "".join(c if c.isprintable() else " " for c in line)
    if len(line) <= width:
        return line
    return line[:width - 3] + "..." if width > 3 else line[:width]


def _header(status: dict[str, Any]) -> list[str]:
    nodes = status.get("nodes") or "?"
    updated = status.get("updated")
    when = (f"updated {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(updated))}"
            " (the coordinator's clock)" if isinstance(updated, (int, float))
            else "no status file of the agents: levels from the PFS index")
    # the state last: the part a long run name may push past the edge
    return [f"run {status.get('run', '?')}: {nodes} nodes, agents {_state(status)}", when]


def _risk(status: dict[str, Any]) -> list[str]:
    lines = risk_lines(status)
    if len(lines) <= MAX_RISK:
        return lines
    return [*lines[:MAX_RISK - 1], f"  ({len(lines) - MAX_RISK + 1} more lines in cachex status)"]


def _state(status: dict[str, Any]) -> str:
    state = str(status.get("state") or "unknown")
    beat = status.get("heartbeat") or {}
    if state == "not running" and "age" in beat:
        return f"not running (heartbeat unchanged for {beat['age']:.0f} s)"
    if state in ("running", "draining") and status.get("live") is None:
        return f"{state}? (heartbeat not yet seen to move)"
    return state


def _legend(total: int, shown: int) -> str:
    if not total:
        return "no checkpoint yet"
    older = f"{total - shown} older not shown" if shown < total else "checkpoints"
    return f"{older}; per node: {LEGEND}"


def _row(row: dict[str, Any], nodes: Any, idw: int) -> str:
    return (f"{_short(row, idw):<{idw}} {str(row.get('level', '?')):<10} [{bar(row, nodes)}]"
            f" {human_size(row.get('bytes') or 0):>10}")


def _short(row: dict[str, Any], width: int) -> str:
    ckpt = str(row.get("id", "?"))
    if len(ckpt) <= width:
        return ckpt
    return "..." + ckpt[-(width - 3):]     # the end tells checkpoints apart (step numbers)


def bar(row: dict[str, Any], nodes: Any, width: int = BAR) -> str:
    """Shares of the nodes by the highest level each reported: flushed `#`, replicated
    `=`, captured `-`, not yet `.`. A share above none shows at least one mark, one
    below all leaves at least one mark of the next level."""
    total = nodes if isinstance(nodes, int) and nodes > 0 else 1
    rank = ORDER.index(row["level"]) if row.get("level") in ORDER else -1

    def at_least(level: int) -> int:
        if rank >= level:       # a level the checkpoint holds, every node holds
            return total
        # the direct path skips `replicated`: a node flushed has also captured
        counted = max(int(row.get(f"nodes_{name}") or 0) for name in ORDER[level:])
        return min(counted, total)

    def cut(count: int) -> int:
        if count in (0, total):
            return count * width // total
        return min(width - 1, max(1, round(count * width / total)))

    flushed, replicated, captured = (cut(at_least(level)) for level in (3, 2, 1))
    return ("#" * flushed + "=" * (replicated - flushed) + "-" * (captured - replicated)
            + "." * (width - captured))


def bandwidth_line(rows: list[dict[str, Any]]) -> str:
    """The newest flushed checkpoint's bytes over its flush time (risk.newest_flush)."""
    if (flush := newest_flush(rows)) is None:
        return "flush bandwidth: not known yet (no flushed checkpoint with its times)"
    row, start_name, seconds = flush
    size = row.get("bytes") or 0
    return (f"flush bandwidth: {human_size(size / seconds)}/s ({row.get('id')}:"
            f" {human_size(size)}, {start_name} to flushed in {seconds:.1f} s)")


def _problems(rows: list[dict[str, Any]]) -> list[str]:
    """Every node's error and every failure's reason, the newest checkpoints' last."""
    found = []
    for row in rows:
        ckpt = _short(row, PROBLEM_ID)
        found += [f"{ckpt}: node {where}: {text}"
                  for where, text in sorted((row.get("errors") or {}).items())]
        if row.get("reason"):
            found.append(f"{ckpt}: failed: {row['reason']}")
    if len(found) <= MAX_PROBLEMS:
        return found
    kept = found[-(MAX_PROBLEMS - 1):]
    return [f"{len(found) - len(kept)} earlier errors not shown (cachex status has them)",
            *kept]


# ------------------------------------------------------------------------- the loop
def watch(cfg: Config, interval: float, once: bool, out: TextIO | None = None,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """`once`: one frame, read as `cachex status` reads it (until liveness is known),
    no escape codes. Else a frame every `interval` s until Ctrl-C, which returns. No
    status at first raises (OperationError, said as `cachex status` says it); later, a
    status not readable for a moment is a line above the last one read. `sleep`: the
    tests' way in."""
    out = out or sys.stdout
    try:
        if once:
            _draw(out, frame(load_status(cfg, settle=True), *_size(out)), "")
        else:
            _interruptible(lambda: _loop(cfg, interval, out, sleep), out)
    except BrokenPipeError:             # `cachex watch | head`: the reader is done
        _discard(out)


def _interruptible(run: Callable[[], None], out: TextIO) -> None:
    # a shell that starts a command in the background may leave SIGINT ignored, and
    # a view that Ctrl-C cannot end is worse than one that ends
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:                  # not the main thread: Ctrl-C is not ours
        previous = None
    try:
        run()
    except KeyboardInterrupt:
        if out.isatty():                # after the terminal's `^C`, the prompt's line
            out.write("\n")
            out.flush()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _loop(cfg: Config, interval: float, out: TextIO,
          sleep: Callable[[float], None]) -> None:
    seen = Unchanged()
    status, problem = load_status(cfg, seen), None
    before = CLEAR if out.isatty() else ""
    due = time.monotonic()
    while True:
        lines = frame(status, *_size(out))
        if problem:
            lines.insert(0, fit(f"status not readable now, the last one read below: {problem}",
                                _size(out)[0]))
        _draw(out, lines, before)
        before = CLEAR if out.isatty() else "\n"
        due = max(due + interval, time.monotonic())   # a slow read delays, never bunches
        sleep(max(0.0, due - time.monotonic()))
        try:
            status, problem = load_status(cfg, seen), None
        except (CachexError, OSError, ValueError) as exc:    # replaced as it was read
            problem = str(exc)


def _draw(out: TextIO, lines: list[str], before: str) -> None:
    out.write(before + "\n".join(lines) + "\n")
    out.flush()


def _size(out: TextIO) -> tuple[int, int]:
    """Columns and lines of the terminal now (it may have been resized)."""
    try:
        size = os.get_terminal_size(out.fileno())
    except (AttributeError, ValueError, OSError):
        return WIDTH, HEIGHT
    return max(20, size.columns or WIDTH), max(10, size.lines or HEIGHT)


def _discard(out: TextIO) -> None:
    """Later writes (the interpreter's flush at exit) go nowhere instead of raising."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (AttributeError, ValueError, OSError):
        pass
