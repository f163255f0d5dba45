"""A fake site to submit a template's usage line to, as written: a private mount
namespace whose root holds the host's /usr and /etc, this checkout and its Python, and
the site's own file systems (project directories, node-local disks, a private
/dev/shm and /tmp), each a directory of the test's; the user's login profile puts the
site's scheduler commands on PATH and defines `module` (ALCF's and Lmod's `module` is a
shell function a login shell defines). The scheduler is fake_scheduler.py; the first
launch of a job step (srun, mpiexec) records its command line and fails, which ends the
job there: what came before it ran for real. Needs root (a mount namespace); nothing
outside the test's directory is written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from stubs import ROOT, SCONTROL, TEMPLATES

HERE = Path(__file__).resolve().parent
USER = "u"
HOME = f"/home/{USER}"

# a launcher: its command line (and whether MPICH_GPU_SUPPORT_ENABLED reached it) into
# the log; srun and mpiexec then fail: the first launch is where the fake job ends
RECORD = r'''#!/bin/bash
{ printf '%s' "${0##*/}"; printf ' %q' "$@"
  printf ' | MPICH_GPU_SUPPORT_ENABLED=%s\n' "${MPICH_GPU_SUPPORT_ENABLED-unset}"
} >>/fakesite/calls.log
'''
PROFILE = r'''export PATH=/fakesite/bin:$PATH
module() {
    { printf 'module'; printf ' %q' "$@"; printf '\n'; } >>/fakesite/calls.log
}
export -f module
'''


@dataclass
class Site:
    name: str
    scheduler: str                      # pbs | slurm
    host_pattern: str
    dirs: tuple[str, ...]               # the site's file systems, made empty
    venv: str                           # where the site's docs put the environment
    down: dict[str, str] = field(default_factory=dict)   # host -> the job it failed in


SITES = {
    "polaris": Site("polaris", "pbs", "x3001c0s{}b0n0", ("/lus/eagle/projects/MYPROJECT",
                    "/local/scratch"), "/lus/eagle/projects/MYPROJECT/u/envs/cachex"),
    "aurora": Site("aurora", "pbs", "x4001c0s{}b0n0", ("/lus/flare/projects/MYPROJECT",),
                   "/lus/flare/projects/MYPROJECT/u/envs/cachex"),
    "frontier": Site("frontier", "slurm", "n{:03d}", ("/ccs/proj/abc123",
                     "/lustre/orion/abc123/scratch/u", "/mnt/bb/u"),
                     "/ccs/proj/abc123/u/envs/cachex"),
    "neuron": Site("neuron", "slurm", "n{:03d}", ("/scratch/u",),
                   "/scratch/u/.conda/envs/cachex"),
}


def usage_line(template: str) -> str:
    """The submission the template's header shows (`#   [cd DIR &&] qsub|sbatch ...`)."""
    text = TEMPLATES[template].read_text()
    match = re.search(r"^#   ((?:cd \S+ && )?(?:qsub|sbatch) .*?)(?:\s+#.*)?$", text, re.M)
    assert match, f"{template}: no usage line"
    return match.group(1)


@dataclass
class Submitted:
    said: subprocess.CompletedProcess[str]      # the usage line's own output
    calls: list[str]                            # modules and launches, in order
    output: str                                 # the job's output file ("" if none)
    status: int | None                          # the job's exit status (None: not run)

    def launches(self) -> list[list[str]]:
        return [shlex.split(c.split(" | ")[0]) for c in self.calls
                if c.startswith(("srun ", "mpiexec ", "sbcast "))]


