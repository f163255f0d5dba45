"""Hostile PFS content against `cachex recover`, `export` and `verify`, and a recovery
killed midway: real agents flush a real checkpoint, then its manifest and bundle are
edited as an attacker with write access to the PFS run directory would."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest
from harness import BIN, Cluster, files_of, finish, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CKPT = "step_00004"
TRAIN = ["--shard-size", "64KiB", "--chunk-size", "64KiB", "--step-time", "0.02",
         "--files-per-rank", "2", "--every", "4", "--steps", "4"]
SENTINEL = "sentinel.txt"


def flushed_one_node(root: Path, *train: str) -> Cluster:
    """One node (recover runs as one process, no mpiexec), `CKPT` flushed, agents gone."""
    c = Cluster(root, nodes=1, model='path = "auto"')
    try:
        c.start_agents()
        finish(c.trainer(*TRAIN, *train, ranks=2, ranks_per_node=2), timeout=180)
        c.wait_level(CKPT, "flushed", timeout=120)
        assert c.stop() == 0
    finally:
        c.close()
    return c


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A flushed run, kept aside: each test works on a fresh copy at the same paths."""
    root = tmp_path_factory.mktemp("hostile") / "run"
    c = flushed_one_node(root)
    shutil.copytree(root, root.with_name("pristine"), symlinks=True)
    return c


@pytest.fixture
def run(pristine):
    root = pristine.root
    shutil.rmtree(root)
    shutil.copytree(root.with_name("pristine"), root, symlinks=True)
    return pristine


# ------------------------------------------------------------------ the attacks
def manifest_path(c: Cluster) -> Path:
    return c.pfs / "ckpt" / CKPT / "manifest.json"


def bundle(c: Cluster) -> Path:
    return c.pfs / "ckpt" / CKPT / "node-00000.h5"


def edit_manifest(c: Cluster, change: Callable[[dict], None]) -> None:
    data = json.loads(manifest_path(c).read_text())
    change(data)
    manifest_path(c).write_text(json.dumps(data))


def ckpt_traversal(c: Cluster) -> tuple[Path, str, Path]:
    """`ckpt` climbs out of the spool (and still names the real bundle on the PFS)."""
    value = f"../ckpt/{CKPT}"
    edit_manifest(c, lambda m: m.update(ckpt=value))
    return manifest_path(c), value, c.spool(0) / ".." / "ckpt" / CKPT


def ckpt_absolute(c: Cluster) -> tuple[Path, str, Path]:
    target = c.root / "elsewhere" / CKPT
    edit_manifest(c, lambda m: m.update(ckpt=str(target)))
    return manifest_path(c), str(target), target


def file_traversal(c: Cluster) -> tuple[Path, str, Path]:
    """A file path climbs out, in the manifest and in the bundle alike (they agree)."""
    value = "../../outside/__0_0.distcp"
    edit_manifest(c, lambda m: _rename_file(m["files"], "__0_0.distcp", value))
    _rename_in_bundle(bundle(c), "__0_0.distcp", value)
    return manifest_path(c), value, c.root / "node0" / "outside"


def bundle_traversal(c: Cluster) -> tuple[Path, str, Path]:
    """Only the bundle's dataset attribute is hostile; the manifest is intact."""
    value = "../../outside/__0_0.distcp"
    _rename_in_bundle(bundle(c), "__0_0.distcp", value)
    return bundle(c), value, c.root / "node0" / "outside"


def _rename_file(files: list[dict], old: str, new: str) -> None:
    next(f for f in files if f["path"] == old)["path"] = new


def _rename_in_bundle(path: Path, old: str, new: str) -> None:
    with h5py.File(path, "r+", locking=False) as h5:
        dataset = next(d for d in h5["files"].values() if d.attrs["path"] == old)
        dataset.attrs["path"] = new


ATTACKS = [ckpt_traversal, ckpt_absolute, file_traversal, bundle_traversal]


def with_sentinel(target: Path) -> dict[str, bytes]:
    """A directory at the traversal target, with a file that must survive unchanged."""
    target.mkdir(parents=True, exist_ok=True)
    (target / SENTINEL).write_text("not cachex's\n")
    return files_of(target)


def assert_refused(result: subprocess.CompletedProcess[str], where: Path, value: str) -> None:
    """One error line naming the file and the value; progress lines (what the command
    was doing, on stderr when not `-q`) may come before it, nothing after it."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if ": error: " in line]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert str(where) in errors[0] and repr(value) in errors[0], errors[0]


# ------------------------------------------------------------------- the tests
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_recover_refuses_and_writes_nothing(run, attack):
    shutil.rmtree(run.root / "node0")           # the node is lost: only the PFS is left
    run.spool(0).mkdir(parents=True)
    where, value, target = attack(run)
    outside = with_sentinel(target)
    result = subprocess.run([str(BIN / "cachex"), "recover", "--config", str(run.config)],
                            capture_output=True, text=True, timeout=120)
    assert_refused(result, where, value)
    assert files_of(target) == outside and sorted(target.iterdir()) == [target / SENTINEL]
    assert list(run.spool(0).iterdir()) == []


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_export_refuses_and_writes_nothing(run, attack):
    where, value, target = attack(run)
    outside = with_sentinel(target)
    dest = run.root / "export"
    result = run.cachex("export", CKPT, str(dest))
    assert_refused(result, where, value)
    assert not dest.exists()
    assert files_of(target) == outside


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__)
def test_verify_refuses(run, attack):
    where, value, target = attack(run)
    outside = with_sentinel(target)
    result = run.cachex("verify", CKPT)
    assert_refused(result, where, value)
    assert result.stdout == ""
    assert files_of(target) == outside


# ------------------------------------------------------------- atomic restore
def recover_popen(c: Cluster) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN / "cachex"), "recover", "--config", str(c.config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_recover_killed_midway_leaves_nothing_under_the_real_name(tmp_path):
    # large files, so that the kill lands while the checkpoint is being assembled
    c = flushed_one_node(tmp_path / "run", "--shard-size", "48MiB", "--chunk-size", "8MiB")
    before = files_of(c.spool(0) / CKPT)
    shutil.rmtree(c.spool(0))
    c.spool(0).mkdir()

    proc = recover_popen(c)
    try:
        # the first byte written anywhere in the spool, whatever the name it lands under
        wait_for(lambda: any(p.is_file() for p in c.spool(0).rglob("*"))
                 or proc.poll() is not None,
                 120, "recover to start writing", poll=0.001)
        assert proc.poll() is None, "recover finished before it could be killed"
    finally:
        kill_tree(proc)
    assert any(c.spool(0).rglob("*")), "the kill came before any write"
    assert not (c.spool(0) / CKPT).exists(), sorted(c.spool(0).rglob("*"))

    result = subprocess.run([str(BIN / "cachex"), "recover", "--config", str(c.config)],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert files_of(c.spool(0) / CKPT) == before
    assert sorted(p.name for p in c.spool(0).iterdir()) == [CKPT]   # no partial left
