"""Erasure encoding, rebuild and verification on 4 real MPI ranks: every rank a member of
one group, real files of unequal sizes (an empty file, a member with an empty part),
small segments so that chunks take several rounds and end in a partial one."""

from __future__ import annotations

from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from cachex_agent.checksum import file_checksum
from cachex_agent.errors import CachexError
from cachex_agent.manifest import FileEntry, LocalManifest

pytestmark = [pytest.mark.mpi(min_size=4), pytest.mark.timeout(300)]
GROUP = [10, 11, 12, 13]        # node numbers, so messages are seen to name nodes
SEGMENT = 16 * 1024
TIMEOUT = 60.0
SIZES = [
    {"a.bin": 100_003, "empty": 0, "sub/b.bin": 7},
    {"x.bin": 250_000},
    {"only-empty": 0},              # a member whose part is empty
    {"y": 1, "z/w.bin": 65_537},
]


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def all_ok(ok: bool) -> bool:
    from mpi4py import MPI
    return world().allreduce(bool(ok), op=MPI.LAND)


def stage(root: Path, rank: int, ckpt: str, sizes: list[dict[str, int]] = SIZES
          ) -> tuple[Path, LocalManifest]:
    """This rank's part: its files under <root>/rank-N/stage/<ckpt>, and its manifest."""
    source = root / f"rank-{rank}" / "stage" / ckpt
    rng = np.random.default_rng(rank + 7)
    files = []
    for name, size in sizes[rank].items():
        path = source / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        files.append(FileEntry(name, size, 0o640, file_checksum(path)))
    return source, LocalManifest(run="r", ckpt=ckpt, seq=1, node=GROUP[rank], host="h",
                                 rank=rank, files=files)


def encoded(root: Path, scheme: str, ckpt: str, sizes: list[dict[str, int]] = SIZES):
    from cachex_agent.peer.encode_exchange import encode_part
    comm = world()
    source, manifest = stage(root, comm.rank, ckpt, sizes)
    parity = root / f"rank-{comm.rank}" / "parity"
    result = encode_part(comm, GROUP, scheme, manifest, source, parity, TIMEOUT, SEGMENT)
    return source, manifest, parity, result


def rebuild(root: Path, lost: tuple[int, ...], source: Path, parity: Path, ckpt: str,
            tag: str):
    """Members `lost` rebuild into a fresh directory from an empty parity store."""
    from cachex_agent.recovery.erasure_rebuild import rebuild_parts
    comm = world()
    dest = root / f"rank-{comm.rank}" / f"rebuilt-{tag}"
    if comm.rank in lost:
        return dest, rebuild_parts(comm, list(lost), root / f"empty-{comm.rank}", None, dest,
                                   ckpt, TIMEOUT, SEGMENT)
    return dest, rebuild_parts(comm, list(lost), parity, source, dest, ckpt, TIMEOUT, SEGMENT)


def same_files(source: Path, dest: Path, manifest: LocalManifest) -> list[str]:
    problems = []
    for entry in manifest.files:
        twin = dest / entry.path
        if not twin.is_file() or twin.read_bytes() != (source / entry.path).read_bytes():
            problems.append(f"{twin}: differs from {source / entry.path}")
        elif twin.stat().st_mode & 0o777 != 0o600:
            problems.append(f"{twin}: mode {twin.stat().st_mode & 0o777:o}")
    return problems


