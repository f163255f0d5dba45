"""The asynchronous flusher: real stage files, real HDF5 bundles, real worker threads.

Conditions are awaited by polling with a bounded deadline; nothing asserts on timing.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachex_agent.config import Flush
from cachex_agent.events import EventLog, read_events
from cachex_agent.flush.bundle import extract, read_manifest, verify_bundle
from cachex_agent.flush.flusher import Flusher
from cachex_agent.handles import Stage, StageLog, State
from cachex_agent.journal import Journal
from cachex_agent.layout import bundle_path, pfs_ckpt_dir
from cachex_agent.manifest import LocalManifest
from cachex_agent.messages import wire
from cachex_agent.stage.capture import capture_copy, list_files

CKPT = "step_00100"
NODE = 1
CHUNK = 64 * 1024
SETTINGS = Flush(retry_max=0.2, chunk=CHUNK, concurrency=1)
DEADLINE = 10.0


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Poll `condition` until it is truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Reports:
    """The thread-safe report callback: collects every dict the flusher hands over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[dict[str, Any]] = []

    def __call__(self, report: Any) -> None:
        with self._lock:
            self._items.append(wire(report))     # as it travels

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items)

    def of(self, kind: str, ckpt: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.all() if r["type"] == kind and (ckpt is None or r["ckpt"] == ckpt)]


def stage_checkpoint(tmp_path: Path, ckpt: str = CKPT, seed: int = 3) -> tuple[LocalManifest,
                                                                               Path]:
    """A trainer's files in the spool, captured into the stage; return (manifest, stage dir)."""
    spool = tmp_path / "spool" / ckpt
    rng = np.random.default_rng(seed)
    files = {
        ".metadata": b"metadata of " + ckpt.encode(),
        "__1_0.distcp": rng.integers(0, 256, 3 * CHUNK + 77, dtype=np.uint8).tobytes(),
        "optim/state.bin": rng.integers(0, 256, 1000, dtype=np.uint8).tobytes(),
        "empty": b"",
    }
    for name, data in files.items():
        (spool / name).parent.mkdir(parents=True, exist_ok=True)
        (spool / name).write_bytes(data)
    stage = tmp_path / "stage" / ckpt
    stage.parent.mkdir(parents=True, exist_ok=True)
    entries = capture_copy(spool, stage, list_files(spool), CHUNK)
    manifest = LocalManifest(run="run1", ckpt=ckpt, seq=int(ckpt.rsplit("_", 1)[1]),
                             node=NODE, host="nid0001", rank=NODE, files=entries)
    return manifest, stage


@pytest.fixture
def pfs_run(tmp_path: Path) -> Path:
    run = tmp_path / "pfs" / "run1"
    run.mkdir(parents=True)
    return run


@pytest.fixture
def events(tmp_path: Path):
    log = EventLog(tmp_path / "journal" / "events.jsonl", node=NODE)
    yield log
    log.close()


@pytest.fixture
def make_flusher(pfs_run: Path, events: EventLog):
    made: list[Flusher] = []

    def make(settings: Flush = SETTINGS, log: EventLog | None = None) -> tuple[Flusher, Reports]:
        reports = Reports()
        flusher = Flusher(pfs_run, settings, log or events, reports)
        made.append(flusher)
        return flusher, reports

    yield make
    for flusher in made:            # never leave worker threads behind
        flusher.close(timeout=0)
        wait_for(lambda f=flusher: not f.pending(), "flusher threads to finish")


def block_pfs(pfs_run: Path) -> Path:
    """Make `<pfs>/<run>/ckpt` a regular file: mkdir under it fails with ENOTDIR (even as root)."""
    obstacle = pfs_run / "ckpt"
    obstacle.write_bytes(b"not a directory")
    return obstacle


def flush_events(path: Path, ckpt: str = CKPT) -> list[dict[str, Any]]:
    return [e for e in read_events(path) if e.get("ckpt") == ckpt]


# ---------------------------------------------------------------------------- success

