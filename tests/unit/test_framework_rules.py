"""The framework rules against the layouts each framework's own save function writes
(reproduced from its code, cited in cachex_agent/rules/): what commits, what is global,
what `auto` calls it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachex_agent import config
from cachex_agent.errors import ConfigError
from cachex_agent.rules import (
    RULE_NAMES,
    AccelerateRule,
    AutoRule,
    DeepSpeedRule,
    HfRule,
    MegatronRule,
    OrbaxRule,
    TorchFileRule,
    detect_kind,
    rules_table,
    tracker_text,
)
from cachex_agent.rules.frameworks import FRAMEWORKS


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
    # committed by metadata.json before Megatron-LM's tracker names it: the capture
    # waits a little for the tracker (it names 8, so nothing is due for 4 or 8)
    write(tmp_path / "iter_0000012" / "metadata.json")
    assert rule.tracker_due(tmp_path, "iter_0000012") == "latest_checkpointed_iteration.txt"
    assert rule.tracker_due(tmp_path, "iter_0000004") is None
    assert rule.tracker_due(tmp_path, "iter_0000008") is None   # named by the tracker
    assert AutoRule(1.0).tracker_due(tmp_path, "iter_0000012") is not None
    assert DeepSpeedRule().tracker_due(tmp_path, "iter_0000012") is None


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


def test_accelerate_save_state_commits_on_an_rng_state_once_settled(tmp_path):
    """What accelerate 1.15.0's `save_state` left on 2 nodes with automatic checkpoint
    naming (test_frameworks.py's drill): the main process's files on node 0, each
    process's RNG state on its own node; nothing written last."""
    clock = Clock()
    rule = AccelerateRule(2.0, clock)
    ckpt = tmp_path / "node0" / "checkpoint_3"
    for name in ("model.safetensors", "optimizer.bin", "scheduler.bin"):
        write(ckpt / name)
    assert rule.own_marker(ckpt) == "random_states_*.pkl"
    assert rule.committed(ckpt.parent) == []        # the main process is still writing
    write(ckpt / "random_states_0.pkl")
    write(ckpt / "custom_checkpoint_0.pkl")         # registered objects, after the RNG
    assert rule.committed(ckpt.parent) == []        # settling
    clock.now = 2.5
    assert rule.committed(ckpt.parent) == ["checkpoint_3"]
    assert rule.global_files(ckpt) == ["custom_checkpoint_0.pkl", "model.safetensors",
                                       "optimizer.bin", "scheduler.bin"]
    assert not rule.vouches_for(ckpt)
    other = write(tmp_path / "node1" / "checkpoint_3" / "random_states_1.pkl").parent
    assert rule.own_marker(other) is None and rule.global_files(other) == []
    assert detect_kind(ckpt) == detect_kind(other) == "accelerate"
    # save_state(output_dir=...) under a name of the user's: its RNG states tell
    named = write(tmp_path / "mine" / "random_states_0.pkl").parent
    assert detect_kind(named) == "accelerate"
    auto = AutoRule(2.0, clock)
    assert auto.committed(ckpt.parent) == [] and auto.needs_polling
    clock.now = 5.0
    assert auto.committed(ckpt.parent) == ["checkpoint_3"]
    assert auto.kind("checkpoint_3") == "accelerate"
    assert auto.own_marker(ckpt) == "random_states_*.pkl"


def test_the_registry_names_every_rule_in_the_config_and_the_docs():
    """`auto`'s frameworks, `commit.rule`'s choices and docs/levels.md's table are read
    from the rules: a framework added to frameworks.py reaches all three."""
    names = {rule.name for rule in FRAMEWORKS}
    assert names <= set(RULE_NAMES) and "accelerate" in names
    assert [rule.priority for rule in FRAMEWORKS] == sorted(r.priority for r in FRAMEWORKS)
    paths = {"paths.spool": "/tmp/s", "paths.pfs": "/tmp/p"}
    for name in RULE_NAMES:
        assert config.load(None, {**paths, "commit.rule": name}, {}).commit.rule == name
    with pytest.raises(ConfigError, match="accelerate"):
        config.load(None, {**paths, "commit.rule": "acelerate"}, {})
    assert rules_table() in (Path(__file__).resolve().parents[2] / "docs" / "levels.md"
                             ).read_text()
