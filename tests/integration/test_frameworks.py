"""The failure drill on the frameworks' own trainers, unchanged (the `[frameworks]`
extra): Hugging Face `transformers.Trainer`, Accelerate's `save_state`, Lightning
`Trainer` + `ModelCheckpoint`, Orbax `CheckpointManager` on JAX CPU, Megatron-Core
`dist_checkpointing` and DeepSpeed ZeRO stage 2 on its CPU accelerator; CPU, 2 processes
in 2 virtual nodes, each saving into its own node's spool.
Agents run beside them with `commit.rule = "auto"`; then node 0 is lost (its spool,
stage and NVMe wiped, the PFS moved away), `cachex recover` rebuilds it from node 1's
replicas, the framework's own resume reads each node's spool, and the final weights equal
those of an uninterrupted run."""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import BIN, MPIEXEC, ROOT, files_of, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
COMMIT = 'settle = "0.5s"\ntimeout = "60s"'


DONE = re.compile(r"done: step \d+ sha256 ([0-9a-f]{64})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(example: str, root, *args: str, timeout: float = 300, spool: str = "spool"
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "examples" / example),
         "--spool", f"{root}/node{{node}}/{spool}", "--port", str(free_port()), *args],
        capture_output=True, text=True, timeout=timeout)


def train(example: str, root, *args: str, timeout: float = 300, spool: str = "spool") -> str:
    """Run examples/<example> on 2 processes; the sha256 of its final weights."""
    result = run_example(example, root, *args, timeout=timeout, spool=spool)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # rank 0's report; mpiexec interleaves the ranks' output, so the other rank's text
    # may come before it on the same line, or after it
    done = DONE.findall(result.stdout)
    assert len(done) == 1, result.stdout[-2000:]
    return done[0]


def lose_node0_and_recover(c, *ckpts: str) -> None:
    kill_tree(c.agents)                                 # node 0 is lost ...
    shutil.rmtree(c.root / "node0")
    c.spool(0).mkdir(parents=True)
    os.rename(c.pfs, c.root / "pfs-gone")               # ... and the PFS is down
    c.pfs.write_text("down")
    for ckpt in ckpts:
        result = subprocess.run([str(MPIEXEC), "-n", "2", str(BIN / "cachex"), "recover",
                                 "--config", str(c.config), "--ckpt", ckpt],
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "from replica on node 1" in result.stdout, result.stdout


def rules_shown(c) -> dict[str, str]:
    shown = c.cachex("status").stdout
    rules = {row["id"]: row.get("rule") for row in c.status()["checkpoints"]}
    assert all(rule in shown for rule in rules.values()), shown
    return rules


def test_hf_trainer_drill(cluster, tmp_path):
    c = cluster(nodes=2, rule="auto", commit=COMMIT)
    c.start_agents()
    # save_on_each_node=True: both nodes write checkpoint-N/, node 0 alone the weights
    train("hf_trainer.py", c.root, "--steps", "8", "--save-steps", "2", "--stop-at", "4")
    c.wait_level("checkpoint-4", "flushed", timeout=120)
    assert rules_shown(c) == {"checkpoint-2": "hf", "checkpoint-4": "hf"}
    ckpt = "checkpoint-4"
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert not (c.root / "node1" / name).exists()
        assert (c.spool(1) / ckpt / name).read_bytes() == (c.spool(0) / ckpt / name).read_bytes()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (c.spool(0) / ckpt).iterdir()}
    before = {n: files_of(c.spool(n) / ckpt) for n in range(2)}
    assert "rng_state_0.pth" in before[0] and "rng_state_1.pth" in before[1]

    lose_node0_and_recover(c, ckpt)
    for node in range(2):
        assert files_of(c.spool(node) / ckpt) == before[node]
    assert {p.name: stat.S_IMODE(p.stat().st_mode)
            for p in (c.spool(0) / ckpt).iterdir()} == modes

    resumed = train("hf_trainer.py", c.root, "--steps", "8", "--save-steps", "2",
                    "--resume")
    reference = train("hf_trainer.py", tmp_path / "reference", "--steps", "8",
                      "--save-steps", "2")
    assert resumed == reference


ACCELERATE_SPOOL = "project/checkpoints"      # save_state's <project_dir>/checkpoints


