"""Node-loss survival per redundancy scheme (model/protection.py) against hand-computed
values and a Monte Carlo of node losses over the real groups and partners."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_model_math import PART, system

from cachex_agent.config import Peer
from cachex_agent.model.plan import Rates, evaluate, make_plan
from cachex_agent.model.protection import Protection, beyond, loss_probability
from cachex_agent.peer.groups import build_groups, shape
from cachex_agent.peer.partners import partner_map

RNG = np.random.default_rng(11)
COPY, XOR4, XOR8, RS42 = (Peer(), Peer(scheme="xor", group=4), Peer(scheme="xor", group=8),
                          Peer(scheme="rs:4+2", group=6))


def test_hand_computed_group_probabilities():
    p = 0.1
    # xor over 4: two or more of 4 lost = 1 - 0.9^4 - 4 (0.1) 0.9^3
    assert beyond(4, 1, p) == pytest.approx(1 - 0.6561 - 0.2916)
    assert beyond(4, 1, p) == pytest.approx(0.0523, abs=1e-12)
    # rs:4+2: three or more of 6 = 1 - 0.9^6 - 6 (0.1) 0.9^5 - 15 (0.01) 0.9^4
    assert beyond(6, 2, p) == pytest.approx(1 - 0.531441 - 0.354294 - 0.098415)
    assert beyond(2, 1, p) == pytest.approx(p ** 2)      # copy: the node and its partner
    assert beyond(3, 5, p) == 0.0                         # tolerates more than it has
    assert loss_probability(0.5, 600.0) == pytest.approx(1 - math.exp(-0.5 / 6))


def test_groups_follow_the_agents_groups_leftovers_included():
    assert Protection.of(XOR4, 8).groups == ((4, 1), (4, 1))
    assert Protection.of(XOR4, 10).groups == ((5, 1), (5, 1))
    assert Protection.of(RS42, 8).groups == ((8, 2),)        # leftovers: K 6, M 2
    assert Protection.of(Peer(copies=2), 3).groups == ((3, 2),) * 3
    for peer, nodes in ((XOR4, 10), (RS42, 8), (XOR8, 17)):
        dealt = build_groups([f"h{n}" for n in range(nodes)], peer.group)
        assert sorted(Protection.of(peer, nodes).groups) == sorted(
            (len(g), shape(peer.scheme, peer.group, len(g))[1]) for g in dealt)


def lost_data(failed: np.ndarray, peer: Peer) -> np.ndarray:
    """Per simulated window: is some part of the newest replicated checkpoint gone? From
    the agents' own maps: groups (erasure) or partners (copy)."""
    nodes = failed.shape[1]
    hosts = [f"h{n}" for n in range(nodes)]
    if peer.scheme == "copy":
        pmap = partner_map(hosts, peer.stride, peer.copies)
        return np.any([failed[:, n] & failed[:, pmap[n]].all(axis=1) for n in range(nodes)],
                      axis=0)
    out = np.zeros(failed.shape[0], bool)
    for group in build_groups(hosts, peer.group):
        m = shape(peer.scheme, peer.group, len(group))[1]
        out |= failed[:, group].sum(axis=1) > m
    return out


@pytest.mark.parametrize("peer,nodes,p,rel", [
    (XOR4, 8, 0.1, 0.03), (XOR8, 8, 0.1, 0.03), (RS42, 6, 0.15, 0.04), (RS42, 8, 0.15, 0.04),
    (XOR4, 10, 0.05, 0.05),
    (COPY, 8, 0.02, 0.06), (COPY, 8, 0.1, 0.1), (Peer(copies=2), 6, 0.08, 0.1),
])
def test_beyond_tolerance_matches_a_monte_carlo_of_the_real_groups(peer, nodes, p, rel):
    failed = RNG.random((1_000_000, nodes)) < p
    simulated = float(lost_data(failed, peer).mean())
    protection = Protection.of(peer, nodes)
    window = -3600 * math.log1p(-p)          # the period in which a node is lost with p
    found = protection.beyond_in_window(1.0, window)
    assert found == pytest.approx(simulated, rel=rel)
    if peer.scheme == "copy":       # parts sharing a holder correlate: P is an upper bound
        assert found >= simulated


def test_fallback_is_the_share_of_node_losses_whose_group_is_beyond_tolerance():
    """Poisson node losses over many periods: one restart per beyond-tolerance period
    falls back; the fraction of all losses matches P / (T/3600) / (lambda N)."""
    rate, period, nodes = 0.4, 900.0, 8
    counts = RNG.poisson(rate * period / 3600, size=(1_000_000, nodes))
    for peer in (XOR4, RS42, COPY):
        simulated = lost_data(counts > 0, peer).sum() / counts.sum()
        found = Protection.of(peer, nodes).fallback(rate, period, nodes)
        if peer.scheme == "copy":       # an upper bound: parts sharing holders correlate
            assert simulated <= found <= 1.1 * simulated
        else:
            assert found == pytest.approx(simulated, rel=0.05), peer
    assert Protection.of(XOR4, nodes).fallback(0.0, period, nodes) == 0.0


