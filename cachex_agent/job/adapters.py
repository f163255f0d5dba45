"""The scheduler's side of the job's life, thin: the allocation's hosts, those failed at
the start, the time left, which nodes are up, signals to a step, the hosts to blame.
Each runs the scheduler's own commands and hands their output to the parsers in
scheduler.py and blame.py; the choices are life.py's and start.py's."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from ..errors import OperationError
from .blame import failed_hosts
from .scheduler import Up, pbs_bad_at_start, pbs_left, pbs_up, slurm_left, slurm_steps, slurm_up

QUERY_TIMEOUT = 60


def _said(argv: list[str], stdin: str | None = None) -> str:
    """A scheduler command's output; "" when it fails or is missing (the parsers then
    take every node as up, and say so)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT,
                              input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and everything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Slurm:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def hosts(self, nodelist: str) -> list[str]:
        """SLURM_JOB_NODELIST expanded by Slurm's own `scontrol`."""
        if not nodelist:
            raise OperationError("SLURM_JOB_NODELIST is not set: not inside a Slurm job")
        return _said(["scontrol", "show", "hostnames", nodelist]).split()

    def bad_at_start(self) -> list[str]:
        return []       # Slurm starts no job on a node it knows is down

    def time_left(self) -> int | None:
        return slurm_left(_said(["squeue", "-h", "-j", self.job_id, "-o", "%L"]))

    def up(self, hosts: list[str]) -> Up:
        """In the job (`squeue -o %N`, expanded by Slurm's own `scontrol`) and not down,
        drained or failing in `sinfo`."""
        in_job = _said(["squeue", "-h", "-j", self.job_id, "-o", "%N"]).strip()
        if in_job:
            in_job = " ".join(_said(["scontrol", "show", "hostnames", in_job]).split())
        sinfo = _said(["sinfo", "-h", "-N", "-n", ",".join(hosts), "-o", "%N %T"])
        return slurm_up(hosts, in_job, sinfo)

    def signal(self, step: str, proc: subprocess.Popen, sig: str) -> None:
        """To every task of the steps of that name; to the launcher when none is found."""
        ids = slurm_steps(_said(["squeue", "-h", "--steps", "-j", self.job_id, "-o", "%i %j"]),
                          step)
        sent = [i for i in ids
                if subprocess.run(["scancel", f"--signal={sig}", i], timeout=QUERY_TIMEOUT,
                                  capture_output=True).returncode == 0]
        if not sent and proc.poll() is None:
            proc.send_signal(getattr(signal, f"SIG{sig}"))

    def failed_on(self, stderr: str, nodes: list[str]) -> list[str]:
        return failed_hosts(stderr, nodes)


class Pbs:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def hosts(self, nodefile: str) -> list[str]:
        """PBS_NODEFILE: a line per rank; each host once, in its order."""
        if not nodefile:
            raise OperationError("PBS_NODEFILE is not set: not inside a PBS job")
        try:
            return list(dict.fromkeys(Path(nodefile).read_text().split()))
        except OSError as exc:
            raise OperationError(f"PBS_NODEFILE={nodefile}: {exc.strerror}") from exc

    def bad_at_start(self) -> list[str]:
        """Nodes `pbsnodes -l` lists down or offline with this job's id (a job with
        tolerate_node_failures starts on them)."""
        return pbs_bad_at_start(_said(["pbsnodes", "-l"]), self.job_id)

    def time_left(self) -> int | None:
        return pbs_left(_said(["qstat", "-f", self.job_id]))

    def up(self, hosts: list[str]) -> Up:
        """Not down or offline in `pbsnodes -v`, asked host by host."""
        said = "".join(f"# host {h}\n{_said(['pbsnodes', '-v', h])}" for h in hosts)
        return pbs_up(hosts, said)

    def signal(self, step: str, proc: subprocess.Popen, sig: str) -> None:
        """mpiexec has no step names: KILL goes to its process tree, others to it."""
        if sig == "KILL":
            kill_group(proc)
        elif proc.poll() is None:
            proc.send_signal(getattr(signal, f"SIG{sig}"))

    def failed_on(self, stderr: str, nodes: list[str]) -> list[str]:
        """No launcher's output is read under PBS: the scheduler's node states count."""
        return []
