"""HDF5 bundles: real files in tmp_path, real h5py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from cachex_agent.checksum import file_checksum
from cachex_agent.errors import OperationError
from cachex_agent.flush.bundle import (
    BundleError,
    extract,
    is_complete,
    read_manifest,
    verify_bundle,
    write_bundle,
)
from cachex_agent.flush.throttle import TokenBucket
from cachex_agent.layout import bundle_name
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.safepath import UnsafeInput

CHUNK = 64 * 1024   # small, so modest files span many chunks

FILES = {
    ".metadata": (b"dcp metadata\n", 0o644),
    "empty.bin": (b"", 0o600),
    "a/b/c.bin": (bytes(range(256)) * 40, 0o640),
    "big/__0_0.distcp": (None, 0o444),          # random, several chunks plus a remainder
    "run.sh": (b"#!/bin/sh\necho resume\n", 0o755),
}


def make_source(root: Path) -> LocalManifest:
    rng = np.random.default_rng(7)
    entries = []
    for name, (data, mode) in FILES.items():
        if data is None:
            data = rng.integers(0, 256, 5 * CHUNK + 1234, dtype=np.uint8).tobytes()
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, mode)
        entries.append(FileEntry(name, len(data), mode, file_checksum(path)))
    return LocalManifest(run="llm7b-a", ckpt="step_00100", seq=100, node=3, host="nid0003",
                         rank=3, files=entries)


@pytest.fixture
def staged(tmp_path: Path) -> tuple[Path, LocalManifest]:
    source = tmp_path / "stage" / "step_00100"
    source.mkdir(parents=True)
    return source, make_source(source)


@pytest.fixture(params=[1, 3], ids=["1 writer", "3 writers"])
def bundle(tmp_path: Path, staged: tuple[Path, LocalManifest], request: pytest.FixtureRequest
           ) -> Path:
    source, manifest = staged
    out = tmp_path / "pfs"
    out.mkdir()
    final = out / bundle_name(manifest.node)
    write_bundle(final, manifest, source, chunk=CHUNK, writers=request.param)
    return final


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_bundle_name() -> None:
    assert bundle_name(3) == "node-00003.h5"
    assert bundle_name(123456) == "node-123456.h5"


def test_round_trip(tmp_path: Path, staged: tuple[Path, LocalManifest], bundle: Path) -> None:
    source, manifest = staged
    assert leftovers(bundle.parent) == [bundle.name]
    assert is_complete(bundle)
    assert read_manifest(bundle) == manifest
    assert verify_bundle(bundle, manifest.files) == []

    dest = tmp_path / "restored"
    extracted = extract(bundle, dest)
    assert extracted == manifest.files
    for entry in manifest.files:
        got = dest / entry.path
        assert got.read_bytes() == (source / entry.path).read_bytes(), entry.path
        assert stat.S_IMODE(got.stat().st_mode) == entry.mode, entry.path
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]


def test_extract_only(tmp_path: Path, staged: tuple[Path, LocalManifest], bundle: Path) -> None:
    source, _ = staged
    dest = tmp_path / "spool"
    got = extract(bundle, dest, only={".metadata", "a/b/c.bin"})
    assert sorted(e.path for e in got) == [".metadata", "a/b/c.bin"]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        ".metadata", "a/b/c.bin"]
    assert (dest / ".metadata").read_bytes() == (source / ".metadata").read_bytes()
    with pytest.raises(BundleError, match="not-there"):
        extract(bundle, dest, only={"not-there"})


def test_readable_with_plain_h5py(bundle: Path, staged: tuple[Path, LocalManifest]) -> None:
    source, manifest = staged
    with h5py.File(bundle, "r", locking=False) as h5:
        attrs = h5.attrs
        assert attrs["format"] == "cachex-bundle"
        assert attrs["version"] == 1
        assert (attrs["run"], attrs["ckpt"], attrs["seq"]) == ("llm7b-a", "step_00100", 100)
        assert (attrs["node"], attrs["host"], attrs["rank"]) == (3, "nid0003", 3)
        assert attrs["algorithm"] == "xxh3-128"
        assert bool(attrs["complete"]) is True
        files = h5["files"]
        assert sorted(files) == [f"{i:06d}" for i in range(len(manifest.files))]
        for i, entry in enumerate(manifest.files):
            dset = files[f"{i:06d}"]
            assert dset.dtype == np.uint8 and dset.shape == (entry.size,)
            assert dset.chunks is None           # contiguous
            assert dset.attrs["path"] == entry.path
            assert dset.attrs["size"] == entry.size
            assert dset.attrs["mode"] == entry.mode
            assert dset.attrs["checksum"] == entry.checksum
            assert dset[()].tobytes() == (source / entry.path).read_bytes()


@pytest.mark.parametrize("writers", [1, 3])
def test_throttle_and_progress_see_every_byte(tmp_path: Path,
                                              staged: tuple[Path, LocalManifest],
                                              writers: int) -> None:
    source, manifest = staged
    seen: list[int] = []
    consumed: list[int] = []

    class Recorder(TokenBucket):
        def consume(self, n: int) -> float:
            consumed.append(n)
            return 0.0

    write_bundle(tmp_path / "b.h5", manifest, source, chunk=CHUNK, throttle=Recorder(0),
                 on_bytes=seen.append, verify=False, writers=writers)
    assert sum(seen) == sum(consumed) == manifest.bytes
    assert max(seen) <= CHUNK


@pytest.mark.parametrize("writers", [1, 3])
def test_source_mismatch_leaves_nothing(tmp_path: Path, staged: tuple[Path, LocalManifest],
                                        writers: int) -> None:
    source, manifest = staged
    target = source / "a/b/c.bin"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    os.chmod(target, 0o644)
    target.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BundleError, match="a/b/c.bin") as info:
        write_bundle(out / "node-00003.h5", manifest, source, chunk=CHUNK, writers=writers)
    assert isinstance(info.value, OperationError)
    assert leftovers(out) == []


@pytest.mark.parametrize("change", ["longer", "shorter", "missing"])
def test_source_size_change_leaves_nothing(tmp_path: Path, staged: tuple[Path, LocalManifest],
                                           change: str) -> None:
    source, manifest = staged
    target = source / "empty.bin" if change == "longer" else source / "a/b/c.bin"
    if change == "longer":
        target.write_bytes(b"x")
    elif change == "shorter":
        target.write_bytes(target.read_bytes()[:-1])
    else:
        target.unlink()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BundleError, match=target.name):
        write_bundle(out / "node-00003.h5", manifest, source, chunk=CHUNK)
    assert leftovers(out) == []


def flip_dataset_byte(bundle: Path, index: int, position: int) -> None:
    """Corrupt one byte of a dataset behind HDF5's back, as a disk would."""
    with h5py.File(bundle, "r", locking=False) as h5:
        offset = h5["files"][f"{index:06d}"].id.get_offset()
    with open(bundle, "r+b") as handle:
        handle.seek(offset + position)
        byte = handle.read(1)
        handle.seek(offset + position)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_flipped_byte_is_found(tmp_path: Path, staged: tuple[Path, LocalManifest],
                               bundle: Path) -> None:
    _, manifest = staged
    index = [e.path for e in manifest.files].index("big/__0_0.distcp")
    flip_dataset_byte(bundle, index, 3 * CHUNK + 17)
    problems = verify_bundle(bundle, manifest.files)
    assert len(problems) == 1
    assert "big/__0_0.distcp" in problems[0] and "checksum" in problems[0]
    dest = tmp_path / "restored"
    with pytest.raises(BundleError, match="big/__0_0.distcp"):
        extract(bundle, dest)
    assert not (dest / "big/__0_0.distcp").exists()
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]


