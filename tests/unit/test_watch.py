"""SpoolWatcher with real files: inotify and polling-only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachex_agent.rules import (
    AutoRule,
    CommitRule,
    DcpRule,
    DeepSpeedRule,
    MarkerRule,
    QuiescenceRule,
    TorchFileRule,
)
from cachex_agent.stage.watch import SpoolWatcher

pytestmark = pytest.mark.timeout(60)

BOUND = 15.0        # generous: a commit must be reported well within this
SLOW_SCAN = 120.0   # with inotify, a scan this slow cannot be what reported a commit


def wait_for(condition: Callable[[], bool], timeout: float = BOUND) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class Recorder:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, ckpt_id: str) -> None:
        with self.lock:
            self.ids.append(ckpt_id)

    def snapshot(self) -> list[str]:
        with self.lock:
            return list(self.ids)

    def has(self, *ids: str) -> Callable[[], bool]:
        return lambda: all(i in self.snapshot() for i in ids)


@pytest.fixture
def make_watcher() -> Iterator[Callable[..., tuple[SpoolWatcher, Recorder]]]:
    started: list[SpoolWatcher] = []

    def make(spool: Path, rule: CommitRule, *, inotify: bool, scan: float | None = None
             ) -> tuple[SpoolWatcher, Recorder]:
        recorder = Recorder()
        if scan is None:
            scan = SLOW_SCAN if inotify else 0.2
        watcher = SpoolWatcher(spool, rule, recorder, scan=scan, use_inotify=inotify)
        watcher.start()
        started.append(watcher)
        return watcher, recorder

    yield make
    for watcher in started:
        watcher.stop()
        assert not watcher.alive


def settle_watcher(watcher: SpoolWatcher) -> None:
    """Wait until the watcher thread has done its first look at an existing spool."""
    assert wait_for(lambda: watcher.inotify_active if watcher.use_inotify else True)


def write_shards(ckpt: Path, ranks: int = 4, size: int = 64 * 1024) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        with open(ckpt / f"__{rank}_0.distcp", "wb") as handle:
            for _ in range(4):
                handle.write(os.urandom(size // 4))
                handle.flush()


def commit_dcp(ckpt: Path) -> None:
    (ckpt / ".metadata.tmp").write_bytes(b"metadata")
    os.replace(ckpt / ".metadata.tmp", ckpt / ".metadata")


both = pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])


@both
def test_dcp_reported_after_metadata_not_before(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, DcpRule(), inotify=inotify)
    settle_watcher(watcher)
    ckpt = spool / "step_00100"
    write_shards(ckpt)
    (ckpt / ".metadata.tmp").write_bytes(b"half")
    # Half-written: give the watcher time to look (events, several polls), then also force
    # an evaluation; nothing may be reported.
    time.sleep(0.6)
    assert watcher.rescan() == []
    assert seen.snapshot() == []
    commit_dcp(ckpt)
    committed_at = time.monotonic()
    assert wait_for(seen.has("step_00100"))
    assert time.monotonic() - committed_at < BOUND
    assert seen.snapshot() == ["step_00100"]
    if inotify:
        assert watcher.inotify_active


@both
def test_reported_once_in_order(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    spool.mkdir()
    for step in (10, 9):          # committed before the watcher started
        write_shards(spool / f"step_{step}", ranks=1)
        commit_dcp(spool / f"step_{step}")
    watcher, seen = make_watcher(spool, DcpRule(), inotify=inotify)
    assert wait_for(seen.has("step_9", "step_10"))
    assert seen.snapshot() == ["step_9", "step_10"]
    write_shards(spool / "step_11", ranks=1)
    commit_dcp(spool / "step_11")
    assert wait_for(seen.has("step_11"))
    for _ in range(5):
        (spool / "step_11" / "touch").write_bytes(b"more events")
        watcher.rescan()
    time.sleep(0.5)
    assert seen.snapshot() == ["step_9", "step_10", "step_11"]


@both
def test_spool_created_after_start(tmp_path, make_watcher, inotify):
    spool = tmp_path / "later" / "spool"
    watcher, seen = make_watcher(spool, DcpRule(), inotify=inotify)
    time.sleep(0.3)
    assert watcher.alive and seen.snapshot() == []
    ckpt = spool / "step_1"
    write_shards(ckpt, ranks=1)
    assert not (ckpt / ".metadata").exists()
    time.sleep(0.8)   # the watcher finds the spool (polls every <= 0.5 s)
    assert seen.snapshot() == []
    commit_dcp(ckpt)
    assert wait_for(seen.has("step_1"))


def test_nested_dirs_created_after_start_inotify(tmp_path, make_watcher):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, MarkerRule("*/meta/deep/DONE"), inotify=True)
    settle_watcher(watcher)
    deep = spool / "step_1" / "meta" / "deep"
    deep.mkdir(parents=True)
    (deep / "data").write_bytes(b"x")
    time.sleep(0.3)
    assert seen.snapshot() == []
    # The marker lands in a directory whose watch was added after the watcher started.
    assert wait_for(lambda: len(watcher._wds) >= 4)
    (deep / "DONE").write_bytes(b"")
    assert wait_for(seen.has("step_1"))


def test_directory_renamed_into_spool_inotify(tmp_path, make_watcher):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, MarkerRule("*/COMMITTED"), inotify=True)
    settle_watcher(watcher)
    # Orbax/HF style: written under a temporary name, complete before the rename.
    staging = spool / "step_7.orbax-checkpoint-tmp-123"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "x").write_bytes(b"x")
    (staging / "COMMITTED").write_bytes(b"")
    time.sleep(0.3)
    assert seen.snapshot() == []
    os.rename(staging, spool / "step_7")
    assert wait_for(seen.has("step_7"))
    # A tree built outside the spool and moved in arrives with no event of its own files.
    outside = tmp_path / "outside" / "step_8"
    (outside / "a" / "b").mkdir(parents=True)
    os.rename(outside, spool / "step_8")
    assert wait_for(lambda: any(p.name == "b" for p in watcher._wds.values()))
    (spool / "step_8" / "COMMITTED").write_bytes(b"")
    assert wait_for(seen.has("step_8"))


@both
def test_deepspeed_latest(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, DeepSpeedRule(), inotify=inotify)
    settle_watcher(watcher)
    for step in (10, 20):
        ckpt = spool / f"global_step{step}"
        ckpt.mkdir()
        (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"m")
        (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"o")
        time.sleep(0.3)
        assert f"global_step{step}" not in seen.snapshot()
        (spool / "latest").write_text(f"global_step{step}")
        assert wait_for(seen.has(f"global_step{step}"))
    assert seen.snapshot() == ["global_step10", "global_step20"]


@both
def test_marker_glob(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, MarkerRule("*/COMMITTED"), inotify=inotify)
    settle_watcher(watcher)
    (spool / "ckpt_a").mkdir()
    (spool / "ckpt_a" / "w.bin").write_bytes(b"w")
    time.sleep(0.3)
    assert seen.snapshot() == []
    (spool / "ckpt_a" / "COMMITTED").write_bytes(b"")
    assert wait_for(seen.has("ckpt_a"))


@both
def test_quiescence_waits_for_writer_and_settle(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    ckpt = spool / "run_1"
    ckpt.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys,time; f=open(sys.argv[1],'wb'); f.write(b'x'*1000); f.flush();"
         " print('ready', flush=True); time.sleep(120)", str(ckpt / "model.bin")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        # scan is slow on purpose: only the settle-driven period can report it.
        watcher, seen = make_watcher(spool, QuiescenceRule(0.3), inotify=inotify,
                                     scan=SLOW_SCAN)
        time.sleep(1.5)   # many settle periods, but the file is still open for writing
        assert seen.snapshot() == []
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    assert wait_for(seen.has("run_1"))
    # An empty directory never commits.
    (spool / "empty").mkdir()
    time.sleep(1.0)
    assert seen.snapshot() == ["run_1"]


def test_auto_mixed(tmp_path, make_watcher):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, AutoRule(0.3), inotify=True)
    settle_watcher(watcher)
    write_shards(spool / "step_1", ranks=2)                  # DCP, no .metadata here
    (spool / "generic").mkdir()
    (spool / "generic" / "state.pt").write_bytes(b"s")
    assert wait_for(seen.has("generic"))
    time.sleep(0.5)
    assert "step_1" not in seen.snapshot()
    commit_dcp(spool / "step_1")
    assert wait_for(seen.has("step_1"))


@both
def test_forget_reports_recreated_checkpoint(tmp_path, make_watcher, inotify):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, DcpRule(), inotify=inotify)
    ckpt = spool / "step_5"
    write_shards(ckpt, ranks=1)
    commit_dcp(ckpt)
    assert wait_for(seen.has("step_5"))
    for child in ckpt.iterdir():
        child.unlink()
    ckpt.rmdir()
    watcher.forget("step_5")
    write_shards(ckpt, ranks=1)
    time.sleep(0.5)
    assert seen.snapshot() == ["step_5"]
    commit_dcp(ckpt)
    assert wait_for(lambda: seen.snapshot() == ["step_5", "step_5"])


class FlakyRule(CommitRule):
    """Fails a few times (as when a directory vanishes mid-scan), then works."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def _select(self, spool: Path, names: list[str]) -> list[str]:
        self.calls += 1
        if self.calls <= self.failures:
            raise FileNotFoundError(2, "vanished mid-scan", str(spool / "gone"))
        return names


