"""The tests' faults (faults.py) reach the work through one hook on `Handle`: none
installed, the handle's fault points do nothing; installed from an environment, each
fault acts at its stage and node (or rank) only. Real handles, real threads, real files."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import cachex_agent
from cachex_agent import faults
from cachex_agent.flush.flusher import FlushHandle
from cachex_agent.handles import Handle, Point, Stage, StageLog
from cachex_agent.peer.encoder import EncodeHandle
from cachex_agent.peer.replicator import ReplicateHandle
from cachex_agent.recovery.restore_handle import RestoreHandle
from cachex_agent.stage.worker import CaptureHandle

CKPT = "step_00004"
# every kind of handle whose work has a fault point, by the stage it is
KINDS: dict[Stage, type[Handle]] = {Stage.CAPTURE: CaptureHandle,
                                    Stage.REPLICATE: ReplicateHandle,
                                    Stage.FLUSH: FlushHandle, Stage.RESTORE: RestoreHandle}
SETTLE = 0.3     # long enough for a thread that would not block to have ended


class Quiet:
    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        return {}


def handle(stage: Stage) -> Handle:
    """A bare handle of `stage`: the fault points need nothing of a subclass's work."""
    kind = type(f"{stage.value.title()}Work", (Handle,), {"stage": stage})
    return kind(CKPT, 2, StageLog(Quiet()))


@pytest.fixture
def install(monkeypatch):
    """faults.install from a given environment; the process's hook put back after."""
    monkeypatch.setattr(Handle, "faults", None)

    def from_env(**env: str) -> faults.EnvFaults | None:
        return faults.install(env)
    return from_env


