"""A directory that behaves like a shared parallel file system under contention (root only).

    ThrottledPFS  a file-backed ext4 image (sparse, under `workdir`) on a loop device
                  (`losetup --direct-io=on`, so the image is not cached twice), mounted at
                  `.path`, and a cgroup v1 blkio group whose `blkio.throttle.write_bps_device`
                  caps the bytes per second that *its members together* write to that
                  device. A process outside the group writes to `.path` at disk speed; a
                  member waits in fsync (or in writeback it causes) until the throttle lets
                  its bios through, first come first served within the group. So a member is
                  one client of a PFS whose bandwidth every member shares.
    Contention    background writers: separate processes in that group, each writing files
                  of heavy-tailed sizes (Pareto or log-normal, capped) with write + fsync,
                  then an exponential think time, keeping only their newest few files;
                  with `burst` > 1, files come in bursts (a geometric number, mean
                  `burst`, back to back) and the think time is between bursts. A
                  checkpoint written by another member queues behind whatever they have in
                  flight, so its service time is heavy-tailed, as on a busy Lustre/GPFS.

Only the standard library is used (the benchmarks import this module from their own
directory, the tests through tests/conftest.py). Set-up takes a fraction of a second.
Everything is undone on exit, also after errors: writers stopped, file system unmounted
(lazily if busy), loop device detached, cgroup removed; the image is unlinked as soon as
it is attached, so the space returns when the device goes. Leftovers of a process that
died without cleaning up (its pid is in the names: `cachex-pfs-<pid>-<n>`) are removed by
the next ThrottledPFS.

    with ThrottledPFS(tmp_path, size="2GiB", write_bps=64 * MiB) as pfs, \\
            Contention(pfs, writers=2):
        proc = pfs.popen(["cachex-agent", "--config", cfg])     # inside the throttle
        ...                                                     # pfs.path is the PFS
        pfs.set_write_bps(None)                                 # lift it for a while

Processes started inside the group must be ended by whoever started them; close() moves
any still there back to the root group (so the cgroup can go) and unthrottles them.

    python benchmarks/contention.py demo [--workdir /tmp] [--bps 64MiB] [--seconds 20]

prints the writers' service times (a quick look at the distribution this makes).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

MiB = 1 << 20
BLKIO = Path("/sys/fs/cgroup/blkio")
PREFIX = "cachex-pfs"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-\d+$")
_IMAGE_RE = re.compile(rf"/{PREFIX}-(\d+)-\d+\.img(?: \(deleted\))?$")
_counter = itertools.count()
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": MiB, "mib": MiB,
          "mb": 1000 ** 2, "g": 1 << 30, "gib": 1 << 30, "gb": 1000 ** 3}


def parse_size(value: str | int | float) -> int:
    """`2GiB`, `64MiB`, `1.5GB`, `4096` or a number of bytes."""
    if isinstance(value, int | float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {value!r} (use e.g. 64MiB, 2GiB, 4096)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {result.returncode}: "
                           f"{result.stderr.strip()}")
    return result.stdout.strip()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why a ThrottledPFS cannot be made here (for pytest.skip), or None."""
    if os.geteuid() != 0:
        return "needs root (loop device, mount, cgroup)"
    if not (BLKIO / "blkio.throttle.write_bps_device").exists():
        return f"no cgroup v1 blkio throttle at {BLKIO}"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control"
    return None


def _empty_cgroup(cgroup: Path) -> None:
    """Move every process of `cgroup` to the root group and remove the cgroup."""
    for _ in range(50):
        try:
            pids = (cgroup / "cgroup.procs").read_text().split()
        except FileNotFoundError:
            return
        for pid in pids:
            try:
                (BLKIO / "cgroup.procs").write_text(pid)
            except OSError:
                pass                                        # exited meanwhile
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        time.sleep(0.02)                                    # a fork raced the move
    cgroup.rmdir()


def _mounts_of(device: str) -> list[str]:
    """Mount points of a block device, newest first (unescaped from /proc/mounts)."""
    points = []
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == device:
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                 fields[1]))
    return points[::-1]


def _umount(point: str) -> None:
    if subprocess.run(["umount", point], capture_output=True).returncode != 0:
        _run("umount", "-l", point)


