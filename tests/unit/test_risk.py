"""Work at risk (risk.py): what a node loss or the allocation's end would cost now,
measured on the coordinator's clock alone."""

from __future__ import annotations

import pytest

from cachex_agent.beats import Unchanged
from cachex_agent.risk import at_risk, risk_lines
from cachex_agent.status import with_liveness

pytestmark = pytest.mark.timeout(20)


def row(seq: int, level: str, written: float) -> dict:
    return {"id": f"step_{seq:03d}", "seq": seq, "level": level, "bytes": 1,
            "times": {"written": written}}


def status(t: float, rows: list[dict], redundancy: dict | None = None) -> dict:
    return {"run": "r", "state": "running", "updated": t, "redundancy": redundancy,
            "heartbeat": {"beat": 1, "life": "a", "t": t, "period": 2.0},
            "checkpoints": rows}


ROWS = [row(10, "flushed", 1000.0), row(20, "replicated", 1100.0),
        row(30, "captured", 1200.0), row(40, "failed", 1250.0)]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_node_loss_resumes_from_the_newest_replicated_the_allocation_from_flushed():
    risk = at_risk(status(1300.0, ROWS))
    assert risk["node_loss"] == {"ckpt": "step_020", "level": "replicated", "seconds": 200.0}
    assert risk["allocation_end"] == {"ckpt": "step_010", "level": "flushed",
                                      "seconds": 300.0}


def test_nothing_outlives_a_loss_yet():
    risk = at_risk(status(1300.0, [row(30, "captured", 1200.0)]))
    assert risk["node_loss"] == risk["allocation_end"] == {"ckpt": None, "seconds": None}
    lines = risk_lines({"at_risk": risk})
    assert "all training so far" in lines[1] and "all training so far" in lines[2]


def test_a_checkpoint_without_a_commit_time_still_names_what_outlives_the_loss():
    """A coordinator that rebuilt its state from the PFS index knows `flushed` only."""
    rows = [{"id": "step_010", "seq": 10, "level": "flushed", "bytes": 1,
             "times": {"flushed": 900.0}}]
    risk = at_risk(status(1300.0, rows))
    assert risk["node_loss"] == {"ckpt": "step_010", "level": "flushed", "seconds": None}
    assert "since step_010 (its commit time is not known here)" in \
        risk_lines({"at_risk": risk})[1]


def test_a_status_from_the_index_has_no_clock_to_measure_from():
    assert at_risk({"run": "r", "checkpoints": [row(10, "flushed", 1.0)]}) is None


@pytest.mark.parametrize("skew", [-3600.0, 0.0, 3600.0])
def test_the_readers_clock_changes_nothing_only_how_long_it_saw_the_heartbeat_stand(skew):
    """The reader's own monotonic clock counts the heartbeat's age; its wall clock, an
    hour off either way, is never read."""
    clock = Clock()
    clock.now = 5000.0 + skew
    seen = Unchanged(clock)
    first = with_liveness(status(1300.0, ROWS), seen)
    assert first["at_risk"]["node_loss"]["seconds"] == 200.0
    clock.now += 7.0                    # the heartbeat stood still for 7 s
    later = with_liveness(status(1300.0, ROWS), seen)
    assert later["at_risk"]["node_loss"]["seconds"] == 207.0
    assert later["at_risk"]["allocation_end"]["seconds"] == 307.0


def test_the_statement_names_the_groups_of_an_erasure_scheme():
    xor = {"scheme": "xor", "group": 4, "survives": 1}
    lines = risk_lines({**status(1300.0, ROWS, xor), "at_risk": at_risk(status(1300.0, ROWS))})
    assert lines[1] == ("  a node lost: 3.3 min of training since step_020 was committed"
                        " (replicated: outlives any 1 lost node of each group of 4;"
                        " beyond that, the allocation's figure)")
    assert lines[2] == "  the allocation ending: 5.0 min of training since step_010 was committed"
    copies = risk_lines({**status(1300.0, ROWS, {"scheme": "copy", "copies": 2,
                                                  "survives": 2}),
                         "at_risk": at_risk(status(1300.0, ROWS))})
    assert "outlives any 2 lost nodes;" in copies[1]
