"""Reports up the relay tree: a level's reports wait for the subtree, then go reduced."""

from __future__ import annotations

import pickle

import pytest

from cachex_agent.layout import bundle_name
from cachex_agent.messages import Tag, decode
from cachex_agent.messages import wire as wire_form
from cachex_agent.relay import children, parent
from cachex_agent.safepath import UnsafeInput
from cachex_agent.uplink import SAMPLES, Uplink, expand


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def replicated(node: int, ckpt: str = "step_1", **extra) -> dict:
    return {"type": "replicated", "ckpt": ckpt, "node": node, "ok": True, "errors": {},
            "partners": [node + 1], "dead": [], "duration": 1.0 + node, **extra}


def expanded(reports: list[dict]) -> list[dict]:
    return [one for r in reports
            for one in (map(wire_form, expand(r)) if r["type"] == "reduced" else [r])]


def nodes_in(reports: list[dict]) -> list[int]:
    return sorted(one["node"] for one in expanded(reports))


def wire(batch: list[dict], source: int) -> list[dict]:
    """As a parent receives it: pickled, then checked."""
    data = pickle.dumps({"type": "batch", "node": source, "reports": batch})
    return decode(pickle.loads(data), f"rank {source}", Tag.COORDINATOR)["reports"], len(data)


def up_the_tree(nodes: int, fanout: int, make=replicated) -> tuple[list[dict], int, int]:
    """Every node reports; returns what node 0 hears, how many batches, the most bytes
    any agent received."""
    links = {n: Uplink(n, nodes, fanout, clock=Clock()) for n in range(nodes)}
    received = dict.fromkeys(range(nodes), 0)
    for n in range(nodes):
        links[n].add(make(n))
    batches = 0
    for n in range(nodes - 1, 0, -1):       # leaves first
        reports, size = wire(links[n].due(), n)
        assert reports, f"node {n} held its subtree's reports"
        up = parent(n, nodes, fanout)
        batches += up == 0
        received[up] += size
        for r in reports:
            assert links[up].add(r)
    return links[0].due(), batches, max(v for n, v in received.items() if n)


@pytest.mark.parametrize("nodes,fanout", [(2, 16), (17, 4), (1000, 16), (5000, 8)])
def test_the_coordinator_hears_one_batch_per_child_and_every_node(nodes, fanout):
    heard, batches, _ = up_the_tree(nodes, fanout)
    assert batches == len(children(0, nodes, fanout))
    assert nodes_in(heard) == list(range(nodes))


def test_what_an_agent_receives_does_not_grow_with_the_job():
    sizes = [up_the_tree(n, 16)[2] for n in (1500, 9000)]
    assert sizes[1] <= 1.2 * sizes[0]


def test_a_reduced_report_keeps_a_bounded_sample_of_real_durations():
    heard, _, _ = up_the_tree(1000, 16)
    reduced = [r for r in heard if r["type"] == "reduced" and len(r["runs"]) > 1]
    assert reduced and all(len(r["samples"]) <= SAMPLES for r in reduced)
    for r in reduced:
        for node, seconds in r["samples"]:
            assert seconds == 1.0 + node          # a node's own duration, not a mean
    flushed, _, _ = up_the_tree(40, 4, lambda n: {"type": "flushed", "ckpt": "step_1",
                                                  "node": n, "bundle": bundle_name(n),
                                                  "duration": 0.5})
    assert {one["bundle"] for one in expanded(flushed)} == {
        bundle_name(n) for n in range(40)}


def test_a_failure_goes_up_whole_named_by_its_node():
    def make(n):
        return replicated(n, ok=False, errors={"2": "No space left"}) if n == 7 else \
            replicated(n)
    heard, _, _ = up_the_tree(40, 2, make)
    whole = [r for r in heard if r["type"] == "replicated" and not r["ok"]]
    assert [(r["node"], r["errors"]) for r in whole] == [(7, {"2": "No space left"})]
    assert nodes_in(heard) == list(range(40))


def test_a_level_waits_for_its_subtree_then_at_most_the_hold():
    clock = Clock()
    link = Uplink(1, 7, 2, hold=0.25, clock=clock)       # children 3 and 4
    link.add(replicated(1))
    link.add(replicated(3))
    assert link.due() == [] and link.next_due() == pytest.approx(0.25)
    clock.t += 0.3
    assert nodes_in(link.due()) == [1, 3]
    link.add(replicated(4))         # late: the subtree is complete with it
    assert nodes_in(link.due()) == [4]


