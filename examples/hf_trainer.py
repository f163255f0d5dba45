"""A Hugging Face `transformers.Trainer` run, unchanged, checkpointing into node-local
spools with `save_on_each_node=True`.

Run under `mpiexec -n N` (CPU, gloo): each process plays one node (its LOCAL_RANK is 0,
so every process is a node's saving process) and its `output_dir` is its node's spool.
A tiny GPT-2 is built from a config (nothing downloaded) and trained on a synthetic
dataset. `--stop-at` ends the run after that step's save, as a lost job would; `--resume`
goes through the Trainer's own `resume_from_checkpoint=True`, which picks the newest
`checkpoint-N/` of each node's own spool. The last line is the sha256 of the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--port", type=int, required=True, help="gloo's rendezvous port")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="end after this step's save")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class Tokens(torch.utils.data.Dataset):
    """Deterministic synthetic token sequences (the same on every process)."""

    def __init__(self, count: int, length: int = 16, vocab: int = 64) -> None:
        gen = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, vocab, (count, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.step and state.global_step >= self.step:
            control.should_training_stop = True
        return control


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    # One process per virtual node: what torchrun would set on N single-GPU nodes.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    spool = args.spool.format(node=rank)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    training = TrainingArguments(
        output_dir=spool, save_on_each_node=True, save_strategy="steps",
        save_steps=args.save_steps, max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, use_cpu=True, report_to=[], logging_steps=1000, seed=0,
        dataloader_num_workers=0, ddp_backend="gloo", disable_tqdm=True)
    trainer = Trainer(model=model, args=training,
                      train_dataset=Tokens(args.steps * 4 * world),
                      callbacks=[StopAt(args.stop_at)])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    sha = hashlib.sha256()
    for tensor in trainer.model.state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"done: step {trainer.state.global_step} sha256 {sha.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown, where torch's threads met C++ static
    # destructors after the final line ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
