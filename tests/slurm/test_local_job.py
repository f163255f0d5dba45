"""scripts/slurm/local.sbatch through real sbatch/srun on this machine's Slurm: the agent
step beside the training step, a SIGKILLed training step recovered and relaunched, the
halt before the walltime, and the next job resuming from the PFS."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from slurm_harness import STEPS, VNODES, LocalJob, run, wait_for

pytestmark = pytest.mark.timeout(420)
CKPTS = [f"step_{s:05d}" for s in range(10, STEPS + 1, 10)]


def final_state(job: LocalJob) -> dict:
    assert job.state_out.exists(), f"the trainer wrote no final state\n{job.tail()}"
    return json.loads(job.state_out.read_text())


def assert_completed(job: LocalJob, result: tuple[str, str]) -> str:
    out = job.output()
    assert result == ("COMPLETED", "0:0"), f"job {job.id} ended {result}:\n{job.tail()}"
    return out


def assert_all_on_pfs(job: LocalJob, ckpt: str) -> None:
    """Every virtual node's bundle of `ckpt` is on the PFS and verifies."""
    bundles = sorted(p.name for p in (job.workdir / "pfs" / "t" / "ckpt" / ckpt).glob("*.h5"))
    assert bundles == [f"node-{n:05d}.h5" for n in range(VNODES)], bundles
    verify = job.cachex("verify", ckpt)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_job_trains_flushes_and_completes(local_job, reference):
    job = local_job("cx-complete")
    job.submit(TRAIN_CMD=job.train_cmd())
    seen: dict[str, set[str]] = {}

    def watch() -> None:        # what `cachex status --json` says while the job runs
        for ckpt, level in job.levels().items():
            seen.setdefault(ckpt, set()).add(level)

    out = assert_completed(job, job.wait(240, watch))
    assert any("flushed" in levels for levels in seen.values()), \
        f"no checkpoint seen flushed while the job ran: {seen}"
    status = job.status()
    assert status["state"] == "stopped"
    assert {r["id"]: r["level"] for r in status["checkpoints"]} == \
        dict.fromkeys(CKPTS, "flushed")
    assert_all_on_pfs(job, CKPTS[-1])
    assert final_state(job) == reference
    assert "training finished; newest checkpoint step_00060 is on the PFS" in out
    assert out.count("training: srun") == 1, out


def test_killed_training_step_is_recovered_and_relaunched(local_job, reference):
    job = local_job("cx-kill")
    # Slower steps (same final state) so that the kill lands mid-run.
    job.submit(TRAIN_CMD=job.train_cmd(step_time=0.1))
    safe = wait_for(lambda: [c for c, level in job.levels().items()
                             if level in ("replicated", "flushed")], 180,
                    f"a replicated checkpoint (job output:\n{job.tail()})")
    steps = job.steps().get("train")
    assert steps, f"no running step named train: {job.steps()}\n{job.tail()}"
    assert STEPS > int(max(safe)[5:]), "the trainer finished before the kill"
    killed = run(["scancel", "--signal=KILL", *steps])
    assert killed.returncode == 0, killed.stderr

    out = assert_completed(job, job.wait(300))
    assert re.search(r"training step failed with status \d+ \(launch 1\)", out), out
    # the work at risk as the relaunch began, on the coordinator's clock
    assert re.search(r"relaunch: at risk now \(the coordinator's clock\):\n"
                     r"\s+a node lost: .*since step_\d+ was committed", out), out
    recovered = re.search(r"^recovered (step_\d+):", out, re.M)
    assert recovered, f"no `cachex recover` summary in the output:\n{out}"
    assert recovered.group(1) >= max(safe)
    assert f"resumed from {recovered.group(1)}" in out
    assert out.count("training: srun") == 2
    assert out.count("agents running on 2 nodes") == 2
    assert final_state(job) == reference
    assert job.levels()[CKPTS[-1]] == "flushed"
    assert_all_on_pfs(job, CKPTS[-1])