def test_element_modified_through_h5py_is_found(staged: tuple[Path, LocalManifest],
                                                bundle: Path) -> None:
    _, manifest = staged
    index = [e.path for e in manifest.files].index(".metadata")
    with h5py.File(bundle, "r+", locking=False) as h5:
        dset = h5["files"][f"{index:06d}"]
        dset[0] = dset[0] ^ 0xFF
    problems = verify_bundle(bundle)
    assert len(problems) == 1 and "'.metadata'" in problems[0]


def test_verify_against_expected(staged: tuple[Path, LocalManifest], bundle: Path) -> None:
    _, manifest = staged
    extra = FileEntry("gone.bin", 3, 0o644, "0" * 32)
    changed = FileEntry(".metadata", 99, 0o644, "f" * 32)
    expected = [e for e in manifest.files if e.path not in (".metadata", "run.sh")]
    problems = verify_bundle(bundle, [*expected, extra, changed])
    text = "\n".join(problems)
    assert len(problems) == 3
    assert "'gone.bin': missing" in text
    assert "'.metadata'" in text and "expected 99 bytes" in text
    assert "'run.sh': in the bundle but not expected" in text


def test_incomplete_and_garbage(tmp_path: Path, bundle: Path) -> None:
    with h5py.File(bundle, "r+", locking=False) as h5:
        h5.attrs["complete"] = False
    assert not is_complete(bundle)
    with pytest.raises(BundleError, match="incomplete"):
        read_manifest(bundle)
    assert verify_bundle(bundle) and "incomplete" in verify_bundle(bundle)[0]
    with pytest.raises(BundleError, match="incomplete"):
        extract(bundle, tmp_path / "x")

    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"not hdf5 at all" * 100)
    assert not is_complete(garbage)
    with pytest.raises(BundleError, match="not a readable HDF5"):
        read_manifest(garbage)

    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as h5:
        h5["x"] = np.arange(3)
    assert not is_complete(other)
    with pytest.raises(BundleError, match="not a cachex bundle"):
        read_manifest(other)

    missing = tmp_path / "missing.h5"
    assert not is_complete(missing)
    with pytest.raises(BundleError, match="no such bundle"):
        read_manifest(missing)
    assert verify_bundle(missing) == [f"{missing}: no such bundle"]


