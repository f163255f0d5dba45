"""The erasure layout, codes, part reader and groups (pure parts: no MPI)."""

from __future__ import annotations

from collections import Counter
from itertools import combinations

import numpy as np
import pytest

from cachex_agent.errors import ConfigError, OperationError
from cachex_agent.manifest import FileEntry
from cachex_agent.peer.erasure import DATA, PARITY, PartReader, Scheme, chunk_length, scheme_of
from cachex_agent.peer.groups import build_groups, shape

SCHEMES = [Scheme(1, 1), Scheme(3, 1), Scheme(7, 1), Scheme(2, 2), Scheme(4, 2), Scheme(5, 3)]


@pytest.mark.parametrize("s", SCHEMES, ids=lambda s: s.name)
def test_every_member_stores_m_parities_and_contributes_each_chunk_once(s):
    stored = Counter()
    chunks = Counter()
    for c in range(s.n):
        holders = [s.symbol(c, p)[0] for p in range(s.n)]
        assert sorted(holders) == list(range(s.n))      # one symbol per member
        for p in range(s.n):
            member, kind, index = s.symbol(c, p)
            if kind == PARITY:
                stored[member] += 1
                assert (c, index) in s.parities_of(member)
            else:
                assert kind == DATA and s.codeword_of_chunk(member, index) == c
                chunks[(member, index)] += 1
    assert stored == dict.fromkeys(range(s.n), s.m)
    assert set(chunks) == {(i, j) for i in range(s.n) for j in range(s.k)}
    assert set(chunks.values()) == {1}


@pytest.mark.parametrize("s", SCHEMES, ids=lambda s: s.name)
def test_any_m_losses_leave_k_symbols_of_every_codeword_and_more_do_not(s):
    for lost in combinations(range(s.n), s.m):
        for c in range(s.n):
            alive = s.survivors(c, set(lost))
            assert len(alive) == s.k and not {s.holder(c, p) for p in alive} & set(lost)
    if s.m < s.n - 1:
        with pytest.raises(OperationError, match="symbols survive"):
            s.survivors(0, set(range(s.m + 1)))


@pytest.mark.parametrize("s", [Scheme(3, 1), Scheme(2, 2), Scheme(4, 2)], ids=lambda s: s.name)
@pytest.mark.parametrize("length", [0, 1, 13, 4096])
def test_decode_from_every_k_symbols_gives_the_data(s, length):
    rng = np.random.default_rng(length)
    data = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(s.k)]
    parity = s.encode(data)
    assert len(parity) == s.m and all(p.nbytes == length for p in parity)
    symbols = data + parity
    for positions in combinations(range(s.n), s.k):
        got = s.decode([symbols[p] for p in positions], list(positions))
        for want, have in zip(data, got, strict=True):
            assert np.array_equal(want, have), (positions, length)


def test_xor_parity_is_the_xor_of_the_data():
    data = [np.array([1, 2, 3], np.uint8), np.array([4, 8, 16], np.uint8)]
    assert Scheme(2, 1).encode(data)[0].tolist() == [5, 10, 19]


def test_scheme_of_and_chunk_length():
    assert scheme_of("xor", 5) == Scheme(4, 1)
    assert scheme_of("rs:2+2", 4) == Scheme(2, 2) and scheme_of("rs:2+2", 5) == Scheme(3, 2)
    assert chunk_length(0, 3) == 0 and chunk_length(10, 3) == 4 and chunk_length(9, 3) == 3


def test_part_reader_concatenates_files_and_pads_with_zeros(tmp_path):
    contents = {"a": b"hello", "empty": b"", "d/b": b"world!"}
    files = []
    for name, body in contents.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(body)
        files.append(FileEntry(name, len(body), 0o600, ""))
    with PartReader(tmp_path, files) as reader:
        out = np.full(16, 7, np.uint8)
        reader.read_into(0, out)
        assert out.tobytes() == b"helloworld!" + bytes(5)
        out = np.full(4, 7, np.uint8)
        reader.read_into(3, out)
        assert out.tobytes() == b"lowo"
        reader.read_into(20, out)
        assert out.tobytes() == bytes(4)


# ------------------------------------------------------------------- groups
def test_groups_put_each_domain_in_distinct_groups():
    domains = ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]
    groups = build_groups(domains, 4)
    assert sorted(n for g in groups for n in g) == list(range(8))
    assert all(len(g) == 4 and len({domains[n] for n in g}) == 4 for g in groups)


def test_leftover_nodes_join_groups_and_raise_k():
    groups = build_groups([str(n) for n in range(10)], 4)
    assert sorted(len(g) for g in groups) == [5, 5]
    assert shape("rs:2+2", 4, 5) == (3, 2) and shape("xor", 4, 5) == (4, 1)


def test_too_few_domains_is_a_configuration_error():
    with pytest.raises(ConfigError, match="peer.group: .*domain 'r0' has 3 nodes"):
        build_groups(["r0", "r0", "r0", "r1", "r1", "r2", "r2", "r3"], 4)
    with pytest.raises(ConfigError, match="peer.group: groups of 4 nodes need at least 4"):
        build_groups(["a", "b", "c"], 4)


def test_status_says_the_sizes_the_groups_really_have():
    """rs:4+2 on 8 nodes is one group of 8 (K 6): status says so, not only the setting."""
    from cachex_agent.config import load
    from cachex_agent.peer.redundancy import redundancy_of
    from cachex_agent.status import redundancy_line

    base = {"paths.spool": "/x", "paths.pfs": "/y"}
    rs = redundancy_of(load(None, {**base, "peer.scheme": "rs:4+2", "peer.group": "6"})
                       ).status(8)
    assert rs == {"scheme": "rs:4+2", "group": 6, "survives": 2, "sizes": [8]}
    assert redundancy_line(rs) == ("replicated: rs:4+2 parity over groups of 6 nodes (8"
                                   " where the nodes left over joined a group: more data"
                                   " members, the same parity); each group survives 2"
                                   " lost nodes")
    xor = redundancy_of(load(None, {**base, "peer.scheme": "xor", "peer.group": "4"})).status(8)
    assert redundancy_line(xor) == ("replicated: xor parity over groups of 4 nodes; each"
                                    " group survives 1 lost node")
    assert redundancy_of(load(None, base)).status(8) == {
        "scheme": "copy", "copies": 1, "survives": 1}
