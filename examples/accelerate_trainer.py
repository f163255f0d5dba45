"""A Hugging Face Accelerate loop, unchanged, saving with `Accelerator.save_state` and
`ProjectConfiguration(automatic_checkpoint_naming=True)` into node-local spools.

Run under `mpiexec -n N` (CPU, gloo, DDP): each process plays one node (LOCAL_RANK 0)
and its project directory is its node's; Accelerate saves into
`<project>/checkpoints/checkpoint_<i>/`, which is the node's spool (`--spool` names it:
it must end in `checkpoints`). The main process writes the weights, optimizer,
scheduler and custom states; every process writes its own
`random_states_<process>.pkl`. The model has dropout, so a resume needs each process's
own RNG state back. `--stop-at` ends the run after that step's save, as a lost job
would; `--resume` goes through `Accelerator.load_state()`, which picks the newest
`checkpoint_<i>` of each node's own spool. The last line is the sha256 of the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True,
                   help="per-node spool template with {node}, ending in /checkpoints")
    p.add_argument("--port", type=int, required=True, help="gloo's rendezvous port")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="end after this step's save")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Counter:
    """A custom object registered with `register_for_checkpointing` (saved last, by the
    main process: `custom_checkpoint_0.pkl`)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=gen), torch.randn(4, 4, generator=gen)


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    # One process per virtual node: what torchrun would set on N single-GPU nodes.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    spool = Path(args.spool.format(node=rank))
    assert spool.name == "checkpoints", "Accelerate saves into <project>/checkpoints"
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(spool.parent), automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    start = 0
    if args.resume:
        accelerator.load_state()        # the newest checkpoint_<i> of this node's spool
        newest = max(int(re.fullmatch(r"checkpoint_(\d+)", p.name).group(1))
                     for p in spool.iterdir() if re.fullmatch(r"checkpoint_\d+", p.name))
        # Accelerate's own advice: set the iteration to go on from
        accelerator.project_configuration.iteration = newest + 1
        start = counter.seen
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.seen = step + 1
        if counter.seen % args.save_steps == 0:
            accelerator.save_state()
        if args.stop_at and counter.seen >= args.stop_at:
            break
    sha = hashlib.sha256()
    for tensor in accelerator.unwrap_model(model).state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"done: step {counter.seen} sha256 {sha.hexdigest()}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown, where torch's threads met C++ static
    # destructors after the final line ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
