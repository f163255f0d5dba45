"""Stage copies removed off the main loop (stage/remover.py): gone from the stage at
once, deleted by the remover's thread, and what a killed agent left is swept at start."""

from __future__ import annotations

import os
import threading

import pytest

from cachex_agent.cleanup import remove_stale
from cachex_agent.errors import OperationError
from cachex_agent.fsutil import is_temporary
from cachex_agent.layout import NodePaths
from cachex_agent.stage import remover as remover_module
from cachex_agent.stage.remover import Remover

pytestmark = pytest.mark.timeout(60)


def a_copy(stage, name="step_1"):
    part = stage / name
    (part / "sub").mkdir(parents=True)
    for i in range(3):
        (part / "sub" / f"f{i}").write_bytes(os.urandom(4096))
    return part


def test_a_discarded_copy_leaves_the_stage_at_once_and_is_deleted_by_the_thread(tmp_path):
    stage = tmp_path / "stage"
    part = a_copy(stage)
    remover = Remover()
    remover.discard(stage, part)
    assert not part.exists()                    # before the thread has run
    assert remover.close(10)
    assert list(stage.iterdir()) == []          # nothing set aside is left


def test_the_removal_does_not_hold_up_the_caller(tmp_path, monkeypatch):
    """The caller returns while the thread is still deleting (here: held)."""
    held, release = threading.Event(), threading.Event()
    real = remover_module.remove_tree

    def slow(path):
        held.set()
        release.wait(10)
        real(path)
    monkeypatch.setattr(remover_module, "remove_tree", slow)
    stage = tmp_path / "stage"
    remover = Remover()
    remover.discard(stage, a_copy(stage, "step_1"))
    assert held.wait(10)
    remover.discard(stage, a_copy(stage, "step_2"))     # returns with the thread busy
    aside = sorted(p.name for p in stage.iterdir())
    assert len(aside) == 2 and all(is_temporary(n) for n in aside)
    release.set()
    assert remover.close(10)
    assert list(stage.iterdir()) == []


def test_a_path_outside_the_stage_is_refused_and_a_missing_one_ignored(tmp_path):
    stage = tmp_path / "stage"
    outside = a_copy(tmp_path / "elsewhere")
    remover = Remover()
    with pytest.raises(OperationError, match="not under"):
        remover.discard(stage, outside)
    with pytest.raises(OperationError, match="not under"):
        remover.discard(stage, stage / ".." / "elsewhere" / "step_1")
    assert outside.exists()
    remover.discard(stage, stage / "step_9")
    assert remover.close(10)


def test_what_a_killed_agent_set_aside_is_swept_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setattr(remover_module, "remove_tree", lambda path: None)   # killed first
    paths = NodePaths(spool=tmp_path / "spool", stage=tmp_path / "stage",
                      cache=tmp_path / "cache", pfs=tmp_path / "pfs")
    for root in (paths.spool, paths.cache, paths.pfs):
        root.mkdir()
    remover = Remover()
    remover.discard(paths.stage, a_copy(paths.stage))
    assert remover.close(10)
    assert len(list(paths.stage.iterdir())) == 1
    remove_stale(paths, 0, coordinator=False)
    assert list(paths.stage.iterdir()) == []


def test_a_copy_that_cannot_be_set_aside_is_removed_on_the_spot(tmp_path, monkeypatch):
    """A rename refused (here: made to fail) falls back to the removal it replaced."""
    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(src))
    monkeypatch.setattr(remover_module.os, "rename", refused)
    stage = tmp_path / "stage"
    part = a_copy(stage)
    remover = Remover()
    remover.discard(stage, part)
    assert not part.exists()
    assert remover.close(10)
    assert list(stage.iterdir()) == []
