"""The framework rules against the layouts each framework's own save function writes
(reproduced from its code, cited in stage/rules.py): what commits, what is global,
what `auto` calls it."""

from __future__ import annotations

import os
from pathlib import Path

from cachex_agent.stage.rules import (
    AutoRule,
    DeepSpeedRule,
    HfRule,
    MegatronRule,
    OrbaxRule,
    TorchFileRule,
    detect_kind,
    tracker_text,
)


def write(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hf_marker_own_marker_and_globals(tmp_path):
    ckpt = tmp_path / "checkpoint-10"
    for name in ("model.safetensors", "config.json", "optimizer.pt", "rng_state_0.pth"):
        write(ckpt / name)
    rule = HfRule()
    assert rule.committed(tmp_path) == [] and rule.own_marker(ckpt) == "trainer_state.json"
    write(ckpt / "trainer_state.json")
    assert rule.committed(tmp_path) == ["checkpoint-10"]
    assert "rng_state_0.pth" not in rule.global_files(ckpt)
    assert {"model.safetensors", "trainer_state.json"} <= set(rule.global_files(ckpt))
    # a node that only holds its RNG state (no save_on_each_node) waits for no marker
    other = write(tmp_path / "n1" / "checkpoint-10" / "rng_state_1.pth").parent
    assert rule.own_marker(other) is None and detect_kind(other) == "hf"


def test_megatron_tracker_and_torch_dist(tmp_path):
    rule = MegatronRule()
    write(tmp_path / "iter_0000004" / "common.pt")
    write(tmp_path / "iter_0000004" / "__0_0.distcp")
    write(tmp_path / "iter_0000008" / "__0_0.distcp")
    assert rule.committed(tmp_path) == []
    write(tmp_path / "iter_0000004" / "metadata.json")      # dist_checkpointing.save, last
    assert rule.committed(tmp_path) == ["iter_0000004"]
    write(tmp_path / "latest_checkpointed_iteration.txt", b"8")
    assert rule.committed(tmp_path) == ["iter_0000004", "iter_0000008"]
    assert rule.root_entries(tmp_path, "iter_0000008") == ["latest_checkpointed_iteration.txt"]
    assert rule.root_entries(tmp_path, "iter_0000004") == []
    assert rule.global_files(tmp_path / "iter_0000004") == ["common.pt", "metadata.json"]
    assert tracker_text("latest_checkpointed_iteration.txt", "iter_0000004") == "4"
    assert tracker_text("latest", "global_step7") == "global_step7"


def test_deepspeed_zero2_layout_of_its_own_save(tmp_path):
    """What deepspeed 0.19.8's `save_checkpoint(<spool>)` left on 2 nodes (ZeRO stage 2,
    test_frameworks.py's drill): the tag directory on each, the model states and the
    tracker on node 0, the recovery scripts at node 0's spool root."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    write(node0 / "global_step4" / "mp_rank_00_model_states.pt")
    write(node0 / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    write(node1 / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    write(node0 / "zero_to_fp32.py")
    write(node0 / "zero_to_torch.py")
    write(node0 / "latest", b"global_step4")
    for rule in (DeepSpeedRule(), AutoRule(1.0)):
        assert rule.committed(node0) == ["global_step4"]
        assert rule.global_files(node0 / "global_step4") == ["mp_rank_00_model_states.pt"]
        # the scripts are not the checkpoint's: no load reads them
        assert rule.root_entries(node0, "global_step4") == ["latest"]
        assert not rule.vouches_for(node0 / "global_step4")
        assert rule.global_files(node1 / "global_step4") == []
    auto = AutoRule(1.0)
    assert auto.committed(node0) == ["global_step4"] and auto.kind("global_step4") == "deepspeed"
    assert detect_kind(node1 / "global_step4") == "deepspeed"    # before `latest` reaches it
    # ZeRO stage 3 and bf16: every rank's own model and optimizer states, none global
    stage3 = tmp_path / "z3" / "global_step2"
    write(stage3 / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    write(stage3 / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert DeepSpeedRule().global_files(stage3) == [] and detect_kind(stage3) == "deepspeed"


def test_orbax_tmp_dirs_never_commit(tmp_path):
    rule = OrbaxRule()
    tmp = write(tmp_path / "3.orbax-checkpoint-tmp" / "default" / "_METADATA").parent
    write(tmp.parent / "_CHECKPOINT_METADATA", b'{"init_timestamp_nsecs": 1}')
    write(tmp.parent / "commit_success.txt")                 # finalize, before the rename
    assert rule.committed(tmp_path) == []
    os.rename(tmp.parent, tmp_path / "3")                   # each host's own finalize
    assert rule.committed(tmp_path) == ["3"] and detect_kind(tmp_path / "3") == "orbax"
    # primary_host=None: every host writes all of its step, merged data of its own name
    write(tmp_path / "3" / "default" / "d" / "9f80a5e9")
    assert rule.global_files(tmp_path / "3") == []


def test_orbax_in_place_save_commits_at_finalize(tmp_path):
    """CommitFileTemporaryPath: the step is created under its final name with
    `_CHECKPOINT_METADATA` at once; finalize adds the commit time, then the commit file."""
    rule, step = OrbaxRule(), tmp_path / "7"
    write(step / "_CHECKPOINT_METADATA", b'{"init_timestamp_nsecs": 1, '
                                         b'"commit_timestamp_nsecs": null}')
    write(step / "default" / "_METADATA")
    assert rule.committed(tmp_path) == [] and detect_kind(step) == "orbax"
    write(step / "_CHECKPOINT_METADATA", b'{"init_timestamp_nsecs": 1, "commit_ti')  # torn
    assert rule.committed(tmp_path) == []
    write(step / "_CHECKPOINT_METADATA", b'{"init_timestamp_nsecs": 1, '
                                         b'"commit_timestamp_nsecs": 2}')
    assert rule.committed(tmp_path) == ["7"]
    os.unlink(step / "_CHECKPOINT_METADATA")
    write(step / "commit_success.txt")
    assert rule.committed(tmp_path) == ["7"]


def test_single_files_settle_links_and_dirs_are_not_single(tmp_path):
    clock = Clock()
    rule = TorchFileRule(1.0, clock)
    write(tmp_path / "epoch=0-step=4.ckpt")
    write(tmp_path / "notes.txt")
    os.symlink("epoch=0-step=4.ckpt", tmp_path / "last.ckpt")
    assert rule.committed(tmp_path) == []
    clock.now = 2.0
    assert rule.committed(tmp_path) == ["epoch=0-step=4.ckpt"]
    assert rule.root_entries(tmp_path, "epoch=0-step=4.ckpt") == ["epoch=0-step=4.ckpt"]


def test_auto_says_which_rule(tmp_path):
    clock = Clock()
    auto = AutoRule(1.0, clock)
    write(tmp_path / "checkpoint-5" / "trainer_state.json")
    write(tmp_path / "iter_0000002" / "metadata.json")
    write(tmp_path / "step_1" / ".metadata")
    write(tmp_path / "model.pt")
    write(tmp_path / "misc" / "a.bin")
    clock.now = 0.0
    auto.committed(tmp_path)
    clock.now = 5.0
    assert auto.committed(tmp_path) == ["checkpoint-5", "iter_0000002", "misc", "model.pt",
                                        "step_1"]
    assert {c: auto.kind(c) for c in ("checkpoint-5", "iter_0000002", "step_1", "model.pt",
                                      "misc")} == {
        "checkpoint-5": "hf", "iter_0000002": "megatron", "step_1": "dcp",
        "model.pt": "torch", "misc": "quiescence"}
    assert auto.is_file_checkpoint(tmp_path, "model.pt")
    assert not auto.is_file_checkpoint(tmp_path, "step_1")
