"""The redundancy descriptor (peer/redundancy.py): what each `peer.scheme` makes of a run,
read once, asked by the code outside peer/ instead of the scheme's name."""

from __future__ import annotations

import pytest

from cachex_agent.config import Peer, load
from cachex_agent.errors import ConfigError
from cachex_agent.model.protection import Protection
from cachex_agent.peer.groups import shape
from cachex_agent.peer.redundancy import Redundancy, redundancy_of

pytestmark = pytest.mark.timeout(30)
COPY2, XOR4, RS42 = Peer(copies=2), Peer(scheme="xor", group=4), Peer(scheme="rs:4+2", group=6)


def test_each_scheme_says_what_it_holds_and_survives():
    copy, xor, rs = (Redundancy.of(p) for p in (COPY2, XOR4, RS42))
    assert (copy.replicas, copy.parity, copy.survives, copy.copies) == (True, False, 2, 2)
    assert (xor.replicas, xor.parity, xor.survives, xor.group) == (False, True, 1, 4)
    assert (rs.replicas, rs.parity, rs.survives, rs.group) == (False, True, 2, 6)
    assert shape(rs.scheme, rs.group, 8) == (6, 2)             # leftovers add to K
    assert shape(xor.scheme, xor.group, 5) == (4, 1)


def test_the_model_and_status_read_the_descriptor():
    assert Redundancy.of(COPY2).protection(3) == ((3, 2),) * 3
    assert Redundancy.of(RS42).protection(8) == ((8, 2),)
    assert Protection.of(XOR4, 10).describe() == (
        "xor over 2 group(s) of 5 nodes, each rebuilding 1 lost member")
    assert Protection.of(COPY2, 4).describe() == (
        "copy: a part is lost with its node and its 2 partners")
    assert Redundancy.of(XOR4).status(9) == {"scheme": "xor", "group": 4, "survives": 1,
                                             "sizes": [5, 4]}


def test_groups_only_for_parity_and_in_distinct_domains():
    base = {"paths.spool": "/x", "paths.pfs": "/y"}
    hosts = [f"h{i}" for i in range(8)]
    assert redundancy_of(load(None, base)).groups(load(None, base), hosts) is None
    config = load(None, {**base, "peer.scheme": "xor", "peer.group": "4"})
    assert redundancy_of(config).groups(config, hosts) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ConfigError, match="peer.group: groups of 4 nodes need at least 4"):
        redundancy_of(config).groups(config, hosts[:3])


def test_status_notes_read_the_status_not_the_scheme_name():
    from cachex_agent.risk import survives
    from cachex_agent.status import scheme_note
    xor, rs = Redundancy.of(XOR4).status(8), Redundancy.of(RS42).status(6)
    copy = Redundancy.of(COPY2).status(3)
    assert (scheme_note(xor), scheme_note(rs), scheme_note(copy)) == ("(xor 4)", "(rs:4+2)", "")
    assert survives(copy) == "any 2 lost nodes"
    assert survives(rs) == "any 2 lost nodes of each group of 6"


def test_recover_can_leave_out_every_kind_of_copy_it_reads_parity_included():
    """`parity` was honoured by the recovery but refused by the command line."""
    from cachex_agent import cli
    from cachex_agent.recovery.plan import KINDS, PREFERENCE
    option = next(p for p in cli.recover_command.params if p.name == "exclude")
    assert tuple(option.type.choices) == KINDS
    assert {"parity", "journal", *PREFERENCE} == set(KINDS)
