"""A JAX training loop with Orbax's `CheckpointManager`, unchanged, saving into
node-local spools.

Run under `mpiexec -n N` (CPU): each process plays one node and joins the others through
`jax.distributed.initialize` (gloo collectives on CPU). Data parallel: the parameters are
global arrays replicated over the processes' devices, each batch is sharded over them
and the jitted step averages the gradients. Each process's `CheckpointManager` writes
into its own node's spool, set up as Orbax sets up its own node-local checkpoints
(orbax/checkpoint/experimental/emergency/checkpoint_manager.py,
`_local_checkpoint_handler`): `MultiprocessingOptions(primary_host=None)` ("all hosts
are only working with local storage") and an `ArrayHandler(primary_host=None,
replica_id=None)`, so every host writes its own full replica of the step and renames its
own `<step>.orbax-checkpoint-tmp` directory to `<step>`, the hosts meeting on barriers.
`--stop-at` ends the run after that step's save, as a lost job would; `--resume`
restores the manager's `latest_step()` from the node's own spool. The last line is the
sha256 of the parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spool", required=True, help="per-node spool template with {node}")
    p.add_argument("--port", type=int, required=True, help="jax.distributed's coordinator port")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="end after this step's save")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def init_params() -> dict[str, np.ndarray]:
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": np.asarray(jax.random.normal(key1, (16, 32)) * 0.1),
            "b1": np.zeros(32, np.float32),
            "w2": np.asarray(jax.random.normal(key2, (32, 4)) * 0.1),
            "b2": np.zeros(4, np.float32)}


def loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


@jax.jit
def train_step(params: dict[str, jax.Array], x: jax.Array,
               y: jax.Array) -> dict[str, jax.Array]:
    grads = jax.grad(loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)


def batch(step: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's slice of step `step`'s batch (the same on every run)."""
    rng = np.random.default_rng(1000 + step)
    x, y = rng.standard_normal((4 * world, 16)), rng.standard_normal((4 * world, 4))
    part = slice(4 * rank, 4 * (rank + 1))
    return x[part].astype(np.float32), y[part].astype(np.float32)


def node_local_manager(directory: str, save_steps: int) -> ocp.CheckpointManager:
    hosts = ocp.options.MultiprocessingOptions(primary_host=None)
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                   use_replica_parallel=False)))
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=hosts,
                                          type_handler_registry=registry)
    options = ocp.CheckpointManagerOptions(save_interval_steps=save_steps,
                                           multiprocessing_options=hosts)
    return ocp.CheckpointManager(directory, options=options, item_handlers=handler)


def main() -> None:
    args = parse()
    rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=world, process_id=rank)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    sharded = NamedSharding(mesh, PartitionSpec("data"))

    def to_global(tree, sharding):  # type: ignore[no-untyped-def]
        return jax.tree.map(lambda a: jax.make_array_from_process_local_data(sharding, a),
                            tree)

    manager = node_local_manager(os.path.abspath(args.spool.format(node=rank)),
                                 args.save_steps)
    state = to_global({"params": init_params(), "step": np.asarray(0, np.int32)},
                      replicated)
    if args.resume and manager.latest_step() is not None:
        state = manager.restore(manager.latest_step(),
                                args=ocp.args.PyTreeRestore(state))
    step = int(state["step"])
    while step < args.steps:
        params = train_step(state["params"], *to_global(batch(step, rank, world), sharded))
        step += 1
        state = {"params": params,
                 "step": to_global(np.asarray(step, np.int32), replicated)}
        manager.save(step, args=ocp.args.PyTreeSave(state))
        if args.stop_at and step >= args.stop_at:
            break
    manager.wait_until_finished()
    manager.close()
    sha = hashlib.sha256()
    for name in sorted(state["params"]):
        sha.update(np.asarray(state["params"][name].addressable_data(0)).tobytes())
    if rank == 0:
        print(f"done: step {step} sha256 {sha.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
