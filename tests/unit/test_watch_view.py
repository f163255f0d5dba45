"""`cachex watch`: the frame (pure: a status in, lines out), the loop in this process, and
the real command under a pseudo-terminal (frames drawn, Ctrl-C exits 0) and with --once."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import run_main

from cachex_agent import config as configuration
from cachex_agent.errors import OperationError
from cachex_agent.fsutil import write_json
from cachex_agent.risk import at_risk
from cachex_agent.watch_view import CLEAR, bandwidth_line, bar, frame, watch

pytestmark = pytest.mark.timeout(60)

RUN = "run1"
CACHEX = Path(sys.executable).parent / "cachex"
MiB = 1 << 20


# ------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def clean_environment(cli_environment):
    """Every test here: conftest.cli_environment."""


def row(seq: int, level: str, **fields) -> dict:
    return {"id": f"step_{seq:05d}", "seq": seq, "level": level, "bytes": 4 * MiB,
            "times": {}, "nodes_captured": 0, "nodes_replicated": 0, "nodes_flushed": 0,
            "flush": True, "path": "peer", "rule": "dcp", "errors": {}, "progress": {},
            "reason": None, **fields}


def status_doc(rows: list[dict], state: str = "running", period: float = 0.1) -> dict:
    """A coordinator's status.json: heartbeat at its own clock's 1000 s."""
    return {"format": "cachex-status", "version": 1, "run": RUN, "updated": 1000.0,
            "state": state, "nodes": 4, "checkpoints": rows,
            "heartbeat": {"beat": 7, "life": "x", "t": 1000.0, "pid": 1, "host": "h",
                          "period": period}}


def judged(doc: dict, live: bool | None = True, age: float = 0.0) -> dict:
    """As load_status returns it, without reading a file."""
    status = {**doc, "live": live, "recorded_state": doc["state"],
              "heartbeat": {**doc["heartbeat"], "age": age}}
    return {**status, "at_risk": at_risk(status)}


def two_checkpoints() -> list[dict]:
    return [row(50, "flushed", nodes_captured=4, nodes_flushed=4,
                times={"written": 900.0, "captured": 902.0, "flushed": 906.0}),
            row(100, "captured", nodes_captured=4, nodes_replicated=2, nodes_flushed=1,
                times={"written": 990.0, "captured": 995.0},
                errors={"1": "pfs: Not a directory"})]


def put_status(cfg: configuration.Config, doc: dict) -> Path:
    path = cfg.node_paths(0).journal / "status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, doc)
    return path


# ----------------------------------------------------------------------------- frame

@pytest.mark.timeout(20)
def test_a_frame_says_the_run_its_risk_checkpoints_bandwidth_and_errors():
    lines = frame(judged(status_doc(two_checkpoints())))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1000.0))
    assert lines[0] == f"run {RUN}: 4 nodes, agents running"
    assert lines[1] == f"updated {when} (the coordinator's clock)"
    assert lines[2] == "at risk now (the coordinator's clock):"
    # the coordinator's "now" (1000 s) against its commit time, never this host's clock
    assert "100 s of training since step_00050" in "\n".join(lines)
    legend = lines.index("checkpoints; per node: # flushed = replicated - captured . not yet")
    assert lines[legend + 1].split() == ["step_00050", "flushed",
                                         "[####################]", "4.0", "MiB"]
    assert lines[legend + 2].split() == ["step_00100", "captured",
                                         "[#####=====----------]", "4.0", "MiB"]
    assert lines[legend + 3] == ("flush bandwidth: 1.0 MiB/s (step_00050: 4.0 MiB, captured"
                                 " to flushed in 4.0 s)")
    assert lines[-1] == "step_00100: node 1: pfs: Not a directory"
    assert all(len(line) <= 80 for line in lines)


@pytest.mark.timeout(20)
def test_long_ids_and_many_errors_stay_within_80_columns_and_24_lines():
    rows = [row(seq, "failed" if seq % 3 else "flushed", nodes_flushed=4,
                id=f"global_step_{seq:09d}_" + "x" * 150 + f"_{seq}",
                errors={str(n): "EIO \x1b[2J" + "y" * 300 for n in range(4)},
                reason="lost\nnode" * 50 if seq % 3 else None)
            for seq in range(1, 41)]
    for width, height in ((80, 24), (40, 24), (132, 50)):
        lines = frame(judged(status_doc(rows)), width, height)
        assert all(len(line) <= width for line in lines), [len(x) for x in lines]
        assert len(lines) <= height - 1
        text = "\n".join(lines)
        assert "\x1b" not in text and "\n" not in "".join(lines)  # nothing to move the cursor
        assert "older not shown" in text and "earlier errors not shown" in text
    lines = frame(judged(status_doc(rows)))
    rows_shown = [line for line in lines if line.endswith(" MiB")]
    assert rows_shown[-1].split()[0].endswith("x_40")      # newest last, its end kept
    problems = [line for line in lines if line.split(": ")[0].endswith("x_40")]
    assert [line.split(": ")[1] for line in problems] == ["node 1", "node 2", "node 3", "failed"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("counts, level, nodes, expected", [
    ((4, 2, 1), "captured", 4, "#####=====----------"),
    ((0, 0, 0), "written", 4, "...................."),
    ((3, 0, 0), "written", 4, "---------------....."),
    ((4, 0, 4), "flushed", 4, "####################"),     # direct path: no `replicated`
    ((2, 0, 2), "written", 4, "##########.........."),      # a flushed node has captured
    ((1, 0, 0), "captured", 4, "--------------------"),     # a level held: held by all
    ((1, 0, 0), "written", 64, "-..................."),    # one of many still shows
    ((63, 63, 63), "captured", 64, "###################-"),  # all but one: not full
    ((0, 0, 0), "flushed", None, "####################"),  # no node count: its level
    ((0, 0, 0), "replicated", 4, "====================")])
def test_the_bar_shares_nodes_by_their_highest_level(counts, level, nodes, expected):
    captured, replicated, flushed = counts
    drawn = bar(row(1, level, nodes_captured=captured, nodes_replicated=replicated,
                    nodes_flushed=flushed), nodes)
    assert drawn == expected


@pytest.mark.timeout(20)
def test_bandwidth_is_the_newest_flushed_checkpoint_over_the_coordinators_times():
    rows = [row(1, "flushed", bytes=8 * MiB, times={"written": 0.0, "captured": 1.0,
                                                     "flushed": 9.0}),
            row(2, "flushed", bytes=6 * MiB, times={"written": 10.0, "flushed": 13.0}),
            row(3, "captured", times={"written": 20.0, "captured": 21.0}),
            row(4, "flushed", times={})]         # rebuilt from the PFS index: no times
    assert bandwidth_line(rows) == ("flush bandwidth: 2.0 MiB/s (step_00002: 6.0 MiB,"
                                    " written to flushed in 3.0 s)")
    assert bandwidth_line(rows[:1]).startswith("flush bandwidth: 1.0 MiB/s (step_00001:")
    assert bandwidth_line(rows[2:]) == ("flush bandwidth: not known yet (no flushed"
                                        " checkpoint with its times)")


@pytest.mark.timeout(20)
def test_a_frame_before_any_checkpoint_and_from_the_pfs_index_alone():
    lines = frame(judged(status_doc([]), live=None))
    assert lines[0] == f"run {RUN}: 4 nodes, agents running? (heartbeat not yet seen to move)"
    assert "no checkpoint yet" in lines
    assert lines[-1].startswith("flush bandwidth: not known yet")
    from_index = {"run": RUN, "state": "unknown (from the PFS index)", "updated": None,
                  "checkpoints": [row(5, "flushed")]}
    lines = frame(from_index)
    assert lines[:2] == [f"run {RUN}: ? nodes, agents unknown (from the PFS index)",
                         "no status file of the agents: levels from the PFS index"]
    assert any(line.startswith("step_00005") and "[####" in line for line in lines)
    assert frame({})[0] == "run ?: ? nodes, agents unknown"


@pytest.mark.timeout(20)
def test_dead_agents_read_not_running_with_the_readers_own_count_of_seconds():
    doc = judged({**status_doc([]), "state": "not running"}, live=False, age=12.4)
    assert frame(doc)[0] == f"run {RUN}: 4 nodes, agents not running (heartbeat unchanged for 12 s)"


# -------------------------------------------------------------- the loop, in-process

@pytest.mark.timeout(30)
def test_the_loop_says_a_status_it_cannot_read_and_stops_on_ctrl_c(cfg, tmp_path):
    path = put_status(cfg, status_doc(two_checkpoints()))
    out = io.StringIO()
    sleeps = []
    before = signal.getsignal(signal.SIGINT)

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 1:
            path.unlink()               # being replaced: neither copy there for a moment
        elif len(sleeps) == 2:
            put_status(cfg, status_doc(two_checkpoints()))
        else:
            raise KeyboardInterrupt
    watch(cfg, 0.5, False, out=out, sleep=sleep)
    frames = out.getvalue().split("\n\n")       # not a terminal: a blank line between
    assert len(frames) == 3 and CLEAR not in out.getvalue()
    assert frames[0].startswith(f"run {RUN}: 4 nodes, agents running?")
    assert frames[1].startswith("status not readable now, the last one read below: run run1:"
                                " no status found")
    assert "step_00100" in frames[1] and "step_00100" in frames[2]
    assert not frames[2].startswith("status not readable")
    assert 0 <= sleeps[0] <= 0.5 and min(sleeps) >= 0
    assert signal.getsignal(signal.SIGINT) is before       # Ctrl-C's handler put back


@pytest.mark.timeout(30)
def test_no_status_at_all_is_the_error_status_gives(monkeypatch, capsys, config_file):
    said = {}
    for command in (["status"], ["watch"], ["watch", "--once"]):
        said[" ".join(command)] = run_main(monkeypatch, capsys, *command, "--config",
                                           str(config_file))
    assert len(set(said.values())) == 1, said
    code, out, err = said["watch"]
    assert (code, out) == (1, "")
    assert err.startswith("cachex: error: run run1: no status found") and err.count("\n") == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("interval", ["0", "-1", "61", "nan", "inf", "soon"])
def test_a_bad_interval_is_a_usage_error(monkeypatch, capsys, config_file, interval):
    code, out, err = run_main(monkeypatch, capsys, "watch", "--interval", interval,
                              "--config", str(config_file))
    assert code == 2 and out == ""
    assert "--interval" in err and "Traceback" not in err


@pytest.mark.timeout(30)
def test_watch_raises_what_status_raises_with_no_status(cfg):
    with pytest.raises(OperationError, match="no status found"):
        watch(cfg, 1.0, False, out=io.StringIO(), sleep=lambda _s: None)


# ------------------------------------------------------------- the installed command

def on_terminal(*args: str) -> tuple[int, subprocess.Popen]:
    """`cachex ARGS` with stdin, stdout and stderr on a new 80x24 pseudo-terminal: the
    process and the terminal's other end, to read from."""
    leader, follower = os.openpty()
    termios.tcsetwinsize(follower, (24, 80))
    proc = subprocess.Popen([str(CACHEX), *args], stdin=follower, stdout=follower,
                            stderr=follower, close_fds=True)
    os.close(follower)
    return leader, proc


