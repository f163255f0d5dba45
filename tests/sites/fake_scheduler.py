"""The fake site's scheduler commands, one program: `fake_scheduler.py qsub|qstat|
pbsnodes|sbatch|squeue ARGS`. Run inside the fake site (tests/sites/fake_site.py), where
/fakesite/site.json names the site. qsub and sbatch read the job script's directives,
let the command line override them, refuse what the site's scheduler refuses
(site_rules.py) and otherwise run the job at once, in the foreground, as the scheduler
would start it: PBS with a fresh login environment (its PBS_* variables and what -v
passes, in $HOME, through the script's #! line); Slurm with the submitting environment
(--export=ALL) in the submit directory. The job's output goes where the scheduler puts
it (PBS: <name>.o<seq> in the submit directory; Slurm: --output)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import site_rules

SITE = Path("/fakesite")
JOBS = SITE / "jobs"
SEQ = 4242


def config() -> dict:
    return json.loads((SITE / "site.json").read_text())


def readable(script: Path, command: str) -> bool:
    if script.is_file():
        return True
    print(f"{command}: error: unable to open file {script}: No such file or directory",
          file=sys.stderr)
    return False


def directives(script: Path, prefix: str) -> list[str]:
    """The words of the script's directives, up to its first command line."""
    words: list[str] = []
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            if line.strip():
                break
            continue
        if line.startswith(prefix + " "):
            words += shlex.split(line[len(prefix) + 1:], comments=True)
    return words


def interpreter(script: Path) -> list[str]:
    first = script.read_text().splitlines()[0]
    return first[2:].split() if first.startswith("#!") else ["/bin/bash"]


# ---------------------------------------------------------------- PBS
def pbs_options(words: list[str], opts: dict[str, str]) -> list[str]:
    """qsub's options into opts (resources by name); the words left (the script)."""
    rest = []
    it = iter(words)
    for word in it:
        if word in ("-A", "-q", "-N", "-j", "-r", "-k", "-o", "-e", "-v", "-W"):
            value = next(it)
            if word == "-v":
                opts["-v"] = ",".join(filter(None, (opts.get("-v", ""), value)))
            else:
                opts[word] = value
        elif word == "-l":
            for item in next(it).split(","):
                key, _, value = item.partition("=")
                opts[key] = value
        elif word in ("-V", "-I"):
            opts[word] = "1"
        else:
            rest.append(word)
    return rest


def submission(command: str, args: list[str], parse, prefix: str, refusal
               ) -> tuple[Path, dict[str, str]] | None:
    """The job script and its options: its directives, then the command line's (which
    win); None (after the scheduler's line) when there is no readable script or the
    site's rules (`refusal(options)`: why not, or None) refuse it."""
    given: dict[str, str] = {}
    rest = parse(args, given)
    if len(rest) != 1:
        print(f"{command}: error: usage: {command} [options] script", file=sys.stderr)
        return None
    script = Path(rest[0])
    if not readable(script, command):
        return None
    opts: dict[str, str] = {}
    parse(directives(script, prefix), opts)
    opts = {**opts, **given}
    refused = refusal(opts)
    if refused:
        print(refused, file=sys.stderr)
        return None
    return script, opts


def qsub(args: list[str]) -> int:
    site = config()
    submitted = submission("qsub", args, pbs_options, "#PBS",
                           lambda opts: site_rules.pbs_refusal(site["name"], opts))
    if submitted is None:
        return 1
    script, opts = submitted
    job = f"{SEQ}.{site['name']}-pbs-01"
    nodes = site_rules.select_nodes(opts["select"])
    JOBS.mkdir(exist_ok=True)
    nodefile = JOBS / f"{job}.nodes"
    nodefile.write_text("".join(f"{h}\n" for h in hosts(site, nodes)))
    (JOBS / f"{job}.json").write_text(json.dumps(
        {"account": opts["-A"], "walltime": opts["walltime"], "nodes": nodes}))
    print(job)
    name = opts.get("-N", script.name)
    env = login_env(site)
    env.update(PBS_JOBID=job, PBS_JOBNAME=name, PBS_NODEFILE=str(nodefile),
               PBS_O_WORKDIR=os.getcwd(), PBS_O_HOME=env["HOME"], PBS_ENVIRONMENT="PBS_BATCH")
    if opts.get("-V"):
        env = {**os.environ, **env}
    for item in filter(None, opts.get("-v", "").split(",")):
        key, _, value = item.partition("=")
        env[key] = value if _ else os.environ.get(key, "")
    out = Path(os.getcwd()) / f"{name}.o{SEQ}"
    return run_job(interpreter(script) + [str(script)], env, env["HOME"], out, job)


