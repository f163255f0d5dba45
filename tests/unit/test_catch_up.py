"""What a starting agent adopts from its spool (node_policy.catch_up)."""

from __future__ import annotations

import pytest

from cachex_agent.node_policy import catch_up

pytestmark = pytest.mark.timeout(20)
SPOOL = {"step_5", "step_10", "step_15", "step_20", "step_25"}


def test_every_checkpoint_newer_than_the_newest_known_oldest_first():
    assert catch_up(SPOOL, {"step_5", "step_15"}) == (["step_20", "step_25"], ["step_10"])


def test_knowing_nothing_adopts_the_newest_and_names_the_rest():
    assert catch_up(SPOOL, set()) == (["step_25"], ["step_5", "step_10", "step_15", "step_20"])


def test_nothing_unknown_nothing_to_do():
    assert catch_up(SPOOL, SPOOL | {"step_30"}) == ([], [])
    assert catch_up(SPOOL, {"step_30"}) == ([], ["step_5", "step_10", "step_15", "step_20",
                                                 "step_25"])