def cleanup_stale() -> list[str]:
    """Remove cgroups, mounts and loop devices left by dead owners; return what went."""
    removed: list[str] = []
    if BLKIO.is_dir():
        for cgroup in BLKIO.glob(f"{PREFIX}-*"):
            match = _NAME_RE.match(cgroup.name)
            if match and not _alive(int(match.group(1))):
                try:
                    _empty_cgroup(cgroup)
                    removed.append(str(cgroup))
                except OSError as exc:
                    warnings.warn(f"stale {cgroup}: {exc}", stacklevel=2)
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            match = _IMAGE_RE.search(backing.read_text().strip())
        except OSError:
            continue
        if match is None or _alive(int(match.group(1))):
            continue
        device = f"/dev/{backing.parent.parent.name}"
        try:
            for point in _mounts_of(device):
                _umount(point)
                if Path(point).is_dir():
                    Path(point).rmdir()
            _run("losetup", "-d", device)
            removed.append(device)
        except (OSError, RuntimeError) as exc:
            warnings.warn(f"stale {device}: {exc}", stacklevel=2)
    return removed


class ThrottledPFS:
    """An ext4 file system on a loop device with a cgroup v1 write-bandwidth cap.

    `.path`: the mount point (`<workdir>/cachex-pfs-<pid>-<n>`); `.device`: "MAJ:MIN" of
    the loop device; `.cgroup`: the blkio group. `write_bps` None (or 0) means no cap.
    Use it as a context manager (or start() ... close()).
    """

    def __init__(self, workdir: str | os.PathLike[str], size: str | int = "2GiB",
                 write_bps: int | None = None, *, direct_io: bool = True) -> None:
        self.workdir = Path(workdir)
        self.size = parse_size(size)
        self.name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.path = self.workdir / self.name
        self.cgroup = BLKIO / self.name
        self.device = ""            # "MAJ:MIN", once started
        self.loop = ""              # /dev/loopN, once started
        self.direct_io = direct_io
        self._write_bps = write_bps or None
        self._mounted = False

    # ------------------------------------------------------------------ life cycle
    def start(self) -> ThrottledPFS:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"ThrottledPFS: {reason}")
        cleanup_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        image = self.workdir / f"{self.name}.img"
        try:
            with open(image, "wb") as handle:
                handle.truncate(self.size)
            _run("mkfs.ext4", "-q", "-F", "-m", "0",
                 "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard", str(image))
            options = ["--direct-io=on"] if self.direct_io else []
            self.loop = _run("losetup", "-f", "--show", *options, str(image))
            image.unlink()
            self.device = Path(f"/sys/block/{Path(self.loop).name}/dev").read_text().strip()
            self.path.mkdir()
            _run("mount", "-o", "noatime", self.loop, str(self.path))
            self._mounted = True
            self.cgroup.mkdir()
            self.set_write_bps(self._write_bps)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Undo everything start() did; safe to call twice and after a failed start."""
        problems: list[str] = []

        def attempt(what: str, action: Any) -> None:
            try:
                action()
            except (OSError, RuntimeError) as exc:
                problems.append(f"{what}: {exc}")

        if self.cgroup.is_dir():
            attempt("unthrottle", lambda: self.set_write_bps(None))
            attempt(f"remove {self.cgroup}", lambda: _empty_cgroup(self.cgroup))
        if self._mounted:
            attempt(f"umount {self.path}", lambda: _umount(str(self.path)))
            self._mounted = False
        if self.loop:
            attempt(f"losetup -d {self.loop}", lambda: _run("losetup", "-d", self.loop))
            self.loop = ""
        if self.path.is_dir():
            attempt(f"rmdir {self.path}", self.path.rmdir)
        image = self.workdir / f"{self.name}.img"
        if image.exists():
            attempt(f"rm {image}", image.unlink)
        if problems:
            warnings.warn("ThrottledPFS cleanup: " + "; ".join(problems), stacklevel=2)

    def __enter__(self) -> ThrottledPFS:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ throttle
    @property
    def write_bps(self) -> int | None:
        return self._write_bps

    def set_write_bps(self, bps: int | None) -> None:
        """Cap the group's writes to the device at `bps` bytes/s; None or 0 lifts the cap.
        Takes effect at once, also for bios already waiting in the throttle."""
        self._write_bps = int(bps) if bps else None
        (self.cgroup / "blkio.throttle.write_bps_device").write_text(
            f"{self.device} {self._write_bps or 0}")

    # ------------------------------------------------------------------ members
    def join(self, pid: int) -> None:
        """Put process `pid` (all its threads) into the throttled group; its children
        forked from now on are members too."""
        (self.cgroup / "cgroup.procs").write_text(str(pid))

    def leave(self, pid: int) -> None:
        """Move `pid` back to the root blkio group (unthrottled)."""
        (BLKIO / "cgroup.procs").write_text(str(pid))

    def members(self) -> list[int]:
        return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]

    def popen_args_prefix(self) -> list[str]:
        """Put this before an argv to run it inside the group (the shell joins, then execs):
        `subprocess.Popen(pfs.popen_args_prefix() + ["mpiexec", ...])`."""
        procs = str(self.cgroup / "cgroup.procs").replace("'", "'\\''")
        return ["sh", "-c", f"echo $$ > '{procs}' && exec \"$@\"", "sh"]

    def popen(self, argv: Sequence[str | os.PathLike[str]], **kwargs: Any
              ) -> subprocess.Popen[Any]:
        """subprocess.Popen(argv, **kwargs), the process and its children in the group."""
        return subprocess.Popen([*self.popen_args_prefix(), *map(str, argv)], **kwargs)


# ---------------------------------------------------------------------- background writers
@dataclass(frozen=True)
class Sample:
    """One file of a background writer: wall-clock end time, bytes, write+fsync seconds."""
    t: float
    size: int
    seconds: float


class Contention:
    """`writers` background writer processes inside `pfs`'s throttled group.

    File sizes: `dist` "pareto" (scale * Pareto(shape), i.e. at least `scale`, mean
    scale*shape/(shape-1) before the cap) or "lognormal" (median `scale`, sigma `shape`);
    capped at `max_size`. Each file: write in `chunk` pieces from a random buffer, fsync,
    close; then, with probability 1/`burst` (the burst ends), sleep Exp(mean `think` s).
    Each writer keeps its newest `keep` files in `<pfs.path>/.contention/w<i>/`. Writers
    exit on their own when their parent dies.
    """

    def __init__(self, pfs: ThrottledPFS, writers: int = 2, *, dist: str = "pareto",
                 scale: str | int = "8MiB", shape: float = 1.5,
                 max_size: str | int = "256MiB", think: float = 0.5, keep: int = 2,
                 chunk: str | int = "4MiB", seed: int = 0, burst: float = 1.0) -> None:
        if dist not in ("pareto", "lognormal"):
            raise ValueError(f"dist must be pareto or lognormal, not {dist!r}")
        self.pfs, self.writers, self.dist = pfs, writers, dist
        self.scale, self.shape = parse_size(scale), shape
        self.max_size, self.chunk = parse_size(max_size), parse_size(chunk)
        self.think, self.keep, self.seed = think, keep, seed
        self.burst = max(1.0, burst)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: Path | None = None
        self._samples: list[Sample] = []

    def start(self) -> Contention:
        self._logs = Path(tempfile.mkdtemp(prefix=f"{self.pfs.name}-writers-",
                                           dir=self.pfs.workdir))
        try:
            for i in range(self.writers):
                self.procs.append(self.pfs.popen(
                    [sys.executable, __file__, "writer",
                     "--dir", self.pfs.path / ".contention" / f"w{i}",
                     "--log", self._logs / f"w{i}.log", "--dist", self.dist,
                     "--scale", str(self.scale), "--shape", str(self.shape),
                     "--max-size", str(self.max_size), "--chunk", str(self.chunk),
                     "--think", str(self.think), "--keep", str(self.keep),
                     "--burst", str(self.burst),
                     "--seed", str(self.seed * 1000 + i), "--parent", str(os.getpid())],
                    stdin=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """End the writers (the cap is lifted meanwhile, so a writer waiting in fsync
        returns at once), delete their files, keep their samples."""
        bps = self.pfs.write_bps
        lifted = False
        if self.procs and self.pfs.cgroup.is_dir():
            try:
                self.pfs.set_write_bps(None)
                lifted = True
            except OSError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                warnings.warn(f"background writer {proc.pid} did not exit", stacklevel=2)
        self.procs = []
        if self._logs is not None:
            self._samples = self.samples()
            shutil.rmtree(self._logs, ignore_errors=True)
            self._logs = None
        shutil.rmtree(self.pfs.path / ".contention", ignore_errors=True)
        if lifted:
            try:
                self.pfs.set_write_bps(bps)
            except OSError:
                pass

    def samples(self) -> list[Sample]:
        """Every file written so far (also after stop()), by end time."""
        if self._logs is None:
            return list(self._samples)
        found = []
        for log in self._logs.glob("w*.log"):
            for line in log.read_text().splitlines():
                fields = line.split()
                if len(fields) == 3:
                    found.append(Sample(float(fields[0]), int(fields[1]), float(fields[2])))
        return sorted(found, key=lambda s: s.t)

    def __enter__(self) -> Contention:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def _draw(rng: random.Random, dist: str, scale: int, shape: float, cap: int) -> int:
    if dist == "pareto":
        size = scale * rng.paretovariate(shape)
    else:
        size = rng.lognormvariate(math.log(scale), shape)
    return max(4096, min(cap, int(size)))


def _writer(args: argparse.Namespace) -> int:
    """One background writer (runs inside the group; started by Contention)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rng = random.Random(args.seed)
    chunk = memoryview(os.urandom(args.chunk))
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    files: deque[Path] = deque()
    with open(args.log, "a", buffering=1) as log:
        for i in itertools.count():
            if os.getppid() != args.parent:
                return 0                                    # the harness is gone
            size = _draw(rng, args.dist, args.scale, args.shape, args.max_size)
            path = directory / f"f{i:07d}"
            start = time.monotonic()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    left = size
                    while left:
                        left -= os.write(fd, chunk[:min(left, len(chunk))])
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                path.unlink(missing_ok=True)
                while files:
                    files.popleft().unlink(missing_ok=True)
                time.sleep(0.1)
                continue
            log.write(f"{time.time():.6f} {size} {time.monotonic() - start:.6f}\n")
            files.append(path)
            while len(files) > args.keep:
                files.popleft().unlink(missing_ok=True)
            if args.think > 0 and rng.random() < 1 / args.burst:     # the burst ends
                time.sleep(rng.expovariate(1 / args.think))
    return 0


