"""Each site's rules as its scheduler applies them at submission, from the guides'
tables (page and revision in docs/jobs.md). `refusal(...)` returns the one line the
site's qsub or sbatch prints when it refuses a job, None when it takes it.

Where a guide says a job "waits" for a limit no single job can ever meet (a per-user
GPU limit, a bin's walltime), a job over it never runs: the fake refuses it too."""

from __future__ import annotations

import re
from dataclasses import dataclass

HOUR = 3600


@dataclass(frozen=True)
class Queue:
    name: str
    fewest: int
    most: int
    longest: int            # seconds
    shortest: int = 5 * 60


# ALCF Polaris, polaris/running-jobs/index.md (2026-02-17): prod is a routing queue that
# sends a job to the first execution queue whose node range and walltime it fits
POLARIS_QUEUES = {
    "debug": Queue("debug", 1, 2, HOUR),
    "debug-scaling": Queue("debug-scaling", 1, 10, HOUR),
    "preemptable": Queue("preemptable", 1, 10, 72 * HOUR),
    "capacity": Queue("capacity", 1, 4, 168 * HOUR),
}
POLARIS_PROD = (Queue("small", 10, 24, 3 * HOUR), Queue("medium", 25, 99, 6 * HOUR),
                Queue("large", 100, 496, 24 * HOUR))
# ALCF Aurora, aurora/running-jobs-aurora.md (2026-07-27)
AURORA_QUEUES = {
    "debug": Queue("debug", 1, 2, HOUR),
    "debug-scaling": Queue("debug-scaling", 2, 256, HOUR),
    "capacity": Queue("capacity", 1, 16, 168 * HOUR),
}
AURORA_PROD = (Queue("small", 256, 1024, 12 * HOUR), Queue("medium", 1025, 1999, 18 * HOUR),
               Queue("large", 2000, 10624, 24 * HOUR))
# filesystems= values: the guides' examples (home:eagle; flare, daos_user); the full list
# is `qstat -Bf`'s resources_available.valid_filesystems, not in the guide
PBS_SITES = {
    "polaris": (POLARIS_QUEUES, POLARIS_PROD, {"home", "eagle"}),
    "aurora": (AURORA_QUEUES, AURORA_PROD, {"home", "flare", "daos_user", "daos_perf"}),
}

# OLCF Frontier, systems/frontier_user_guide.rst (2026-07-07): batch's walltime by the
# node-count bin; extended at most 64 nodes, 24 h
FRONTIER_BINS = ((91, 2 * HOUR), (183, 6 * HOUR), (1881, 12 * HOUR), (5644, 12 * HOUR),
                 (9472, 12 * HOUR))
FRONTIER_EXTENDED = (64, 24 * HOUR)


@dataclass(frozen=True)
class Partition:
    nodes: int
    gpus: int               # a node
    cores: int              # a node
    user_gpus: int          # a user at once


# KISTI Neuron, system/running-jobs-through-scheduler-slurm.md (2026-08-12; the queue
# table as revised 2026-05-11): the partitions a user may submit to; 2 days at most
NEURON_PARTITIONS = {
    "cas_v100nv_8": Partition(5, 8, 32, 32), "cas_v100nv_4": Partition(4, 4, 40, 12),
    "cas_v100_4": Partition(11, 4, 40, 44), "cas_v100_2": Partition(2, 2, 32, 6),
    "amd_a100nv_8": Partition(9, 8, 64, 88), "eme_h200nv_8": Partition(1, 8, 96, 16),
}
NEURON_LONGEST = 48 * HOUR
# the same page's field and program tables for --comment (in force since 2026-08-12)
NEURON_FIELDS = frozenset(
    "agenticai robotics aim nlp cv speech recsys multimodal sciai efficientai healthai"
    " finai misc math phys chem aac ees bio med bns agf qst mse ere mae ne che eee ict cse"
    " cte ss caa hum".split())
NEURON_APPLS = frozenset(
    "pytorch jax triton pytorch-ddp tensorflow jupyter pytorch-fsdp tensorrt r deepspeed"
    " ollama misc megatron-lm vllm abaqus grims q-chem amber gromacs qmcpack ansys kflow"
    " quantum_espresso berkeleygw lammps bwa ls-dyna ramses castep materials_studio raspa"
    " cesm matlab roms cgyro mfdn rosetta charmm mom siesta cp2k mpas star-ccm fhi_aims"
    " msc_one su2 fvcom namd vasp gadget nw_chem wannier90 gatk openfoam wien2k gaussian"
    " openmm wrf geant4 openmx xtb gotpm orca in_house gpaw pyfr".split())


def seconds(walltime: str) -> int:
    """PBS `HH:MM:SS` / Slurm `[D-]HH:MM:SS`, `MM:SS`, `MM`."""
    days, _, clock = walltime.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if len(parts) == 1 and not days:
        parts = [0, parts[0], 0]        # Slurm: a bare number is minutes
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return (int(days) if days else 0) * 24 * HOUR + h * HOUR + m * 60 + s