@pytest.mark.parametrize("nodes", [8, 64])
def test_larger_groups_protect_less(nodes):
    rate, period = 0.01, 3600.0
    beyond_p = {name: Protection.of(peer, nodes).beyond_in_window(rate, period)
                for name, peer in (("xor4", XOR4), ("xor8", XOR8), ("rs42", RS42),
                                   ("copy1", COPY), ("copy2", Peer(copies=2)))}
    assert beyond_p["xor8"] > beyond_p["xor4"] > beyond_p["copy1"] > beyond_p["copy2"]
    assert beyond_p["rs42"] < beyond_p["xor4"]           # two lost members rebuilt
    fallback = [Protection.of(Peer(scheme="xor", group=g), nodes).fallback(rate, period, nodes)
                for g in (2, 4, 8)]
    assert fallback[0] < fallback[1] < fallback[2]
    # first order in p: a share (n - 1) p / 2 of node losses falls back with xor over n
    p = loss_probability(rate, period)
    assert fallback[1] == pytest.approx(3 * p / 2, rel=0.05)


def test_node_loss_on_the_peer_path_mixes_replicated_and_flushed():
    """Deterministic lags: E[L_node] = (1 - f)(T/2 + D_replicated) + f (T/2 + D_flushed);
    the direct path's node loss waits for `flushed` whatever the scheme."""
    model = system(capture=1.0, replicate=5.0, flush=50.0)
    nodes, period, rates = 8, 600.0, Rates(crash=0.0, node=0.2, job=0.0)
    unbreakable = Protection("copy", ((2, 2),) * nodes)     # never beyond its tolerance
    never = evaluate(model, "peer", 1, nodes * PART, nodes, period, rates, 2000, unbreakable)
    assert never.fallback == 0
    for peer in (COPY, XOR4, XOR8):
        shield = Protection.of(peer, nodes)
        f = shield.fallback(0.2, period, nodes)
        plan = evaluate(model, "peer", 1, nodes * PART, nodes, period, rates, 2000, shield)
        assert plan.fallback == pytest.approx(f) and 0 < f < 1
        # the trapezoid over a step survival is off by up to T/800 per class
        assert plan.lost["node"] == pytest.approx(
            (1 - f) * (period / 2 + 6.0) + f * (period / 2 + 56.0), abs=1.0)
        assert plan.lost["node"] == pytest.approx(
            (1 - f) * never.lost["node"] + f * plan.lost["job"])
        direct = evaluate(model, "direct", 1, nodes * PART, nodes, period, rates, 2000, shield)
        assert direct.fallback == 0 and direct.lost["node"] == pytest.approx(
            period / 2 + 51.0, abs=1.0)


def test_a_larger_group_can_make_the_plan_go_direct():
    """Replication 54 s, flush 60 s, node losses dominant (0.3 per node-hour): with full
    copies peer wins; xor over all 8 nodes falls back to `flushed` so often that the
    direct flush, which comes sooner than the peer path's, loses less."""
    model = system(capture=1.0, replicate=54.0, flush=60.0)
    rates = Rates(crash=0.0, node=0.3, job=0.001)
    plans = {name: make_plan(model, 8 * PART, 8, 600.0, 5.0, rates,
                             protection=Protection.of(peer, 8))
             for name, peer in (("copy", COPY), ("xor8", XOR8))}
    assert plans["copy"].best.name == "peer"
    assert plans["xor8"].best.name == "direct"
    assert plans["xor8"].beyond > plans["copy"].beyond
    direct = {name: next(p for p in plan.paths if p.name == "direct").loss
              for name, plan in plans.items()}
    assert direct["copy"] == pytest.approx(direct["xor8"])     # the scheme is not on it


def test_the_online_choice_uses_the_configured_scheme():
    """`model.path = auto`: the same stage times, the node-loss survival of the scheme.
    Full copies keep the peer path (it loses less); xor over all 8 nodes falls back to
    `flushed` so often that direct loses less by more than the margin."""
    from cachex_agent.config import load
    from cachex_agent.model.choose import PathChooser

    def decide(**peer: str):
        cfg = load(None, {"paths.spool": "/x", "paths.pfs": "/y", "model.window": "8",
                          "model.crash_rate": "0", "model.node_rate": "1.0",
                          "model.job_rate": "0.001", **{f"peer.{k}": v for k, v in peer.items()}},
                   environ={})
        chooser = PathChooser(cfg, 8, True)
        for stage, seconds in (("capture", 1.0), ("replicate", 51.5), ("flush", 60.0)):
            for i in range(64):
                chooser.observe(stage, f"k{i // 8}", i % 8, int(PART), seconds)
        for now in (0.0, 600.0, 1200.0):
            choice = chooser.choose(8 * PART, now)
        return chooser, choice
    copy, by_copy = decide()
    xor, by_xor = decide(scheme="xor", group="8")
    assert copy.protection.groups == ((2, 1),) * 8 and xor.protection.groups == ((8, 1),)
    assert by_copy.path == "peer" and by_xor.path == "direct", (by_copy, by_xor)
    assert by_copy.loss["peer"] < by_copy.loss["direct"] < by_xor.loss["peer"]
    assert by_xor.loss["direct"] == pytest.approx(by_copy.loss["direct"], rel=0.05)