@pytest.mark.timeout(20)
def test_flush_writes_the_bundle_and_reports(tmp_path, pfs_run, events, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    wait_for(lambda: reports.of("flushed"), "the flushed report")
    assert flusher.close(timeout=5) == []

    target = pfs_run / "ckpt" / CKPT / "node-00001.h5"
    assert target == bundle_path(pfs_run, CKPT, NODE)
    assert target.parent == pfs_ckpt_dir(pfs_run, CKPT)
    assert target.is_file()
    assert verify_bundle(target, manifest.files) == []
    assert read_manifest(target).files == manifest.files
    # No temp siblings on the PFS.
    assert sorted(p.name for p in target.parent.iterdir()) == ["node-00001.h5"]

    out = tmp_path / "restored"
    extract(target, out)
    for entry in manifest.files:
        assert (out / entry.path).read_bytes() == (stage / entry.path).read_bytes()

    seq = reports.all()
    assert {r["type"] for r in seq} <= {"progress", "flushed"}
    last = seq[-1]
    assert last["type"] == "flushed"
    assert last["adopted"] is False
    assert last["ckpt"] == CKPT and last["node"] == NODE and last["bundle"] == "node-00001.h5"
    for progress in reports.of("progress"):
        assert progress["total"] == manifest.bytes
        assert 0 < progress["done"] <= manifest.bytes

    evs = flush_events(events.path)
    assert [e["event"] for e in evs] == ["flush_queued", "flush_start", "flushed"]
    # one events schema (handles.py): stage, state, ckpt, seq on every stage event
    assert [(e["stage"], e["state"], e["seq"]) for e in evs] == [
        ("flush", s, manifest.seq) for s in ("queued", "running", "done")]
    evs = evs[1:]
    assert evs[0]["bytes"] == manifest.bytes and evs[0]["target"] == str(target)
    assert evs[1]["adopted"] is False and evs[1]["node"] == NODE
    assert evs[0]["t"] <= evs[1]["t"]


@pytest.mark.timeout(20)
def test_flush_states_reach_the_journal_before_the_report(tmp_path, pfs_run, events):
    """A FlushHandle (handles.py): queued, running, done with its bundle in the journal,
    which holds `done` by the time the coordinator could hear `flushed`."""
    manifest, stage = stage_checkpoint(tmp_path)
    journal = Journal(tmp_path / "journal")
    seen: list[str | None] = []

    def report(msg: Any) -> None:
        if msg.TYPE == "flushed":
            seen.append(Journal(journal.root).entry(CKPT).state(Stage.FLUSH))

    flusher = Flusher(pfs_run, SETTINGS, events, report, StageLog(events, journal))
    handle = flusher.submit(manifest, stage)
    assert handle.wait(DEADLINE) and handle.test() and handle.state == State.DONE
    assert flusher.close(timeout=5) == []
    assert seen == [State.DONE]
    entry = Journal(journal.root).get(CKPT)
    assert entry["stages"] == {"flush": "done"} and entry["bundle"] == "node-00001.h5"
    assert not handle.cancel()


@pytest.mark.timeout(20)
def test_a_flush_stays_pending_until_its_report_is_out(tmp_path, pfs_run, events):
    """A drain asks `pending()` before it says `drained`: a flush done but not yet
    reported counted as finished, and the coordinator heard `drained` before `flushed`."""
    manifest, stage = stage_checkpoint(tmp_path)
    in_report, release = threading.Event(), threading.Event()

    def report(msg: Any) -> None:
        if msg.TYPE == "flushed":
            in_report.set()
            release.wait(DEADLINE)

    flusher = Flusher(pfs_run, SETTINGS, events, report)
    handle = flusher.submit(manifest, stage)
    assert in_report.wait(DEADLINE)
    assert handle.test() and handle.state == State.DONE     # recorded before the report
    assert flusher.pending() == [CKPT]
    release.set()
    wait_for(lambda: flusher.pending() == [], "the worker returned")
    assert flusher.close(timeout=5) == []


@pytest.mark.timeout(20)
def test_resubmitting_a_queued_ckpt_is_a_no_op(tmp_path, pfs_run, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    obstacle = block_pfs(pfs_run)
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    wait_for(lambda: reports.of("flush_error"), "a first failure")
    flusher.submit(manifest, stage)          # still retrying: must not queue a second one
    obstacle.unlink()
    wait_for(lambda: reports.of("flushed"), "the flushed report")
    assert flusher.close(timeout=5) == []
    assert len(reports.of("flushed")) == 1


# --------------------------------------------------------------------------- adoption

@pytest.mark.timeout(20)
def test_restarted_flusher_adopts_a_complete_bundle(tmp_path, pfs_run, events, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    first, first_reports = make_flusher()
    first.submit(manifest, stage)
    wait_for(lambda: first_reports.of("flushed"), "the first flush")
    assert first.close(timeout=5) == []
    target = bundle_path(pfs_run, CKPT, NODE)
    before = target.stat()

    # The agent restarts (new flusher, new event log on the same file) before the
    # coordinator's commit, and submits the same checkpoint again.
    restarted_events = EventLog(events.path, node=NODE)
    try:
        second, reports = make_flusher(log=restarted_events)
        second.submit(LocalManifest.from_json(manifest.to_json()), stage)
        wait_for(lambda: reports.of("flushed"), "the adoption report")
        assert second.close(timeout=5) == []
    finally:
        restarted_events.close()

    last = reports.all()[-1]
    assert last["type"] == "flushed" and last["adopted"] is True
    assert reports.of("flush_error") == []
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino, before.st_mtime_ns, before.st_size)
    names = [e["event"] for e in flush_events(events.path)]
    assert names == ["flush_queued", "flush_start", "flushed",    # no second flush_start
                     "flush_queued", "flushed"]
    assert flush_events(events.path)[-1]["adopted"] is True


@pytest.mark.timeout(20)
def test_a_bundle_of_other_files_is_rewritten_not_adopted(tmp_path, pfs_run, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    first, first_reports = make_flusher()
    first.submit(manifest, stage)
    wait_for(lambda: first_reports.of("flushed"), "the first flush")
    assert first.close(timeout=5) == []
    target = bundle_path(pfs_run, CKPT, NODE)
    old_inode = target.stat().st_ino

    # The same checkpoint id captured again with different content (a relaunch that
    # rewrote it): the bundle on the PFS no longer matches and must not be adopted.
    other, other_stage = stage_checkpoint(tmp_path / "again", seed=99)
    assert other.files != manifest.files
    second, reports = make_flusher()
    second.submit(other, other_stage)
    wait_for(lambda: reports.of("flushed"), "the second flush")
    assert second.close(timeout=5) == []
    assert reports.of("flushed")[-1]["adopted"] is False
    assert target.stat().st_ino != old_inode
    assert verify_bundle(target, other.files) == []


# ------------------------------------------------------------------- failure and retry

@pytest.mark.timeout(20)
def test_unwritable_pfs_is_retried_until_it_recovers(tmp_path, pfs_run, events, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    obstacle = block_pfs(pfs_run)
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    errors = wait_for(lambda: len(reports.of("flush_error")) >= 2 and reports.of("flush_error"),
                      "two failed attempts (a retry)")
    for error in errors:
        assert error["final"] is False
        assert error["ckpt"] == CKPT and error["node"] == NODE
        assert SETTINGS.retry_max / 2 <= error["retry_in"] <= SETTINGS.retry_max
        assert "Not a directory" in error["error"]
        assert str(obstacle) in error["error"]
    assert flusher.pending() == [CKPT]
    assert reports.of("flushed") == []

    obstacle.unlink()
    wait_for(lambda: reports.of("flushed"), "the flush after the PFS recovered")
    assert flusher.close(timeout=5) == []
    assert reports.all()[-1]["type"] == "flushed"
    assert reports.all()[-1]["adopted"] is False
    assert verify_bundle(bundle_path(pfs_run, CKPT, NODE), manifest.files) == []
    evs = flush_events(events.path)
    names = [e["event"] for e in evs]
    assert names[-2:] == ["flush_start", "flushed"]
    assert names[0] == "flush_queued"
    assert set(names[1:-2]) == {"flush_error"} and len(names) >= 5
    assert all(e["final"] is False for e in evs if e["event"] == "flush_error")


@pytest.mark.timeout(20)
def test_missing_staged_copy_is_a_final_error(tmp_path, pfs_run, events, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    for path in sorted(stage.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    stage.rmdir()
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    wait_for(lambda: not flusher.pending(), "the flush to give up")
    errors = reports.of("flush_error")
    assert len(errors) == 1
    assert errors[0]["final"] is True
    assert str(stage) in errors[0]["error"]
    assert reports.of("flushed") == []
    assert not bundle_path(pfs_run, CKPT, NODE).exists()
    leftover = pfs_ckpt_dir(pfs_run, CKPT)
    assert not leftover.exists() or list(leftover.iterdir()) == []
    assert [e["final"] for e in flush_events(events.path) if e["event"] == "flush_error"] == [True]
    assert flusher.close(timeout=1) == []


@pytest.mark.timeout(20)
def test_staged_copy_disappearing_while_retrying_is_final(tmp_path, pfs_run, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    obstacle = block_pfs(pfs_run)
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    wait_for(lambda: reports.of("flush_error"), "a first failure")
    shutil.rmtree(stage)            # e.g. the checkpoint failed elsewhere and was dropped
    wait_for(lambda: not flusher.pending(), "the flush to give up")
    errors = reports.of("flush_error")
    assert all(e["final"] is False for e in errors[:-1])
    assert errors[-1]["final"] is True
    assert "gone" in errors[-1]["error"]
    assert reports.of("flushed") == []
    obstacle.unlink()
    assert flusher.close(timeout=1) == []


@pytest.mark.timeout(20)
def test_cancel_stops_the_retries(tmp_path, pfs_run, make_flusher):
    manifest, stage = stage_checkpoint(tmp_path)
    obstacle = block_pfs(pfs_run)
    flusher, reports = make_flusher()

    flusher.submit(manifest, stage)
    wait_for(lambda: reports.of("flush_error"), "a first failure")
    flusher.cancel(CKPT)
    wait_for(lambda: not flusher.pending(), "the cancelled flush to stop")
    count = len(reports.all())
    obstacle.unlink()               # the PFS is back: a cancelled flush must not resume
    assert flusher.close(timeout=1) == []
    assert len(reports.all()) == count
    assert reports.of("flushed") == []
    assert all(e["final"] is False for e in reports.of("flush_error"))
    assert not bundle_path(pfs_run, CKPT, NODE).exists()


@pytest.mark.timeout(20)
def test_cancel_of_a_queued_flush(tmp_path, pfs_run, make_flusher):
    first, first_stage = stage_checkpoint(tmp_path, "step_00100")
    second, second_stage = stage_checkpoint(tmp_path, "step_00200", seed=5)
    block_pfs(pfs_run)
    flusher, reports = make_flusher(Flush(retry_max=0.2, chunk=CHUNK, concurrency=1))

    flusher.submit(first, first_stage)          # occupies the only worker, retrying
    wait_for(lambda: reports.of("flush_error", "step_00100"), "the first ckpt to fail")
    flusher.submit(second, second_stage)        # queued behind it
    assert sorted(flusher.pending()) == ["step_00100", "step_00200"]
    flusher.cancel("step_00200")
    assert flusher.pending() == ["step_00100"]
    assert flusher.close(timeout=0.3) == ["step_00100"]
    wait_for(lambda: not flusher.pending(), "the worker to stop after close")
    assert reports.of("flush_error", "step_00200") == []
    assert reports.of("flushed") == []


@pytest.mark.timeout(20)
def test_close_returns_the_unfinished_ckpts(tmp_path, pfs_run, make_flusher):
    done_manifest, done_stage = stage_checkpoint(tmp_path, "step_00050", seed=1)
    flusher, reports = make_flusher(Flush(retry_max=0.2, chunk=CHUNK, concurrency=2))
    flusher.submit(done_manifest, done_stage)
    wait_for(lambda: reports.of("flushed", "step_00050"), "the first flush")

    obstacle = pfs_run / "ckpt" / "step_00100"
    obstacle.write_bytes(b"")               # blocks only these two checkpoints' directories
    (pfs_run / "ckpt" / "step_00200").write_bytes(b"")
    first, first_stage = stage_checkpoint(tmp_path, "step_00100")
    second, second_stage = stage_checkpoint(tmp_path, "step_00200", seed=5)
    flusher.submit(first, first_stage)
    flusher.submit(second, second_stage)
    wait_for(lambda: reports.of("flush_error", "step_00100")
             and reports.of("flush_error", "step_00200"), "both to fail once")

    left = flusher.close(timeout=0.3)
    assert sorted(left) == ["step_00100", "step_00200"]
    # After close the workers stop retrying and exit.
    wait_for(lambda: not flusher.pending(), "the workers to stop after close")
    count = len(reports.all())
    assert not flusher.pending()
    assert len(reports.all()) == count
    assert os.path.isfile(bundle_path(pfs_run, "step_00050", NODE))


def test_retries_back_off_exponentially_with_jitter():
    from cachex_agent.flush.flusher import backoff
    delays = [backoff(3, cap=60.0) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert len({round(d, 3) for d in delays}) > 100      # spread, not one value
    assert all(30.0 <= backoff(20, cap=60.0) <= 60.0 for _ in range(50))
