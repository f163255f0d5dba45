"""Each job template under a fake site of its kind (tests/sites/stubs.py): `CX_PLAN=1`
prints the steps in the order the job runs them, and they are checked against what the
site's guide requires. The planned steps are then run through the stubs, which record
what each launch received."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from site_rules import NEURON_PARTITIONS
from stubs import TEMPLATES, FakeSite, default, directives, flag

from cachex_agent.errors import ConfigError
from cachex_agent.job.adapters import Pbs, Slurm
from cachex_agent.job.start import halt_window
from cachex_agent.job.supervisor import master_addr

FRONTIER_GCDS, FRONTIER_CORES = 8, 56              # low-noise mode: 56 of 64 cores
# Programming environment: Open MPI for GPU jobs, with its compiler and CUDA
NEURON_MODULES = "gcc/15.2.0 cuda/12.4.1 cudampi/openmpi-4.1.8"
# the PyTorch page's module set (pytorch_frontier, 2026-07-07)
FRONTIER_MODULES = ("PrgEnv-gnu/8.7.0 cpe/26.03 miniforge3/23.11.0-0 rocm/7.1.1"
                    " rccl-net-plugin craype-accel-amd-gfx90a")


def order(steps: list[tuple[str, list[str]]]) -> list[str]:
    return [kind for kind, _ in steps]


def step(steps: list[tuple[str, list[str]]], kind: str) -> list[str]:
    return next(words for k, words in steps if k == kind)


def checked_start(steps: list[tuple[str, list[str]]], staged: bool) -> None:
    """Staging (when on) before anything runs on the nodes; the pre-flight check is the
    first cachex step; the agents after it; training after them."""
    kinds = order(steps)
    start = [k for k in kinds if k in ("stage", "unpack", "check", "agents")]
    assert start == (["stage", "unpack"] if staged else []) + ["check", "agents"], kinds
    assert kinds.index("agents") < kinds.index("train"), kinds
    if staged:
        assert kinds[:2] == ["stage", "unpack"], kinds


def test_frontier_follows_the_olcf_guide(tmp_path):
    site = FakeSite(tmp_path, "slurm", hosts=34)
    found = directives("frontier")
    nodes = int(found["--nodes"])
    # what the scheduler takes is test_site_rules.py's; here the job's own counts
    assert nodes == int(default("frontier", "NODES")) + int(default("frontier", "SPARES"))
    assert found["--network"] == "disable_rdzv_get"     # rccl-net-plugin's alt_read
    assert found["--constraint"] == "nvme"                 # /mnt/bb/$USER exists
    assert found["--signal"] == f"B:USR1@{default('frontier', 'HALT_MARGIN')}"

    steps = site.plan("frontier", CX_BIN="")     # the template's own venv
    checked_start(steps, staged=True)
    # the PyTorch page's modules, versions and all, loaded for real in the batch shell
    loads = [c for c in site.calls() if c.startswith("module load")]
    assert [c.split(" | ")[0] for c in loads] == [f"module load {FRONTIER_MODULES}"], loads
    # the environment in Project Home (not purged), packed onto Orion (not into Project
    # Home's 50 GB), broadcast to the NVMe; every node step runs that copy
    sbcast = step(steps, "stage")
    assert sbcast[0] == "sbcast" and sbcast[-1] == "/mnt/bb/u/cachex-venv.tar"
    assert sbcast[-2] == "/lustre/orion/abc123/scratch/u/cachex-venv.tar"
    unpack = step(steps, "unpack")
    assert flag(unpack, "--nodelist").split(",") == site.hosts     # spares get it too
    for kind in ("check", "agents", "recover"):
        words = step(steps, kind)
        assert "/mnt/bb/u/cachex-venv/bin/python" in words, words
        assert words[:3] == ["env", "-u", "MPICH_GPU_SUPPORT_ENABLED"], words
        assert flag(words, "--mpi") is None             # the site default, as the guide
        # the default --cpu-bind=threads with -c 1 put every agent thread on one
        # hardware thread: the agent spans the 56 usable cores, unbound
        if kind == "agents":
            assert flag(words, "--cpus-per-task") == str(FRONTIER_CORES), words
            assert flag(words, "--cpu-bind") == "none", words
    train = step(steps, "train")
    # no GPU-aware MPI by default: Cray MPICH exits at MPI_Init without the GTL library,
    # which OLCF's mpi4py recipe does not link
    assert train[:2] == ["env", "NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3"], train
    assert "srun" in train and "MPICH_GPU_SUPPORT_ENABLED=1" not in train
    # torch imported from the NVMe copy ("NVMe > Orion >> NFS"), not from Project Home
    assert "/mnt/bb/u/cachex-venv/bin/python" in train
    assert flag(train, "--ntasks-per-node") == str(FRONTIER_GCDS)
    assert flag(train, "--gpus-per-task") == "1" and flag(train, "--gpu-bind") == "closest"
    assert FRONTIER_GCDS * int(flag(train, "--cpus-per-task")) <= FRONTIER_CORES

    # run the steps through the stubs from a shell where the user exported the variable
    said = {}
    for kind in ("stage", "unpack", "check", "agents", "train"):
        said[kind] = site.execute(step(steps, kind), MPICH_GPU_SUPPORT_ENABLED="1")
    assert said["stage"][0].startswith("sbcast ")
    for kind in ("unpack", "check", "agents"):
        assert said[kind][0].endswith("MPICH_GPU_SUPPORT_ENABLED=unset"), said[kind]
    assert said["train"][0].endswith("MPICH_GPU_SUPPORT_ENABLED=1"), said["train"]   # the user's
    # MASTER_ADDR the first training node's address, as the guide's `hostname -i`
    assert master_addr("localhost", default("frontier", "MASTER_ADDR_FROM")) \
        in ("127.0.0.1", "::1")
    assert master_addr("localhost", "name") == "localhost"


def test_neuron_follows_the_kisti_guide(tmp_path):
    site = FakeSite(tmp_path, "slurm", hosts=5)
    found = directives("neuron")
    part = NEURON_PARTITIONS[found["--partition"]]
    gpus, cores = part.gpus, part.cores
    nodes = int(found["--nodes"])
    assert nodes == int(default("neuron", "NODES")) + int(default("neuron", "SPARES"))
    assert found["--gres"] == f"gpu:{gpus}"                     # every GPU of a node
    assert default("neuron", "PFS").startswith("/scratch/$USER")
    # no node-local disk in the guide: nothing of the job's on /tmp; the venv on /scratch
    assert not any(default("neuron", v).startswith("/tmp") for v in ("SPOOL", "STAGE",
                                                                    "CACHE", "STAGE_DIR"))

    steps = site.plan("neuron", CX_BIN="")
    checked_start(steps, staged=False)          # the guide says nothing of sbcast
    loads = [c.split(" | ")[0] for c in site.calls() if c.startswith("module")]
    assert loads == ["module purge", f"module load {NEURON_MODULES}"], loads   # as the guide
    assert "/scratch/u/.conda/envs/cachex/bin/cachex-agent" in step(steps, "agents")
    train = step(steps, "train")
    ranks = int(flag(train, "--ntasks-per-node"))
    assert ranks == gpus and flag(train, "--gpus-per-task") == "1"
    assert ranks * int(flag(train, "--cpus-per-task")) <= cores
    for kind in ("check", "agents", "recover"):
        words = step(steps, kind)
        assert words[0] == "srun" and flag(words, "--mpi") is None, words
        assert "--overlap" in words and flag(words, "--ntasks-per-node") == "1"
    said = site.execute(step(steps, "agents"))
    assert len(said) == 1 and said[0].startswith("srun --job-name=cachex-agents")


def test_local_template_on_a_one_host_slurm(tmp_path):
    site = FakeSite(tmp_path, "slurm", hosts=1)
    found = directives("local")
    assert found["--nodes"] == "1" and found["--signal"].startswith("B:USR1@")
    steps = site.plan("local", VNODES="3", WORKDIR=str(tmp_path / "w"))
    checked_start(steps, staged=False)
    assert not [c for c in site.calls() if c.startswith("module")]     # no modules here
    agents = step(steps, "agents")
    assert {"--mpi=pmi2", "--nodes=1", "--ntasks=3", "--overlap"} <= set(agents)


def test_pbs_template_through_mpiexec(tmp_path):
    site = FakeSite(tmp_path, "pbs")
    found = " ".join(directives("pbs", "#PBS"))
    assert "-A ACCOUNT" in found and "-l select" in found and "-q " in found
    steps = site.plan("pbs")
    checked_start(steps, staged=False)
    hostfile = str(tmp_path / "run" / "hosts")
    assert step(steps, "check")[:7] == ["mpiexec", "-f", hostfile, "-n", "8", "-ppn", "1"]
    said = site.execute(step(steps, "check"))
    assert len(said) == 1 and said[0].startswith("mpiexec -f ")
    refused = site.run("pbs", STAGE_VENV="1", STAGE_DIR="/tmp/v")
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        "STAGE_VENV=1: staging uses Slurm's sbcast, which pbs has not; set STAGE_VENV=0")


# ALCF: cores a node and the cores the OS keeps (Aurora: 0 and 52 of each socket's 52)
ALCF_CORES = {"polaris": (32, ()), "aurora": (104, (0, 52))}


def pbs_directives(template: str) -> dict[str, str]:
    """`-q prod` -> {"-q": "prod"}, `-l select=12:...` -> {"-l select": "12:..."}"""
    found = {}
    for line in TEMPLATES[template].read_text().splitlines():
        if line.startswith("#PBS "):
            words = line[5:].split(maxsplit=1)
            option, _, value = (words[0] + " " + words[1]).partition("=") \
                if "=" in words[1] else (words[0], "", words[1])
            found[option] = value
    return found


@pytest.mark.parametrize("system", ["polaris", "aurora"])
def test_alcf_templates_follow_alcfs_guide(tmp_path, system):
    cores, reserved = ALCF_CORES[system]
    found = pbs_directives(system)
    # what qsub takes is test_site_rules.py's; here the job's own counts
    nodes = int(found["-l select"].split(":")[0])
    assert nodes == int(default(system, "NODES")) + int(default(system, "SPARES"))
    assert TEMPLATES[system].read_text().startswith("#!/bin/bash -l\n")   # `module`
    if system == "polaris":
        assert found["-l select"].endswith(":system=polaris")
        assert "-W tolerate_node_failures" not in found     # the Polaris guide: silent
    else:
        assert found["-W tolerate_node_failures"] == "all"  # documented, the loop acts on it
    site = FakeSite(tmp_path, "pbs", hosts=nodes)
    steps = site.plan(system, CX_BIN="", PROJECT="myproj")
    checked_start(steps, staged=False)
    calls = [c.split(" | ")[0] for c in site.calls() if c.startswith("module")]
    assert calls == (["module use /soft/modulefiles", "module load conda/2025-09-25"]
                     if system == "polaris" else ["module load frameworks"]), calls
    pfs = {"polaris": "eagle", "aurora": "flare"}[system]
    assert default(system, "PFS") == f"/lus/{pfs}/projects/$PROJECT/$USER/cachex"
    venv = f"/lus/{pfs}/projects/myproj/u/envs/cachex/bin"
    local = default(system, "SPOOL")
    # the node SSD on Polaris only; Aurora's parts stay in memory
    assert local.startswith("/local/scratch/" if system == "polaris" else "/dev/shm/")
    check = step(steps, "check")
    assert check[0] == "mpiexec" and flag_after(check, "--ppn") == "1", check
    assert flag_after(check, "--cpu-bind") == "none" and f"{venv}/cachex-agent" in check
    train = step(steps, "train")
    ranks = int(flag_after(train, "--ppn"))
    assert f"{venv}/python" in train
    if system == "polaris":
        depth = int(flag_after(train, "--depth"))
        assert flag_after(train, "--cpu-bind") == "depth" and ranks * depth <= cores
        return
    # Aurora: an explicit list, one set of cores a rank, none of the OS's, six ranks a
    # socket (--depth 8 split rank 6 across the sockets)
    bind = flag(train, "--cpu-bind")
    assert bind and bind.startswith("list:"), train
    sets = [range(int(a), int(b) + 1) for a, b in (r.split("-") for r in bind[5:].split(":"))]
    taken = [c for cs in sets for c in cs]
    assert len(sets) == ranks and len(taken) == len(set(taken)), bind
    assert not set(taken) & set(reserved) and max(taken) < cores
    assert [all(c < 52 for c in cs) for cs in sets] == [True] * 6 + [False] * 6, bind


def flag_after(words: list[str], name: str) -> str | None:
    """The word after `name` (PALS' `--ppn 4` form)."""
    return words[words.index(name) + 1] if name in words else None


def test_excluded_nodes_stay_out_and_the_minimum_is_kept(tmp_path):
    site = FakeSite(tmp_path, "slurm", hosts=5)
    steps = site.plan("neuron", EXCLUDE_NODES="n002")
    assert flag(step(steps, "agents"), "--nodelist") == "n001,n003,n004,n005"
    # three excluded of five: 2 usable hosts for NODES=4
    short = site.run("neuron", EXCLUDE_NODES="n[001-003]")
    assert short.returncode == 2
    assert short.stderr.strip().endswith(
        "NODES=4 but the allocation has only 2 usable hosts (MIN_NODES=0)")
    steps = site.plan("neuron", EXCLUDE_NODES="n[001-003]", MIN_NODES="2")
    assert flag(step(steps, "agents"), "--nodelist") == "n004,n005"
    assert flag(step(steps, "agents"), "--nodes") == "2"


def test_no_module_command_is_one_line_and_status_2(tmp_path):
    site = FakeSite(tmp_path, "slurm", hosts=5)
    (site.bin / "module").unlink()
    result = site.run("neuron")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"MODULES={NEURON_MODULES} but this shell has no `module` command" \
        in result.stderr


def test_the_staged_copy_is_what_the_node_steps_run(tmp_path):
    """The planned unpack step, run for real (srun stub runs it on this host), turns the
    broadcast tar into STAGE_DIR; the staged python is the copy's own venv."""
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    (venv / "bin" / "cachex-agent").write_text("import sys\nprint(sys.prefix)\n")
    site = FakeSite(tmp_path, "slurm", hosts=3)
    stage_dir = tmp_path / "nvme" / "cachex-venv"
    stage_dir.parent.mkdir()
    steps = site.plan("frontier", CX_BIN=str(venv / "bin"), STAGE_DIR=str(stage_dir),
                      NODES="2", SPARES="1")
    subprocess.run(["tar", "-C", str(venv), "-cf", str(stage_dir) + ".tar", "."], check=True)
    site.execute(step(steps, "unpack"), CX_FAKE_EXEC="1")
    assert (stage_dir / ".cachex-staged").exists() and not Path(f"{stage_dir}.tar").exists()
    check = step(steps, "check")
    command = check[check.index(str(stage_dir / "bin" / "python")):]
    out = subprocess.run(command[:2], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.stdout.strip() == str(stage_dir), out.stderr
    # a directory there that is no staged copy is never replaced
    other = tmp_path / "nvme" / "mine"
    other.mkdir()
    (other / "keep").write_text("x")
    steps = site.plan("frontier", CX_BIN=str(venv / "bin"), STAGE_DIR=str(other),
                      NODES="2", SPARES="1")
    subprocess.run(["tar", "-C", str(venv), "-cf", f"{other}.tar", "."], check=True)
    with pytest.raises(subprocess.CalledProcessError):
        site.execute(step(steps, "unpack"), CX_FAKE_EXEC="1")
    assert (other / "keep").read_text() == "x"


def test_a_bad_exclude_list_ends_the_job_in_one_line(tmp_path):
    """cx_die inside $(...) ended only the subshell: the job went on without the list."""
    site = FakeSite(tmp_path, "slurm", hosts=5)
    result = site.run("neuron", EXCLUDE_NODES="n[001-")
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().splitlines()[-1].endswith(
        "EXCLUDE_NODES: cannot expand 'n[001-'"), result.stderr


def stub(site: FakeSite, name: str, body: str) -> None:
    (site.bin / name).write_text(f"#!/bin/bash\n{body}")
    (site.bin / name).chmod(0o755)


def test_the_halt_comes_from_the_time_left_not_from_the_controllers_clock(tmp_path,
                                                                          monkeypatch):
    """The end time (squeue %e, qstat's stime) is on the scheduler's clock: with that
    clock an hour ahead of this host's, the halt came an hour late."""
    site = FakeSite(tmp_path, "slurm", hosts=2)
    monkeypatch.setenv("PATH", site.env["PATH"])
    ahead = "$(date -d '+2 hours' +%Y-%m-%dT%H:%M:%S)"       # ends in 1 h, clock 1 h ahead
    stub(site, "squeue", f'case "$*" in *%e*) echo "{ahead}" ;; *%L*) echo 1:00:00 ;; esac\n')
    assert Slurm("42").time_left() == 3600
    stub(site, "squeue", "echo UNLIMITED\n")
    assert Slurm("42").time_left() is None and halt_window(None, 600) is None
    assert halt_window(3600, 600) == 3600
    with pytest.raises(ConfigError, match="HALT_MARGIN=600s leaves no time to train"):
        halt_window(300, 600)                                # less than HALT_MARGIN

    (tmp_path / "pbs").mkdir()
    pbs = FakeSite(tmp_path / "pbs", "pbs", hosts=2)
    stub(pbs, "qstat", 'echo "Job Id: 42.pbs"; echo "    stime = $(date -d \'-3 hours\')";'
                       ' echo "    Resource_List.walltime = 01:00:00";'
                       ' echo "    resources_used.walltime = 00:20:00"\n')
    monkeypatch.setenv("PATH", pbs.env["PATH"])
    assert Pbs("42.pbs").time_left() == 2400


def test_a_halt_margin_longer_than_the_job_ends_it_at_once_in_one_line(tmp_path):
    """Before any step runs on the nodes."""
    site = FakeSite(tmp_path, "slurm", hosts=1)
    stub(site, "squeue", "echo 0:30\n")
    result = site.run("local", CX_PLAN="0", CX_BIN=str(Path(sys.executable).parent),
                      WORKDIR=str(tmp_path / "w"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "HALT_MARGIN=60s leaves no time to train: the job ends in 30s"), result.stderr
    assert not site.calls()                     # no srun