def test_rule_errors_do_not_kill_the_thread(tmp_path, make_watcher):
    spool = tmp_path / "spool"
    (spool / "ckpt").mkdir(parents=True)
    rule = FlakyRule(failures=3)
    watcher, seen = make_watcher(spool, rule, inotify=False, scan=0.1)
    assert wait_for(seen.has("ckpt"))
    assert rule.calls > 3 and watcher.alive


class BuggyRule(CommitRule):
    """A rule with a bug (not an unreadable or unparsable trainer file)."""

    name = "buggy"

    def _select(self, spool: Path, names: list[str]) -> list[str]:
        raise TypeError("a bug in the rule")


@pytest.mark.parametrize("where", ["rule", "callback"])
def test_a_bug_in_the_rule_or_the_callback_ends_the_watcher_through_excepthook(
        tmp_path, monkeypatch, where):
    """Only an unreadable spool or trainer file is retried: a bug reaches
    threading.excepthook (the agent's ends the agent) instead of a watcher that goes
    on without ever reporting the checkpoint."""
    spool = tmp_path / "spool"
    (spool / "a").mkdir(parents=True)
    (spool / "a" / "OK").write_bytes(b"")
    hooked: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: hooked.append(args.exc_value))

    def explode(ckpt_id: str) -> None:
        raise RuntimeError(f"boom on {ckpt_id}")
    rule = BuggyRule() if where == "rule" else MarkerRule("*/OK")
    watcher = SpoolWatcher(spool, rule, explode, scan=0.1, use_inotify=True)
    watcher.start()
    try:
        assert wait_for(lambda: hooked and not watcher.alive)
        expected = TypeError if where == "rule" else RuntimeError
        assert isinstance(hooked[0], expected)
    finally:
        watcher.stop()


