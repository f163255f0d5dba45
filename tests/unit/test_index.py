"""The PFS index: one writer, one reader that checks every value."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cachex_agent.index import Index, NotAnIndex, Row, read_index, write_index
from cachex_agent.layout import index_path
from cachex_agent.safepath import UnsafeInput


def _rows() -> list[Row]:
    return [Row("step_2", 2, "failed", 0, None), Row("step_1", 1, "valid", 10, 5.0),
            Row("step_3", 3, "purged", 7, 6.5)]


def test_written_index_reads_back_oldest_first_with_current(tmp_path: Path):
    write_index(tmp_path / "run", Index.build("run", _rows()))
    data = json.loads(index_path(tmp_path / "run").read_text())
    assert data == {"format": "cachex-index", "version": 1, "run": "run", "current": "step_1",
                    "checkpoints": [
                        {"id": "step_1", "seq": 1, "state": "valid", "bytes": 10,
                         "flushed_at": 5.0},
                        {"id": "step_2", "seq": 2, "state": "failed", "bytes": 0,
                         "flushed_at": None},
                        {"id": "step_3", "seq": 3, "state": "purged", "bytes": 7,
                         "flushed_at": 6.5}]}
    index = read_index(tmp_path / "run")
    assert index.ids() == {"step_1", "step_2", "step_3"}
    assert [r.level for r in index.checkpoints] == ["flushed", "failed", "purged"]


@pytest.mark.parametrize("text", ["not json", '{"format": "other", "version": 1}',
                                  '{"format": "cachex-index", "version": 9}'])
def test_a_file_that_is_no_index_is_told_apart(tmp_path: Path, text: str):
    index_path(tmp_path).write_text(text)
    with pytest.raises(NotAnIndex, match="index.json"):
        read_index(tmp_path)


def test_not_an_index_is_of_the_packages_error_family_also_for_bytes_that_are_no_text(
        tmp_path: Path):
    """Not UTF-8 at all was a bare UnicodeDecodeError: a traceback from `cachex index`."""
    from cachex_agent.errors import CachexError
    index_path(tmp_path).write_bytes(b"\xff\xfe{not text")
    with pytest.raises(NotAnIndex, match="index.json: not JSON") as caught:
        read_index(tmp_path)
    assert isinstance(caught.value, CachexError) and not isinstance(caught.value, ValueError)


@pytest.mark.parametrize("change, what", [
    ({"id": "../escape"}, "unsafe checkpoint id '../escape'"),
    ({"seq": "1"}, "seq of step_1 '1'"),
    ({"state": "gone"}, "state 'gone' of step_1"),
    ({"bytes": -1}, "bytes of step_1 -1"),
    ({"flushed_at": "now"}, "flushed_at 'now' of step_1"),
])
def test_an_unsafe_value_is_refused_naming_file_and_value(tmp_path: Path, change, what):
    write_index(tmp_path, Index.build("run", _rows()[1:2]))
    data = json.loads(index_path(tmp_path).read_text())
    data["checkpoints"][0].update(change)
    index_path(tmp_path).write_text(json.dumps(data))
    with pytest.raises(UnsafeInput, match=rf"index\.json: .*{re.escape(what)}"):
        read_index(tmp_path)


def test_pin_and_drop_replace_the_index_and_keep_a_pin_that_stays(tmp_path: Path):
    from cachex_agent.errors import ConfigError, OperationError
    from cachex_agent.index import drop, pinned_current, set_current
    run = tmp_path / "run"
    write_index(run, Index.build("run", [*_rows(), Row("step_0", 0, "valid", 3, 1.0)]))
    (run / "ckpt" / "step_1").mkdir(parents=True)
    assert pinned_current(run) is None
    assert set_current(run, "step_0").current == "step_0"
    assert pinned_current(run) == "step_0" and read_index(run).pinned
    with pytest.raises(ConfigError, match=r"step_9: unknown checkpoint .*known: step_0,"):
        set_current(run, "step_9")
    with pytest.raises(OperationError, match="step_2: failed in the index of run run"):
        set_current(run, "step_2")
    assert drop(run, "step_1").current == "step_0"              # the pin stays
    assert not (run / "ckpt" / "step_1").exists() and read_index(run).pinned
    after = drop(run, "step_0")                                  # the pinned one goes
    assert after.current is None and not after.pinned and after.ids() == {"step_2", "step_3"}
