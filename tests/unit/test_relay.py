"""The relay tree and chain: every live node reached once, frames checked before use."""

from __future__ import annotations

import pickle

import pytest

from cachex_agent.relay import (
    HEADER,
    Route,
    children,
    depth,
    frame,
    message,
    next_hops,
    parent,
    parse,
    subtree,
)
from cachex_agent.safepath import UnsafeInput


def reached(nodes: int, fanout: int, skip: tuple[int, ...] = ()) -> list[int]:
    seen, todo = [], [0]
    while todo:
        node = todo.pop()
        seen.append(node)
        todo += children(node, nodes, fanout, skip)
    return sorted(seen)


@pytest.mark.parametrize("nodes,fanout", [(1, 2), (2, 16), (17, 16), (1000, 2), (10_000, 16)])
def test_the_tree_reaches_every_node_once(nodes, fanout):
    assert reached(nodes, fanout) == list(range(nodes))
    assert max(len(children(n, nodes, fanout)) for n in range(nodes)) <= fanout


def test_skipped_nodes_are_left_out_and_their_children_adopted():
    skip = (1, 2, 5, 6)
    assert reached(40, 2, skip) == [n for n in range(40) if n not in skip]
    assert children(1, 40, 2, skip) == []
    assert children(0, 40, 2, skip) == [3, 4]


def test_depth_is_logarithmic():
    assert [depth(n, 16) for n in (1, 2, 17, 18, 273, 274, 10_000)] == [0, 1, 1, 2, 2, 3, 4]


def test_a_chain_goes_from_one_holder_to_the_next():
    route = Route("chain", chain=(5, 2, 9))
    assert [next_hops(route, n, 10) for n in (0, 5, 2, 9, 3)] == [[5], [2], [9], [], []]


def test_a_frame_round_trips_and_is_serialized_once():
    route = Route("tree", 4, skip=(3,))
    buf = frame(route, {"type": "commit", "ckpt": "step_1"})
    parsed, body = parse(bytearray(buf), 8, "rank 2")
    assert parsed == route and message(body) == {"type": "commit", "ckpt": "step_1"}


@pytest.mark.parametrize("header,error", [
    ({"kind": "flood", "fanout": 2, "skip": [], "chain": []}, "relay header"),
    ({"kind": "tree", "fanout": 1, "skip": [], "chain": []}, "fanout"),
    ({"kind": "tree", "fanout": 2, "skip": [0], "chain": []}, "skips the root"),
    ({"kind": "tree", "fanout": 2, "skip": [3, 2], "chain": []}, "not sorted"),
    ({"kind": "chain", "fanout": 2, "skip": [], "chain": [99]}, "names node 99"),
    ({"kind": "chain", "fanout": 2, "skip": [], "chain": [-1]}, "node"),
])
def test_a_hostile_header_is_refused_naming_the_sender(header, error):
    head = pickle.dumps(header)
    with pytest.raises(UnsafeInput, match=error) as raised:
        parse(HEADER.pack(len(head)) + head + pickle.dumps({}), 8, "rank 3")
    assert "rank 3" in str(raised.value)
    with pytest.raises(UnsafeInput, match="relay header of"):
        parse(HEADER.pack(1 << 30) + head, 8, "rank 3")


@pytest.mark.parametrize("nodes,fanout,skip", [(1, 2, ()), (17, 16, ()), (40, 2, (1, 2, 5, 6)),
                                               (10_000, 16, (3, 17, 4000)), (1000, 3, (999,))])
def test_parent_inverts_children_and_subtree_counts_the_nodes_below(nodes, fanout, skip):
    below: dict[int, int] = {}
    for node in sorted(set(range(nodes)) - set(skip), reverse=True):
        kids = children(node, nodes, fanout, skip)
        assert all(parent(kid, nodes, fanout, skip) == node for kid in kids)
        below[node] = 1 + sum(below[kid] for kid in kids)
        assert subtree(node, nodes, fanout, skip) == below[node]
    assert all(parent(n, nodes, fanout, skip) == 0 and subtree(n, nodes, fanout, skip) == 1
               for n in skip)
