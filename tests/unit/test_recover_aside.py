"""recovery/aside.py: what a recovery would replace goes to a free set-aside name."""

from __future__ import annotations

from cachex_agent.checksum import file_checksum
from cachex_agent.checksum import same_bytes as same_file
from cachex_agent.manifest import FileEntry
from cachex_agent.recovery.aside import Aside, differs, tree_matches


def entry_of(path, relpath: str) -> FileEntry:
    return FileEntry(relpath, path.stat().st_size, 0o644, file_checksum(path))


def test_differs_by_bytes_not_by_presence(tmp_path):
    (tmp_path / "a").write_bytes(b"one")
    entry = entry_of(tmp_path / "a", "a")
    assert not differs(tmp_path / "a", entry)
    assert not differs(tmp_path / "missing", entry)      # nothing there to keep
    (tmp_path / "a").write_bytes(b"two")                 # same size, other bytes
    assert differs(tmp_path / "a", entry)
    (tmp_path / "d").mkdir()
    assert differs(tmp_path / "d", entry)


def test_same_file_and_tree_matches(tmp_path):
    (tmp_path / "x").write_bytes(b"abc")
    (tmp_path / "y").write_bytes(b"abc")
    (tmp_path / "z").write_bytes(b"abd")
    assert same_file(tmp_path / "x", tmp_path / "y")
    assert not same_file(tmp_path / "x", tmp_path / "z")
    tree = tmp_path / "t"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_bytes(b"data")
    expected = [entry_of(tree / "sub" / "f", "sub/f")]
    assert tree_matches(tree, expected)
    (tree / "new").write_bytes(b"")                      # a file the manifest lacks
    assert not tree_matches(tree, expected)


def test_an_earlier_set_aside_copy_stays_and_each_move_is_said(tmp_path):
    spool = tmp_path / "spool"
    (spool / "ckpt").mkdir(parents=True)
    (spool / "ckpt" / "w.bin").write_bytes(b"newer")
    (spool / "ckpt.pt").write_bytes(b"newer save")
    (spool / ".cachex-unrecoverable-ckpt.pt").write_bytes(b"earlier")
    aside = Aside(spool, 3)
    inside = aside.inside("ckpt", "w.bin", "differs")
    whole = aside.entry("ckpt.pt", "differs")
    assert inside == spool / ".cachex-unrecoverable-ckpt" / "w.bin"
    assert inside.read_bytes() == b"newer" and not (spool / "ckpt" / "w.bin").exists()
    assert whole == spool / ".cachex-unrecoverable-ckpt.pt.2"
    assert whole.read_bytes() == b"newer save"
    assert (spool / ".cachex-unrecoverable-ckpt.pt").read_bytes() == b"earlier"
    assert aside.moved == [
        "node 3: ckpt/w.bin set aside as .cachex-unrecoverable-ckpt/w.bin (differs)",
        "node 3: ckpt.pt set aside as .cachex-unrecoverable-ckpt.pt.2 (differs)"]
