"""The owner's side of a part to one partner (peer/replicator.Sender): with `streams`
files in flight their pieces go in turn, each piece the file's own bytes at its offset;
a part fed by its capture goes one file at a time (tests/mpi/test_replication.py runs
every replication case with 1 and 3 streams against real windows)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest

from cachex_agent.checksum import file_checksum
from cachex_agent.manifest import FileEntry, LocalManifest
from cachex_agent.peer.replicator import Sender, Stream

PIECE = 4096
SIZES = {"a": 3 * PIECE, "empty": 0, "b": PIECE + 1, "c": 5 * PIECE, "d": 10}


@pytest.fixture
def part(tmp_path: Path) -> tuple[Path, LocalManifest]:
    rng = np.random.default_rng(7)
    entries = []
    for name, size in SIZES.items():
        (tmp_path / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        entries.append(FileEntry(name, size, 0o600, file_checksum(tmp_path / name)))
    return tmp_path, LocalManifest(run="r", ckpt="c1", seq=1, node=0, host="h", rank=0,
                                   files=entries)


def pieces(sender: Sender) -> list[tuple[int, int, bytes]]:
    buffer = np.empty(PIECE, np.uint8)
    out = []
    while (chunk := sender.next_chunk(buffer)) is not None:
        assert not isinstance(chunk, str)
        index, offset, data = chunk
        out.append((index, offset, bytes(data)))
    sender.close()
    return out


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_three_streams_take_turns_and_every_piece_is_its_files_bytes(part, mapped):
    source, manifest = part
    sender = Sender(manifest, source, 1, 1, 0, deque([0]), mapped=mapped, streams=3)
    got = pieces(sender)
    order = [index for index, _offset, _data in got]
    assert order[:3] == [0, 2, 3]       # a, b, c in turn (the empty file has no piece)
    for at in range(len(got)):          # never more than 3 begun and unfinished
        begun = set(order[:at + 1])
        assert len({i for i in begun if i in order[at + 1:]}) <= 3
    assert order[-1] == 3 and 4 in order[:-1]   # d took a finished file's place
    for index, offset, data in got:
        path = source / manifest.files[index].path
        assert data == path.read_bytes()[offset:offset + len(data)]
        assert offset == sum(len(d) for j, _o, d in got[:got.index((index, offset, data))]
                             if j == index)     # each file's pieces in order
    sent = {i: sum(len(d) for j, _o, d in got if j == i) for i in range(len(SIZES))}
    assert sent == {i: e.size for i, e in enumerate(manifest.files)}


def test_one_stream_sends_the_files_in_order(part):
    source, manifest = part
    order = [index for index, _o, _d in pieces(Sender(manifest, source, 1, 1, 0, deque([0])))]
    assert order == sorted(order)


def test_a_part_fed_by_its_capture_goes_one_file_at_a_time(part):
    """The capture reads the files in turn: a later file's piece would only wait."""
    source, manifest = part

    class Fed:
        def serve(self, *_args, **_kwargs):
            return "read"       # feed.READ: nothing kept, read the file

        def drop(self, _ckpt):
            pass
    stream = Stream(manifest, source, source)
    sender = Sender(manifest, source, 1, 1, 0, deque([0]), stream=stream, streams=3,
                    feed=Fed())     # type: ignore[arg-type]
    assert sender.width() == 1
    order = [index for index, _o, _d in pieces(sender)]
    assert order == sorted(order)
