"""An example MPI trainer that writes DCP-like checkpoints and knows nothing about cachex.

Run it under ``mpiexec -n N``. Each rank owns a float64 shard of a parameter vector and
updates it every step from a seeded generator keyed on (seed, step, rank) plus a global
norm, so the final state is a pure function of (seed, steps, world size, shard size) and
an interrupted-then-resumed run ends bit-identical to an uninterrupted one.

Checkpoint layout, per virtual node (node = rank // ranks_per_node):

    <spool(node)>/step_<NNNNN>/__<rank>_0.distcp   one per rank, written in place, in chunks
    <spool(0)>/step_<NNNNN>/.metadata              JSON, rank 0 only, tmp -> fsync -> rename

A shard file is a 64-byte header (``SHARD_HEADER``) followed by the raw little-endian
float64 parameters. Like PyTorch DCP, only ``.metadata`` is the commit marker: data files
are never written atomically, and ``.metadata`` lands only on the coordinator's node.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm

# magic, step, rank, world size, element count; padded so the data starts 64-byte aligned.
SHARD_MAGIC = b"CXTRAIN1"
SHARD_HEADER = struct.Struct("<8sQQQQ24x")
DTYPE = np.dtype("<f8")
METADATA = ".metadata"
METADATA_FORMAT = "cachex-example-trainer"
METADATA_VERSION = 1
STEP_DIR_RE = re.compile(r"^step_(\d{5,})$")
EXIT_RESUME_FAILED = 2

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """Parse ``4MiB``, ``512KiB``, ``1GiB`` or a plain byte count (binary units only)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4MiB, 512KiB, 1GiB)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def step_dir_name(step: int) -> str:
    return f"step_{step:05d}"


def shard_file_name(rank: int, part: int = 0) -> str:
    return f"__{rank}_{part}.distcp"


@dataclass(frozen=True)
class Layout:
    """Where every rank's files live; shared by writer, loader and --keep."""

    spool_template: str
    world_size: int
    ranks_per_node: int
    files_per_rank: int = 1

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def spool(self, node: int) -> Path:
        return Path(self.spool_template.format(node=node))

    def shard_path(self, step: int, rank: int, part: int = 0) -> Path:
        return (self.spool(self.node_of(rank)) / step_dir_name(step)
                / shard_file_name(rank, part))


# ---------------------------------------------------------------------------- model


def initial_params(seed: int, rank: int, count: int) -> np.ndarray:
    # The key differs from every step's key ([seed, step, rank] has three words).
    return np.random.default_rng([seed, rank]).standard_normal(count)


def global_norm(comm: Intracomm, params: np.ndarray, total_count: int) -> float:
    # allgather + fsum in rank order rather than allreduce(SUM): the MPI reduction order
    # may change with the algorithm MPICH picks, which would break bit-identical resume.
    partials = comm.allgather(float(np.dot(params, params)))
    return math.sqrt(math.fsum(partials) / total_count)


def train_step(
    comm: Intracomm, params: np.ndarray, seed: int, step: int, total_count: int
) -> np.ndarray:
    noise = np.random.default_rng([seed, step, comm.rank]).standard_normal(params.size)
    norm = global_norm(comm, params, total_count)
    # A decaying mix of the old state and noise damped by the global norm keeps values
    # bounded however long the run, and makes every rank depend on every other rank.
    return 0.99 * params + (0.1 / (1.0 + norm)) * noise


# ---------------------------------------------------------------------------- writing


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(
    path: Path,
    step: int,
    rank: int,
    world_size: int,
    params: np.ndarray,
    chunk_size: int,
    delay: float,
) -> dict[str, int]:
    """Write one shard in place, chunk by chunk, so a kill can leave it half-written."""
    header = SHARD_HEADER.pack(SHARD_MAGIC, step, rank, world_size, params.size)
    data = memoryview(np.ascontiguousarray(params, dtype=DTYPE)).cast("B")
    chunks = [header] + [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
    with open(path, "wb") as f:
        for i, chunk in enumerate(chunks):
            f.write(chunk)
            if delay > 0 and i + 1 < len(chunks):
                # Make the partial bytes visible to watchers while we "stall".
                f.flush()
                time.sleep(delay)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(header) + len(data), "crc32": zlib.crc32(data)}