class FakeSite:
    def __init__(self, tmp: Path, site: str) -> None:
        self.tmp, self.site = tmp, SITES[site]
        self.fake = tmp / "fakesite"
        self.home = tmp / "home" / USER

    def _populate(self) -> None:
        bin_ = self.fake / "bin"
        bin_.mkdir(parents=True)
        for name in ("srun", "mpiexec", "mpirun"):
            self._script(bin_ / name, RECORD + "exit 1\n")
        self._script(bin_ / "sbcast", RECORD)
        self._script(bin_ / "sinfo", "#!/bin/sh\nexit 0\n")
        self._script(bin_ / "scontrol", SCONTROL)
        for name in ("qsub", "qstat", "pbsnodes", "sbatch", "squeue"):
            self._script(bin_ / name, f'#!/bin/bash\nexec {sys.executable} /fakesite/'
                                      f'fake_scheduler.py {name} "$@"\n')
        for name in ("fake_scheduler.py", "site_rules.py"):
            (self.fake / name).write_text((HERE / name).read_text())
        (self.fake / "site.json").write_text(json.dumps(
            {"name": self.site.name, "user": USER, "home": HOME,
             "host_pattern": self.site.host_pattern}))
        (self.fake / "down.json").write_text(json.dumps(self.site.down))
        self.home.mkdir(parents=True)
        (self.home / ".bash_profile").write_text(PROFILE)
        (self.home / "cachex-agent").symlink_to(ROOT)

    @staticmethod
    def _script(path: Path, text: str) -> None:
        path.write_text(text)
        path.chmod(0o755)

    def _venv(self, root: Path) -> None:
        """The user's environment where the site's docs put it: the package's commands
        (this checkout's venv) and its python; small, so that packing it is quick."""
        venv = root / self.site.venv.lstrip("/")
        (venv / "bin").mkdir(parents=True)
        (venv / "lib" / "python3" / "site-packages").mkdir(parents=True)
        real = Path(sys.executable).parent
        for name in ("cachex", "cachex-agent"):
            self._script(venv / "bin" / name, f'#!/bin/sh\nexec {real / name} "$@"\n')
        (venv / "bin" / "python").symlink_to(sys.executable)

    def _mount_script(self, command: str) -> str:
        """A shell script that builds the fake root in a private mount namespace and
        runs `command` there as the user's login shell would."""
        root = self.tmp / "root"
        root.mkdir()
        binds = {"/usr": "/usr", "/etc": "/etc", "/proc": "/proc", "/sys": "/sys",
                 "/dev": "/dev", "/fakesite": str(self.fake), "/home": str(self.tmp / "home")}
        for path in {str(ROOT), sys.prefix, sys.base_prefix,
                     str(Path(sys.executable).resolve().parent.parent)}:
            binds[path] = path
        for d in self.site.dirs:
            host = self.tmp / "fs" / d.lstrip("/")
            host.mkdir(parents=True, exist_ok=True)
            binds[d] = str(host)
        top = {d.split("/")[1] for d in binds}
        self._venv(self.tmp / "fs")
        lines = ["set -e", f"R={shlex.quote(str(root))}", 'mount -t tmpfs cxroot "$R"']
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}") and link not in top:
                lines.append(f'ln -s {shlex.quote(os.readlink(f"/{link}"))} "$R/{link}"')
        for target, source in sorted(binds.items(), key=lambda kv: kv[0].count("/")):
            lines += [f'mkdir -p "$R{target}"', f'mount --rbind {shlex.quote(source)} "$R{target}"']
        # a checkout under /tmp (CI's may be) is bound in already: /tmp exists then
        lines += ['mount -t tmpfs shm "$R/dev/shm"', 'mkdir -p "$R/tmp"', 'chmod 1777 "$R/tmp"']
        login = ["env", "-i", f"HOME={HOME}", f"USER={USER}", f"LOGNAME={USER}", "TERM=dumb",
                 "PATH=/usr/bin:/bin", "bash", "-l", "-c", f"cd {HOME} && {command}"]
        lines.append(f'exec chroot "$R" {shlex.join(login)}')
        return "\n".join(lines)

    def submit(self, command: str, home_files: dict[str, str] | None = None) -> Submitted:
        """Run `command` (a usage line) at the fake site, with `home_files` in the user's
        home; what it and its job did."""
        self._populate()
        for name, text in (home_files or {}).items():
            (self.home / name).write_text(text)
        said = subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork",
                               "bash", "-c", self._mount_script(command)],
                              capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        log = self.fake / "calls.log"
        calls = log.read_text().splitlines() if log.exists() else []
        exits = list((self.fake / "jobs").glob("*.exit")) if (self.fake / "jobs").exists() else []
        outputs = [p for p in (self.tmp / "fs").rglob("*")
                   if p.is_file() and re.search(r"(\.o\d+|\.out)$", p.name)]
        outputs += [p for p in self.home.glob("*") if re.search(r"(\.o\d+|\.out)$", p.name)]
        return Submitted(said, calls, outputs[0].read_text() if outputs else "",
                         int(exits[0].read_text()) if exits else None)