def in_thread(action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def returns(call: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """`call` ends at once: a fault point that held or paused it fails the test here
    instead of hanging it."""
    thread = in_thread(lambda: call(*args, **kwargs))
    thread.join(5)
    assert not thread.is_alive()


# ------------------------------------------------------------------ no hook
@pytest.mark.parametrize("env", [{}, {"CACHEX_TEST_CLOCK_FILE": "/x", "CACHEX_TEST_HOLD": ""}],
                         ids=["empty", "no fault set"])
def test_without_a_fault_in_the_environment_no_hook_is_installed(install, env):
    assert install(**env) is None
    assert Handle.faults is None


def test_install_replaces_an_earlier_hook(install):
    assert install(CACHEX_TEST_HOLD="flush:1") is not None
    assert install() is None and not FlushHandle.held(1)


def test_with_no_hook_every_fault_point_does_nothing(install, tmp_path):
    install()
    for stage in Stage:
        work = handle(stage)
        assert not any(work.held(node) for node in range(4))
        returns(work.hold, 1)
        returns(work.hold, 1, until=())
        work.at(Point.START, rank=2)
        returns(work.at, Point.FILE, node=0, timeout=60.0)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------- holds
@pytest.mark.parametrize("stage", list(KINDS))
def test_a_hold_holds_its_stage_on_its_node_only(install, stage):
    install(CACHEX_TEST_HOLD=f"{stage.value}:1")
    for other, kind in KINDS.items():
        assert [kind.held(node) for node in range(3)] == [False, other == stage, False], other
    assert EncodeHandle.held(1) == (stage == Stage.REPLICATE)   # parity is replication too


def test_a_held_worker_waits_until_its_handle_is_cancelled(install):
    install(CACHEX_TEST_HOLD="capture:1")
    work = handle(Stage.CAPTURE)
    returns(handle(Stage.CAPTURE).hold, 0)      # another node
    returns(handle(Stage.FLUSH).hold, 1)        # another stage
    thread = in_thread(lambda: work.hold(1))
    thread.join(SETTLE)
    assert thread.is_alive()
    work.cancel()
    thread.join(5)
    assert not thread.is_alive()


def test_a_hold_ends_on_any_event_it_was_given(install):
    install(CACHEX_TEST_HOLD="flush:0")
    work, stop = handle(Stage.FLUSH), threading.Event()
    thread = in_thread(lambda: work.hold(0, until=(stop, work.cancelled)))
    thread.join(SETTLE)
    assert thread.is_alive()
    stop.set()                              # the flusher closing, not a cancel
    thread.join(5)
    assert not thread.is_alive()


def test_a_hold_given_no_event_outlasts_a_cancel(install):
    install(CACHEX_TEST_HOLD="replicate:3")
    work = handle(Stage.REPLICATE)
    thread = in_thread(lambda: work.hold(3, until=()))
    work.cancel()
    thread.join(SETTLE)
    assert thread.is_alive()
    Handle.faults = None                    # the hook gone: nothing holds it any more
    thread.join(5)
    assert not thread.is_alive()


# ------------------------------------------------------------ capture fails
def test_the_capture_of_its_rank_alone_raises(install):
    install(CACHEX_TEST_FAIL_CAPTURE="2")
    handle(Stage.CAPTURE).at(Point.START, rank=1)
    handle(Stage.FLUSH).at(Point.START, rank=2)
    with pytest.raises(RuntimeError, match="^CACHEX_TEST_FAIL_CAPTURE=2$"):
        handle(Stage.CAPTURE).at(Point.START, rank=2)
    returns(handle(Stage.CAPTURE).at, Point.FILE, node=2, timeout=60.0)


# ------------------------------------------------------------ capture pause
def test_the_capture_of_its_node_pauses_once_per_checkpoint(install, tmp_path):
    install(CACHEX_TEST_CAPTURE_PAUSE=f"0:{tmp_path}")
    returns(handle(Stage.CAPTURE).at, Point.FILE, node=1, timeout=60.0)
    returns(handle(Stage.FLUSH).at, Point.FILE, node=0, timeout=60.0)
    assert list(tmp_path.iterdir()) == []
    work = handle(Stage.CAPTURE)
    thread = in_thread(lambda: work.at(Point.FILE, node=0, timeout=60.0))
    thread.join(SETTLE)
    assert thread.is_alive() and (tmp_path / f"paused-{CKPT}").exists()
    (tmp_path / f"resume-{CKPT}").touch()
    thread.join(5)
    assert not thread.is_alive()
    (tmp_path / f"resume-{CKPT}").unlink()
    returns(work.at, Point.FILE, node=0, timeout=60.0)     # paused once only


def test_a_paused_capture_goes_on_when_cancelled_or_past_its_timeout(install, tmp_path):
    install(CACHEX_TEST_CAPTURE_PAUSE=f"0:{tmp_path}")
    cancelled = handle(Stage.CAPTURE)
    thread = in_thread(lambda: cancelled.at(Point.FILE, node=0, timeout=60.0))
    thread.join(SETTLE)
    assert thread.is_alive()
    cancelled.cancel()
    thread.join(5)
    assert not thread.is_alive()
    late = handle(Stage.CAPTURE)
    late.ckpt = "step_00008"
    late.at(Point.FILE, node=0, timeout=0.1)        # no resume file: the timeout ends it
    assert (tmp_path / "paused-step_00008").exists()


# --------------------------------------------------------------------- pace
def test_pace_slows_a_restore_between_files_only(install, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(faults, "time", SimpleNamespace(sleep=slept.append,
                                                        monotonic=time.monotonic))
    install(CACHEX_TEST_PACE="0.5")
    handle(Stage.FLUSH).at(Point.FILE, node=0, timeout=60.0)
    handle(Stage.RESTORE).at(Point.START)
    assert slept == []
    handle(Stage.RESTORE).at(Point.FILE)
    assert slept == [0.5]


# --------------------------------------------------------------- one reader
def test_no_product_module_reads_a_test_switch_or_imports_faults():
    package = Path(cachex_agent.__file__).parent
    readers = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        text = path.read_text()
        if name != "faults.py" and "CACHEX_TEST_" in text:
            readers.append(f"{name}: names a test switch")
        if name not in ("faults.py", "cli.py") and re.search(
                r"^\s*(from \.+ import [^\n]*\bfaults\b|import [\w.]*faults|from [\w.]*faults"
                r" import)", text, re.M):
            readers.append(f"{name}: imports faults")
    assert readers == []