def test_accelerate_drill(cluster, tmp_path):
    c = cluster(nodes=2, rule="auto", commit=COMMIT, spool=ACCELERATE_SPOOL)
    c.start_agents()
    # the main process (node 0) alone writes the weights, optimizer, scheduler and the
    # registered object's state; each process its own random_states_<process>.pkl
    train("accelerate_trainer.py", c.root, "--steps", "8", "--save-steps", "2",
          "--stop-at", "4", spool=ACCELERATE_SPOOL)
    c.wait_level("checkpoint_1", "flushed", timeout=120)
    assert rules_shown(c) == {"checkpoint_0": "accelerate", "checkpoint_1": "accelerate"}
    ckpt = "checkpoint_1"
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin",
                 "custom_checkpoint_0.pkl"):                # mirrored: every process loads it
        assert (c.spool(1) / ckpt / name).read_bytes() == (c.spool(0) / ckpt / name).read_bytes()
    before = {n: files_of(c.spool(n) / ckpt) for n in range(2)}
    assert "random_states_0.pkl" not in before[1] and "random_states_1.pkl" not in before[0]
    assert "random_states_1.pkl" in before[1]

    lose_node0_and_recover(c, ckpt)
    for node in range(2):
        assert files_of(c.spool(node) / ckpt) == before[node]

    # load_state() picks the newest checkpoint_<i> of each node's own spool
    resumed = train("accelerate_trainer.py", c.root, "--steps", "8", "--save-steps", "2",
                    "--resume", spool=ACCELERATE_SPOOL)
    reference = train("accelerate_trainer.py", tmp_path / "reference", "--steps", "8",
                      "--save-steps", "2", spool=ACCELERATE_SPOOL)
    assert resumed == reference


def test_lightning_drill(cluster, tmp_path):
    c = cluster(nodes=2, rule="auto", commit=COMMIT)
    c.start_agents()
    # Lightning saves on global rank 0 only: node 1's spool gets nothing from it
    train("lightning_trainer.py", c.root, "--epochs", "4", "--every", "2", "--stop-at", "2")
    names = ("epoch=1-step=4.ckpt", "last.ckpt")
    for name in names:
        c.wait_level(name, "flushed", timeout=120)
    assert rules_shown(c) == dict.fromkeys(names, "torch")
    saved = {name: (c.spool(0) / name).read_bytes() for name in names}
    for name in names:                                  # mirrored: every rank loads it
        assert (c.spool(1) / name).read_bytes() == saved[name]
    mode = stat.S_IMODE((c.spool(0) / "last.ckpt").stat().st_mode)

    lose_node0_and_recover(c, *names)
    for node in range(2):
        assert {n: (c.spool(node) / n).read_bytes() for n in names} == saved
    assert stat.S_IMODE((c.spool(0) / "last.ckpt").stat().st_mode) == mode

    resumed = train("lightning_trainer.py", c.root, "--epochs", "4", "--every", "2",
                    "--resume")
    reference = train("lightning_trainer.py", tmp_path / "reference", "--epochs", "4",
                      "--every", "2")
    assert resumed == reference


def test_orbax_drill(cluster, tmp_path):
    """Orbax `CheckpointManager` on JAX CPU: 2 processes of one `jax.distributed` job in
    2 virtual nodes, each host writing its own replica into its node's spool
    (`primary_host=None`, Orbax's setting for node-local storage)."""
    c = cluster(nodes=2, rule="auto", commit=COMMIT)
    c.start_agents()
    train("orbax_trainer.py", c.root, "--steps", "8", "--save-steps", "2", "--stop-at", "4")
    c.wait_level("4", "flushed", timeout=120)
    rules = rules_shown(c)
    assert "4" in rules and set(rules.values()) == {"orbax"}, rules
    ckpt = "4"
    before = {n: files_of(c.spool(n) / ckpt) for n in range(2)}
    for node in range(2):                    # every host's own part, under the final name
        assert {"commit_success.txt", "_CHECKPOINT_METADATA", "default/_METADATA",
                f"default/ocdbt.process_{node}/manifest.ocdbt"} <= set(before[node])
        assert not [p for p in c.spool(node).iterdir() if "orbax-checkpoint-tmp" in p.name]
    # each host's files are its own (every host writes every one): none is mirrored
    merged = [{f for f in before[n] if f.startswith("default/d/")} for n in range(2)]
    assert merged[0] and merged[1] and merged[0].isdisjoint(merged[1]), merged

    lose_node0_and_recover(c, ckpt)
    for node in range(2):
        assert files_of(c.spool(node) / ckpt) == before[node]

    resumed = train("orbax_trainer.py", c.root, "--steps", "8", "--save-steps", "2",
                    "--resume")
    reference = train("orbax_trainer.py", tmp_path / "reference", "--steps", "8",
                      "--save-steps", "2")
    assert resumed == reference


