"""Progress of `recover`, `export` and `verify` on stderr: a bar with bytes, rate and time
left on a terminal (a real pseudo-terminal), a line per step elsewhere, nothing with -q."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest
from harness import BIN, Cluster, files_of, finish

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
TRAIN = ["--shard-size", "1MiB", "--chunk-size", "256KiB", "--step-time", "0.02",
         "--files-per-rank", "4", "--every", "4"]
SIZE = r"[\d.]+ (B|KiB|MiB|GiB)"
BAR = re.compile(rf"node 0 \[#+\] {SIZE}/{SIZE} {SIZE}/s \d+:\d\d left")


def one_node_run(cluster) -> tuple[Cluster, dict[str, bytes]]:
    """A flushed one-node run whose spool is then lost: `cachex recover` runs as one
    process (no mpiexec), so it can have the terminal itself."""
    c = cluster(nodes=1, model='path = "auto"')
    c.start_agents()
    finish(c.trainer("--steps", "8", *TRAIN, ranks=2, ranks_per_node=2))
    c.wait_level("step_00008", "flushed")
    assert c.stop() == 0
    return c, files_of(c.spool(0) / "step_00008")


def lose_spool(c: Cluster) -> None:
    shutil.rmtree(c.spool(0))
    c.spool(0).mkdir()


def on_terminal(*args: str, timeout: float = 120) -> tuple[int, str]:
    """Run `cachex ARGS` with stdin, stdout and stderr on a new pseudo-terminal; return
    its exit code and everything it wrote there."""
    leader, follower = os.openpty()
    proc = subprocess.Popen([str(BIN / "cachex"), *args], stdin=follower, stdout=follower,
                            stderr=follower, close_fds=True)
    os.close(follower)
    out = bytearray()
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"cachex {args} still running: {out.decode()}"
        try:
            data = os.read(leader, 65536)
        except OSError:         # EIO: every holder of the terminal closed it
            break
        if not data:
            break
        out += data
    os.close(leader)
    return proc.wait(timeout=30), out.decode(errors="replace")


def test_recover_on_a_terminal_shows_bytes_rate_and_time_left_and_q_silences_it(cluster):
    c, before = one_node_run(cluster)
    lose_spool(c)
    code, out = on_terminal("recover", "--config", str(c.config))
    assert code == 0, out
    assert BAR.search(out), out
    assert "cachex recover: restoring step_00008: 9 files" in out, out
    assert "recovered step_00008" in out
    assert files_of(c.spool(0) / "step_00008") == before

    lose_spool(c)
    code, out = on_terminal("recover", "-q", "--config", str(c.config))
    assert code == 0, out
    assert "recovered step_00008" in out, out          # the result is still said
    assert not BAR.search(out) and "cachex recover:" not in out and "\r" not in \
        out.replace("\r\n", "\n"), out
    assert files_of(c.spool(0) / "step_00008") == before


def test_without_a_terminal_each_step_is_one_line(cluster, tmp_path):
    c, before = one_node_run(cluster)
    lose_spool(c)
    result = subprocess.run([str(BIN / "cachex"), "recover", "--json", "--config",
                             str(c.config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("cachex recover:")]
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "listing", "restoring", "node", "copying"], result.stderr
    assert re.fullmatch(rf"cachex recover: node 0: {SIZE} in [\d.]+s \({SIZE}/s\)", lines[2])
    assert "\r" not in result.stderr and "[#" not in result.stderr
    assert result.stdout.startswith("{") and '"schema": 1' in result.stdout   # stdout clean

    exported = c.cachex("export", "step_00008", str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    assert re.search(rf"^cachex export: node 0: 9 files, {SIZE}$", exported.stderr, re.M)
    assert re.search(rf"^cachex export: export step_00008: {SIZE} in", exported.stderr, re.M)
    verified = c.cachex("verify", "step_00008")
    assert verified.returncode == 0, verified.stderr
    assert re.search(r"^cachex verify: verifying 2 copies of step_00008$", verified.stderr,
                     re.M), verified.stderr
    quiet = c.cachex("verify", "step_00008", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert files_of(c.spool(0) / "step_00008") == before
