"""One MPI job (topology.check_one_job) and one coordinator per run (runlock.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cachex_agent.errors import ConfigError
from cachex_agent.runlock import RunLock
from cachex_agent.topology import check_one_job, launched_size

HYDRA_IN_SLURM = {"MPI_LOCALNRANKS": "2", "PMI_SIZE": "8", "SLURM_STEP_NUM_TASKS": "1"}
SRUN_PMI2 = {"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}
SRUN_NO_PMI = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "6", "SLURM_STEP_NUM_TASKS": "2"}


@pytest.mark.parametrize(("env", "expected"), [
    (HYDRA_IN_SLURM, (8, "PMI_SIZE")),     # Hydra's ranks see the proxies' step, not theirs
    (SRUN_PMI2, (4, "SLURM_STEP_NUM_TASKS")),
    (SRUN_NO_PMI, (4, "SLURM_STEP_NUM_TASKS")),
    (OPEN_MPI, (6, "OMPI_COMM_WORLD_SIZE")),
    ({}, None),
    ({"SLURM_STEP_NUM_TASKS": "x"}, None),
])
def test_the_launcher_size_comes_from_whoever_formed_the_job(env, expected):
    assert launched_size(env) == expected


def test_lone_agents_of_a_pmi_mismatch_are_refused_with_the_count():
    with pytest.raises(ConfigError) as caught:
        check_one_job(1, SRUN_NO_PMI)
    assert str(caught.value).startswith("MPI formed a job of 1 agent but the launcher"
                                        " started 4 (SLURM_STEP_NUM_TASKS=4)")
    check_one_job(8, HYDRA_IN_SLURM)
    check_one_job(3, {})


def _holder(tmp_path, **record) -> None:
    """Written as a coordinator writes it (renamed into place): a refresher reading it
    half-written would take it for an unreadable lock, and rightly keep its own."""
    tmp = tmp_path / "taker.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(tmp_path / "coordinator.lock")


def test_a_live_coordinator_of_another_job_keeps_the_run(tmp_path, monkeypatch):
    """Live: its refresh moves `beat` while the contender watches, whatever the times."""
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    holder = RunLock.acquire(tmp_path, stale=60)
    monkeypatch.setenv("SLURM_JOB_ID", "200")
    try:
        with pytest.raises(ConfigError) as caught:
            RunLock.acquire(tmp_path, stale=60)
    finally:
        holder.release()
    message = str(caught.value)
    assert f"{tmp_path}/coordinator.lock: run" in message
    assert f"coordinated by job slurm:100 on {os.uname().nodename} (pid {os.getpid()}" \
        in message
    assert "a second coordinator refuses" in message


def test_a_lock_is_taken_over_by_its_own_job_a_dead_process_or_when_stale(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    _holder(tmp_path, job="slurm:100", host="other-host", pid=1, t=0)
    RunLock.acquire(tmp_path, stale=60).release()

    monkeypatch.setenv("SLURM_JOB_ID", "200")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _holder(tmp_path, job="slurm:100", host=os.uname().nodename, pid=dead.pid, t=0)
    RunLock.acquire(tmp_path, stale=60).release()

    # refreshed "just now" by its own clock, yet its beat stands still while watched
    _holder(tmp_path, job="slurm:100", host="other-host", pid=1, t=time.time(), beat=3)
    lock = RunLock.acquire(tmp_path, stale=1)
    assert json.loads((tmp_path / "coordinator.lock").read_text())["job"] == "slurm:200"
    assert (tmp_path / "coordinator.lock").stat().st_mode & 0o777 == 0o600
    lock.release()
    assert not (tmp_path / "coordinator.lock").exists()


def test_a_held_lock_beats_and_stops_refreshing_once_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr("cachex_agent.runlock.REFRESH", 0.05)
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    lock = RunLock.acquire(tmp_path, stale=60)
    path = tmp_path / "coordinator.lock"
    beats = {json.loads(path.read_text())["beat"] for _ in range(40) if not time.sleep(0.01)}
    assert len(beats) > 1                           # the counter moves
    with lock._writing:     # the takeover lands between two refreshes, not inside one
        _holder(tmp_path, job="slurm:300", host="h", pid=1, token="theirs", beat=0)
    time.sleep(0.3)
    assert json.loads(path.read_text())["job"] == "slurm:300"     # not overwritten
    lock.release()
    assert path.exists()


def test_release_leaves_a_lock_that_another_coordinator_took_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    lock = RunLock.acquire(tmp_path, stale=60)
    _holder(tmp_path, job="slurm:300", host="h", pid=1, t=time.time())
    lock.release()
    assert json.loads((tmp_path / "coordinator.lock").read_text())["job"] == "slurm:300"


def test_a_wheel_mpi_beside_a_site_mpi_is_named():
    from cachex_agent.preflight import mpi_warning, site_mpi_hint
    wheel = f"{sys.prefix}/lib/libmpi.so.12"
    assert site_mpi_hint({"LOADEDMODULES": "craype:cray-mpich/8.1.28:rocm"}) == (
        "module cray-mpich/8.1.28 is loaded")
    assert site_mpi_hint({"LOADEDMODULES": "gcc/12"}) is None
    warning = mpi_warning(wheel, {"I_MPI_ROOT": "/opt/intel/mpi"})
    assert warning is not None and wheel in warning and "I_MPI_ROOT=/opt/intel/mpi" in warning
    assert mpi_warning("/opt/cray/pe/lib64/libmpi_cray.so.12", {"CRAY_MPICH_DIR": "x"}) is None
    assert mpi_warning(wheel, {}) is None


def test_a_taker_takes_its_lock_back_from_a_holder_that_wrote_after_a_stall(tmp_path,
                                                                           monkeypatch):
    """The stalled holder read its own record just before the takeover, then rewrote it:
    the taker's refresh finds the token it took over from and writes its own again."""
    monkeypatch.setattr("cachex_agent.runlock.REFRESH", 0.05)
    monkeypatch.setenv("SLURM_JOB_ID", "200")
    stalled = {"job": "slurm:100", "host": "other-host", "pid": 1, "token": "old", "beat": 7}
    _holder(tmp_path, **stalled)
    lock = RunLock.acquire(tmp_path, stale=0.3)
    path = tmp_path / "coordinator.lock"
    try:
        with lock._writing:
            _holder(tmp_path, **{**stalled, "beat": 8})     # its refresh after the stall
        time.sleep(0.3)
        assert json.loads(path.read_text())["token"] == lock.record["token"]
        assert not lock._stop.is_set()                      # still refreshing
    finally:
        lock.release()
    assert not path.exists()