def read_until(leader: int, done: Callable[[str], bool], deadline: float, out: bytearray) -> bool:
    """Read into `out` until `done(text)`, the end of the terminal, or the deadline."""
    while not done(out.decode(errors="replace")):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([leader], [], [], left)
        if not ready:
            continue
        try:
            data = os.read(leader, 65536)
        except OSError:             # EIO: every holder of the terminal closed it
            return done(out.decode(errors="replace"))
        if not data:
            return done(out.decode(errors="replace"))
        out += data
    return True


def ended(proc: subprocess.Popen) -> Callable[[str], bool]:
    return lambda _text: proc.poll() is not None


@pytest.mark.timeout(90)
def test_watch_on_a_terminal_draws_frames_and_ctrl_c_exits_0(cfg, config_file):
    put_status(cfg, status_doc(two_checkpoints()))
    leader, proc = on_terminal("watch", "--interval", "0.2", "--config", str(config_file))
    out = bytearray()
    try:
        drawn = read_until(leader, lambda text: text.count(CLEAR) >= 2 and "step_00100"
                           in text.rpartition(CLEAR)[2] and text.endswith("\n"),
                           time.monotonic() + 60, out)
        assert drawn, out.decode(errors="replace")
        before = len(out)
        proc.send_signal(signal.SIGINT)
        read_until(leader, ended(proc), time.monotonic() + 20, out)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = out.decode(errors="replace")
    assert code == 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    last = text.rpartition(CLEAR)[2].replace("\r\n", "\n")
    assert last.startswith(f"run {RUN}: 4 nodes, agents ")
    assert all(len(line) <= 80 for line in last.splitlines())
    assert "step_00100" in last and "[#####=====----------]" in last
    # after Ctrl-C: the rest of a frame at most, then at most a newline
    assert text[before:].replace("\r\n", "\n").count(CLEAR) <= 1


