"""A DeepSpeed training loop (ZeRO stage 2, CPU), unchanged, saving with
`engine.save_checkpoint` into node-local spools.

Run under `mpiexec -n N` with `DS_ACCELERATOR=cpu`: each process plays one node (its
LOCAL_RANK is 0) and joins the others through `deepspeed.init_distributed("gloo")`. A
small MLP is built in the script (nothing downloaded) and trained data parallel with
ZeRO stage 2 (optimizer states and gradients partitioned over the processes) and a
plain `torch.optim.Adam` passed in (`zero_allow_untested_optimizer`), so no DeepSpeed
optimizer op (FusedAdam, DeepSpeedCPUAdam) is built. Each save is
`engine.save_checkpoint(<the node's spool>)`: every rank writes its own
`global_stepN/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, rank 0 alone
`global_stepN/mp_rank_00_model_states.pt`, then, after a barrier, `latest` at the spool
root. `--resume` is DeepSpeed's own `engine.load_checkpoint(<spool>)`, which reads the
tag from the node's own `latest`. `--stop-at` ends the run after that step's save, as a
lost job would. The last line is the sha256 of the weights.

On the CPU accelerator DeepSpeed 0.19.8 builds one C++ op at start whatever the
configuration: deepspeed/comm/torch.py, `TorchBackend.__init__` calls `build_shm_op()`,
which JIT-compiles `ShareMemCommBuilder` (csrc/cpu/comm/shm*.cpp) through
torch.utils.cpp_extension (g++ and ninja), cached in `$TORCH_EXTENSIONS_DIR`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--port", type=int, required=True, help="gloo's rendezvous port")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="end after this step's save")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    # One process per virtual node: what the deepspeed launcher sets on N one-device
    # nodes. LOCAL_SIZE is the CPU accelerator's device count (else one per NUMA node).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # after the environment: its accelerator is chosen from it

    deepspeed.init_distributed(dist_backend="gloo")
    spool = os.path.abspath(args.spool.format(node=rank))
    torch.manual_seed(0)                    # the same initial weights on every process
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=config)
    if args.resume:
        path, _client = engine.load_checkpoint(spool)
        assert path is not None, f"no checkpoint named by {spool}/latest"
    while engine.global_steps < args.steps:
        # each process's own batch, a function of the step alone: a resumed run sees
        # what the uninterrupted one saw
        gen = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
        x, target = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        engine.backward(torch.nn.functional.mse_loss(engine(x), target))
        engine.step()
        if engine.global_steps % args.save_steps == 0:
            engine.save_checkpoint(spool)
            if args.stop_at and engine.global_steps >= args.stop_at:
                break
    sha = hashlib.sha256()
    for tensor in engine.module.state_dict().values():
        sha.update(tensor.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"done: step {engine.global_steps} sha256 {sha.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown, where torch's threads met C++ static
    # destructors after the final line ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