def _demo(args: argparse.Namespace) -> int:
    bps = parse_size(args.bps)
    started = time.monotonic()
    with ThrottledPFS(args.workdir, size=args.size, write_bps=bps) as pfs:
        made = time.monotonic() - started
        with Contention(pfs, writers=args.writers, dist=args.dist, shape=args.shape,
                        scale=args.scale, max_size=args.max_size, think=args.think,
                        burst=args.burst) as contention:
            time.sleep(args.seconds)
        samples = contention.samples()
        print(f"{pfs.path} on {pfs.loop} ({pfs.device}), cap {bps / MiB:.0f} MiB/s,"
              f" set up in {made:.2f}s; {len(samples)} files in {args.seconds:.0f}s")
    if samples:
        total = sum(s.size for s in samples)
        per_mib = sorted(s.seconds / (s.size / MiB) for s in samples)
        sizes = sorted(s.size / MiB for s in samples)
        seconds = sorted(s.seconds for s in samples)
        print(f"written {total / MiB:.0f} MiB ({total / MiB / args.seconds:.1f} MiB/s);"
              f" sizes MiB median {sizes[len(sizes) // 2]:.1f} max {sizes[-1]:.1f};"
              f" s/MiB median {per_mib[len(per_mib) // 2]:.4f} max {per_mib[-1]:.4f};"
              f" file seconds median {seconds[len(seconds) // 2]:.3f}"
              f" p99 {seconds[int(0.99 * (len(seconds) - 1))]:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    writer = sub.add_parser("writer", help="one background writer (used by Contention)")
    writer.add_argument("--dir", required=True)
    writer.add_argument("--log", required=True)
    writer.add_argument("--dist", default="pareto", choices=["pareto", "lognormal"])
    writer.add_argument("--scale", type=parse_size, default=8 * MiB)
    writer.add_argument("--shape", type=float, default=1.5)
    writer.add_argument("--max-size", type=parse_size, default=256 * MiB)
    writer.add_argument("--chunk", type=parse_size, default=4 * MiB)
    writer.add_argument("--think", type=float, default=0.5)
    writer.add_argument("--keep", type=int, default=2)
    writer.add_argument("--burst", type=float, default=1.0)
    writer.add_argument("--seed", type=int, default=0)
    writer.add_argument("--parent", type=int, required=True)
    demo = sub.add_parser("demo", help="a throttled PFS with writers for a while: stats")
    demo.add_argument("--workdir", default="/tmp")
    demo.add_argument("--size", default="2GiB")
    demo.add_argument("--bps", default="64MiB")
    demo.add_argument("--writers", type=int, default=2)
    demo.add_argument("--dist", default="pareto", choices=["pareto", "lognormal"])
    demo.add_argument("--seconds", type=float, default=20)
    demo.add_argument("--shape", type=float, default=1.5)
    demo.add_argument("--scale", type=parse_size, default=8 * MiB)
    demo.add_argument("--max-size", type=parse_size, default=256 * MiB)
    demo.add_argument("--think", type=float, default=0.5)
    demo.add_argument("--burst", type=float, default=1.0)
    args = parser.parse_args(argv)
    return _writer(args) if args.command == "writer" else _demo(args)


if __name__ == "__main__":
    sys.exit(main())
