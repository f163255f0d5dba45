"""A Lightning `Trainer` run with `ModelCheckpoint`, unchanged, saving into node-local
spools.

Run under `mpiexec -n N` (CPU, gloo, DDP): each process plays one node (NODE_RANK = its
rank, LOCAL_RANK 0) and its `ModelCheckpoint(dirpath=...)` is its node's spool. Lightning
saves on global rank 0 only, so node 0's spool alone gets `epoch=E-step=S.ckpt` and
`last.ckpt`; every rank reads the checkpoint on resume. `--stop-at` ends the run after
that epoch, as a lost job would; `--resume` passes `ckpt_path` = the node's own
`last.ckpt` (or `--ckpt NAME`) to `Trainer.fit`. The last line is the sha256 of the
weights.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--port", type=int, required=True, help="gloo's rendezvous port")
    p.add_argument("--epochs", type=int, default=4, help="of 2 steps each")
    p.add_argument("--every", type=int, default=2, help="epochs between saves")
    p.add_argument("--save-last", default="true", choices=["true", "link"])
    p.add_argument("--stop-at", type=int, default=0, help="end after this epoch's save")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds of each epoch's start spent waiting (time between saves)")
    p.add_argument("--ckpt", default="last.ckpt", help="file of the spool to resume from")
    return p.parse_args()


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, _index):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(count: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(count, 16, generator=gen), torch.randn(count, 4, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class StopAt(Callback):
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def on_train_epoch_end(self, trainer, *_args):  # type: ignore[no-untyped-def]
        # ModelCheckpoint's own epoch-end save still runs (callbacks run before it)
        if self.epochs and trainer.current_epoch + 1 >= self.epochs:
            trainer.should_stop = True


class Pace(Callback):
    """Time between saves, as real epochs take: each save under one name (`last.ckpt`)
    settles before the next replaces it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_start(self, *_args):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    # One process per virtual node: what a launcher sets on N single-device nodes.
    os.environ.update(WORLD_SIZE=str(world), NODE_RANK=str(rank), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    spool = args.spool.format(node=rank)
    save_last = "link" if args.save_last == "link" else True
    # Saved at epoch ends: Lightning restarts a mid-epoch resume at the epoch's first batch
    checkpoint = ModelCheckpoint(dirpath=spool, every_n_epochs=args.every,
                                 save_on_train_epoch_end=True, save_top_k=-1,
                                 save_last=save_last)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=world, max_epochs=args.epochs,
        strategy=DDPStrategy(process_group_backend="gloo",
                             cluster_environment=LightningEnvironment()),
        callbacks=[checkpoint, StopAt(args.stop_at), Pace(args.pause)], logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    model = Tiny()
    ckpt_path = os.path.join(spool, args.ckpt) if args.resume else None
    trainer.fit(model, data(2 * 4), ckpt_path=ckpt_path)
    sha = hashlib.sha256()
    for tensor in model.state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"done: step {trainer.global_step} sha256 {sha.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown, where torch's threads met C++ static
    # destructors after the final line ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