def test_markers_go_at_the_next_turn_reduced_with_their_files():
    link = Uplink(1, 7, 2, clock=Clock())
    link.add({"type": "marker", "ckpt": "s", "node": 3, "global_files": []})
    link.add({"type": "marker", "ckpt": "s", "node": 1,
              "global_files": [".metadata"], "rule": "dcp"})
    (reduced,) = link.due()
    assert (reduced["rule"], reduced["global_files"]) == ("dcp", [".metadata"])
    assert nodes_in([reduced]) == [1, 3]


def test_a_new_parent_gets_the_reports_of_checkpoints_in_flight_again():
    link = Uplink(3, 7, 2, clock=Clock())       # parent 1; a leaf
    link.add(replicated(3))
    link.add(replicated(3, "step_0"))
    assert len(link.due()) == 2
    link.forget("step_0")                       # finalized: nothing to resend
    link.reroute((1,))                          # node 1 lost: node 3 moves
    assert link.parent == parent(3, 7, 2, (1,)) != 1
    assert [r["ckpt"] for r in link.due()] == ["step_1"]
    link.reroute((1,))                          # the same route: nothing again
    assert link.due() == []


def test_a_report_not_yet_sent_still_goes_when_its_checkpoint_ends():
    link = Uplink(3, 7, 2, clock=Clock())
    link.add(replicated(3))         # a replica finished after the flush ...
    link.forget("step_1")           # ... and the Finalized came in the same turn
    assert nodes_in(link.due()) == [3]
    link.forget("step_1")
    assert link._levels == {}


def test_a_report_naming_no_node_of_the_job_is_refused():
    link = Uplink(1, 4, 2, clock=Clock())
    assert not link.add(replicated(4)) and not link.add(replicated(1) | {"node": 9})
    assert not link.add({"type": "reduced", "kind": "flushed", "ckpt": "s", "node": 1,
                         "runs": [[2, 4]], "samples": []})
    assert link.due() == []


def test_the_kept_reports_are_bounded():
    link = Uplink(1, 4, 2, clock=Clock())
    for i in range(200):
        link.add(replicated(1, f"step_{i}"))
    link.due()
    assert len(link._levels) <= 64


def reduced(**fields) -> dict:
    return {"type": "batch", "node": 1, "reports": [
        {"type": "reduced", "kind": "replicated", "ckpt": "s", "node": 1,
         "runs": [[1, 3]], "samples": [], **fields}]}


@pytest.mark.parametrize("batch,error", [
    ({"type": "batch", "node": 1, "reports": "x"}, "reports must be a list"),
    ({"type": "batch", "node": 1, "reports": [{"type": "batch", "node": 2, "reports": []}]},
     "not a report"),
    ({"type": "batch", "node": 1, "reports": [{"type": "captured", "node": 2}]},
     "not a report"),
    ({"type": "batch", "node": 1, "reports": [{"type": "flushed", "node": 2,
                                               "ckpt": "../x"}]}, "flushed"),
    ({"type": "batch", "node": -3, "reports": []}, "batch"),
    (reduced(kind="captured"), "kind"),
    (reduced(runs=[[3, 1]]), "not sorted"),
    (reduced(runs=[[1, 3], [4, 5]]), "not sorted and apart"),
    (reduced(runs=[[0, 1 << 30]]), "more than"),
    (reduced(runs=[[1, "2"]]), "node"),
    (reduced(samples=[[1, float("nan")]]), "seconds"),
    (reduced(samples=[[1, 0.5]] * 100), "samples"),
    (reduced(dead=["x"]), "node"),
    (reduced(global_files=["/etc/passwd"]), "global file"),
])
def test_a_hostile_batch_is_refused_naming_the_sender(batch, error):
    with pytest.raises(UnsafeInput, match="rank 5") as caught:
        decode(batch, "rank 5", Tag.COORDINATOR)
    assert error in str(caught.value)


def test_flush_progress_goes_up_only_in_small_jobs():
    progress = {"type": "progress", "ckpt": "s", "node": 3, "stage": "flush", "done": 1,
                "total": 2}
    small, large = Uplink(1, 64, 4, clock=Clock()), Uplink(1, 65, 4, clock=Clock())
    assert small.add(progress) and large.add(progress)
    assert small.due() == [progress] and large.due() == []


def test_drained_goes_up_after_every_report_the_node_holds():
    """The coordinator ends the run when every node drained: a flush held for the rest
    of a subtree must not arrive after it."""
    link = Uplink(1, 7, 2, hold=60, clock=Clock())      # children 3, 4 yet to report
    link.add({"type": "flushed", "ckpt": "s", "node": 1, "bundle": bundle_name(1)})
    assert link.due() == []
    link.add({"type": "drained", "node": 1})
    out = link.due()
    assert [r["type"] for r in out] == ["reduced", "drained"]