NO_CUDA = "Torch not compiled with CUDA enabled"


def test_megatron_core_unchanged_on_a_cpu_only_torch_stops_in_its_own_save(tmp_path):
    """Why the drill redirects two CUDA calls: megatron-core 0.16.1's
    `dist_checkpointing.save` calls torch.cuda unconditionally. On a CPU-only torch (as
    here) the unchanged save must fail there, in megatron's code, with torch's own error;
    with CUDA present it must save."""
    import torch
    result = run_example("megatron_trainer.py", tmp_path, "--iters", "2",
                         "--save-interval", "2")
    if torch.cuda.is_available():
        assert result.returncode == 0, result.stderr[-3000:]
        return
    assert result.returncode != 0 and NO_CUDA in result.stderr, result.stderr[-3000:]
    frames = re.findall(r'megatron/core/([\w/]+\.py)", line \d+, in \w+', result.stderr)
    assert any(f.startswith("dist_checkpointing/") for f in frames), result.stderr[-3000:]


def distcp_files_named(ckpt_dir: Path) -> set[str]:
    """The `__R_T.distcp` files DCP's `.metadata` says hold a chunk (torch's own reader:
    torch/distributed/checkpoint/filesystem.py, `FileSystemReader.read_metadata`)."""
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    return {item.relative_path for item in metadata.storage_data.values()}


MEGATRON_PARALLEL = {
    # each rank writes and reads its own shards
    "tensor": ("--parallel", "tensor"),
    # the same tensors on both nodes (replica_id = data-parallel rank); Megatron-Core's
    # fully parallel wrappers split the save between the replicas and give each rank
    # the same share to load, the rest over the process group
    "data": ("--parallel", "data", "--fully-parallel"),
}


@pytest.mark.parametrize("parallel", list(MEGATRON_PARALLEL))
def test_megatron_core_drill(cluster, tmp_path, parallel):
    """Megatron-Core `dist_checkpointing.save/load` (torch_dist), gloo, 2 processes in 2
    virtual nodes, with Megatron-LM's tracker, tensor-parallel or data-parallel (fully
    parallel save and load); its two CUDA calls redirected to the CPU
    (examples/megatron_trainer.py --cuda-calls-on-cpu), the drill runs on the layout its
    own save writes."""
    c = cluster(nodes=2, rule="auto", commit=COMMIT)
    args = ("--iters", "8", "--save-interval", "2", "--cuda-calls-on-cpu",
            *MEGATRON_PARALLEL[parallel])
    # the uninterrupted run shares nothing with the drill: it runs beside it
    reference = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "examples" / "megatron_trainer.py"),
         "--spool", f"{tmp_path}/reference/node{{node}}/spool", "--port", str(free_port()),
         *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)                 # kill_tree signals its group
    try:
        c.start_agents()
        first = run_example("megatron_trainer.py", c.root, *args, "--stop-at", "4")
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
        ckpt, tracker = "iter_0000004", "latest_checkpointed_iteration.txt"
        c.wait_level(ckpt, "flushed", timeout=120)
        assert rules_shown(c) == {"iter_0000002": "megatron", ckpt: "megatron"}
        # rank 0 alone wrote these; every rank's load reads them: mirrored to node 1
        for name in ("common.pt", "metadata.json", ".metadata"):
            assert ((c.spool(1) / ckpt / name).read_bytes()
                    == (c.spool(0) / ckpt / name).read_bytes())
        assert (c.spool(1) / tracker).read_text() == "4"
        before = {n: files_of(c.spool(n) / ckpt) for n in range(2)}
        own = [{f for f in before[n] if f.endswith(".distcp")} for n in range(2)]
        # each node holds only its own rank's files, and each holds chunks
        for node in range(2):
            assert own[node] and all(f.startswith(f"__{node}_") for f in own[node]), own
        assert distcp_files_named(c.spool(0) / ckpt) == own[0] | own[1]

        lose_node0_and_recover(c, ckpt)
        for node in range(2):
            assert files_of(c.spool(node) / ckpt) == before[node]
            assert (c.spool(node) / tracker).read_text().strip() == "4"

        resumed = train("megatron_trainer.py", c.root, *args, "--resume")
        out, err = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            kill_tree(reference)
    assert reference.returncode == 0, out[-2000:] + err[-3000:]
    assert DONE.findall(out) == [resumed]


