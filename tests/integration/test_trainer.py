"""examples/trainer.py under real ``mpiexec -n 4``, two virtual nodes of two ranks each.

The trainer is what the demo and the cachex tests kill and restore, so these tests pin
down the things they rely on: the DCP-like layout, that only ``.metadata`` commits, that
a SIGKILL mid-write leaves an uncommitted step dir, and that resume is bit-identical.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from harness import kill_tree

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "examples" / "trainer.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
NP = 4
RANKS_PER_NODE = 2
EVERY = 4
STEPS = 12
SHARD_BYTES = 256 << 10
HEADER_BYTES = 64
# 8 data chunks per shard: with --write-delay a checkpoint stays half-written long enough
# to be killed reliably, without slowing the runs that use no delay.
COMMON = [
    "--ranks-per-node", str(RANKS_PER_NODE),
    "--every", str(EVERY),
    "--shard-size", "256KiB",
    "--chunk-size", "32KiB",
    "--step-time", "0.02",
]  # fmt: skip
RUN_TIMEOUT = 30.0



def spool(root: Path, node: int) -> Path:
    return root / f"node{node}" / "spool"


def step_dir(root: Path, node: int, step: int) -> Path:
    return spool(root, node) / f"step_{step:05d}"


def trainer_cmd(root: Path, *args: str) -> list[str]:
    template = str(root / "node{node}" / "spool")
    return [str(MPIEXEC), "-n", str(NP), sys.executable, str(TRAINER), "--spool", template,
            *COMMON, *args]  # fmt: skip


def run(cmd: list[str], timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {cmd}\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def train(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = run(trainer_cmd(root, *args))
    assert result.returncode == 0, f"trainer failed:\n{result.stdout}\n{result.stderr}"
    return result


def read_state(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())


def wait_for(
    proc: subprocess.Popen[str], condition: Callable[[], bool], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"trainer exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """One uninterrupted run shared by every test: (spool root, final sha256, stdout)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    state = root / "state.json"
    result = train(root, "--steps", str(STEPS), "--state-out", str(state))
    got = read_state(state)
    assert got["step"] == STEPS
    return root, str(got["sha256"]), result.stdout


@pytest.mark.timeout(60)
def test_resume_is_bit_identical(uninterrupted: tuple[Path, str, str], tmp_path: Path) -> None:
    _, want, _ = uninterrupted
    # --keep 1 rides along: pruning must neither break resume nor touch the newest commit.
    train(tmp_path, "--steps", "8", "--keep", "1")
    for node in range(NP // RANKS_PER_NODE):
        assert [p.name for p in spool(tmp_path, node).iterdir()] == ["step_00008"]

    state = tmp_path / "state.json"
    result = train(tmp_path, "--steps", str(STEPS), "--resume", "--keep", "1",
                   "--state-out", str(state))  # fmt: skip
    assert "resumed from step_00008" in result.stdout
    got = read_state(state)
    assert (got["step"], got["sha256"]) == (STEPS, want)
    for node in range(NP // RANKS_PER_NODE):
        assert [p.name for p in spool(tmp_path, node).iterdir()] == ["step_00012"]


@pytest.mark.timeout(60)
def test_checkpoint_layout(uninterrupted: tuple[Path, str, str]) -> None:
    root, _, stdout = uninterrupted
    nodes = NP // RANKS_PER_NODE
    shard_size = HEADER_BYTES + SHARD_BYTES
    for step in range(EVERY, STEPS + 1, EVERY):
        assert f"checkpoint step_{step:05d} committed ({NP * shard_size} bytes)" in stdout
        for node in range(nodes):
            own = {f"__{r}_0.distcp" for r in range(NP) if r // RANKS_PER_NODE == node}
            files = {p.name for p in step_dir(root, node, step).iterdir()}
            # Only the coordinator's node sees the commit marker, as with DCP.
            assert files == (own | {".metadata"} if node == 0 else own)
            for name in own:
                assert (step_dir(root, node, step) / name).stat().st_size == shard_size

        meta = json.loads((step_dir(root, 0, step) / ".metadata").read_text())
        assert (meta["step"], meta["world_size"], meta["ranks_per_node"]) == (
            step, NP, RANKS_PER_NODE
        )  # fmt: skip
        assert [(s["rank"], s["node"], s["file"], s["size"]) for s in meta["shards"]] == [
            (r, r // RANKS_PER_NODE, f"__{r}_0.distcp", shard_size) for r in range(NP)
        ]
        assert meta["total_bytes"] == NP * shard_size
    assert not any(root.rglob("*.tmp"))


@pytest.mark.timeout(60)
def test_sigkill_mid_write_then_resume(
    uninterrupted: tuple[Path, str, str], tmp_path: Path
) -> None:
    _, want, _ = uninterrupted
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            trainer_cmd(tmp_path, "--steps", str(STEPS), "--write-delay", "0.1"),
            stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
    try:
        marker = step_dir(tmp_path, 0, 4) / ".metadata"
        wait_for(proc, marker.exists, 20, "the step 4 commit")
        first_shard = step_dir(tmp_path, 0, 8) / "__0_0.distcp"
        wait_for(proc, first_shard.exists, 20, "step 8 to start writing")
    finally:
        kill_tree(proc)

    assert proc.returncode != 0, log.read_text()
    assert not (step_dir(tmp_path, 0, 8) / ".metadata").exists()
    shards = [p for n in range(NP // RANKS_PER_NODE) for p in step_dir(tmp_path, n, 8).glob("*")]
    # Killed mid-write: at least one shard is missing or short.
    assert len(shards) < NP or any(p.stat().st_size < HEADER_BYTES + SHARD_BYTES for p in shards)

    state = tmp_path / "state.json"
    result = train(tmp_path, "--steps", str(STEPS), "--resume", "--state-out", str(state))
    assert "resumed from step_00004" in result.stdout
    assert read_state(state)["sha256"] == want
    assert (step_dir(tmp_path, 0, 8) / ".metadata").exists()


def _delete(path: Path) -> None:
    path.unlink()


def _flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("damage", "message"),
    [(_delete, "missing shard"), (_flip_byte, "crc32")],
    ids=["deleted", "flipped"],
)
def test_resume_with_bad_shard_fails_on_all_ranks(
    uninterrupted: tuple[Path, str, str],
    tmp_path: Path,
    damage: Callable[[Path], None],
    message: str,
) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted[0], root)
    victim = step_dir(root, 1, STEPS) / "__3_0.distcp"
    damage(victim)

    started = time.monotonic()
    result = run(trainer_cmd(root, "--steps", str(STEPS + EVERY), "--resume"))
    assert result.returncode != 0
    assert time.monotonic() - started < RUN_TIMEOUT
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "rank 3" in errors[0] and str(victim) in errors[0] and message in errors[0]
    # Nothing was trained or written after the failed resume.
    assert not step_dir(root, 0, STEPS + EVERY).exists()


def _load_trainer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolves the module's annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(10)
def test_parse_size() -> None:
    parse_size = _load_trainer().parse_size
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("512KiB") == 512 << 10
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="bad size"):
        parse_size("4MB")