def test_each_coordinator_of_a_run_counts_one_generation_more(tmp_path, monkeypatch):
    """Released, taken over or refused, the count only grows with each holder; a count
    that is not one is said and gives 0 (the statuses fall back to their times)."""
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    seen = []
    for _ in range(2):
        lock = RunLock.acquire(tmp_path, stale=60)
        seen.append(lock.generation)
        lock.release()
    _holder(tmp_path, job="slurm:100", host="other-host", pid=1, t=0)   # taken over
    lock = RunLock.acquire(tmp_path, stale=60)
    seen.append(lock.generation)
    monkeypatch.setenv("SLURM_JOB_ID", "200")
    with pytest.raises(ConfigError):
        RunLock.acquire(tmp_path, stale=60)     # refused: no generation of its own
    lock.release()
    assert seen == [1, 2, 3]
    path = tmp_path / "coordinator.generation"
    assert json.loads(path.read_text()) == {"generation": 3}
    assert path.stat().st_mode & 0o777 == 0o600
    for hostile in (b'{"generation": -4}', b'{"generation": "9"}', b"\xff", b"[]"):
        path.write_bytes(hostile)
        lock = RunLock.acquire(tmp_path, stale=60)
        assert lock.generation == 0
        lock.release()


def test_of_two_coordinators_statuses_the_later_generation_wins_whatever_the_clocks():
    """The earlier job's host ran an hour ahead: its status's `updated` is later, yet
    the later coordinator's is the newest (issue 26: no two hosts' clocks compared)."""
    from cachex_agent.status import newest
    earlier = {"updated": 1e9 + 3600, "state": "stopped",
               "heartbeat": {"life": "a", "beat": 900, "generation": 4}}
    later = {"updated": 1e9, "state": "running",
             "heartbeat": {"life": "b", "beat": 2, "generation": 5}}
    assert newest([earlier, later]) is later and newest([later, earlier]) is later
    before = {"updated": 1e9 + 3600, "heartbeat": {"life": "c", "beat": 1}}  # no count
    assert newest([before, later]) is later
    hostile = {"updated": "soon", "heartbeat": {"life": "d", "generation": [7]}}
    assert newest([hostile, later]) is later
    one_life = [{**later, "heartbeat": {**later["heartbeat"], "beat": 3}, "updated": 0}, later]
    assert newest(one_life) is one_life[0]      # the higher beat of one life
