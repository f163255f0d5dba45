"""open_for_write / wait_quiescent against real processes and real files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachex_agent.errors import OperationError
from cachex_agent.mapped import unusable
from cachex_agent.rules import quiescence
from cachex_agent.rules.quiescence import (
    DirectoryTimeout,
    QuiescenceStopped,
    QuiescenceTimeout,
    open_for_write,
    skip_processes,
    snapshot,
    wait_for_directory,
    wait_quiescent,
    wait_settled,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, params=["walk", "lease"])
def leases(request):
    """Every check twice: by the walk of /proc alone (a process whose SIGIO would end
    it takes no lease), and with the read lease proving a file free first (the agent)."""
    before = signal.getsignal(signal.SIGIO)
    if request.param == "lease":
        signal.signal(signal.SIGIO, signal.SIG_IGN)
        if unusable():
            pytest.fail(f"read leases unusable on this machine: {unusable()}")
    yield request.param
    signal.signal(signal.SIGIO, before)

# Opens argv[1] with mode argv[2], says "ready", then holds it until killed.
_HOLDER = (
    "import sys, time\n"
    "f = open(sys.argv[1], sys.argv[2])\n"
    "if 'r' not in sys.argv[2]: f.write(b'x'); f.flush()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


class Holder:
    """A separate process holding one file open."""

    def __init__(self, path: Path, mode: str = "wb") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path), mode],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(path: Path, mode: str = "wb") -> Holder:
        holder = Holder(path, mode)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.kill()


def test_open_for_write_sees_writer_process(tmp_path, holders):
    written, idle = tmp_path / "a.distcp", tmp_path / "b.distcp"
    idle.write_bytes(b"done")
    holder = holders(written, "wb")
    assert open_for_write([written, idle]) == {written}
    holder.kill()
    assert open_for_write([written, idle]) == set()


def test_skipped_processes_are_not_walked_and_the_rest_still_are(tmp_path, holders):
    skipped, seen = tmp_path / "agent.log", tmp_path / "shard.distcp"
    agent, trainer = holders(skipped, "wb"), holders(seen, "wb")
    try:
        skip_processes([agent.proc.pid])
        assert open_for_write([skipped, seen]) == {seen}
        skip_processes([trainer.proc.pid])
        assert open_for_write([skipped, seen]) == {skipped}
    finally:
        skip_processes([])
    assert open_for_write([skipped, seen]) == {skipped, seen}


@pytest.mark.parametrize("mode,writes", [("rb", False), ("r+b", True), ("ab", True),
                                         ("a+b", True), ("wb", True)])
def test_open_for_write_modes(tmp_path, holders, mode, writes):
    path = tmp_path / "f.bin"
    path.write_bytes(b"data")
    holders(path, mode)
    assert open_for_write([path]) == ({path} if writes else set())


def test_open_for_write_in_this_process(tmp_path):
    path = tmp_path / "mine"
    with open(path, "wb"):
        assert open_for_write([path]) == {path}
    assert open_for_write([path]) == set()


def test_open_for_write_matches_other_names(tmp_path, holders):
    real = tmp_path / "real"
    real.mkdir()
    target = real / "x.bin"
    holders(target, "wb")
    link_dir = tmp_path / "link"
    link_dir.symlink_to(real)
    via_symlink = link_dir / "x.bin"
    hard = tmp_path / "hard.bin"
    os.link(target, hard)
    # The symlinked name resolves to the writer's path; the hard link matches by inode.
    assert open_for_write([via_symlink, hard, str(target)]) == {via_symlink, hard, target}


def test_a_free_file_is_proved_free_without_the_walk(tmp_path, holders, leases,
                                                     monkeypatch):
    free, written = tmp_path / "free.distcp", tmp_path / "written.distcp"
    free.write_bytes(b"done")
    holders(written, "wb")
    holders(free, "rb")             # a reader does not stop a read lease
    walked: list[int] = []
    real = quiescence._pids
    monkeypatch.setattr(quiescence, "_pids", lambda: walked.append(1) or real())
    assert open_for_write([free]) == set()
    assert walked == ([] if leases == "lease" else [1])
    assert open_for_write([free, written]) == {written}     # a writer: the walk names it


def test_open_for_write_empty_and_missing(tmp_path):
    assert open_for_write([]) == set()
    assert open_for_write([tmp_path / "missing"]) == set()


def test_snapshot_recursive_regular_files_only(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "d" / "e" / "b").write_bytes(b"22")
    (tmp_path / "d" / "c.tmp").write_bytes(b"3")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    files = snapshot(tmp_path, ignore=lambda rel: rel.endswith(".tmp"))
    assert sorted(files) == [tmp_path / "a", tmp_path / "d" / "e" / "b"]
    assert files[tmp_path / "d" / "e" / "b"][0] == 2
    with pytest.raises(FileNotFoundError):
        snapshot(tmp_path / "nope")


def test_wait_quiescent_returns_at_once_when_idle(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b", "a", "sub/c"):
        (tmp_path / name).write_bytes(b"x")
    started = time.monotonic()
    files = wait_quiescent(tmp_path, settle=0, timeout=10)
    assert files == [tmp_path / "a", tmp_path / "b", tmp_path / "sub" / "c"]
    assert time.monotonic() - started < 5


def test_wait_quiescent_waits_for_writer_to_exit(tmp_path, holders):
    (tmp_path / "done.distcp").write_bytes(b"x")
    holder = holders(tmp_path / "busy.distcp", "wb")
    killed_at: list[float] = []

    def kill_later() -> None:
        time.sleep(0.8)
        killed_at.append(time.monotonic())
        holder.kill()

    killer = threading.Thread(target=kill_later)
    killer.start()
    files = wait_quiescent(tmp_path, settle=0, timeout=30, poll=0.05)
    returned_at = time.monotonic()
    killer.join()
    assert killed_at and returned_at >= killed_at[0]
    assert files == [tmp_path / "busy.distcp", tmp_path / "done.distcp"]


def test_wait_quiescent_settle_waits_for_changes_to_stop(tmp_path):
    path = tmp_path / "growing"
    path.write_bytes(b"")
    last_write: list[float] = []

    def grow() -> None:
        for _ in range(10):
            with open(path, "ab") as handle:
                handle.write(b"x" * 100)
            last_write.append(time.monotonic())
            time.sleep(0.1)

    writer = threading.Thread(target=grow)
    writer.start()
    files = wait_quiescent(tmp_path, settle=0.3, timeout=30, poll=0.02)
    returned_at = time.monotonic()
    writer.join()
    assert files == [path]
    assert path.stat().st_size == 1000
    assert returned_at - last_write[-1] >= 0.3


def test_wait_quiescent_timeout_names_directory_and_files(tmp_path, holders):
    busy = tmp_path / "busy.bin"
    holders(busy, "wb")
    with pytest.raises(QuiescenceTimeout) as caught:
        wait_quiescent(tmp_path, settle=0, timeout=0.5, poll=0.05)
    assert isinstance(caught.value, OperationError)
    message = str(caught.value)
    assert str(tmp_path) in message and str(busy) in message
    assert caught.value.still_open == [busy]


def test_wait_quiescent_timeout_while_changing(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(QuiescenceTimeout, match="changing"):
        wait_quiescent(tmp_path, settle=30, timeout=0.3, poll=0.05)


def test_wait_quiescent_directory_disappears(tmp_path, holders):
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    holder = holders(ckpt / "x", "wb")

    def remove_later() -> None:
        time.sleep(0.3)
        holder.kill()
        (ckpt / "x").unlink()
        ckpt.rmdir()

    remover = threading.Thread(target=remove_later)
    remover.start()
    with pytest.raises(FileNotFoundError):
        wait_quiescent(ckpt, settle=60, timeout=30, poll=0.05)
    remover.join()
    with pytest.raises(FileNotFoundError):
        wait_quiescent(tmp_path / "never", settle=0, timeout=1)


def test_wait_quiescent_stop_event(tmp_path, holders):
    holders(tmp_path / "busy", "wb")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(QuiescenceStopped):
        wait_quiescent(tmp_path, settle=0, timeout=30, stop=stop, poll=0.05)
    assert time.monotonic() - started < 20


def test_wait_quiescent_ignores_temp_files(tmp_path, holders):
    (tmp_path / "a.distcp").write_bytes(b"x")
    holders(tmp_path / ".metadata.tmp", "wb")
    files = wait_quiescent(tmp_path, settle=0, timeout=10,
                           ignore=lambda rel: rel.endswith(".tmp"))
    assert files == [tmp_path / "a.distcp"]


def test_wait_settled_returns_the_state_of_each_file(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    states = wait_settled(tmp_path, settle=0, timeout=10)
    st = (tmp_path / "a").stat()
    assert states == {tmp_path / "a": (3, st.st_mtime_ns, st.st_ino)}


def test_wait_for_directory_waits_until_it_appears(tmp_path):
    late = tmp_path / "step_1"
    assert wait_for_directory(tmp_path, timeout=1) is False      # there: no wait
    maker = threading.Timer(0.3, late.mkdir)
    maker.start()
    assert wait_for_directory(late, timeout=30, poll=0.02) is True
    maker.join()


def test_wait_for_directory_is_bounded_and_stoppable(tmp_path):
    with pytest.raises(DirectoryTimeout, match=r"step_1: checkpoint directory did not appear"):
        wait_for_directory(tmp_path / "step_1", timeout=0.2, poll=0.05)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(QuiescenceStopped):
        wait_for_directory(tmp_path / "step_1", timeout=30, stop=stop, poll=0.05)