def test_spool_removed_and_recreated(tmp_path, make_watcher):
    spool = tmp_path / "spool"
    spool.mkdir()
    watcher, seen = make_watcher(spool, DcpRule(), inotify=True)
    settle_watcher(watcher)
    spool.rmdir()
    assert wait_for(lambda: not watcher.inotify_active)
    write_shards(spool / "step_1", ranks=1)
    commit_dcp(spool / "step_1")
    assert wait_for(seen.has("step_1"))
    assert watcher.alive


def test_rescan_without_thread_and_stop_is_bounded(tmp_path):
    spool = tmp_path / "spool"
    write_shards(spool / "step_3", ranks=1)
    commit_dcp(spool / "step_3")
    seen = Recorder()
    watcher = SpoolWatcher(spool, DcpRule(), seen, scan=SLOW_SCAN)
    assert watcher.rescan() == ["step_3"]
    assert watcher.rescan() == []
    assert watcher.reported == frozenset({"step_3"})
    watcher.start()
    assert wait_for(lambda: watcher.inotify_active)
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 5
    assert not watcher.alive and not watcher.inotify_active
    assert seen.snapshot() == ["step_3"]


def test_reentrant_rescan_from_callback_reports_once(tmp_path):
    spool = tmp_path / "spool"
    for step in (1, 2, 3):
        write_shards(spool / f"step_{step}", ranks=1)
        commit_dcp(spool / f"step_{step}")
    calls: list[str] = []
    watcher: SpoolWatcher

    def on_commit(ckpt_id: str) -> None:
        calls.append(ckpt_id)
        watcher.rescan()

    watcher = SpoolWatcher(spool, DcpRule(), on_commit, scan=SLOW_SCAN)
    watcher.rescan()
    assert calls == ["step_1", "step_2", "step_3"]