def test_truncated_bundle_is_reported_not_crashing(staged: tuple[Path, LocalManifest],
                                                   bundle: Path) -> None:
    _, manifest = staged
    size = bundle.stat().st_size
    os.truncate(bundle, size - 5000)
    assert not is_complete(bundle) or verify_bundle(bundle, manifest.files)
    assert verify_bundle(bundle, manifest.files)


def test_unsafe_path_is_refused(tmp_path: Path, bundle: Path) -> None:
    with h5py.File(bundle, "r+", locking=False) as h5:
        h5["files/000000"].attrs["path"] = "../escape"
    with pytest.raises(UnsafeInput, match=r"files/000000: unsafe file path '\.\./escape'"):
        extract(bundle, tmp_path / "dest")
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "dest").exists()         # refused before anything is written


def test_empty_manifest(tmp_path: Path) -> None:
    manifest = LocalManifest(run="r", ckpt="c", seq=1, node=0, host="h", rank=0, files=[])
    final = tmp_path / bundle_name(0)
    write_bundle(final, manifest, tmp_path)
    assert read_manifest(final) == manifest
    assert extract(final, tmp_path / "d") == []


def test_rewrite_replaces_existing(tmp_path: Path, staged: tuple[Path, LocalManifest],
                                   bundle: Path) -> None:
    source, manifest = staged
    manifest.seq = 101
    write_bundle(bundle, manifest, source, chunk=CHUNK)
    assert read_manifest(bundle).seq == 101
    assert leftovers(bundle.parent) == [bundle.name]


def test_without_mmap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                      staged: tuple[Path, LocalManifest], bundle: Path) -> None:
    """File systems without mmap: the pread path gives the same answers."""
    import cachex_agent.flush.bundle as module

    def no_mmap(*args: object, **kwargs: object) -> None:
        raise OSError(19, "No such device")

    monkeypatch.setattr(module.mmap, "mmap", no_mmap)
    source, manifest = staged
    assert verify_bundle(bundle, manifest.files) == []
    extract(bundle, tmp_path / "d")
    for entry in manifest.files:
        assert (tmp_path / "d" / entry.path).read_bytes() == (source / entry.path).read_bytes()
    flip_dataset_byte(bundle, 3, 10)
    assert len(verify_bundle(bundle)) == 1


def test_repacked_with_compression_still_reads(tmp_path: Path,
                                               staged: tuple[Path, LocalManifest],
                                               bundle: Path) -> None:
    """A bundle rewritten with chunked, compressed datasets (h5repack -f GZIP) still works."""
    source, manifest = staged
    repacked = tmp_path / "repacked.h5"
    with h5py.File(bundle, "r", locking=False) as old, h5py.File(repacked, "w") as new:
        new.attrs.update(old.attrs)
        for name, dset in old["files"].items():
            copy = new.create_dataset(f"files/{name}", data=dset[()],
                                      compression="gzip" if dset.shape[0] else None)
            copy.attrs.update(dset.attrs)
    assert verify_bundle(repacked, manifest.files) == []
    extract(repacked, tmp_path / "d")
    for entry in manifest.files:
        assert (tmp_path / "d" / entry.path).read_bytes() == (source / entry.path).read_bytes()


@pytest.mark.parametrize("damage", ["attribute", "group"])
def test_malformed_entry(tmp_path: Path, bundle: Path, damage: str) -> None:
    with h5py.File(bundle, "r+", locking=False) as h5:
        if damage == "attribute":
            del h5["files/000002"].attrs["checksum"]
        else:
            h5.create_group("files/999999")
    with pytest.raises(BundleError, match="files/(000002|999999)"):
        read_manifest(bundle)
    assert "files/" in verify_bundle(bundle)[0]


def test_fixed_length_string_attributes_are_read(staged: tuple[Path, LocalManifest],
                                                 bundle: Path) -> None:
    """Tools other than h5py may store strings as fixed-length bytes."""
    _, manifest = staged
    with h5py.File(bundle, "r+", locking=False) as h5:
        dset = h5["files/000000"]
        dset.attrs["path"] = np.bytes_(manifest.files[0].path.encode())
        dset.attrs["size"] = np.int32(manifest.files[0].size)
    assert read_manifest(bundle) == manifest
    assert verify_bundle(bundle, manifest.files) == []


