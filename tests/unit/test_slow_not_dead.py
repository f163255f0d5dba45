"""Slow is not dead (liveness.py, decisions.py): the clock net of this process's own
stalls, the watch over the nodes that report to this one, and the coordinator's
suspect nodes, as pure bookkeeping on fake clocks."""

from __future__ import annotations

from cachex_agent import decisions as d
from cachex_agent import relay
from cachex_agent.liveness import NodeLiveness, OwnClock, Watch, beat_period
from cachex_agent.messages import Frames, Replicated, Silence


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_own_clock_leaves_out_the_time_its_loop_stood_still():
    wall = Clock()
    own = OwnClock(allowance=1.0, clock=wall)
    for _ in range(10):                 # a loop turning every 0.1 s: all of it counts
        wall.t += 0.1
        assert own.tick() == 0.0
    assert own.now() == wall.t
    wall.t += 45.0                      # SIGSTOP for 45 s
    assert own.tick() == 45.0
    assert own.now() == wall.t - 44.0   # the allowance of a turn counts, the rest not
    assert own.longest == 45.0


def test_a_stall_under_way_is_not_counted_before_the_next_turn():
    wall = Clock()
    own = OwnClock(allowance=1.0, clock=wall)
    own.tick()
    start = own.now()
    wall.t += 30.0                      # stopped in the middle of a turn
    assert own.now() - start == 1.0     # a peer judged now is not blamed for it
    own.tick()
    assert own.now() - start == 1.0


def test_a_watched_child_is_reported_once_when_silent_and_once_when_back():
    now = Clock()
    watch = Watch(node=1, timeout=10.0, clock=now)
    watch.expect([3, 4, 1])             # itself is never watched
    now.t += 9.0
    assert watch.silent() == []
    assert watch.heard(3) is None       # heard in time: nothing to say
    now.t += 2.0
    assert [(s.peer, s.ended, s.holds) for s in watch.silent()] == [(4, False, "reports")]
    assert watch.silent() == []         # reported once
    assert watch.silent_now() == {4: 11.0}
    now.t += 5.0
    back = watch.heard(4)
    assert back is not None and (back.peer, back.ended, back.seconds) == (4, True, 16.0)
    assert watch.heard(4) is None and watch.silent_now() == {}


def test_a_child_new_to_the_tree_starts_heard_and_one_gone_is_forgotten():
    now = Clock()
    watch = Watch(node=0, timeout=10.0, clock=now)
    watch.expect([1, 2])
    now.t += 8.0
    watch.expect([2, 5])                # a reroute: 1 went to another parent, 5 came
    now.t += 4.0
    assert [s.peer for s in watch.silent()] == [2]
    assert watch.heard(1) is None


def test_beats_come_four_times_per_timeout():
    assert beat_period(60.0) == 15.0 and beat_period(0.1) == 0.05


# ------------------------------------------------------------------ coordinator
NODES = 8


def state(fanout: int = 2) -> d.CoordinatorState:
    settings = d.Settings("run", commit_timeout=60.0, agent_timeout=10.0, flush_every=1,
                          drain_timeout=60.0, keep_pfs=2, fixed_path=("peer", "test"))
    return d.CoordinatorState(settings, [d.NodeRecord(n) for n in range(NODES)])


def silence(by: int, peer: int, seconds: float, ended: bool = False, now: float = 50.0,
            holds: str = "reports") -> Silence:
    return Silence(node=by, peer=peer, seconds=seconds, ended=ended, holds=holds, now=now)


