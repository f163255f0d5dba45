"""fsutil: private modes whatever the umask, temporary names within 255 bytes, one test
of what is ours and temporary."""

from __future__ import annotations

import os
import stat

import pytest

from cachex_agent.fsutil import (
    NAME_MAX,
    create_file,
    derived_name,
    is_temporary,
    is_temporary_of,
    makedirs,
    partial_path,
    remove_temporaries,
    temp_name,
    write_json,
)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_files_0600_and_directories_0700_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        made = makedirs(tmp_path / "a" / "b")
        write_json(made / "x.json", {"k": 1})
        os.close(create_file(made / "y"))
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in
             (tmp_path / "a", made, made / "x.json", made / "y")}
    assert modes == {tmp_path / "a": 0o700, made: 0o700, made / "x.json": 0o600,
                     made / "y": 0o600}


@pytest.mark.parametrize("name", ["a", "n" * 240, "n" * 255, "é" * 127 + "x"])
def test_temporary_and_derived_names_fit_and_are_recognised(tmp_path, name):
    final = tmp_path / name
    for temp in (temp_name(final), partial_path(final)):
        assert len(os.fsencode(temp.name)) <= NAME_MAX
        assert temp.parent == tmp_path
        assert is_temporary(temp.name) and is_temporary_of(temp.name, name)
        assert not is_temporary_of(temp.name, name + "2")
    assert len(os.fsencode(derived_name(name, ".manifest.json"))) <= NAME_MAX
    assert not is_temporary(name)
    assert not is_temporary(f".{name}.tmp-123")       # a trainer's or another tool's


def test_temporary_names_differ_within_one_pid_and_older_pid_only_names_are_ours(tmp_path):
    """Two hosts writing one PFS file may share a pid: the name carries a token too."""
    names = {temp_name(tmp_path / "index.json").name for _ in range(50)}
    assert len(names) == 50
    assert is_temporary(".index.json.tmp-cachex-4242")
    assert not is_temporary(".index.json.tmp-cachex-4242-xyz")


def test_remove_temporaries_only_ours_and_only_of_the_names_given(tmp_path):
    ours = [temp_name(tmp_path / "node-00001.h5"), partial_path(tmp_path / "step_1")]
    others = [temp_name(tmp_path / "node-00002.h5"), tmp_path / "node-00001.h5",
              tmp_path / ".x.tmp-5"]
    for path in ours + others:
        path.write_bytes(b"")
    removed = remove_temporaries(tmp_path, only_of=frozenset({"node-00001.h5", "step_1"}))
    assert sorted(removed) == sorted(ours)
    assert all(p.exists() for p in others) and not any(p.exists() for p in ours)
    deep = partial_path(makedirs(tmp_path / "d" / "e") / "c")
    deep.mkdir()
    assert sorted(remove_temporaries(tmp_path, recursive=True)) == sorted([others[0], deep])
    assert not deep.exists() and (tmp_path / "d" / "e").is_dir()
