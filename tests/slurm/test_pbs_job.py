"""scripts/pbs/cachex.pbs run for real on this machine, without a PBS server: bash runs
the job script as PBS would (PBS_NODEFILE of this host, PBS_JOBID), its steps go through
the venv's mpiexec (hydra) with 2 virtual nodes. The trainer's ranks are SIGKILLed
mid-run: the loop stops the agents, runs `cachex recover`, restarts them and relaunches
the trainer, which ends in the state of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from slurm_harness import BIN, ROOT, SCRIPTS, TRAINER, VNODES, levels_of, trainer_words, wait_for

pytestmark = pytest.mark.timeout(300)
PBS = SCRIPTS / "pbs" / "cachex.pbs"


def trainer_ranks(workdir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        # `python trainer.py ...`: the ranks, not the mpiexec that launched them
        if cmdline[1:2] == [str(TRAINER)] and any(str(workdir) in w for w in cmdline):
            found.append(proc)
    return found


def kill_job(job: subprocess.Popen[bytes]) -> None:
    try:
        tree = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(10)


def pbs_env(tmp_path: Path, train_cmd: str, **variables: str) -> dict[str, str]:
    """What PBS would give the job script, and the template's variables for 2 virtual
    nodes under `tmp_path/w`."""
    work = tmp_path / "w"
    for node in range(VNODES):
        (work / f"node{node}" / "spool").mkdir(parents=True)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(f"{socket.gethostname()}\n" * 4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEX_", "PBS_"))}
    env.update(PBS_NODEFILE=str(nodefile), PBS_JOBID="1.pbs-test", PBS_O_WORKDIR=str(work),
               CX_ROOT=str(ROOT), CX_BIN=str(BIN), VNODES=str(VNODES), RANKS_PER_NODE="2",
               RUN_NAME="t", SPOOL=f"{work}/node{{node}}/spool",
               STAGE=f"{work}/node{{node}}/shm", CACHE=f"{work}/node{{node}}/nvme",
               PFS=f"{work}/pfs", FAILURE_DOMAIN="rank", COMMIT_RULE="dcp", NODE_DIRS="",
               CONFIG_OUT=str(work / "cachex.toml"), CONFIG_EXTRA='[agent]\ntimeout = "20s"',
               TRAIN_CMD=train_cmd, CX_RUNDIR=str(tmp_path / "run"), AGENT_STOP_TIMEOUT="30",
               DRAIN_TIMEOUT="120", TRAIN_STOP_GRACE="10", POLL="1")
    env.update(variables)
    return env


def test_pbs_template_recovers_killed_ranks_and_relaunches(tmp_path, reference):
    work = tmp_path / "w"
    config = work / "cachex.toml"
    words = trainer_words("--spool", f"{work}/node{{node}}/spool", "--every", "10",
                          "--step-time", "0.1", "--state-out", str(work / "state.json"))
    env = pbs_env(tmp_path, shlex.join(words))
    log = tmp_path / "job.out"
    with log.open("wb") as out:
        job = subprocess.Popen(["bash", str(PBS)], stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        wait_for(lambda: any(level in ("replicated", "flushed")
                             for level in levels_of(config).values()), 180,
                 "a replicated checkpoint", poll=0.3)
        ranks = trainer_ranks(work)
        assert len(ranks) == VNODES * 2, ranks
        for rank in ranks:
            rank.kill()
        code = job.wait(240)
    finally:
        if job.poll() is None:
            kill_job(job)
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert re.search(r"training step failed with status \d+ \(launch 1\)", text), text
    recovered = re.search(r"^recovered (step_\d+):", text, re.M)
    assert recovered, text
    assert f"resumed from {recovered.group(1)}" in text
    assert text.count(f"training: {BIN / 'mpiexec'} -n 4 ") == 2, text
    assert json.loads((work / "state.json").read_text()) == reference
    assert levels_of(config)["step_00060"] == "flushed"


def test_a_trainer_that_keeps_failing_ends_the_job_after_max_relaunches(tmp_path):
    env = pbs_env(tmp_path, "bash -c 'echo trainer crashed; exit 3'", MAX_RELAUNCHES="1")
    result = subprocess.run(["bash", str(PBS)], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=180)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert out.splitlines().count("trainer crashed") == 2 * 4    # 2 launches x 4 ranks
    assert "no checkpoint of run t captured yet: relaunching from the start" in out
    assert "recover:" not in out                      # nothing to recover from
    assert "final drain" in out and out.count("agents running on 2 nodes") == 2
    errors = [line for line in result.stderr.splitlines() if "cachex-job: error:" in line]
    assert len(errors) == 1 and errors[0].endswith(
        "training failed 2 times (MAX_RELAUNCHES=1); newest checkpoint - at level -"), errors


def launched_as(proc: psutil.Process, rank: int) -> bool:
    try:
        return proc.environ().get("PMI_RANK") == str(rank)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def outcome(job: subprocess.Popen[bytes], log: Path, act: Callable[[], None]
            ) -> tuple[int, str]:
    """`act` on the running job, then its exit status and output (killed if it hangs)."""
    try:
        act()
        code = job.wait(240)
    finally:
        if job.poll() is None:
            kill_job(job)
    return code, log.read_text()


def named_hosts_job(tmp_path: Path, train_cmd: str, hosts: int = 3, **variables: str
                    ) -> tuple[subprocess.Popen[bytes], Path]:
    """cachex.pbs on pbsnode1..`hosts` (hydra's fork launcher runs them all on this host),
    with a `pbsnodes` that reports down the hosts listed in tmp_path/down; the job, its
    log."""
    env = pbs_env(tmp_path, train_cmd, VNODES="", MPIEXEC_AGENT_FLAGS="-launcher fork",
                  MPIEXEC_TRAIN_FLAGS="-launcher fork", **variables)
    (tmp_path / "nodefile").write_text("".join(f"pbsnode{i}\n" for i in range(1, hosts + 1)))
    down = tmp_path / "down"
    down.write_text("")
    fake = tmp_path / "pbsbin"
    fake.mkdir()
    (fake / "pbsnodes").write_text(     # `pbsnodes -v HOST`, as PBS answers it
        f'#!/bin/bash\nh=${{!#}}; s=free; grep -qx "$h" {down} && s=down\n'
        'printf "%s\\n     Mom = %s\\n     state = %s\\n" "$h" "$h" "$s"\n')
    (fake / "pbsnodes").chmod(0o755)
    env["PATH"] = f"{fake}:{env['PATH']}"
    log = tmp_path / "job.out"
    with log.open("wb") as out:
        job = subprocess.Popen(["bash", str(PBS)], stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return job, log


def test_a_node_pbsnodes_reports_down_is_replaced_by_a_spare(tmp_path, reference):
    """The PBS adapter on named hosts (hydra's fork launcher runs them all here): PBS
    marks pbsnode2 down and its ranks and agent die with their files; the supervisor
    reads `pbsnodes`, takes the spare pbsnode3, recovers node 1 onto it and relaunches
    on the new host file; the trainer ends in an uninterrupted run's state."""
    work, config, down = tmp_path / "w", tmp_path / "w" / "cachex.toml", tmp_path / "down"
    words = trainer_words("--spool", f"{work}/node{{node}}/spool", "--every", "10",
                          "--step-time", "0.1", "--state-out", str(work / "state.json"))
    job, log = named_hosts_job(tmp_path, shlex.join(words), NODES="2", SPARES="1")

    def lose_node_1() -> None:
        wait_for(lambda: any(level in ("replicated", "flushed")
                             for level in levels_of(config).values()), 180,
                 "a replicated checkpoint", poll=0.3)
        down.write_text("pbsnode2\n")
        lost = [p for p in trainer_ranks(work) if launched_as(p, 2) or launched_as(p, 3)]
        lost += [p for p in psutil.process_iter(["cmdline"])       # this job's only
                 if any(w.endswith("cachex-agent") for w in p.info["cmdline"] or [])
                 and str(config) in (p.info["cmdline"] or []) and launched_as(p, 1)]
        assert len(lost) == 3, lost                     # two ranks and node 1's agent
        for proc in lost:
            proc.kill()
        shutil.rmtree(work / "node1")                   # its spool, stage and NVMe are gone
        (work / "node1" / "spool").mkdir(parents=True)  # the spare's empty disk

    code, text = outcome(job, log, lose_node_1)
    assert code == 0, text[-4000:]
    assert "lost pbsnode2; replaced by spares; node set now pbsnode1,pbsnode3" in text, text
    assert (tmp_path / "run" / "hosts").read_text() == "pbsnode1\npbsnode3\n"
    recovered = re.search(r"^recovered (step_\d+):", text, re.M)
    assert recovered, text
    assert f"resumed from {recovered.group(1)}" in text
    assert json.loads((work / "state.json").read_text()) == reference
    assert levels_of(config)["step_00060"] == "flushed"


def test_pbs_shrinks_to_min_nodes_when_no_spare_is_left(tmp_path):
    """pbsnode2 down and its ranks gone before the first checkpoint, no spare,
    MIN_NODES=1: relaunched from the start on pbsnode1 alone."""
    work, go = tmp_path / "w", tmp_path / "go"
    words = trainer_words("--spool", f"{work}/node{{node}}/spool", "--every", "10",
                          "--step-time", "0", "--state-out", str(work / "state.json"))
    script = f'until [ -e {go} ]; do sleep 0.2; done; exec "$@"'
    job, log = named_hosts_job(tmp_path, f"bash -c {shlex.quote(script)} _ {shlex.join(words)}",
                               hosts=2, NODES="2", SPARES="0", MIN_NODES="1")

    def lose_node_1() -> None:
        wait_for(lambda: len(waiting(work, go)) == 4, 120, "the waiting trainer", poll=0.3)
        (tmp_path / "down").write_text("pbsnode2\n")
        for proc in waiting(work, go)[2:]:        # node 1's two ranks
            proc.kill()
        go.touch()

    code, text = outcome(job, log, lose_node_1)
    assert code == 0, text[-4000:]
    assert "going on with 1 of 2 nodes (MIN_NODES=1)" in text, text
    assert "no checkpoint of run t captured yet: relaunching from the start" in text, text
    assert (tmp_path / "run" / "hosts").read_text() == "pbsnode1\n"
    assert json.loads((work / "state.json").read_text())["world_size"] == 2


def waiting(work: Path, go: Path) -> list[psutil.Process]:
    """This job's gated trainer ranks (`bash -c 'until [ -e go ]...'`), by launch rank."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline[:2] == ["bash", "-c"] and str(go) in cmdline[2] and \
                any(str(work) in w for w in cmdline):
            found.append(proc)
    return sorted(found, key=lambda p: int(p.environ().get("PMI_RANK", "-1")))


def test_pbs_halts_before_the_walltime_and_drains(tmp_path):
    """The time left (JOB_END here, qstat's walltime on a site) less HALT_MARGIN: the
    trainer gets SIGTERM, the agents drain, the job exits HALT_EXIT."""
    work = tmp_path / "w"
    config = work / "cachex.toml"
    words = trainer_words("--spool", f"{work}/node{{node}}/spool", "--every", "10",
                          "--step-time", "1", "--state-out", str(work / "state.json"))
    env = pbs_env(tmp_path, shlex.join(words), HALT_MARGIN="60",
                  JOB_END=str(int(time.time()) + 60 + 45))
    result = subprocess.run(["bash", str(PBS)], capture_output=True, text=True, env=env,
                            stdin=subprocess.DEVNULL, timeout=280)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "halt: the job ends in" in out and "halted before the walltime" in out, out
    assert not (work / "state.json").exists(), "the trainer finished: nothing was halted"
    levels = levels_of(config)
    assert levels and levels[max(levels)] == "flushed", levels


def test_a_shrunk_relaunch_resumes_a_dcp_checkpoint_on_fewer_nodes(tmp_path):
    """pbsnode2 down after the DCP trainer's step_00008 is flushed, no spare,
    MIN_NODES=1: the 4 ranks' checkpoint is gathered once into the job's directory
    (`cachex recover --to`) and the trainer resumes from there (LOAD_FROM_ARGS) on
    pbsnode1's 2 ranks, DCP resharding on load, and trains on to step 16."""
    work, go, steps = tmp_path / "w", tmp_path / "go", tmp_path / "steps"
    config = work / "cachex.toml"
    steps.write_text("8")
    # each rank waits for `go` once its trainer is done: the node is lost after a
    # whole checkpoint and before the job ends, whatever the machine's speed
    hold = f'"$@"; rc=$?; until [ -e {go} ]; do sleep 0.2; done; exit $rc'
    trainer = [str(BIN / "python"), str(ROOT / "examples" / "dcp_trainer.py"), "--spool",
               f"{work}/node{{node}}/spool", "--ranks-per-node", "2", "--every", "4"]
    train = (f"bash -c {shlex.quote(hold)} _ {shlex.join(trainer)}"
             f' --steps "$(cat {steps})" --rendezvous "$CX_RUNDIR/rdv-$RANDOM$RANDOM"')
    job, log = named_hosts_job(
        tmp_path, train, hosts=2, NODES="2", SPARES="0", MIN_NODES="1",
        LOAD_FROM_ARGS='--load-from "$CX_LOAD_FROM"',
        CONFIG_EXTRA='globals = ["__0_0.distcp"]\n[agent]\ntimeout = "20s"')

    def lose_node_1() -> None:
        wait_for(lambda: "done: step 8 " in log.read_text(), 180, "the first training",
                 poll=0.3)
        wait_for(lambda: levels_of(config).get("step_00008") == "flushed", 120,
                 "step_00008 flushed", poll=0.3)
        steps.write_text("16")
        (tmp_path / "down").write_text("pbsnode2\n")
        # every rank's trainer gone, its wrapper waiting: none left orphaned by the kill
        wait_for(lambda: trainers_done(work, go), 120, "every trainer done", poll=0.3)
        for proc in waiting(work, go)[2:]:        # node 1's two ranks
            proc.kill()
        go.touch()          # node 0's ranks may end 0: the step failed with node 1's

    code, text = outcome(job, log, lose_node_1)
    assert code == 0, text[-4000:]
    assert "going on with 1 of 2 nodes (MIN_NODES=1)" in text, text
    gathered = tmp_path / "run" / "load-1"
    assert re.search(rf"^\S+ cachex-job: recover: .* recover --config \S+ --to {gathered}$",
                     text, re.M), text
    assert (gathered / "step_00008" / ".metadata").is_file()
    assert "resumed from step_00008 with dcp.load on 2 ranks" in text, text
    assert "done: step 16 " in text and levels_of(config)["step_00016"] == "flushed"


def trainers_done(work: Path, go: Path) -> bool:
    """The 4 wrappers wait for `go` with no trainer left under them."""
    try:
        held = waiting(work, go)
        return len(held) == 4 and not any("dcp_trainer.py" in " ".join(c.cmdline())
                                          for p in held for c in p.children())
    except psutil.Error:        # a process ended while read: look again
        return False