def test_a_silent_relay_is_suspect_routed_around_and_taken_back_when_it_speaks():
    s = state()
    s, out = d.decide(s, silence(0, 1, 12.0))
    s, again = d.decide(s, silence(0, 2, 12.0))
    assert s.nodes[1].suspect == 38.0 and s.nodes[1].skipped and not s.nodes[1].dead
    s, tick = d.decide(s, d.Tick(now=51.0))
    # one frame for both, at the next tick: the tree's new shape is the news
    assert [type(e.msg).__name__ for e in out + again + tick
            if isinstance(e, d.Broadcast)] == ["Reroute"]
    s, _ = d.decide(s, d.Heard(now=51.0, node=2))
    skip = tuple(n for n, node in enumerate(s.nodes) if node.skipped)
    assert relay.parent(3, NODES, 2, skip) != 1     # node 1's children report elsewhere
    rows = d.silent_rows(s, now=60.0, fanout=2)
    assert [(r["node"], r["state"], r["seconds"], r["by"], r["relays_for"], r["subtree"])
            for r in rows] == [(1, "suspect", 22.0, [0], [3, 4], 3)]
    s, out = d.decide(s, silence(0, 1, 30.0, holds="replication", now=70.0))
    assert not out and s.nodes[1].holds == {"reports": 0, "replication": 0}
    s, out = d.decide(s, d.Heard(now=75.0, node=1))
    assert s.nodes[1].suspect is None and not s.nodes[1].skipped
    assert [e.event for e in out if isinstance(e, d.Emit)] == ["node_back"]
    assert d.silent_rows(s, now=80.0, fanout=2) == []


def test_the_coordinator_never_takes_its_own_node_for_silent_or_dead():
    s = state()
    s, out = d.decide(s, silence(3, 0, 45.0, holds="replication"))
    assert s.nodes[0].suspect is None and not out
    s, _ = d.decide(s, Replicated(node=3, ckpt="c1", ok=False, dead=[0, 2], now=60.0))
    assert not s.nodes[0].dead and s.nodes[2].dead
    skip = tuple(n for n, node in enumerate(s.nodes) if node.skipped)
    assert skip == (2,)
    relay.parse(relay.frame(relay.Route("tree", 2, skip), {"type": "reroute"}), NODES, "t")


def test_a_silence_that_ended_clears_the_suspect_as_the_watcher_says():
    s = state()
    s, _ = d.decide(s, silence(1, 4, 11.0))
    s, _ = d.decide(s, silence(1, 4, 0.0, ended=True, now=80.0))
    assert s.nodes[4].suspect is None and s.nodes[4].holds == {}


def test_frame_numbers_name_the_gap_once_and_drop_late_copies():
    seen = relay.Numbers()
    assert seen.see(1) == (True, range(0))
    assert seen.see(4) == (True, range(2, 4))     # 2 and 3 went to a stalled parent
    assert seen.see(3) == (False, range(0))       # its late copy: asked for already
    assert seen.see(5) == (True, range(0))
    assert seen.see(5) == (False, range(0))
    route, _ = relay.parse(relay.frame(relay.Route("tree", 2, number=7), {}), NODES, "t")
    assert route.number == 7


def test_a_node_that_missed_frames_gets_them_again_from_the_coordinator():
    s = state()
    s, out = d.decide(s, Frames(node=3, first=2, last=4, now=1.0))
    assert out == [d.Resend(3, 2, 4)]


def test_an_agent_follows_a_new_tree_once_and_asks_for_what_it_missed():
    live = NodeLiveness(node=3, nodes=NODES, fanout=2, timeout=10.0)
    assert live.follow(relay.Route("tree", 2, number=1)) == (True, range(0))
    assert set(live.watch._children) == {7}             # 3's child in the whole tree
    new, missed = live.follow(relay.Route("tree", 2, skip=(1,), number=4))
    assert new and list(missed) == [2, 3]              # held by a stalled parent
    assert set(live.watch._children) == set(relay.children(3, NODES, 2, (1,)))
    assert live.follow(relay.Route("tree", 2, number=2)) == (False, range(0))
    assert live.follow(relay.Route("chain", chain=(3,))) == (True, range(0))
    assert live.send_up([]) is False and live.send_up([{"type": "x"}]) is True
