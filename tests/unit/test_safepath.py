"""The validator of names from outside the process, and the guarded removal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cachex_agent.errors import OperationError
from cachex_agent.fsutil import is_temporary, remove_under
from cachex_agent.journal import Journal
from cachex_agent.layout import recover_partial_dir
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest
from cachex_agent.rules import make_rule
from cachex_agent.safepath import UnsafeInput, checkpoint_id, index, relative_path

BAD_PATHS = {"": "empty", "/etc/passwd": "absolute", "a/../b": "'..'", "..": "'..'",
             "a//b": "empty component", "a/./b": "'.'", "a/": "empty component",
             "a\0b": "NUL", "x" * 256: "256 bytes", "é" * 128: "256 bytes"}


@pytest.mark.parametrize("value", list(BAD_PATHS), ids=range(len(BAD_PATHS)))
def test_unsafe_relative_paths_are_refused_naming_where_and_what(value):
    with pytest.raises(UnsafeInput) as caught:
        relative_path(value, "/pfs/ckpt/s/manifest.json")
    message = str(caught.value)
    assert message.startswith("/pfs/ckpt/s/manifest.json: unsafe file path ")
    assert repr(value) in message and BAD_PATHS[value] in message and "\n" not in message


@pytest.mark.parametrize("value", ["a", "a/b/c.distcp", ".metadata", "x" * 255, "é" * 127,
                                   "d/" + "y" * 255, "...", "a b/c"])
def test_safe_relative_paths_pass_unchanged(value):
    assert relative_path(value, "here") == value


@pytest.mark.parametrize("value", [None, 3, b"step_1"])
def test_non_strings_are_refused(value):
    with pytest.raises(UnsafeInput, match="not a string"):
        relative_path(value, "here")


@pytest.mark.parametrize("value", ["../ckpt/step_1", "/abs/step_1", "a/b", ".hidden",
                                   "step_1.tmp", "tmp-step_1", "lost+found", "",
                                   ".step_1.tmp-cachex-partial"])
def test_unsafe_checkpoint_ids_are_refused(value):
    with pytest.raises(UnsafeInput, match="unsafe checkpoint id"):
        checkpoint_id(value, "f")


def test_checkpoint_id_must_match_the_name_it_is_stored_under():
    assert checkpoint_id("step_1", "f", "step_1") == "step_1"
    with pytest.raises(UnsafeInput, match="differs from 'step_2'"):
        checkpoint_id("step_1", "f", "step_2")


@pytest.mark.parametrize("value", [-1, True, "0", 1.0, None])
def test_node_numbers_are_non_negative_ints(value):
    with pytest.raises(UnsafeInput, match="not a non-negative integer"):
        index(value, "f")


def _local(ckpt: str = "step_1", path: str = "a/b") -> LocalManifest:
    return LocalManifest(run="r", ckpt=ckpt, seq=1, node=0, host="h", rank=0,
                         files=[FileEntry(path, 1, 0o600, "c")])


def test_manifests_are_checked_when_loaded(tmp_path: Path):
    good = GlobalManifest.build([_local()], ["a/b"], {}, {0: "node-00000.h5"})
    path = tmp_path / "step_1" / "manifest.json"
    path.parent.mkdir()
    for change, value in ((lambda d: d.update(ckpt="../x"), "'../x'"),
                          (lambda d: d["files"][0].update(path="/etc/passwd"), "/etc/passwd"),
                          (lambda d: d.update(global_files=["../m"]), "'../m'"),
                          (lambda d: d["nodes"][0].update(host="../h"), "'../h'"),
                          (lambda d: d["files"][0].update(node=7), "node 7"),
                          (lambda d: d["nodes"][0].update(node=3), "[3]")):
        data = copy.deepcopy(good.to_json())       # to_json shares the manifest's lists
        change(data)
        path.write_text(json.dumps(data))
        with pytest.raises(UnsafeInput, match=str(path)) as caught:
            GlobalManifest.load(path, "step_1")
        assert value in str(caught.value)
    path.write_text(json.dumps(good.to_json()))
    assert GlobalManifest.load(path, "step_1") == good
    with pytest.raises(UnsafeInput, match="differs from 'step_2'"):
        GlobalManifest.load(path, "step_2")
    with pytest.raises(UnsafeInput, match="'../a'"):
        LocalManifest.from_json(_local(path="../a").to_json(), "msg")


def test_journal_refuses_unsafe_ids_and_sources(tmp_path: Path):
    stage, spool = tmp_path / "stage", tmp_path / "spool"
    journal = Journal(tmp_path / "j", (stage, spool))
    journal.update("step_1", seq=1, source=str(stage / "step_1"))
    assert Journal(tmp_path / "j", (stage, spool)).get("step_1")["seq"] == 1
    journal.update("step_2", seq=2, source="/etc")
    with pytest.raises(UnsafeInput, match="unsafe source '/etc' of step_2"):
        Journal(tmp_path / "j", (stage, spool))
    journal.forget("step_2")
    journal.update("../x", seq=3)
    with pytest.raises(UnsafeInput, match="state.json: unsafe checkpoint id '../x'"):
        Journal(tmp_path / "j")


def test_remove_under_refuses_anything_not_strictly_below_its_root(tmp_path: Path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    for path in (root, root / ".." / "outside", outside, root / "link", Path("/")):
        with pytest.raises(OperationError, match="refusing to remove"):
            remove_under(root, path)
    assert outside.is_dir() and root.is_dir()
    remove_under(root, root / "a")
    assert not (root / "a").exists()


def test_agents_never_take_a_recovery_partial_for_a_checkpoint(tmp_path: Path):
    partial = recover_partial_dir(tmp_path, "step_1")
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"m")
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / ".metadata").write_bytes(b"m")
    assert make_rule("dcp", 0.0, []).committed(tmp_path) == ["step_1"]
    assert partial.name == ".step_1.tmp-cachex-partial" and is_temporary(partial.name)
    long = recover_partial_dir(tmp_path, "s" * 255).name
    assert is_temporary(long) and len(long.encode()) <= 255