def test_layout_of_the_encoded_group(mpi_tmp_path):
    """Each member stores M parity chunks of L/K bytes; every manifest agrees."""
    comm = world()
    _source, _manifest, parity, result = encoded(mpi_tmp_path, "rs:2+2", "layout")
    largest = max(sum(s.values()) for s in SIZES)
    chunk = -(-largest // 2)
    stored = sorted((parity / "layout").iterdir())
    ok = (result.chunk == chunk and len(stored) == 2
          and all(p.stat().st_size == chunk and p.stat().st_mode & 0o777 == 0o600
                  for p in stored)
          and result.member == comm.rank and result.group == GROUP)
    every = comm.allgather((result.chunks, result.parity))
    assert all_ok(ok and all(e == every[0] for e in every)), (result.chunk, stored)


def test_xor_rebuilds_any_one_lost_member_byte_for_byte(mpi_tmp_path):
    comm = world()
    source, manifest, parity, _ = encoded(mpi_tmp_path, "xor", "x1")
    for lost in range(comm.size):
        dest, rebuilt = rebuild(mpi_tmp_path, (lost,), source, parity, "x1", f"{lost}")
        problems = same_files(source, dest, manifest) if comm.rank == lost else []
        if comm.rank == lost:
            problems += [] if rebuilt.files == manifest.files else ["manifest differs"]
        assert all_ok(not problems), (lost, problems)


def test_rs_rebuilds_any_two_lost_members_then_re_encodes(mpi_tmp_path):
    from cachex_agent.peer.encode_exchange import encode_part
    from cachex_agent.peer.parity import check_member
    comm = world()
    source, manifest, parity, _ = encoded(mpi_tmp_path, "rs:2+2", "r2")
    for lost in combinations(range(comm.size), 2):
        tag = "-".join(map(str, lost))
        dest, _ = rebuild(mpi_tmp_path, lost, source, parity, "r2", tag)
        problems = same_files(source, dest, manifest) if comm.rank in lost else []
        assert all_ok(not problems), (lost, problems)
    # the last replacements re-encode from their rebuilt parts, into their own stores
    mine = dest if comm.rank in lost else source
    store = mpi_tmp_path / f"rank-{comm.rank}" / ("parity-new" if comm.rank in lost
                                                  else "parity")
    encode_part(comm, GROUP, "rs:2+2", manifest, mine, store, TIMEOUT, SEGMENT)
    assert all_ok(not check_member(store, "r2", mine))


def test_three_lost_in_rs_2_2_is_refused_naming_group_and_nodes(mpi_tmp_path):
    comm = world()
    source, _manifest, parity, _ = encoded(mpi_tmp_path, "rs:2+2", "r3")
    with pytest.raises(CachexError) as error:
        rebuild(mpi_tmp_path, (0, 1, 3), source, parity, "r3", "three")
    text = str(error.value)
    assert "[10, 11, 12, 13]" in text and "lost nodes 10, 11, 13" in text, text
    assert "rebuilds at most 2" in text and "PFS" in text, text
    assert not (mpi_tmp_path / f"rank-{comm.rank}" / "rebuilt-three").exists()


@pytest.mark.parametrize("scheme", ["xor", "rs:2+2"])
def test_verify_catches_corrupted_parity_and_data(mpi_tmp_path, scheme):
    from cachex_agent.peer.parity import check_member
    comm = world()
    ckpt = f"v-{scheme.replace(':', '').replace('+', '')}"
    source, _manifest, parity, result = encoded(mpi_tmp_path, scheme, ckpt)
    clean = check_member(parity, ckpt, source)
    comm.Barrier()
    if comm.rank == 1:          # one byte of one parity chunk
        path = result.parity_path(parity, 1, 0)
        body = bytearray(path.read_bytes())
        body[len(body) // 2] ^= 0x40
        path.write_bytes(bytes(body))
    if comm.rank == 3:          # one byte of a staged file
        path = source / "z/w.bin"
        body = bytearray(path.read_bytes())
        body[-1] ^= 1
        path.write_bytes(bytes(body))
    found = check_member(parity, ckpt, source)
    want = {1: "parity", 3: "data chunk"}.get(comm.rank)
    ok = not clean and (not found if want is None
                        else len(found) == 1 and want in next(iter(found)))
    assert all_ok(ok), (clean, found)


def test_rebuild_from_corrupted_parity_fails_on_every_rank(mpi_tmp_path):
    """A survivor's changed parity byte makes the decoded chunk mismatch its checksum:
    the rebuild fails on every rank and leaves no file."""
    comm = world()
    source, _manifest, parity, result = encoded(mpi_tmp_path, "xor", "bad")
    if comm.rank == 1:
        for slot in range(result.m):
            path = result.parity_path(parity, 1, slot)
            body = bytearray(path.read_bytes())
            body[0] ^= 0xFF
            path.write_bytes(bytes(body))
    comm.Barrier()
    lost = next(c for c in range(comm.size)
                if 1 in [result.code.holder(c, p) for p in range(result.code.k,
                                                                 result.code.n)])
    lost = result.code.contributors(lost)[0]    # a member whose chunk needs rank 1's parity
    with pytest.raises(CachexError, match="decode to other bytes"):
        rebuild(mpi_tmp_path, (lost,), source, parity, "bad", "bad")
    dest = mpi_tmp_path / f"rank-{comm.rank}" / "rebuilt-bad"
    assert not dest.exists() or not [p for p in dest.rglob("*") if p.is_file()]


def test_a_group_of_empty_parts_encodes_and_rebuilds(mpi_tmp_path):
    """Chunks of 0 bytes: empty parity files, and a rebuild that only recreates files."""
    comm = world()
    sizes = [{"e": 0}, {}, {"f": 0, "g/h": 0}, {"i": 0}]
    source, manifest, parity, result = encoded(mpi_tmp_path, "rs:2+2", "e", sizes)
    ok = result.chunk == 0 and all(p.stat().st_size == 0 for p in (parity / "e").iterdir())
    assert all_ok(ok)
    dest, _ = rebuild(mpi_tmp_path, (0, 2), source, parity, "e", "e")
    assert all_ok(comm.rank not in (0, 2) or not same_files(source, dest, manifest))