def login_env(site: dict) -> dict[str, str]:
    """What PBS gives a job before its shell's profile: the user, no more."""
    return {"HOME": site["home"], "USER": site["user"], "LOGNAME": site["user"],
            "SHELL": "/bin/bash", "PATH": "/usr/bin:/bin"}


def qstat(args: list[str]) -> int:
    job = args[-1]
    path = JOBS / f"{job}.json"
    if "-f" not in args or not path.exists():
        print(f"qstat: Unknown Job Id {job}", file=sys.stderr)
        return 1
    info = json.loads(path.read_text())
    print(f"Job Id: {job}\n    Account_Name = {info['account']}\n"
          f"    Resource_List.walltime = {info['walltime']}\n"
          "    resources_used.walltime = 00:00:00")
    return 0


def pbsnodes(args: list[str]) -> int:
    """-l: the nodes down or offline, with the job that had them; -v HOST: its state."""
    down = json.loads((SITE / "down.json").read_text()) if (SITE / "down.json").exists() else {}
    if args[:1] == ["-l"]:
        for host, job in down.items():
            print(f"{host:<20} offline,down         node down: communication closed"
                  f" (job {job})")
        return 0
    host = args[-1]
    print(f"{host}\n     Mom = {host}\n     state = {'down' if host in down else 'free'}")
    return 0


# ---------------------------------------------------------------- Slurm
SHORT = {"-A": "--account", "-p": "--partition", "-N": "--nodes", "-t": "--time",
         "-J": "--job-name", "-C": "--constraint", "-o": "--output"}
FLAGS = ("--no-kill", "--exclusive")


def slurm_options(words: list[str], opts: dict[str, str]) -> list[str]:
    rest = []
    it = iter(words)
    for word in it:
        if word in SHORT:
            opts[SHORT[word]] = next(it)
        elif word in FLAGS:
            opts[word] = "1"
        elif word.startswith("--") and "=" in word:
            key, _, value = word.partition("=")
            opts[key] = value
        elif word.startswith("-"):
            opts[word] = next(it)
        else:
            rest.append(word)
    return rest


def sbatch(args: list[str]) -> int:
    site = config()
    submitted = submission("sbatch", args, slurm_options, "#SBATCH", lambda opts: (
        site_rules.slurm_refusal(site["name"], opts, os.getcwd(), site["user"])))
    if submitted is None:
        return 1
    script, opts = submitted
    nodes = int(opts.get("--nodes", "1"))
    job = str(SEQ)
    JOBS.mkdir(exist_ok=True)
    (JOBS / f"{job}.json").write_text(json.dumps(
        {"time": opts.get("--time", "1:00:00"), "nodes": nodes}))
    print(f"Submitted batch job {job}")
    name = opts.get("--job-name", script.name)
    env = dict(os.environ)               # sbatch --export=ALL, its default
    env.update(SLURM_JOB_ID=job, SLURM_JOB_NAME=name, SLURM_SUBMIT_DIR=os.getcwd(),
               SLURM_JOB_NODELIST=f"n[001-{nodes:03d}]", SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_ACCOUNT=opts.get("--account", "").lower(),
               SLURM_JOB_PARTITION=opts.get("--partition", ""))
    output = opts.get("--output", "slurm-%j.out").replace("%x", name).replace("%j", job)
    return run_job(interpreter(script) + [str(script)], env, os.getcwd(),
                   Path(os.getcwd()) / output, job)


def squeue(args: list[str]) -> int:
    """-o %L: the job's time left (its whole --time: it has just started); %N: its nodes."""
    if "--steps" in args or "-j" not in args:
        return 0
    info = json.loads((JOBS / f"{args[args.index('-j') + 1]}.json").read_text())
    fmt = args[args.index("-o") + 1] if "-o" in args else ""
    if fmt == "%L":
        print(info["time"])
    elif fmt == "%N":
        print(f"n[001-{info['nodes']:03d}]")
    return 0


# ---------------------------------------------------------------- both
def hosts(site: dict, count: int) -> list[str]:
    return [site["host_pattern"].format(i) for i in range(1, count + 1)]


def run_job(argv: list[str], env: dict[str, str], cwd: str, out: Path, job: str) -> int:
    with out.open("w") as log:
        rc = subprocess.run(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, timeout=240).returncode
    (JOBS / f"{job}.exit").write_text(f"{rc}\n")
    return 0


COMMANDS = {"qsub": qsub, "qstat": qstat, "pbsnodes": pbsnodes, "sbatch": sbatch,
            "squeue": squeue}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