# DeepSpeed's CPU accelerator JIT-compiles its shared-memory comm op on every start
# (examples/deepspeed_trainer.py): once per venv, under the venv, so a new torch
# gets a new build
DS_OPS = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions"),
          "DS_ACCELERATOR": "cpu"}
ZERO_STATES = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"     # each rank's own


@pytest.mark.timeout(1200)      # the first run compiles: measured 1.5 to 4 min here
def test_deepspeed_drill(cluster, tmp_path, monkeypatch):
    """DeepSpeed 0.19.8, ZeRO stage 2 on its CPU accelerator (gloo), 2 processes in 2
    virtual nodes, each rank's `engine.save_checkpoint(<its node's spool>)`; resume by
    DeepSpeed's own `engine.load_checkpoint(<spool>)`."""
    for name, value in DS_OPS.items():
        monkeypatch.setenv(name, value)
    args = ("--steps", "8", "--save-steps", "2")
    # the uninterrupted run first: it builds the op before any agent waits on it
    reference = train("deepspeed_trainer.py", tmp_path / "reference", *args, timeout=900)

    c = cluster(nodes=2, rule="auto", commit=COMMIT)
    c.start_agents()
    train("deepspeed_trainer.py", c.root, *args, "--stop-at", "4")
    ckpt = "global_step4"
    c.wait_level(ckpt, "flushed", timeout=120)
    assert rules_shown(c) == {"global_step2": "deepspeed", ckpt: "deepspeed"}
    # rank 0 alone wrote the model states and `latest`; every rank's load reads them
    model = "mp_rank_00_model_states.pt"
    wait_for(lambda: (c.spool(1) / "latest").is_file(), 60, "`latest` mirrored to node 1")
    assert (c.spool(1) / "latest").read_text() == ckpt
    assert (c.spool(1) / ckpt / model).read_bytes() == (c.spool(0) / ckpt / model).read_bytes()
    before = {n: files_of(c.spool(n) / ckpt) for n in range(2)}
    assert set(before[0]) == {model, ZERO_STATES.format(rank=0)}
    assert set(before[1]) == {model, ZERO_STATES.format(rank=1)}
    # its converters go to the spool root, beside `latest`, not into the tag
    assert (c.spool(0) / "zero_to_fp32.py").is_file()

    lose_node0_and_recover(c, ckpt)
    for node in range(2):
        assert files_of(c.spool(node) / ckpt) == before[node]
        assert (c.spool(node) / "latest").read_text().strip() == ckpt
    assert not (c.spool(0) / "global_step2").exists()    # node 0 lost it: not recovered

    resumed = train("deepspeed_trainer.py", c.root, *args, "--resume")
    assert resumed == reference


@pytest.mark.timeout(900)       # the op's build, when this runs before the drill
def test_deepspeed_writes_latest_before_the_other_ranks_files(tmp_path, monkeypatch):
    """Why the `deepspeed` rule has each node check its own part: in DeepSpeed's
    `save_checkpoint`, rank 0 writes `latest` before the barrier. Rank 1's optimizer
    states go into a FIFO that nobody reads, so its write cannot finish: `latest` still
    appears, naming the step, while rank 1 is held in its own save."""
    for name, value in DS_OPS.items():
        monkeypatch.setenv(name, value)
    held = tmp_path / "node1" / "spool" / "global_step2" / ZERO_STATES.format(rank=1)
    held.parent.mkdir(parents=True)
    os.mkfifo(held)
    trainer = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "examples" / "deepspeed_trainer.py"),
         "--spool", f"{tmp_path}/node{{node}}/spool", "--port", str(free_port()),
         "--steps", "2", "--save-steps", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        latest = tmp_path / "node0" / "spool" / "latest"
        wait_for(lambda: latest.is_file() and latest.read_text() == "global_step2"
                 or trainer.poll() is not None, 840, "rank 0's `latest`")
        assert trainer.poll() is None, trainer.communicate()[0].decode()[-3000:]
        # rank 1 has not written a byte yet: its FIFO was never opened for reading
        with open(held, "rb") as fifo:
            states = fifo.read()
        assert states.startswith(b"PK")                 # torch.save's zip, now complete
        out, _ = trainer.communicate(timeout=120)
        assert trainer.returncode == 0, out.decode()[-3000:]
    finally:
        if trainer.poll() is None:
            kill_tree(trainer)
