"""The nodes a failed training step is blamed on (job/blame.py), from srun's own
error lines as Slurm prints them."""

from __future__ import annotations

import pytest

from cachex_agent.job.blame import failed_hosts

pytestmark = pytest.mark.timeout(30)
HOSTS = [f"n{i:03d}" for i in range(1, 9)]

ONE_RANK = """\
step 120 loss 2.31
srun: error: n003: task 5: Exited with exit code 1
srun: Terminating StepId=42.3
slurmstepd: error: *** STEP 42.3 ON n001 CANCELLED AT 2026-12-05T10:00:00 ***
srun: error: n001: tasks 0-1: Killed
srun: error: n002: tasks 2-3: Killed
srun: error: n004: tasks 6-7: Killed
"""


def test_the_rank_that_failed_first_is_blamed_not_those_srun_killed_after_it():
    assert failed_hosts(ONE_RANK, HOSTS) == ["n003"]


def test_a_node_failure_and_a_crash_are_blamed():
    text = ("srun: error: Node failure on n006\n"
            "srun: error: n002: task 3: Segmentation fault (core dumped)\n"
            "srun: error: n001: tasks 0-1: Killed\n")
    assert failed_hosts(text, HOSTS) == ["n006", "n002"]


def test_nobody_is_blamed_when_it_cannot_tell_or_the_failure_is_everywhere():
    assert failed_hosts("srun: error: n001: tasks 0-15: Killed\n", HOSTS) == []
    assert failed_hosts("Traceback (most recent call last):\n", HOSTS) == []
    everywhere = "".join(f"srun: error: {h}: task {i}: Exited with exit code 1\n"
                         for i, h in enumerate(HOSTS[:4]))
    assert failed_hosts(everywhere, HOSTS) == []            # half the nodes: the trainer's
    assert failed_hosts("srun: error: x99: task 0: Exited with exit code 1\n", HOSTS) == []

