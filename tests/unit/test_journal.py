"""The journal on node-local storage: real files, re-read by a new instance."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from cachex_agent.fsutil import read_json
from cachex_agent.journal import Journal
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest, ManifestDigest
from cachex_agent.safepath import UnsafeInput


def local_manifest(node: int, ckpt: str = "step_00100") -> LocalManifest:
    files = [FileEntry(".metadata", 12, 0o644, "0" * 32),
             FileEntry(f"__{node}_0.distcp", 4096, 0o600, f"{node:032x}"),
             FileEntry("sub/dir/empty", 0, 0o640, "9" * 32)]
    return LocalManifest(run="run1", ckpt=ckpt, seq=100, node=node, host=f"nid{node:04d}",
                         rank=node * 2, files=files, captured_at=1700000000.25)


def no_temp_files(root: Path) -> bool:
    return not [p for p in root.rglob("*") if ".tmp-" in p.name]


@pytest.mark.timeout(10)
def test_update_get_forget_persist_across_instances(tmp_path):
    root = tmp_path / "cache" / "run1" / "journal"
    journal = Journal(root)
    assert (root / "manifests").is_dir() and (root / "global").is_dir()
    assert journal.get("step_00100") is None

    journal.update("step_00100", state="capturing", seq=100)
    journal.update("step_00100", state="captured", source="/stage/step_00100", mode="copy")
    journal.update("step_00200", state="capturing", seq=200)
    assert journal.get("step_00100") == {"state": "captured", "seq": 100,
                                         "source": "/stage/step_00100", "mode": "copy"}

    reopened = Journal(root)
    assert reopened.get("step_00100") == journal.get("step_00100")
    assert reopened.get("step_00200") == {"state": "capturing", "seq": 200}
    assert set(reopened.entries) == {"step_00100", "step_00200"}

    reopened.save_manifest(local_manifest(0))
    reopened.forget("step_00100")
    assert reopened.get("step_00100") is None
    assert reopened.manifest("step_00100") is None
    assert not (root / "manifests" / "step_00100.json").exists()

    third = Journal(root)
    assert third.get("step_00100") is None
    assert third.get("step_00200") == {"state": "capturing", "seq": 200}
    third.forget("never-seen")                 # forgetting an unknown ckpt is harmless
    assert set(Journal(root).entries) == {"step_00200"}


@pytest.mark.timeout(10)
def test_state_json_format_and_atomic_writes(tmp_path):
    root = tmp_path / "journal"
    journal = Journal(root)
    for i in range(20):
        journal.update(f"step_{i:05d}", state="captured", seq=i)
        # After every update the file is whole, valid JSON, and no temp file is left.
        data = read_json(root / "state.json")
        assert data["version"] == 1
        assert len(data["ckpts"]) == i + 1
        assert no_temp_files(root)
    journal.forget("step_00003")
    assert "step_00003" not in read_json(root / "state.json")["ckpts"]
    assert no_temp_files(root)
    assert json.loads((root / "state.json").read_text())["ckpts"]["step_00019"]["seq"] == 19


@pytest.mark.timeout(20)
def test_concurrent_updates_are_all_persisted(tmp_path):
    root = tmp_path / "journal"
    journal = Journal(root)
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            for i in range(10):
                journal.update(f"t{thread}-{i}", state="captured", seq=i)
        except BaseException as exc:        # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert not errors
    assert len(Journal(root).entries) == 40
    assert no_temp_files(root)


@pytest.mark.timeout(10)
def test_local_manifest_round_trip(tmp_path):
    root = tmp_path / "journal"
    original = local_manifest(3)
    Journal(root).save_manifest(original)
    loaded = Journal(root).manifest("step_00100")
    assert loaded == original
    assert loaded.bytes == 12 + 4096
    assert all(isinstance(f, FileEntry) for f in loaded.files)
    assert Journal(root).manifest("step_99999") is None
    assert no_temp_files(root)


@pytest.mark.timeout(10)
def test_global_manifest_round_trip(tmp_path):
    root = tmp_path / "journal"
    parts = [local_manifest(1), local_manifest(0)]
    original = GlobalManifest.build(parts, global_files=[".metadata"],
                                    times={"written": 1.0, "captured": 2.0, "flushed": 3.5},
                                    bundles={0: "node-00000.h5", 1: "node-00001.h5"})
    Journal(root).save_global(original)
    loaded = Journal(root).global_manifest("step_00100")
    assert loaded == original
    assert [n["node"] for n in loaded.nodes] == [0, 1]
    assert loaded.node_files(1) == local_manifest(1).files
    assert loaded.bytes == 2 * (12 + 4096)
    assert Journal(root).global_manifest("step_99999") is None
    assert no_temp_files(root)


def test_a_global_manifest_is_written_as_its_json_and_a_copy_with_other_times_too(tmp_path):
    """`encoded` reuses the lists' text for a `replace`d copy (the finalize's), never for
    a manifest whose lists are others."""
    parts = [local_manifest(1), local_manifest(0)]
    built = GlobalManifest.build(parts, [".metadata"], {"written": 1.0},
                                 {0: "node-00000.h5", 1: "node-00001.h5"})
    assert json.loads(built.encoded()) == built.to_json()
    later = replace(built, times={"written": 1.0, "flushed": 4.0}, committed_at=9.0)
    assert later.lists_text is built.lists_text
    assert json.loads(later.encoded()) == later.to_json()
    other = replace(built, files=built.files[:1])
    assert json.loads(other.encoded()) == other.to_json()
    built.save(tmp_path / "m.json")
    assert GlobalManifest.load(tmp_path / "m.json") == built
    with pytest.raises(UnsafeInput, match="lists_text"):
        GlobalManifest.from_json({**built.to_json(), "lists_text": [[1], "{}"]})


@pytest.mark.timeout(10)
def test_read_and_write_named_files(tmp_path):
    root = tmp_path / "journal"
    journal = Journal(root)
    assert journal.read("status.json") == {}
    journal.write("status.json", {"run": "run1", "checkpoints": []})
    assert Journal(root).read("status.json") == {"run": "run1", "checkpoints": []}
    assert no_temp_files(root)


def test_manifest_digest_names_the_content_and_its_global_files(tmp_path):
    parts = [local_manifest(node) for node in range(3)]
    gm = GlobalManifest.build(parts, [], {"written": 1.0}, {n: f"node-{n}.h5" for n in range(3)})
    digest = gm.digest()
    assert (digest.nodes, digest.files, digest.bytes) == (3, len(gm.files), gm.bytes)
    assert ManifestDigest.from_json(json.loads(json.dumps(digest.to_json()))) == digest
    rebuilt = GlobalManifest.build(parts[::-1], [], {}, {n: "x.h5" for n in range(3)}, 5.0)
    assert digest.matches(rebuilt)                  # times and bundles are not content
    changed = [*parts[:2], local_manifest(2, "step_00100")]
    changed[2].files[0] = FileEntry(changed[2].files[0].path, 1, 0o600, "other")
    assert not digest.matches(GlobalManifest.build(changed, [], {}, {n: "x" for n in range(3)}))


def test_manifest_digest_refuses_what_does_not_fit_it():
    gm = GlobalManifest.build([local_manifest(0)], [], {}, {0: "node-00000.h5"})
    data = gm.digest().to_json()
    with pytest.raises(UnsafeInput, match="not a node of this checkpoint"):
        ManifestDigest.from_json({**data, "globals": [{**gm.files[0], "node": 4}]})
    with pytest.raises(UnsafeInput, match="unsafe checkpoint id"):
        ManifestDigest.from_json({**data, "ckpt": "../x"})