def test_a_directory_seen_then_deleted_is_removed_until_it_comes_back(tmp_path):
    spool = tmp_path / "spool"
    write_shards(spool / "step_1", ranks=1)
    watcher = SpoolWatcher(spool, DcpRule(), Recorder(), scan=SLOW_SCAN)
    watcher.rescan()
    assert not watcher.removed("step_1") and not watcher.removed("step_2")
    shutil.rmtree(spool / "step_1")              # the trainer's retention, before a capture
    assert watcher.removed("step_1")
    assert not watcher.removed("step_2")         # never seen: it may still come
    write_shards(spool / "step_1", ranks=1)
    assert not watcher.removed("step_1")


class FakeClock:
    """The settle timers' clock, moved by the test (the files and /proc are real)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("make_rule, write", [
    (lambda clock: TorchFileRule(0.5, clock),
     lambda spool, data: (spool / "last.ckpt").write_bytes(data)),
    (lambda clock: MarkerRule("*/COMMITTED"),
     lambda spool, data: ((spool / "latest").mkdir(exist_ok=True),
                          (spool / "latest" / "w.bin").write_bytes(data),
                          (spool / "latest" / "COMMITTED").write_bytes(data[:4]))),
], ids=["torch", "marker"])
def test_a_name_committed_again_by_a_new_save_is_reported_again(tmp_path, make_rule, write):
    clock = FakeClock()
    again = Recorder()
    first = Recorder()
    watcher = SpoolWatcher(tmp_path, make_rule(clock), first, scan=SLOW_SCAN,
                           use_inotify=False, on_again=again)
    name = "last.ckpt" if isinstance(watcher.rule, TorchFileRule) else "latest"
    for save, data in enumerate((b"save one", b"save two!!", b"save three")):
        write(tmp_path, data)
        watcher.rescan()                    # the settle timer starts (torch)
        clock.now += 1.0
        watcher.rescan()
        watcher.rescan()                    # nothing new: reported once per save
        assert first.snapshot() == [name]
        assert again.snapshot() == [name] * (save + 1)     # every save, the first too


def test_a_new_save_not_accounted_for_is_offered_again(tmp_path):
    """`on_again` answering False (a capture of the name is still running) hears of the
    same save at the next evaluation, and no more once it answers True."""
    answers = [False, False, True]
    asked: list[str] = []

    def on_again(name: str) -> bool:
        asked.append(name)
        return answers[len(asked) - 1]
    watcher = SpoolWatcher(tmp_path, MarkerRule("*/COMMITTED"), Recorder(),
                           scan=SLOW_SCAN, use_inotify=False, on_again=on_again)
    (tmp_path / "latest").mkdir()
    (tmp_path / "latest" / "COMMITTED").write_bytes(b"1")
    for _ in range(5):
        watcher.rescan()
    assert asked == ["latest"] * 3
