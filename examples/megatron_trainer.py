"""A tensor- or data-parallel training loop checkpointing with Megatron-Core's
`dist_checkpointing` (the `torch_dist` format) into node-local spools, with the tracker
Megatron-LM's training loop writes.

Run under `mpiexec -n N` (CPU, gloo): each process plays one node. With `--parallel
tensor` (the default) each holds its shard of a 2-layer MLP (the first layer split by
rows, the second by columns, as Megatron's column- and row-parallel linear layers; the
partial outputs are summed with `all_reduce`), with SGD momentum buffers sharded the
same way. With `--parallel data` every process holds the whole model, a replica
(`replica_id` = its data-parallel rank), trains on its own batch and averages the
gradients with `all_reduce`; `--fully-parallel` then saves and loads through
Megatron-Core's `FullyParallelSaveStrategyWrapper` / `FullyParallelLoadStrategyWrapper`
over the data-parallel group, what Megatron-LM's `--ckpt-fully-parallel-save` /
`--ckpt-fully-parallel-load` select. Each save is what
megatron/training/checkpointing.py `save_checkpoint` does for `torch_dist`: rank 0
creates `<save>/iter_NNNNNNN/`, every rank calls `dist_checkpointing.save` with its
sharded state dict, a barrier, then rank 0 writes `latest_checkpointed_iteration.txt`.
`<save>` is each node's own spool. `--resume` reads the tracker of the node's own spool
and `dist_checkpointing.load`s that iteration, as `load_checkpoint` does. `--stop-at`
ends the run after that iteration's save, as a lost job would. The last line is the
sha256 of the full weights (gathered; with data parallelism every replica's are checked
equal first).

megatron-core 0.16.1's `torch_dist` save calls `torch.cuda.synchronize()`
(strategies/filesystem_async.py, `preload_tensors`) and
`torch.cuda.current_device()` (strategies/state_dict_saver.py,
`save_state_dict_async_finalize`) unconditionally: a CPU-only torch raises "Torch not
compiled with CUDA enabled" there. `--cuda-calls-on-cpu` redirects those two calls
(`synchronize` does nothing, `current_device` names the CPU) so that its save and load
run unchanged otherwise on a CPU-only machine. The load wrapper's default exchange
(`broadcast`) allocates CUDA tensors (exchange_utils.py,
`_get_empty_tensor_for_exchange`); on the CPU the trainer selects the wrapper's
`gather_object` exchange, which moves the same tensors over the process group and
reads the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--port", type=int, required=True, help="gloo's rendezvous port")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="end after this iteration's save")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--parallel", choices=("tensor", "data"), default="tensor")
    p.add_argument("--fully-parallel", action="store_true",
                   help="save and load through Megatron-Core's fully parallel wrappers")
    p.add_argument("--cuda-calls-on-cpu", action="store_true",
                   help="let megatron-core's CUDA-only calls run on a CPU-only torch")
    return p.parse_args()


def cuda_calls_on_cpu() -> None:
    torch.cuda.synchronize = lambda *_args, **_kwargs: None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]


class Shards:
    """This rank's part of the model and of the optimizer's momentum: a tensor-parallel
    shard (`dp` = 1) or a data-parallel replica of the whole (`tp` = 1)."""

    def __init__(self, rank: int, world: int, parallel: str, hidden: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)        # the same full weights everywhere
        w1, w2 = torch.randn(hidden, 8, generator=gen), torch.randn(4, hidden, generator=gen)
        self.tp, self.dp = (world, 1) if parallel == "tensor" else (1, world)
        self.tp_rank, self.dp_rank = (rank, 0) if parallel == "tensor" else (0, rank)
        # every rank creates every group (torch.distributed.new_group's contract)
        self.tp_group = self._my_group(world, by_tp=True)
        self.dp_group = self._my_group(world, by_tp=False)
        rows = hidden // self.tp
        sl = slice(self.tp_rank * rows, (self.tp_rank + 1) * rows)
        self.w1 = (w1[sl] * 0.3).requires_grad_()
        self.w2 = (w2[:, sl] * 0.3).requires_grad_()
        self.m1, self.m2 = torch.zeros_like(self.w1), torch.zeros_like(self.w2)

    def _my_group(self, world: int, by_tp: bool):  # type: ignore[no-untyped-def]
        # with 2 kinds of parallelism and one of them of size 1, a group is either
        # the whole world or a rank alone
        size = self.tp if by_tp else self.dp
        if size == world:
            return dist.new_group(list(range(world)))
        mine = None
        for r in range(world):
            group = dist.new_group([r])
            if r == dist.get_rank():
                mine = group
        return mine

    def sharded_state_dict(self, iteration: int):  # type: ignore[no-untyped-def]
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        def shard(key: str, tensor: torch.Tensor, axis: int) -> ShardedTensor:
            offsets = ((axis, self.tp_rank, self.tp),) if self.tp > 1 else ()
            return ShardedTensor.from_rank_offsets(key, tensor.detach(), *offsets,
                                                   replica_id=self.dp_rank)
        return {"model": {"fc1.weight": shard("model.fc1.weight", self.w1, 0),
                          "fc2.weight": shard("model.fc2.weight", self.w2, 1)},
                "optimizer": {"fc1.momentum": shard("optimizer.fc1.momentum", self.m1, 0),
                              "fc2.momentum": shard("optimizer.fc2.momentum", self.m2, 1)},
                "iteration": iteration}

    def load(self, state) -> None:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            self.w1.copy_(state["model"]["fc1.weight"])
            self.w2.copy_(state["model"]["fc2.weight"])
        self.m1.copy_(state["optimizer"]["fc1.momentum"])
        self.m2.copy_(state["optimizer"]["fc2.momentum"])

    def step(self, iteration: int) -> None:
        # one batch per data-parallel rank; with dp = 1 the seed is the same as before
        gen = torch.Generator().manual_seed(1000 + iteration * self.dp + self.dp_rank)
        x, target = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        partial = torch.relu(x @ self.w1.T) @ self.w2.T
        out = partial.detach().clone()
        if self.tp > 1:
            dist.all_reduce(out, group=self.tp_group)     # the row-parallel layer's sum
        partial.backward(2 * (out - target) / out.numel())
        with torch.no_grad():
            for weight, momentum in ((self.w1, self.m1), (self.w2, self.m2)):
                if self.dp > 1:                           # data parallel: mean gradient
                    dist.all_reduce(weight.grad, group=self.dp_group)
                    weight.grad /= self.dp
                momentum.mul_(0.9).add_(weight.grad)
                weight.sub_(0.05 * momentum)
                weight.grad = None

    def digest(self) -> str:
        full = [self.w1.detach(), self.w2.detach()]
        if self.tp > 1:
            parts = [[torch.empty_like(t) for _ in range(self.tp)] for t in full]
            for gathered, t in zip(parts, full, strict=True):
                dist.all_gather(gathered, t, group=self.tp_group)
            full = [torch.cat(parts[0], 0), torch.cat(parts[1], 1)]
        sha = hashlib.sha256()
        for t in full:
            sha.update(t.contiguous().numpy().tobytes())
        digest = sha.hexdigest()
        if self.dp > 1:                 # replicas that drifted apart are a failed resume
            every: list[str | None] = [None] * self.dp
            dist.all_gather_object(every, digest, group=self.dp_group)
            if len(set(every)) != 1:
                raise SystemExit(f"data-parallel replicas differ: {every}")
        return digest


def strategies(shards: Shards, directory: str, fully_parallel: bool, saving: bool):  # type: ignore[no-untyped-def]
    """None (megatron's defaults) or the fully parallel wrapper over the data-parallel
    group, as megatron/training/checkpointing.py builds them for
    --ckpt-fully-parallel-save / --ckpt-fully-parallel-load."""
    if not fully_parallel:
        return None
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    if saving:
        return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                                shards.dp_group)
    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(directory),
                                            shards.dp_group, exchange_algo="gather_object")


def save(shards: Shards, save_dir: str, iteration: int, fully_parallel: bool) -> None:
    from megatron.core import dist_checkpointing
    directory = os.path.join(save_dir, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:        # the other ranks' writers create their own
        os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(shards.sharded_state_dict(iteration), directory,
                            strategies(shards, directory, fully_parallel, saving=True))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, TRACKER), "w") as tracker:
            tracker.write(str(iteration))


def resume(shards: Shards, save_dir: str, fully_parallel: bool) -> int:
    from megatron.core import dist_checkpointing
    try:
        with open(os.path.join(save_dir, TRACKER)) as tracker:
            iteration = int(tracker.read().strip())
    except FileNotFoundError:
        return 0
    directory = os.path.join(save_dir, f"iter_{iteration:07d}")
    state = dist_checkpointing.load(shards.sharded_state_dict(0), directory,
                                    strategies(shards, directory, fully_parallel,
                                               saving=False))
    shards.load(state)
    return int(state["iteration"])


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo")
    if args.cuda_calls_on_cpu:
        cuda_calls_on_cpu()
    save_dir = os.path.abspath(args.spool.format(node=rank))
    shards = Shards(rank, world, args.parallel)
    iteration = resume(shards, save_dir, args.fully_parallel) if args.resume else 0
    while iteration < args.iters:
        shards.step(iteration)
        iteration += 1
        if iteration % args.save_interval == 0:
            save(shards, save_dir, iteration, args.fully_parallel)
            if args.stop_at and iteration >= args.stop_at:
                break
    digest = shards.digest()
    if rank == 0:
        print(f"done: step {iteration} sha256 {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
