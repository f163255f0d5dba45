"""A PyTorch trainer that checkpoints with Distributed Checkpoint (DCP), unchanged.

Run under `mpiexec -n N` (CPU, gloo). Each virtual node (rank // ranks_per_node) saves
into its own spool directory, as on a machine with node-local NVMe: DCP writes
`.metadata` only into the coordinator's directory, and with
`DefaultSavePlanner(dedup_save_to_lowest_rank=True)` the replicated model lands in
`__0_0.distcp` of rank 0. Resume goes through DCP's own `load` from each rank's own
node directory, so it needs those two files on every node: what cachex mirrors
(`commit.globals = ["__0_0.distcp"]`) and what `cachex recover` restores.

Each rank also holds a shard of a tensor sharded over all ranks (a DTensor, `Shard(0)`),
so every rank's file carries data of its own. DCP reshards it on `load`: resumed with
another number of ranks (after `cachex recover` onto another node count), each rank reads
the pieces of its new shard from whichever files hold them. Onto another node count,
`cachex recover --to DIR` restores the checkpoint once into DIR, a directory every rank
reads (any rank may read any file, and which ones is DCP's plan): `--load-from DIR`
resumes from there; new checkpoints still go into the spools.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

STEP_DIR = re.compile(r"^step_(\d+)$")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--rendezvous", required=True, help="a file path for gloo's file store")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--global-size", type=int, default=196608,
                   help="floats of the tensor sharded over the ranks")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--load-from", type=Path, help="resume from this directory every rank"
                   " reads (`cachex recover --to DIR`), not from each node's spool")
    return p.parse_args()


def build(world: int, global_size: int) -> tuple[torch.nn.Module, DTensor]:
    torch.manual_seed(0)            # the same replicated model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.arange(global_size, dtype=torch.float64), mesh,
                                [Shard(0)])
    return model, sharded


def train_step(model: torch.nn.Module, sharded: DTensor, step: int, rank: int,
               world: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for param in model.parameters():
            dist.all_reduce(param.grad)                 # data parallel: average gradients
            param -= 0.01 * param.grad / world
        local = sharded.to_local()                      # this rank's shard, in place
        local.mul_(0.99).add_(torch.randn(local.shape, generator=gen, dtype=torch.float64))


def state_of(model: torch.nn.Module, sharded: DTensor, step: int) -> dict:
    return {"model": model.state_dict(), "sharded": sharded, "step": torch.tensor(step)}


def newest_committed(spool: Path) -> int:
    steps = [int(m.group(1)) for p in spool.glob("step_*")
             if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return max(steps, default=0)


def digest(model: torch.nn.Module, sharded: DTensor) -> str:
    """Of the model and the whole sharded tensor: the same whatever the world size."""
    sha = hashlib.sha256()
    for tensor in [*model.state_dict().values(), sharded.full_tensor()]:
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.rendezvous}", rank=rank,
                            world_size=world)
    spool = Path(args.spool.format(node=rank // args.ranks_per_node))
    model, sharded = build(world, args.global_size)
    start = 0
    if args.resume:
        source = args.load_from or spool
        found = [newest_committed(args.load_from or Path(args.spool.format(node=0)))]
        dist.broadcast_object_list(found, src=0)
        start = found[0]
        if start:
            state = state_of(model, sharded, 0)     # DCP loads the shards in place
            dcp.load(state, storage_reader=FileSystemReader(source / f"step_{start:05d}"))
            model.load_state_dict(state["model"])
            if rank == 0:
                print(f"resumed from step_{start:05d} with dcp.load on {world} ranks",
                      flush=True)
    for step in range(start + 1, args.steps + 1):
        train_step(model, sharded, step, rank, world)
        if step % args.every == 0:
            target = spool / f"step_{step:05d}"
            dcp.save(state_of(model, sharded, step), storage_writer=FileSystemWriter(target),
                     planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
            if rank == 0:
                print(f"checkpoint step_{step:05d} saved", flush=True)
    final = digest(model, sharded)
    if rank == 0:
        print(f"done: step {args.steps} sha256 {final}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # every checkpoint is saved and every line flushed: leave without the interpreter's
    # teardown, where torch's threads met C++ static destructors ("terminate called
    # without an active exception", exit 9 after the final sha256 was printed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
