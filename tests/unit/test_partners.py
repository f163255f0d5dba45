"""Partner choice: ring with stride, other failure domains only, copies in distinct domains."""

from __future__ import annotations

import pytest

from cachex_agent.errors import ConfigError
from cachex_agent.peer.partners import (
    domains_of,
    incoming,
    metadata_holders,
    partner_map,
    partners,
)


def test_ring_with_stride_one_and_two():
    domains = [str(i) for i in range(4)]
    assert [partners(i, domains) for i in range(4)] == [[1], [2], [3], [0]]
    assert [partners(i, domains, stride=2) for i in range(4)] == [[2], [3], [0], [1]]


def test_skips_the_same_domain():
    domains = ["cab0", "cab0", "cab1", "cab1"]          # two nodes per cabinet
    assert [partners(i, domains) for i in range(4)] == [[2], [2], [0], [0]]


def test_copies_land_in_distinct_domains():
    domains = ["a", "a", "b", "b", "c", "c"]
    for node in range(6):
        chosen = partners(node, domains, copies=2)
        assert len({domains[c] for c in chosen} | {domains[node]}) == 3


def test_stride_that_does_not_visit_every_node_still_finds_partners():
    domains = ["a", "b", "a", "b"]
    assert partners(0, domains, stride=2) == [1]        # 0+2 is domain a: fall back to ring


def test_too_few_domains_is_a_config_error():
    with pytest.raises(ConfigError, match="peer.copies"):
        partners(0, ["h", "h", "h"])
    with pytest.raises(ConfigError, match="3 failure domains"):
        partners(0, ["a", "b", "a"], copies=2)


def test_incoming_two_owners_to_one_partner():
    pmap = partner_map([str(i) for i in range(4)], stride=1, copies=2)
    assert pmap[0] == [1, 2] and incoming(2, pmap) == [0, 1]


def test_domain_specs(tmp_path):
    hosts = ["frontier00012", "frontier00013", "frontier01044"]
    assert domains_of("node", hosts) == hosts
    assert domains_of("rank", hosts) == ["0", "1", "2"]
    assert domains_of(r"regex:frontier(\d\d)", hosts) == ["00", "00", "01"]
    table = tmp_path / "domains"
    table.write_text("# host cabinet\nfrontier00012 c1\nfrontier00013 c1\nfrontier01044 c7\n")
    assert domains_of(f"file:{table}", hosts) == ["c1", "c1", "c7"]
    with pytest.raises(ConfigError, match="frontier99999"):
        domains_of(f"file:{table}", ["frontier99999"])
    with pytest.raises(ConfigError, match="does not match host"):
        domains_of("regex:^x", hosts)


def test_metadata_holders_spread_over_other_domains():
    nodes = [str(i) for i in range(10_000)]
    assert metadata_holders(nodes, copies=1) == [3333, 6667]
    assert metadata_holders(nodes, copies=3) == [2500, 5000, 7500]
    # node 0's cabinet last: a holder there is lost with the coordinator
    assert metadata_holders(["a", "a", "b", "b", "c", "c"], copies=1) == [2, 4]
    assert metadata_holders(["a", "a", "b", "b"], copies=1) == [3, 1]


def test_metadata_holders_of_small_jobs():
    assert metadata_holders(["a"], copies=1) == []
    assert metadata_holders(["a", "b"], copies=2) == [1]
    assert metadata_holders(["a", "b", "c"], copies=1) == [1, 2]
