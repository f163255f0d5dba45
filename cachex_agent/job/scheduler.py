"""What the scheduler's own commands say, read for the job templates: which hosts are
still up, and how long the job has left.

The adapters (adapters.py) only run `squeue`, `sinfo`, `pbsnodes` and `qstat` and hand
their output here. The time left is read as the scheduler states it, relative (Slurm's `%L`,
PBS's walltime less the walltime used), never as an end time on the controller's clock
set against this host's: the two clocks are not compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .nodes import expand_hosts

# Slurm's node states (sinfo %T) and PBS's (pbsnodes `state`) under which a node
# cannot run the next step; a trailing `*` is Slurm's "not responding".
_SLURM_GONE = re.compile(r"down|drain|fail|\*|maint|reboot|power|unknown")
_PBS_GONE = re.compile(r"down|offline|unknown|stale|unresolvable")
_DURATION = re.compile(r"^(?:(?P<days>\d+)-)?(?P<clock>\d+(?::\d+){0,2})$")
_QSTAT = re.compile(r"^\s*(?P<key>[A-Za-z_.]+)\s*=\s*(?P<value>.*?)\s*$")


@dataclass(frozen=True)
class Up:
    hosts: list[str]
    notes: list[str] = field(default_factory=list)


def _all_up(hosts: list[str], why: str) -> Up:
    # A lost node ends or shrinks the job: when the scheduler cannot tell, the job
    # goes on with what it has rather than end on no evidence.
    return Up(list(hosts), [f"{why}: every node taken as up"])


def slurm_up(hosts: list[str], in_job: str, sinfo: str) -> Up:
    """`hosts` still in the job (`in_job`: its hosts, names or a Slurm host list) and in
    a state that can run a step (sinfo `-N -o '%N %T'` lines)."""
    job_hosts = set(expand_hosts(in_job, "squeue %N")) if in_job.strip() else set()
    states: dict[str, str] = {}
    for line in sinfo.splitlines():
        words = line.split()
        if len(words) >= 2:
            states[words[0]] = words[1].lower()
    if not job_hosts or not states:
        return _all_up(hosts, "squeue or sinfo said nothing of the job's nodes")
    return Up([h for h in hosts if h in job_hosts and h in states
               and not _SLURM_GONE.search(states[h])])


def pbs_up(hosts: list[str], pbsnodes: str) -> Up:
    """`hosts` that `pbsnodes -v` does not show down or offline. The adapter frames each
    host's answer with a `# host NAME` line; a host with no `state` is taken as up."""
    states: dict[str, str] = {}
    host = None
    for line in pbsnodes.splitlines():
        if line.startswith("# host "):
            host = line[len("# host "):].strip()
            continue
        match = _QSTAT.match(line)
        if host is not None and match and match["key"] == "state":
            states.setdefault(host, match["value"].lower())
    if not states:
        return _all_up(hosts, "pbsnodes said nothing of the job's nodes")
    return Up([h for h in hosts if not _PBS_GONE.search(states.get(h, ""))])


def pbs_bad_at_start(pbsnodes_l: str, job_id: str) -> list[str]:
    """The nodes `pbsnodes -l` (down or offline nodes, one a line, name first) lists with
    this job's number: with tolerate_node_failures a job starts on nodes that already
    failed, and ALCF's Aurora guide says to keep them out of mpiexec."""
    number = job_id.partition(".")[0]
    if not number.isdigit():
        return []
    mention = re.compile(rf"(^|[^0-9]){number}([^0-9]|$)")
    return [line.split()[0] for line in pbsnodes_l.splitlines()
            if line.split() and mention.search(line)]


def slurm_steps(squeue: str, name: str) -> list[str]:
    """The ids of the job's steps named `name`, from `squeue -h --steps -o '%i %j'`."""
    return [words[0] for words in map(str.split, squeue.splitlines())
            if len(words) == 2 and words[1] == name]


def seconds(text: str) -> int | None:
    """Slurm's and PBS's durations: `[D-]H:M:S`, `M:S`, `S`, `D-H`, `D-H:M`; None for
    anything else (`UNLIMITED`, `NOT_SET`, `INVALID`, nothing)."""
    match = _DURATION.match(text.strip())
    if match is None:
        return None
    parts = [int(p) for p in match["clock"].split(":")]
    if match["days"] is not None:
        hours, minutes, secs = (parts + [0, 0])[:3]        # D-H, D-H:M, D-H:M:S
        return ((int(match["days"]) * 24 + hours) * 60 + minutes) * 60 + secs
    while len(parts) < 3:
        parts.insert(0, 0)                                 # S, M:S, H:M:S
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def slurm_left(squeue: str) -> int | None:
    """The job's time left from `squeue -h -j JOB -o %L`; None when unlimited or unknown."""
    lines = squeue.split()
    return seconds(lines[0]) if len(lines) == 1 else None


def pbs_left(qstat: str) -> int | None:
    """`Resource_List.walltime` less `resources_used.walltime` from `qstat -f JOB`; None
    without a walltime. The MoM updates the walltime used at its polling interval, so
    the figure may be that much too long: HALT_MARGIN covers it (docs/jobs.md)."""
    found: dict[str, str] = {}
    for line in qstat.splitlines():
        match = _QSTAT.match(line)
        if match:
            found.setdefault(match["key"], match["value"])
    wall = seconds(found.get("Resource_List.walltime", ""))
    if wall is None:
        return None
    used = seconds(found.get("resources_used.walltime", "0")) or 0
    return max(0, wall - used)