def write_metadata(step_dir: Path, metadata: dict[str, Any]) -> None:
    tmp = step_dir / (METADATA + ".tmp")
    with open(tmp, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / METADATA)
    fsync_dir(step_dir)


def save_checkpoint(
    comm: Intracomm, layout: Layout, args: argparse.Namespace, step: int, params: np.ndarray
) -> None:
    rank = comm.rank
    shard_path = layout.shard_path(step, rank)
    shard_path.parent.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        # A marker left by an older run at this step would "commit" our half-written files.
        (shard_path.parent / METADATA).unlink(missing_ok=True)
    comm.Barrier()

    parts = np.array_split(params, layout.files_per_rank)
    info = [write_shard(layout.shard_path(step, rank, k), step, rank, comm.size, part,
                        args.chunk_size, args.write_delay) for k, part in enumerate(parts)]
    infos = comm.gather(info, root=0)
    comm.Barrier()

    if rank == 0:
        assert infos is not None
        shards = [
            {
                "rank": r,
                "part": k,
                "node": layout.node_of(r),
                "file": shard_file_name(r, k),
                "size": i["size"],
                "crc32": i["crc32"],
            }
            for r, rank_infos in enumerate(infos)
            for k, i in enumerate(rank_infos)
        ]
        total = sum(s["size"] for s in shards)
        metadata = {
            "format": METADATA_FORMAT,
            "version": METADATA_VERSION,
            "step": step,
            "world_size": comm.size,
            "ranks_per_node": layout.ranks_per_node,
            "nodes": layout.node_of(comm.size - 1) + 1,
            "seed": args.seed,
            "dtype": DTYPE.str,
            "shard_elements": int(params.size),
            "files_per_rank": layout.files_per_rank,
            "header_bytes": SHARD_HEADER.size,
            "total_bytes": total,
            "shards": shards,
        }
        write_metadata(shard_path.parent, metadata)
        print(f"checkpoint {step_dir_name(step)} committed ({total} bytes)", flush=True)
    # Nobody prunes or moves on until the commit marker exists.
    comm.Barrier()
    if args.keep > 0 and rank % layout.ranks_per_node == 0:
        prune_spool(layout.spool(layout.node_of(rank)), step, args.keep)


def list_step_dirs(spool: Path) -> list[tuple[int, Path]]:
    if not spool.is_dir():
        return []
    found = []
    for entry in spool.iterdir():
        match = STEP_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def prune_spool(spool: Path, committed_step: int, keep: int) -> None:
    """Keep the ``keep`` newest step dirs up to the one just committed; drop older ones.

    Dirs newer than ``committed_step`` are left alone: they are not ours to judge.
    """
    older = [p for s, p in list_step_dirs(spool) if s <= committed_step]
    for path in older[:-keep]:
        # Another node's leader may share this spool (template without {node}).
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- resuming


class ResumeError(Exception):
    pass


def find_newest_committed(spool: Path) -> tuple[int, dict[str, Any] | None]:
    for step, path in reversed(list_step_dirs(spool)):
        marker = path / METADATA
        if marker.is_file():
            try:
                return step, json.loads(marker.read_text())
            except (OSError, ValueError) as exc:
                # The marker is renamed into place, so a bad one is damage, not a race.
                raise ResumeError(f"rank 0: unreadable {marker}: {exc}") from exc
    return 0, None


