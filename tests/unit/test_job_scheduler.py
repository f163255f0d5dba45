"""What the scheduler's commands say, read for the job templates (job/scheduler.py,
adapters.py runs the commands): hosts up, failed at the start, and the time left
as the scheduler states it."""

from __future__ import annotations

import pytest

from cachex_agent.job.scheduler import (
    pbs_bad_at_start,
    pbs_left,
    pbs_up,
    seconds,
    slurm_left,
    slurm_steps,
    slurm_up,
)

pytestmark = pytest.mark.timeout(30)
HOSTS = ["n001", "n002", "n003", "n004"]
QSTAT = """Job Id: 42.pbs
    Job_Name = llm
    stime = Sun Dec  6 09:00:00 2026
    Resource_List.walltime = 01:00:00
    Resource_List.select = 4
    resources_used.walltime = 00:10:05
"""


def test_durations_read_as_slurm_and_pbs_print_them():
    assert [seconds(t) for t in ("1-02:03:04", "02:03:04", "3:04", "59", "2-05", "1-00:30",
                                 " 00:00:00\n")] == [
        93784, 7384, 184, 59, 2 * 86400 + 5 * 3600, 86400 + 1800, 0]
    for unknown in ("UNLIMITED", "NOT_SET", "INVALID", "", "1:2:3:4", "-5", "1h"):
        assert seconds(unknown) is None, unknown


def test_the_time_left_is_the_schedulers_relative_figure():
    assert slurm_left("1:30:00\n") == 5400 and slurm_left("UNLIMITED\n") is None
    assert slurm_left("") is None and slurm_left("1:00\n2:00\n") is None   # not one job
    assert pbs_left(QSTAT) == 3600 - 605
    assert pbs_left(QSTAT.replace("    resources_used.walltime = 00:10:05\n", "")) == 3600
    assert pbs_left("Job Id: 42.pbs\n    Job_Name = llm\n") is None        # no walltime
    assert pbs_left(QSTAT.replace("00:10:05", "02:00:00")) == 0            # overrun


def test_slurm_hosts_up_are_in_the_job_and_in_a_state_to_run():
    sinfo = "n001 allocated\nn002 down*\nn003 drained\nn004 mixed\nn005 idle\n"
    assert slurm_up(HOSTS + ["n005"], "n[001-004]", sinfo).hosts == ["n001", "n004"]
    for state in ("allocated*", "failing", "maint", "reboot_issued", "powered_down",
                  "unknown", "draining"):
        assert slurm_up(["n001"], "n001", f"n001 {state}\n").hosts == [], state
    assert slurm_up(["n001", "n002"], "n001,n002", "n001 completing\n").hosts == ["n001"]


def test_when_slurm_says_nothing_every_host_is_taken_as_up_with_a_note():
    for in_job, sinfo in (("", "n001 down\n"), ("n[001-004]", ""), ("n001", "garbage\n")):
        up = slurm_up(HOSTS, in_job, sinfo)
        assert up.hosts == HOSTS
        assert up.notes == ["squeue or sinfo said nothing of the job's nodes: every node"
                            " taken as up"]


def test_pbs_hosts_up_are_not_down_or_offline():
    said = "".join(f"# host {h}\n{h}\n     Mom = {h}\n     state = {s}\n     ntype = PBS\n\n"
                   for h, s in zip(HOSTS, ("job-busy", "down", "offline,down", "free"),
                                   strict=True))
    assert pbs_up(HOSTS, said).hosts == ["n001", "n004"]
    # a host pbsnodes did not answer for is taken as up; silence on all: a note
    assert pbs_up(HOSTS + ["n009"], said + "# host n009\n").hosts == ["n001", "n004", "n009"]
    assert pbs_up(HOSTS, "# host n001\n# host n002\n").notes == [
        "pbsnodes said nothing of the job's nodes: every node taken as up"]


def test_steps_by_name_from_squeue():
    said = "42.0 cachex-agents\n42.1 cachex-train\n42.2 cachex-agents\n42.3 x y\n"
    assert slurm_steps(said, "cachex-agents") == ["42.0", "42.2"]
    assert slurm_steps(said, "cachex") == [] and slurm_steps("", "cachex-train") == []



def test_the_nodes_pbs_lists_failed_with_the_jobs_id_at_its_start():
    """`pbsnodes -l`: name, state, comment; a job of tolerate_node_failures starts on
    them (ALCF's Aurora guide)."""
    said = ("x1001 offline  job 4242.aurora-pbs failed here\nx1002 down  142.pbs\n"
            "x1003 down  42.pbs\nx1004 offline\n")
    assert pbs_bad_at_start(said, "42.aurora-pbs") == ["x1003"]
    assert pbs_bad_at_start(said, "4242") == ["x1001"]
    assert pbs_bad_at_start(said, "local") == [] and pbs_bad_at_start("", "42") == []
