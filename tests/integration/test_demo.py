"""`cachex demo` ended by a signal or by an error ends the agents and trainers it started
(mpiexec, Hydra's proxies and every rank), instead of leaving them running."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from harness import BIN, _alive, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SMALL = ["--steps", "20", "--every", "5"]


def _start(workdir: Path, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "cachex"), "demo", "--workdir", str(workdir),
                             *options], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _descendants(demo: subprocess.Popen[str]) -> list[psutil.Process]:
    try:
        return psutil.Process(demo.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _of_workdir(workdir: Path) -> list[psutil.Process]:
    """Every live process naming the demo's directory: agents (--config), trainers
    (--spool), whatever their parent is now."""
    return [p for p in psutil.process_iter() if str(workdir) in _command(p) and _alive(p)]


def _assert_all_ended(started: list[psutil.Process], workdir: Path) -> None:
    # SIGKILLed processes end asynchronously: bounded, not timed
    wait_for(lambda: not any(_alive(p) for p in started) and not _of_workdir(workdir), 30,
             "the demo's agents and trainers to end")
    assert not [p for p in started if _alive(p)]


def _end_leftovers(demo: subprocess.Popen[str], workdir: Path) -> None:
    """A failing test leaves nothing running either (orphans are no longer the demo's
    descendants, but they name its directory)."""
    kill_tree(demo)
    for process in _of_workdir(workdir):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def test_sigterm_while_agents_and_the_trainer_run_ends_them_all(tmp_path):
    workdir = tmp_path / "demo"
    demo = _start(workdir, *SMALL)
    try:
        def running() -> list[psutil.Process]:
            tree = _descendants(demo)
            commands = [_command(p) for p in tree]
            agents = sum("cachex-agent --config" in c for c in commands)
            trainers = sum("trainer.py" in c and "python" in c for c in commands)
            return tree if agents >= 4 and trainers >= 8 else []
        started = wait_for(running, 120, "4 agents and 8 trainer ranks")
        started = _descendants(demo)        # the ranks forked since
        demo.send_signal(signal.SIGTERM)
        out, err = demo.communicate(timeout=60)
        assert demo.returncode == 1, (out, err)
        assert err.strip().splitlines() == [
            "cachex: error: demo ended by SIGTERM; its agents and trainers are ended too"], err
        _assert_all_ended(started, workdir)
    finally:
        _end_leftovers(demo, workdir)


def test_a_trainer_that_fails_ends_the_demo_at_once_and_its_agents(tmp_path):
    workdir = tmp_path / "demo"
    demo = _start(workdir, *SMALL, "--shard-size", "12.5QiB")   # the trainer refuses it
    try:
        seen: dict[psutil.Process, str] = {}

        def ended() -> bool:
            # each poll's command line, not the first one seen: a rank first seen just
            # forked by Hydra's proxy still shows the proxy's until its exec
            for process in _descendants(demo):
                command = _command(process)
                if command or process not in seen:
                    seen[process] = command
            return demo.poll() is not None
        wait_for(ended, 240, "the demo to fail", poll=0.05)
        err = demo.stderr.read()
        assert demo.returncode == 1, err
        line = err.strip().splitlines()[-1]     # after the trainer's own usage lines
        assert line.startswith("cachex: error: ") and "trainer.py" in line, line
        assert "while waiting for step_00015 to be replicated" in line, line
        # the agents were up (the trainer starts only then) and are ended with the demo
        assert sum("cachex-agent --config" in c for c in seen.values()) >= 4, seen
        _assert_all_ended(list(seen), workdir)
    finally:
        _end_leftovers(demo, workdir)