_PEAK_SCRIPT = """
import json, sys
from pathlib import Path
from cachex_agent.checksum import file_checksum
from cachex_agent.flush.bundle import extract, verify_bundle

def hwm():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM"))

bundle, dest, source = map(Path, sys.argv[1:4])
growth = {}
for name, action in (("verify", lambda: verify_bundle(bundle)),
                     ("extract", lambda: extract(bundle, dest)),
                     ("checksum", lambda: file_checksum(source))):
    before = hwm()
    result = action()
    # verify finds no problem; extract and checksum return something
    growth[name] = [hwm() - before, result == [] if name == "verify" else bool(result)]
print(json.dumps(growth))
"""


def test_reading_a_large_bundle_holds_one_window_not_the_bundle(tmp_path: Path) -> None:
    """RSS counts the mapped pages of a file: a verify, an extract or a checksum of a
    192 MiB part must not grow the peak RSS of a fresh process by the part."""
    source = tmp_path / "stage"
    source.mkdir()
    block = bytearray(os.urandom(1024 * 1024))
    entries = []
    for i in range(3):
        path = source / f"__{i}_0.distcp"
        with open(path, "wb") as out:
            for j in range(64):
                block[:4] = (i * 64 + j).to_bytes(4, "little")
                out.write(block)
        entries.append(FileEntry(path.name, path.stat().st_size, 0o600, file_checksum(path)))
    manifest = LocalManifest(run="r", ckpt="step_1", seq=1, node=0, host="h", rank=0,
                             files=entries)
    final = tmp_path / bundle_name(0)
    write_bundle(final, manifest, source, verify=False)
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(final), str(tmp_path / "out"),
                           str(source / entries[0].path)],
                          capture_output=True, text=True, timeout=120, check=True)
    growth = json.loads(done.stdout)
    assert all(ok for _, ok in growth.values()), growth
    assert max(peak for peak, _ in growth.values()) < 32 * 1024 * 1024, growth


def test_a_temporary_the_pfs_will_not_remove_is_named_then_swept(
        tmp_path: Path, staged: tuple[Path, LocalManifest],
        caplog: pytest.LogCaptureFixture) -> None:
    """Mid-write the bundle's directory becomes immutable (a real `chattr +i`, as a PFS
    gone read-only refuses the rename and the removal alike): the write fails with the
    rename's error, the temporary is named in one line, the next start removes it."""
    from cachex_agent.cleanup import remove_stale
    from cachex_agent.layout import NodePaths
    source, manifest = staged
    pfs = tmp_path / "pfs"
    out = pfs / "ckpt" / manifest.ckpt
    out.mkdir(parents=True)
    frozen = []

    def freeze(_n: int) -> None:
        if not frozen:
            subprocess.run(["chattr", "+i", str(out)], check=True)
            frozen.append(out)
    try:
        with pytest.raises(OSError) as raised:
            write_bundle(out / bundle_name(manifest.node), manifest, source, chunk=CHUNK,
                         on_bytes=freeze)
        assert raised.value.filename and "tmp-cachex" in str(raised.value.filename)
        left = list(out.iterdir())
        assert len(left) == 1 and ".tmp-cachex-" in left[0].name
        lines = [r.getMessage() for r in caplog.records if str(left[0]) in r.getMessage()]
        assert len(lines) == 1 and "next agent start removes it" in lines[0], lines
    finally:
        for path in frozen:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    paths = NodePaths(tmp_path / "spool", tmp_path / "nostage", tmp_path / "cache", pfs)
    assert remove_stale(paths, manifest.node, coordinator=False) == [str(left[0])]
    assert list(out.iterdir()) == []


def test_hostile_attributes_are_incomplete_and_a_bug_is_not_hidden(tmp_path: Path, bundle: Path,
                                                                   monkeypatch) -> None:
    """Attributes of other types (an array where a flag goes, bytes that are no UTF-8)
    make a bundle incomplete; an error of the code's own (here a TypeError) is raised,
    not taken for an incomplete bundle."""
    with h5py.File(bundle, "r+", locking=False) as h5:
        h5.attrs["complete"] = np.array([True, False])
    assert not is_complete(bundle)
    with h5py.File(bundle, "r+", locking=False) as h5:
        h5.attrs["complete"] = True
        h5.attrs["format"] = np.bytes_(b"\xff\xfe")
    assert not is_complete(bundle)
    from cachex_agent.flush import bundle as module

    def broken(*_args, **_kwargs):
        raise TypeError("a bug")
    monkeypatch.setattr(module, "_checked_root", broken)
    with pytest.raises(TypeError, match="a bug"):
        is_complete(bundle)