def check_metadata(
    metadata: dict[str, Any], step: int, comm: Intracomm, layout: Layout, count: int
) -> None:
    expected = {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        "step": step,
        "world_size": comm.size,
        "ranks_per_node": layout.ranks_per_node,
        "shard_elements": count,
    }
    where = layout.spool(0) / step_dir_name(step) / METADATA
    for key, want in expected.items():
        if metadata.get(key) != want:
            raise ResumeError(
                f"rank 0: {where}: {key} is {metadata.get(key)!r}, this run needs {want!r}"
            )
    if metadata.get("files_per_rank", 1) != layout.files_per_rank:
        raise ResumeError(f"rank 0: {where}: files_per_rank is"
                          f" {metadata.get('files_per_rank', 1)}, this run needs"
                          f" {layout.files_per_rank}")
    shards = metadata.get("shards")
    ranks = [r for r in range(comm.size) for _ in range(layout.files_per_rank)]
    if not isinstance(shards, list) or [s.get("rank") for s in shards] != ranks:
        raise ResumeError(f"rank 0: {where}: shard list does not cover ranks 0..{comm.size - 1}")


def load_shard(
    path: Path, step: int, rank: int, world_size: int, entry: dict[str, Any]
) -> np.ndarray:
    try:
        blob = path.read_bytes()
    except FileNotFoundError as exc:
        raise ResumeError(f"rank {rank}: missing shard {path}") from exc
    except OSError as exc:
        raise ResumeError(f"rank {rank}: cannot read shard {path}: {exc.strerror}") from exc
    if len(blob) != entry["size"] or len(blob) < SHARD_HEADER.size:
        raise ResumeError(
            f"rank {rank}: shard {path} has {len(blob)} bytes, .metadata says {entry['size']}"
        )
    magic, h_step, h_rank, h_world, h_count = SHARD_HEADER.unpack_from(blob)
    if (magic, h_step, h_rank, h_world) != (SHARD_MAGIC, step, rank, world_size):
        raise ResumeError(
            f"rank {rank}: shard {path} header is for step {h_step} rank {h_rank} "
            f"world {h_world} (magic {magic!r}), expected step {step} rank {rank}"
        )
    data = memoryview(blob)[SHARD_HEADER.size :]
    if len(data) != h_count * DTYPE.itemsize:
        raise ResumeError(f"rank {rank}: shard {path} is truncated")
    if zlib.crc32(data) != entry["crc32"]:
        raise ResumeError(f"rank {rank}: shard {path} fails its crc32 check")
    return np.frombuffer(data, dtype=DTYPE).copy()


def resume(comm: Intracomm, layout: Layout, count: int) -> tuple[int, np.ndarray | None]:
    """Agree on the newest step committed on node 0 and load every rank's shard of it.

    Every failure is collected collectively, so all ranks exit together (never a hang).
    """
    found: tuple[int, dict[str, Any] | None, str | None] = (0, None, None)
    if comm.rank == 0:
        try:
            step, metadata = find_newest_committed(layout.spool(0))
            if metadata is not None:
                check_metadata(metadata, step, comm, layout, count)
            found = (step, metadata, None)
        except ResumeError as exc:
            found = (0, None, str(exc))
    step, metadata, error = comm.bcast(found, root=0)
    if error is None and metadata is None:
        return 0, None

    params = None
    if error is None:
        assert metadata is not None
        k = layout.files_per_rank
        try:
            params = np.concatenate([
                load_shard(layout.shard_path(step, comm.rank, part), step, comm.rank,
                           comm.size, metadata["shards"][comm.rank * k + part])
                for part in range(k)])
        except ResumeError as exc:
            error = str(exc)
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        if comm.rank == 0:
            for line in dict.fromkeys(errors):
                print(
                    f"error: resume failed: {line}",
                    file=sys.stderr,
                    flush=True,
                )
        sys.exit(EXIT_RESUME_FAILED)
    return step, params


# ---------------------------------------------------------------------------- main


def state_digest(comm: Intracomm, params: np.ndarray) -> str | None:
    """sha256 over every rank's shard in rank order; only rank 0 gets a value."""
    gathered = np.empty(params.size * comm.size, dtype=DTYPE) if comm.rank == 0 else None
    comm.Gather(np.ascontiguousarray(params, dtype=DTYPE), gathered, root=0)
    return None if gathered is None else hashlib.sha256(gathered.tobytes()).hexdigest()


