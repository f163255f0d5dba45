"""Capture spool -> stage: real files in tmp_path, real checksums, no mocked file system."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cachex_agent.checksum import file_checksum
from cachex_agent.errors import OperationError
from cachex_agent.fsutil import partial_path
from cachex_agent.manifest import FileEntry
from cachex_agent.rules.quiescence import snapshot
from cachex_agent.stage import capture
from cachex_agent.stage.capture import CaptureError, capture_copy, capture_reference, list_files

CHUNK = 4096        # small, so every non-trivial file spans several on_bytes callbacks

FILES = {
    ".metadata": (b"dcp metadata\n", 0o644),
    "__0_0.distcp": (None, 0o600),              # random, several chunks plus a remainder
    "empty.bin": (b"", 0o640),
    "model/layers/0/weights.bin": (bytes(range(256)) * 33, 0o444),
    "run.sh": (b"#!/bin/sh\necho resume\n", 0o755),
}


def make_checkpoint(root: Path) -> dict[str, bytes]:
    """Write FILES under `root`; return relpath -> content."""
    rng = np.random.default_rng(11)
    contents = {}
    for name, (data, mode) in FILES.items():
        if data is None:
            data = rng.integers(0, 256, 5 * CHUNK + 321, dtype=np.uint8).tobytes()
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, mode)
        contents[name] = data
    return contents


@pytest.fixture
def spool_ckpt(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    src = tmp_path / "spool" / "step_00100"
    src.mkdir(parents=True)
    return src, make_checkpoint(src)


@pytest.fixture
def stage(tmp_path: Path) -> Path:
    directory = tmp_path / "stage"
    directory.mkdir()
    return directory


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "partial" in p.name)


# ------------------------------------------------------------------------ capture_copy

@pytest.mark.timeout(10)
def test_capture_copy_is_byte_exact_with_checksums_and_modes(spool_ckpt, stage):
    src, contents = spool_ckpt
    dst = stage / "step_00100"
    rels = list_files(src)
    assert rels == sorted(contents)

    entries = capture_copy(src, dst, rels, CHUNK)

    assert [e.path for e in entries] == rels
    for entry in entries:
        source, target = src / entry.path, dst / entry.path
        assert target.read_bytes() == contents[entry.path]
        assert entry.size == len(contents[entry.path])
        assert entry.checksum == file_checksum(source) == file_checksum(target)
        assert entry.mode == FILES[entry.path][1]
        assert stat.S_IMODE(target.stat().st_mode) == 0o600     # staged copies are private
    assert sorted(list_files(dst)) == rels
    assert leftovers(stage) == []


@pytest.mark.timeout(10)
def test_capture_copy_reports_bytes_through_on_bytes(spool_ckpt, stage):
    src, contents = spool_ckpt
    seen: list[int] = []
    capture_copy(src, stage / "step_00100", list_files(src), CHUNK, on_bytes=seen.append)
    assert sum(seen) == sum(len(c) for c in contents.values())
    assert max(seen) <= CHUNK


@pytest.mark.timeout(10)
def test_capture_copy_replaces_an_existing_destination(spool_ckpt, stage):
    src, contents = spool_ckpt
    dst = stage / "step_00100"
    (dst / "stale" / "dir").mkdir(parents=True)
    (dst / "stale" / "dir" / "old.bin").write_bytes(b"from an earlier, aborted run")
    (dst / ".metadata").write_bytes(b"wrong")
    # A leftover partial directory from a killed capture is cleared too.
    old_partial = partial_path(dst)
    old_partial.mkdir()
    (old_partial / "junk").write_bytes(b"junk")

    capture_copy(src, dst, list_files(src), CHUNK)

    assert list_files(dst) == sorted(contents)
    assert (dst / ".metadata").read_bytes() == contents[".metadata"]
    assert not (dst / "stale").exists()
    assert leftovers(stage) == []


@pytest.mark.timeout(10)
def test_capture_copy_of_a_subset(spool_ckpt, stage):
    src, contents = spool_ckpt
    dst = stage / "step_00100"
    entries = capture_copy(src, dst, ["run.sh", "model/layers/0/weights.bin"], CHUNK)
    assert [e.path for e in entries] == ["run.sh", "model/layers/0/weights.bin"]
    assert list_files(dst) == ["model/layers/0/weights.bin", "run.sh"]


@pytest.mark.timeout(10)
def test_file_deleted_during_copy_fails_and_leaves_nothing(spool_ckpt, stage):
    src, _ = spool_ckpt
    dst = stage / "step_00100"
    rels = list_files(src)
    victim = src / "run.sh"           # sorted last: not yet copied when the callback runs
    assert rels[-1] == "run.sh"

    def delete_victim(_n: int) -> None:
        victim.unlink(missing_ok=True)

    with pytest.raises(CaptureError) as info:
        capture_copy(src, dst, rels, CHUNK, on_bytes=delete_victim)

    assert str(victim) in str(info.value)
    assert "deleted" in str(info.value)
    assert isinstance(info.value, OperationError)
    assert not dst.exists()
    assert leftovers(stage) == []
    assert list(stage.iterdir()) == []


@pytest.mark.timeout(10)
def test_file_being_copied_deleted_mid_copy_fails(spool_ckpt, stage):
    src, _ = spool_ckpt
    dst = stage / "step_00100"
    victim = src / "__0_0.distcp"

    def delete_current(_n: int) -> None:
        victim.unlink(missing_ok=True)

    with pytest.raises(CaptureError, match="deleted") as info:
        capture_copy(src, dst, ["__0_0.distcp"], CHUNK, on_bytes=delete_current)
    assert str(victim) in str(info.value)
    assert not dst.exists()
    assert list(stage.iterdir()) == []


@pytest.mark.timeout(10)
def test_failed_capture_keeps_the_previous_destination(spool_ckpt, stage):
    src, _ = spool_ckpt
    dst = stage / "step_00100"
    dst.mkdir()
    (dst / "keep.bin").write_bytes(b"the last good copy")

    with pytest.raises(CaptureError):
        capture_copy(src, dst, [*list_files(src), "not/there.bin"], CHUNK)

    assert (dst / "keep.bin").read_bytes() == b"the last good copy"
    assert leftovers(stage) == []


@pytest.mark.timeout(10)
def test_file_appended_during_copy_is_rewritten(spool_ckpt, stage):
    src, _ = spool_ckpt
    dst = stage / "step_00100"
    target = src / "__0_0.distcp"
    done = []

    def append_once(_n: int) -> None:
        if not done:
            done.append(True)
            with open(target, "ab") as handle:
                handle.write(b"more bytes from a trainer that did not finish")

    with pytest.raises(CaptureError, match="rewritten") as info:
        capture_copy(src, dst, ["__0_0.distcp"], CHUNK, on_bytes=append_once)
    assert str(target) in str(info.value)
    assert not dst.exists()
    assert leftovers(stage) == []


@pytest.mark.timeout(10)
def test_file_rewritten_same_size_with_new_mtime_is_rewritten(spool_ckpt, stage):
    src, _ = spool_ckpt
    dst = stage / "step_00100"
    target = src / "__0_0.distcp"
    before = target.stat()
    done = []

    def rewrite_once(_n: int) -> None:
        if not done:
            done.append(True)
            with open(target, "r+b") as handle:
                handle.write(b"\xff" * 100)          # same size, different bytes
            # Make the mtime change explicit (the kernel's timestamp tick is coarse).
            os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))

    with pytest.raises(CaptureError, match="rewritten"):
        capture_copy(src, dst, ["__0_0.distcp"], CHUNK, on_bytes=rewrite_once)
    assert target.stat().st_size == before.st_size
    assert not dst.exists()
    assert leftovers(stage) == []


@pytest.mark.timeout(10)
def test_file_replaced_by_rename_during_copy_is_rewritten(spool_ckpt, stage):
    src, contents = spool_ckpt
    dst = stage / "step_00100"
    target = src / "__0_0.distcp"
    done = []

    def replace_once(_n: int) -> None:
        if not done:
            done.append(True)
            fresh = src / ".fresh"
            fresh.write_bytes(contents["__0_0.distcp"])       # same size: new inode only
            os.replace(fresh, target)

    with pytest.raises(CaptureError, match="rewritten"):
        capture_copy(src, dst, ["__0_0.distcp"], CHUNK, on_bytes=replace_once)
    assert not dst.exists()


@pytest.mark.timeout(10)
def test_missing_checkpoint_dir(tmp_path, stage):
    with pytest.raises(CaptureError, match="missing") as info:
        list_files(tmp_path / "spool" / "nope")
    assert str(tmp_path / "spool" / "nope") in str(info.value)
    with pytest.raises(CaptureError):
        capture_copy(tmp_path / "spool" / "nope", stage / "nope", ["a.bin"], CHUNK)
    assert list(stage.iterdir()) == []


@pytest.mark.timeout(10)
def test_list_files_on_a_regular_file_is_missing_dir(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_bytes(b"x")
    with pytest.raises(CaptureError):
        list_files(path)


# -------------------------------------------------------------------------- list_files

@pytest.mark.timeout(10)
def test_list_files_honours_ignore_and_skips_symlinks(spool_ckpt, tmp_path):
    src, contents = spool_ckpt
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "secret.bin").write_bytes(b"not part of the checkpoint")
    os.symlink(src / ".metadata", src / "link-to-file")
    os.symlink(outside, src / "link-to-dir")
    os.symlink(src / "does-not-exist", src / "dangling")
    (src / "tmp").mkdir()
    (src / "tmp" / "x.tmp").write_bytes(b"temp")

    everything = list_files(src)
    assert everything == sorted([*contents, "tmp/x.tmp"])

    seen: list[str] = []

    def ignore(rel: str) -> bool:
        seen.append(rel)
        return rel.endswith(".tmp") or rel.startswith("model/")

    assert list_files(src, ignore) == sorted(
        rel for rel in contents if not rel.startswith("model/"))
    # The callback gets '/'-separated paths relative to the checkpoint directory.
    assert "model/layers/0/weights.bin" in seen
    assert "tmp/x.tmp" in seen
    assert not any(Path(rel).is_absolute() for rel in seen)


@pytest.mark.timeout(10)
def test_list_files_of_an_empty_dir(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert list_files(tmp_path / "empty") == []


# ------------------------------------------------------------------- capture_reference

@pytest.mark.timeout(10)
def test_capture_reference_matches_capture_copy(spool_ckpt, stage):
    src, _ = spool_ckpt
    rels = list_files(src)
    before = {rel: (src / rel).read_bytes() for rel in rels}

    referenced = capture_reference(src, rels)
    copied = capture_copy(src, stage / "step_00100", rels, CHUNK)

    assert referenced == copied
    assert all(isinstance(e, FileEntry) for e in referenced)
    # In place: nothing written next to the source, nothing changed in it.
    assert list_files(src) == rels
    assert {rel: (src / rel).read_bytes() for rel in rels} == before


@pytest.mark.timeout(10)
def test_capture_reference_detects_a_rewrite(spool_ckpt, monkeypatch):
    src, _ = spool_ckpt
    target = src / "__0_0.distcp"
    real_checksum = capture.file_checksum

    def checksum_then_trainer_appends(path, *args, **kwargs):
        result = real_checksum(path, *args, **kwargs)
        if Path(path) == target:
            with open(target, "ab") as handle:      # the trainer writes the file again
                handle.write(b"tail")
        return result

    monkeypatch.setattr(capture, "file_checksum", checksum_then_trainer_appends)
    with pytest.raises(CaptureError, match="rewritten") as info:
        capture_reference(src, list_files(src))
    assert str(target) in str(info.value)


@pytest.mark.timeout(10)
def test_capture_reference_detects_a_deleted_file(spool_ckpt):
    src, _ = spool_ckpt
    rels = list_files(src)
    (src / "run.sh").unlink()
    with pytest.raises(CaptureError, match="deleted") as info:
        capture_reference(src, rels)
    assert str(src / "run.sh") in str(info.value)


# ------------------------------------------------ completeness and a full stage (issue 10)

def test_a_file_changing_under_the_copy_is_a_part_changed(spool_ckpt, stage):
    """PartChanged (the writer is still at work) tells the agent to capture again."""
    src, _ = spool_ckpt
    with pytest.raises(capture.PartChanged, match="deleted"):
        capture_copy(src, stage / "step_00100", ["not/there.bin"], CHUNK)


def test_part_changes_names_what_was_added_removed_or_changed(spool_ckpt):
    src, _ = spool_ckpt
    before = snapshot(src)
    assert capture.part_changes(before, snapshot(src)) == ""
    (src / "late.bin").write_bytes(b"written after the listing")
    (src / "run.sh").unlink()
    with open(src / "empty.bin", "ab") as handle:
        handle.write(b"grown")
    changes = capture.part_changes(before, snapshot(src))
    assert changes.startswith("1 added, 1 removed, 1 changed file(s) since listed")
    for name in ("late.bin", "run.sh", "empty.bin"):
        assert name in changes


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_a_full_stage_is_recognized_and_leaves_no_partial(spool_ckpt, tmp_path):
    src, _ = spool_ckpt
    (src / "big.bin").write_bytes(os.urandom(2 << 20))
    small = tmp_path / "small-stage"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(OSError) as info:
            capture_copy(src, small / "step_00100", list_files(src), CHUNK)
        assert capture.is_stage_full(info.value)
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert not capture.is_stage_full(OSError(errno.EIO, "I/O error"))
    assert capture.is_stage_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