@pytest.mark.timeout(60)
def test_once_prints_one_frame_without_escape_codes(cfg, config_file):
    put_status(cfg, status_doc(two_checkpoints()))
    result = subprocess.run([str(CACHEX), "watch", "--once", "--config", str(config_file)],
                            capture_output=True, text=True, timeout=45)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and "\x1b" not in result.stdout
    lines = result.stdout.splitlines()
    # settled as `cachex status` is: a heartbeat that never moved is dead
    assert lines[0].startswith(f"run {RUN}: 4 nodes, agents not running (heartbeat unchanged")
    assert lines[1].startswith("updated ") and lines[1].endswith("(the coordinator's clock)")
    legend = lines.index("checkpoints; per node: # flushed = replicated - captured . not yet")
    assert [line.split()[:3] for line in lines[legend + 1:legend + 3]] == [
        ["step_00050", "flushed", "[####################]"],
        ["step_00100", "captured", "[#####=====----------]"]]
    assert lines[legend + 3].startswith("flush bandwidth: 1.0 MiB/s (step_00050")
    assert lines[-1] == "step_00100: node 1: pfs: Not a directory"
    assert all(len(line) <= 80 for line in lines) and len(lines) <= 23

    leader, proc = on_terminal("watch", "--once", "--config", str(config_file))
    out = bytearray()
    try:
        read_until(leader, ended(proc), time.monotonic() + 45, out)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    on_tty = out.decode(errors="replace").replace("\r\n", "\n").splitlines()
    assert code == 0 and "\x1b" not in "".join(on_tty)      # not even on a terminal
    # the same frame (above the legend, the seconds this reader waited may differ)
    assert on_tty[on_tty.index(lines[legend]):] == lines[legend:]
