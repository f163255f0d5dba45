"""Capture by hard link (stage.capture): the choice per rule and per file system, the
link itself, its fallback to a copy, copy_file_range, and every reader of a staged file
refusing one the trainer rewrote in place after its capture. Real files: tmp_path is on
one file system, /dev/shm (tmpfs) on another."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from cachex_agent.checksum import copy_range_with_checksum, copy_with_checksum, file_problem
from cachex_agent.config import load
from cachex_agent.errors import ConfigError
from cachex_agent.flush.bundle import BundleError, write_bundle
from cachex_agent.manifest import LocalManifest
from cachex_agent.peer.replicator import Sender
from cachex_agent.rules import AutoRule, make_rule
from cachex_agent.stage.capture import (
    Plan,
    capture_copy,
    capture_method,
    copies_in_kernel,
    file_system_type,
    list_files,
    same_file_system,
)

pytestmark = pytest.mark.timeout(60)
FILES = {".metadata": b"dcp metadata\n", "__0_0.distcp": os.urandom(300_001),
         "sub/__0_1.distcp": os.urandom(70_000), "empty.bin": b""}
MODES = {".metadata": 0o644, "__0_0.distcp": 0o640, "sub/__0_1.distcp": 0o600,
         "empty.bin": 0o644}


def write_part(root: Path) -> Path:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        os.chmod(root / rel, MODES[rel])
    return root


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on tmpfs, another file system than tmp_path's."""
    directory = Path("/dev/shm") / f"cachex-test-{uuid.uuid4().hex}"
    directory.mkdir(mode=0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def other_file_systems(a: Path, b: Path) -> None:
    assert not same_file_system(a, b), f"{a} and {b} share a file system: pick others"


def rewrite_in_place(path: Path) -> None:
    """What torch.save over an existing file does: the same inode, other bytes."""
    with open(path, "r+b") as handle:
        handle.write(bytes(255 - b for b in handle.read(16)))


# ------------------------------------------------------------------ the choice
@pytest.mark.parametrize("spec, new_files", [
    ("dcp", True), ("deepspeed", True), ("megatron", True), ("hf", True), ("orbax", True),
    ("torch", False), ("quiescence", False), ("marker:*/COMMITTED", False)])
def test_each_rule_says_whether_its_framework_writes_new_files(tmp_path, spec, new_files):
    assert make_rule(spec, 1.0).writes_new_files(tmp_path, "step_1") is new_files


def test_auto_asks_the_rule_of_each_checkpoint_layout(tmp_path):
    spool = tmp_path / "spool"
    write_part(spool / "step_1")                            # DCP: .metadata, *.distcp
    (spool / "generic").mkdir()
    (spool / "generic" / "state.bin").write_bytes(b"x")     # nobody's: quiescence
    (spool / "last.ckpt").write_bytes(b"torch")             # a single file: torch.save
    rule = AutoRule(1.0)
    assert rule.writes_new_files(spool, "step_1")
    assert not rule.writes_new_files(spool, "generic")
    assert not rule.writes_new_files(spool, "last.ckpt")


def test_link_only_where_the_setting_the_rule_and_the_file_systems_allow(tmp_path, shm):
    spool, stage = tmp_path / "spool", tmp_path / "stage"
    spool.mkdir()
    stage.mkdir()
    other_file_systems(spool, shm)
    assert capture_method("auto", True, spool, stage) == ("link", "")
    assert capture_method("link", False, spool, stage) == ("link", "")     # forced
    assert capture_method("auto", False, spool, stage) == (
        "copy", "the framework may rewrite its files in place")
    assert capture_method("copy", True, spool, stage) == ("copy", "stage.capture = copy")
    method, why = capture_method("auto", True, spool, shm)
    assert method == "copy" and "different file systems" in why
    assert capture_method("link", True, spool, shm)[0] == "copy"


def test_copies_go_through_the_kernel_on_disk_only(tmp_path, shm):
    assert file_system_type(shm) == "tmpfs"
    assert not copies_in_kernel(shm, shm)       # tmpfs: one pass through user space
    assert not copies_in_kernel(tmp_path, shm)  # two file systems: copy_file_range can't
    kind = file_system_type(tmp_path)
    assert kind and copies_in_kernel(tmp_path, tmp_path) is (kind not in ("tmpfs", "ramfs"))


@pytest.mark.parametrize("value", ["auto", "link", "copy"])
def test_the_setting_is_read(tmp_path, value):
    config = load(None, {"paths.spool": str(tmp_path / "s"), "paths.pfs": str(tmp_path / "p"),
                         "stage.capture": value}, environ={})
    assert config.stage.capture == value


def test_a_bad_setting_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load(None, {"paths.spool": str(tmp_path / "s"), "paths.pfs": str(tmp_path / "p")},
             environ={"CACHEX_STAGE_CAPTURE": "reflink"})
    assert str(caught.value).startswith("stage.capture: expected one of auto | link | copy")


# ------------------------------------------------------------------- the link
def test_a_linked_capture_shares_the_inode_and_checksums_like_a_copy(tmp_path):
    src = write_part(tmp_path / "spool" / "step_1")
    rels = list_files(src)
    plan = Plan(frozenset(rels))
    linked = capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    copied = capture_copy(src, tmp_path / "copy" / "step_1", rels)
    assert linked == copied                         # sizes, trainer modes, checksums
    assert sorted(plan.linked) == rels and not plan.refused
    for rel in rels:
        staged, spooled = (tmp_path / "stage" / "step_1" / rel).stat(), (src / rel).stat()
        assert staged.st_ino == spooled.st_ino and staged.st_nlink == 2
        # never chmodded: a linked file's mode is the trainer's own
        assert stat.S_IMODE(spooled.st_mode) == MODES[rel]


def test_only_the_files_of_the_plan_are_linked(tmp_path):
    src = write_part(tmp_path / "spool" / "step_1")
    rels = list_files(src)
    plan = Plan(frozenset({"__0_0.distcp"}))
    capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    nlinks = {rel: (tmp_path / "stage" / "step_1" / rel).stat().st_nlink for rel in rels}
    assert nlinks == {rel: 2 if rel == "__0_0.distcp" else 1 for rel in rels}


def test_a_setuid_setgid_or_sticky_file_is_copied_not_linked(tmp_path):
    src = write_part(tmp_path / "spool" / "step_1")
    os.chmod(src / "__0_0.distcp", 0o4755)
    os.chmod(src / ".metadata", 0o1644)
    rels = list_files(src)
    plan = Plan(frozenset(rels))
    capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    assert sorted(plan.linked) == ["empty.bin", "sub/__0_1.distcp"] and not plan.refused
    for rel in ("__0_0.distcp", ".metadata"):
        staged = (tmp_path / "stage" / "step_1" / rel).stat()
        assert staged.st_nlink == 1 and stat.S_IMODE(staged.st_mode) == 0o600


def test_a_link_across_file_systems_falls_back_to_a_copy(tmp_path, shm):
    src = write_part(shm / "spool" / "step_1")
    other_file_systems(shm, tmp_path)
    rels = list_files(src)
    plan = Plan(frozenset(rels))
    entries = capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    assert entries == capture_copy(src, tmp_path / "copy" / "step_1", rels)
    assert plan.linked == [] and "not linked (Invalid cross-device link)" in plan.refused
    assert all((tmp_path / "stage" / "step_1" / rel).stat().st_nlink == 1 for rel in rels)
    assert all(stat.S_IMODE((tmp_path / "stage" / "step_1" / rel).stat().st_mode) == 0o600
               for rel in rels)


# ------------------------------------------------------------ copy_file_range
def test_copy_file_range_copies_and_checksums_like_the_copy(tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(3 << 20) + b"tail")
    seen: list[int] = []
    got = copy_range_with_checksum(src, tmp_path / "a", on_bytes=seen.append)
    assert got == copy_with_checksum(src, tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == src.read_bytes() and sum(seen) == got[0]
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o600


def test_copy_file_range_refused_across_file_systems_falls_back(tmp_path, shm):
    src = write_part(shm / "spool" / "step_1")
    other_file_systems(shm, tmp_path)
    with pytest.raises(OSError) as caught:
        copy_range_with_checksum(src / "__0_0.distcp", tmp_path / "x")
    assert caught.value.errno == errno.EXDEV
    rels = list_files(src)
    plan = Plan(ranged=True)
    entries = capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    assert entries == capture_copy(src, tmp_path / "copy" / "step_1", rels)
    assert not plan.ranged                          # asked once, then through user space


def test_a_ranged_capture_on_one_file_system(tmp_path):
    src = write_part(tmp_path / "spool" / "step_1")
    rels = list_files(src)
    plan = Plan(ranged=True)
    entries = capture_copy(src, tmp_path / "stage" / "step_1", rels, plan=plan)
    assert entries == capture_copy(src, tmp_path / "copy" / "step_1", rels)
    assert plan.ranged
    assert all((tmp_path / "stage" / "step_1" / rel).stat().st_nlink == 1 for rel in rels)


# ------------------------------------------- a rewrite in place after the capture
@pytest.fixture
def rewritten(tmp_path) -> tuple[Path, LocalManifest]:
    """A part captured by link whose `__0_0.distcp` the trainer then rewrote in place."""
    src = write_part(tmp_path / "spool" / "step_1")
    rels = list_files(src)
    staged = tmp_path / "stage" / "step_1"
    entries = capture_copy(src, staged, rels, plan=Plan(frozenset(rels)))
    rewrite_in_place(src / "__0_0.distcp")
    manifest = LocalManifest(run="t", ckpt="step_1", seq=1, node=0, host="h", rank=0,
                             files=entries)
    return staged, manifest


def test_a_rewritten_linked_file_fails_its_check_in_place(rewritten):
    staged, manifest = rewritten
    entry = next(e for e in manifest.files if e.path == "__0_0.distcp")
    assert file_problem(staged / entry.path, entry.size, entry.checksum) == "checksum mismatch"


def test_a_rewritten_linked_file_is_never_flushed(rewritten, tmp_path):
    staged, manifest = rewritten
    target = tmp_path / "pfs" / "node-00000.h5"
    target.parent.mkdir()
    with pytest.raises(BundleError) as caught:
        write_bundle(target, manifest, staged)
    assert "__0_0.distcp: checksum" in str(caught.value)
    assert "captured by hard link: the trainer rewrote its file in place" in str(caught.value)
    assert not target.exists()


def test_a_rewritten_linked_file_is_read_not_mapped_and_named_when_the_partner_refuses(
        rewritten):
    """The owner reads a linked file into its buffer (never a mapping: a truncate would
    be SIGBUS) and does not hash it: the partner checks the checksum as it writes, and
    the index its ack names becomes the owner's reason (tests/integration/
    test_capture_by_link.py runs the whole path)."""
    staged, manifest = rewritten
    sender = Sender(manifest, staged, partner=1, rank=1, region=0, free=deque([0]))
    buffer = np.empty(64 * 1024, np.uint8)
    read = []
    while (chunk := sender.next_chunk(buffer)) is not None:
        index, _offset, data = chunk
        assert np.shares_memory(data, buffer)   # read, not mapped
        read.append(manifest.files[index].path)
    sender.close()
    assert set(read) == {e.path for e in manifest.files if e.size}
    index = next(i for i, e in enumerate(manifest.files) if e.path == "__0_0.distcp")
    reason = sender.mismatch(index)
    assert "__0_0.distcp: checksum differs from the capture's" in reason
    assert "captured by hard link: the trainer rewrote its file in place" in reason
    assert sender.mismatch(len(manifest.files)) is None     # the partner's word is checked
    assert sender.mismatch(-1) is None


def test_a_copied_staged_file_is_still_put_from_a_mapping(tmp_path):
    src = write_part(tmp_path / "spool" / "step_1")
    staged = tmp_path / "stage" / "step_1"
    entries = capture_copy(src, staged, ["__0_0.distcp"])
    manifest = LocalManifest(run="t", ckpt="step_1", seq=1, node=0, host="h", rank=0,
                             files=entries)
    sender = Sender(manifest, staged, partner=1, rank=1, region=0, free=deque([0]))
    buffer = np.empty(64 * 1024, np.uint8)
    _index, _offset, data = sender.next_chunk(buffer)
    assert not np.shares_memory(data, buffer)
    sender.close()