def write_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True) + "\n")
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--spool",
        required=True,
        help="checkpoint root per node; {node} is replaced by rank // ranks-per-node",
    )
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--every", type=int, default=10, help="checkpoint every K steps (K > 0)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="ranks per virtual node")
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=1 << 20,
        help="bytes of float64 parameters per rank (KiB/MiB/GiB), default 1MiB",
    )
    p.add_argument(
        "--chunk-size",
        type=parse_size,
        default=256 << 10,
        help="bytes per write() of a shard, default 256KiB",
    )
    p.add_argument(
        "--write-delay",
        type=float,
        default=0.0,
        help="seconds to sleep between chunks of a shard (lets tests kill mid-write)",
    )
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step")
    p.add_argument(
        "--keep",
        type=int,
        default=0,
        help="after each commit keep only the N newest step dirs (0 = keep all)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--files-per-rank", type=int, default=1,
                   help="split each rank's state into this many shard files")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest step dir with .metadata in node 0's spool",
    )
    p.add_argument(
        "--state-out",
        type=Path,
        help="rank 0 writes {step, sha256 of all shards in rank order} here",
    )
    return p


def validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 0 or args.every <= 0 or args.ranks_per_node <= 0 or args.keep < 0:
        p.error("--steps/--keep must be >= 0, --every and --ranks-per-node > 0")
    if args.files_per_rank <= 0:
        p.error("--files-per-rank must be > 0")
    if args.shard_size <= 0 or args.shard_size % DTYPE.itemsize:
        p.error(f"--shard-size must be a positive multiple of {DTYPE.itemsize} bytes")
    if args.chunk_size <= 0:
        p.error("--chunk-size must be > 0")
    try:
        args.spool.format(node=0)
    except (KeyError, IndexError, ValueError) as exc:
        p.error(f"--spool template {args.spool!r}: only {{node}} may be used ({exc})")


def abort_on_uncaught(comm: Intracomm) -> None:
    # One rank dying on an exception would leave the others blocked in a collective.
    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        sys.__excepthook__(kind, value, tb)
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook


def wheel_mpich() -> bool:
    """The PyPI `mpich` wheel is installed, so mpi4py loads its libmpi."""
    import importlib.metadata
    try:
        importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(parser, args)

    # The PyPI MPICH's default network module can hang MPI_Init under srun --mpi=pmi2
    # across nodes (docs/jobs.md): a trainer on that MPI picks OFI unless told otherwise.
    if os.environ.get("SLURM_MPI_TYPE") == "pmi2" and wheel_mpich():
        os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
    # Imported here so that parse_size and friends can be imported without starting MPI.
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    abort_on_uncaught(comm)
    layout = Layout(args.spool, comm.size, args.ranks_per_node, args.files_per_rank)
    count = args.shard_size // DTYPE.itemsize

    start, params = resume(comm, layout, count) if args.resume else (0, None)
    if params is None:
        params = initial_params(args.seed, comm.rank, count)
    if comm.rank == 0:
        origin = f"resumed from {step_dir_name(start)}" if start else "starting from step 0"
        print(f"{origin}: {comm.size} ranks, {args.ranks_per_node} per node", flush=True)

    step = start
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_time)
        params = train_step(comm, params, args.seed, step, count * comm.size)
        if step % args.every == 0:
            save_checkpoint(comm, layout, args, step, params)
    final_step = max(step, start)

    digest = state_digest(comm, params)
    if comm.rank == 0:
        print(f"done: step {final_step} sha256 {digest}", flush=True)
        if args.state_out is not None:
            write_state(
                args.state_out,
                {
                    "step": final_step,
                    "world_size": comm.size,
                    "shard_bytes": args.shard_size,
                    "sha256": digest,
                },
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