def select_nodes(select: str) -> int:
    """`12:system=polaris+1:vnode=x` -> 13 chunks of one node each."""
    return sum(int(chunk.split(":")[0]) for chunk in select.split("+"))


def pbs_refusal(site: str, opts: dict[str, str]) -> str | None:
    """opts: `-A`, `-q`, `select`, `walltime`, `filesystems` as the job asks."""
    queues, prod, valid_fs = PBS_SITES[site]
    for key, option in (("-A", "-A"), ("walltime", "-l walltime"),
                        ("filesystems", "-l filesystems")):
        if not opts.get(key):
            return f"qsub: {option} is required"
    bad_fs = set(opts["filesystems"].split(":")) - valid_fs
    if bad_fs:
        return f"qsub: invalid filesystems: {':'.join(sorted(bad_fs))}"
    if "select" not in opts:
        return "qsub: -l select is required"
    nodes, walltime = select_nodes(opts["select"]), seconds(opts["walltime"])
    queue = opts.get("-q", "")
    if queue == "prod":
        if any(q.fewest <= nodes <= q.most and q.shortest <= walltime <= q.longest
               for q in prod):
            return None
        return (f"qsub: Job rejected by all possible destinations (prod: {nodes} nodes for"
                f" {opts['walltime']})")
    if queue in {q.name for q in prod}:
        return f"qsub: cannot submit to {queue} directly: submit to prod"
    if queue not in queues:
        return f"qsub: Unknown queue {queue!r}"
    q = queues[queue]
    if not (q.fewest <= nodes <= q.most and q.shortest <= walltime <= q.longest):
        return (f"qsub: Job exceeds queue resource limits ({queue}: {nodes} nodes for"
                f" {opts['walltime']})")
    return None


def slurm_refusal(site: str, opts: dict[str, str], submit_dir: str, user: str) -> str | None:
    """opts: sbatch's long options (`--nodes`, `--time`, ...) as the job asks."""
    if site == "frontier":
        return frontier_refusal(opts)
    if site == "neuron":
        return neuron_refusal(opts, submit_dir, user)
    return None


def frontier_refusal(opts: dict[str, str]) -> str | None:
    if not opts.get("--account"):
        return "sbatch: error: no account (-A): every job is charged to a project"
    nodes, walltime = int(opts.get("--nodes", "1")), seconds(opts.get("--time", "0"))
    partition = opts.get("--partition", "batch")
    if partition == "extended":
        most, longest = FRONTIER_EXTENDED
        if nodes > most or walltime > longest:
            return (f"sbatch: error: extended: {nodes} nodes for {opts.get('--time')}"
                    " over 64 nodes / 24 h")
        return None
    if partition != "batch":
        return f"sbatch: error: invalid partition specified: {partition}"
    longest = next((limit for most, limit in FRONTIER_BINS if nodes <= most), None)
    if longest is None or walltime > longest:
        return (f"sbatch: error: batch: {nodes} nodes for {opts.get('--time')} is over its"
                " bin's walltime")
    return None


def neuron_refusal(opts: dict[str, str], submit_dir: str, user: str) -> str | None:
    if not (submit_dir + "/").startswith(f"/scratch/{user}/"):
        return f"sbatch: error: jobs are submitted from /scratch/{user} only, not {submit_dir}"
    comment = re.fullmatch(r"field=([^;]+);appl=(.+)", opts.get("--comment", "").strip('"'))
    if not comment:
        return 'sbatch: error: --comment="field=<field>;appl=<application>" is required'
    if comment.group(1) not in NEURON_FIELDS or comment.group(2) not in NEURON_APPLS:
        return f"sbatch: error: --comment: unknown field or appl: {opts['--comment']} (showappl)"
    name = opts.get("--partition", "")
    if name not in NEURON_PARTITIONS:
        return f"sbatch: error: invalid partition specified: {name or '(none)'}"
    part = NEURON_PARTITIONS[name]
    nodes = int(opts.get("--nodes", "1"))
    gres = re.fullmatch(r"gpu:(\d+)", opts.get("--gres", "gpu:0"))
    gpus = int(gres.group(1)) if gres else 0
    if nodes > part.nodes:
        return (f"sbatch: error: Batch job submission failed: Requested node configuration is"
                f" not available ({name} has {part.nodes} nodes)")
    if gpus > part.gpus:
        return f"sbatch: error: {name}: gpu:{gpus} on nodes of {part.gpus} GPUs"
    if nodes * gpus > part.user_gpus:
        return (f"sbatch: error: {name}: {nodes * gpus} GPUs, over the {part.user_gpus} a user"
                " may hold")
    if seconds(opts.get("--time", "0")) > NEURON_LONGEST:
        return f"sbatch: error: {name}: --time={opts['--time']} over 2 days"
    return None