def test_walltime_halt_drains_and_next_job_resumes_from_the_pfs(local_job, reference):
    job = local_job("cx-halt")
    # A 2-minute walltime, halt 85 s before its end; 1 s steps: far from done by then.
    job.submit("--time=2", TRAIN_CMD=job.train_cmd(every=5, step_time=1.0),
               HALT_MARGIN="85")
    out = assert_completed(job, job.wait(150))
    assert "halt: the job ends in" in out and "halted before the walltime" in out, out
    assert re.search(r"halt: at risk now \(the coordinator's clock\):\n"
                     r"\s+a node lost: .*\n\s+the allocation ending: ", out), out
    assert not job.state_out.exists(), "the trainer finished: nothing was halted"
    levels = job.levels()
    newest = max(levels)
    assert levels[newest] == "flushed", levels
    assert newest < CKPTS[-1]

    # The next job of the run: new nodes (empty spools, stage, journals), the same PFS.
    for node in range(VNODES):
        shutil.rmtree(job.workdir / f"node{node}")
    job.submit(TRAIN_CMD=job.train_cmd())
    out = assert_completed(job, job.wait(240))
    assert "has a checkpoint on the PFS: recovering it before training" in out
    assert f"resumed from {newest}" in out, out
    assert final_state(job) == reference
    assert job.levels()[CKPTS[-1]] == "flushed"


def test_the_schedulers_walltime_warning_halts_at_once(local_job):
    """Slurm's `--signal=B:USR1@N` to the batch shell (sent here with scancel, which is
    what Slurm does N seconds before the end): training is halted and drained at once,
    though the end time read at the start was far away."""
    job = local_job("cx-usr1")
    job.submit("--time=20", TRAIN_CMD=job.train_cmd(every=5, step_time=1.0))
    wait_for(lambda: "flushed" in job.levels().values(), 150, "a flushed checkpoint")
    signalled = run(["scancel", "--batch", "--signal=USR1", job.id])
    assert signalled.returncode == 0, signalled.stderr
    out = assert_completed(job, job.wait(150))
    assert "USR1: the scheduler warns that the job ends soon: halting now" in out, out
    assert "halt: the job ends in" in out and "halted before the walltime" in out, out
    assert not job.state_out.exists(), "the trainer finished: nothing was halted"


def test_a_bad_key_fails_the_job_before_any_step_with_one_line(local_job):
    """The job's configuration is read back by the agents' parser as it is written: a
    bad CONFIG_EXTRA key ends the job there, naming it, status 2, nothing launched."""
    job = local_job("cx-badconf")
    job.submit(TRAIN_CMD=job.train_cmd(), CONFIG_EXTRA='[flush]\nno_such_key = 1')
    state, code = job.wait(120)
    out = job.output()
    assert (state, code) == ("FAILED", "2:0"), f"{state} {code}\n{out}"
    errors = [line for line in out.splitlines() if "cachex-job: error:" in line]
    assert len(errors) == 1 and "flush.no_such_key: unknown configuration key" in errors[0], out
    assert "srun" not in out


def test_agents_that_cannot_start_fail_the_job_with_one_line(local_job):
    """A configuration that parses but that the agents refuse for this job (an erasure
    group larger than its 2 nodes): the pre-flight check (`cachex-agent --check`, the
    same launcher) refuses it before anything starts; the job fails with status 2."""
    job = local_job("cx-badgroup")
    job.submit(TRAIN_CMD=job.train_cmd(), CONFIG_EXTRA='[peer]\nscheme = "xor"\ngroup = 8')
    state, code = job.wait(120)
    out = job.output()
    assert (state, code) == ("FAILED", "2:0"), f"{state} {code}\n{out}"
    errors = [line for line in out.splitlines() if "cachex-job: error:" in line]
    assert len(errors) == 1 and "pre-flight check failed" in errors[0], out
    assert re.search(r"tasks? [0-9,-]+: Exited with exit code 2", out), out
    assert "peer.group" in out, out
    assert "agents: srun" not in out
    assert "training: srun" not in out
