"""Commit rules on real spool directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachex_agent.errors import ConfigError
from cachex_agent.rules import (
    AutoRule,
    CommitRule,
    DcpRule,
    DeepSpeedRule,
    MarkerRule,
    MegatronRule,
    QuiescenceRule,
    checkpoint_names,
    detect_kind,
    is_checkpoint_name,
    is_temp_file,
    make_rule,
    natural_sorted,
)

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def commit_dcp(ckpt: Path) -> None:
    """What DCP's FileSystemWriter.finish does: write .metadata.tmp, rename it."""
    write(ckpt / ".metadata.tmp", b"meta")
    os.replace(ckpt / ".metadata.tmp", ckpt / ".metadata")


def write_latest(spool: Path, tag: str) -> None:
    (spool / "latest").write_text(tag)


# -- names and sorting -----------------------------------------------------------------

def test_natural_sort():
    ids = ["step_10", "step_9", "step_100", "global_step2", "step_09", "a"]
    assert natural_sorted(ids) == ["a", "global_step2", "step_09", "step_9", "step_10",
                                   "step_100"]
    assert natural_sorted(["checkpoint-1000", "checkpoint-500"]) == [
        "checkpoint-500", "checkpoint-1000"]


@pytest.mark.parametrize("name,ok", [
    ("step_00100", True), ("global_step5", True), ("checkpoint-3", True),
    (".hidden", False), ("step_1.tmp", False), ("step_1-tmp", False),
    ("tmp-checkpoint-3", False), ("5.orbax-checkpoint-tmp-1712", False),
    ("lost+found", False)])
def test_checkpoint_names(name, ok):
    assert is_checkpoint_name(name) is ok


def test_checkpoint_names_lists_real_dirs_only(tmp_path):
    for name in ("step_1", ".step_2", "step_3.tmp"):
        (tmp_path / name).mkdir()
    write(tmp_path / "latest")
    (tmp_path / "linked").symlink_to(tmp_path / "step_1")
    assert checkpoint_names(tmp_path) == ["step_1"]
    assert checkpoint_names(tmp_path / "missing") == []


@pytest.mark.parametrize("relpath,temp", [
    (".metadata.tmp", True), ("__0_0.distcp.tmp", True), ("x.TMP", True),
    (".model.bin.tmp-1234", True), ("a.part", True), ("b~", True), (".nfs000123", True),
    ("sub.tmp/file", True), ("tmp-sub/file", True),
    (".metadata", False), ("__0_0.distcp", False), ("mp_rank_00_model_states.pt", False),
    ("sub/.hidden", False), ("templates/tmpl.json", False), ("latest", False)])
def test_is_temp_file(relpath, temp):
    assert is_temp_file(relpath) is temp
    assert DcpRule().ignore(relpath) is temp


# -- dcp -------------------------------------------------------------------------------

def test_dcp_commit_needs_metadata(tmp_path):
    rule = DcpRule()
    ckpt = tmp_path / "step_00100"
    write(ckpt / "__0_0.distcp")
    write(ckpt / "__1_0.distcp")
    assert rule.committed(tmp_path) == []
    write(ckpt / ".metadata.tmp")
    assert rule.committed(tmp_path) == []
    commit_dcp(ckpt)
    assert rule.committed(tmp_path) == ["step_00100"]
    assert rule.global_files(ckpt) == [".metadata"]


def test_dcp_order_and_hidden_dirs(tmp_path):
    for name in ("step_10", "step_9", ".step_11", "step_12.tmp"):
        commit_dcp(tmp_path / name)
    (tmp_path / "step_13").mkdir()
    assert DcpRule().committed(tmp_path) == ["step_9", "step_10"]


def test_dcp_global_files(tmp_path):
    ckpt = tmp_path / "step_1"
    write(ckpt / "__0_0.distcp")
    assert DcpRule().global_files(ckpt) == []     # a non-coordinator node has no .metadata
    commit_dcp(ckpt)
    assert DcpRule(extra_global=["__0_0.distcp"]).global_files(ckpt) == [
        ".metadata", "__0_0.distcp"]


def test_missing_spool_is_empty(tmp_path):
    for rule in (DcpRule(), DeepSpeedRule(), MarkerRule("*/DONE"), QuiescenceRule(0),
                 AutoRule(0)):
        assert rule.committed(tmp_path / "nope") == []


# -- deepspeed -------------------------------------------------------------------------

def test_deepspeed_latest(tmp_path):
    rule = DeepSpeedRule()
    write(tmp_path / "global_step10" / "mp_rank_00_model_states.pt")
    write(tmp_path / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert rule.committed(tmp_path) == []
    write_latest(tmp_path, "global_step10")
    assert rule.committed(tmp_path) == ["global_step10"]
    # A newer save in progress is not committed; the older one stays committed.
    write(tmp_path / "global_step20" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert rule.committed(tmp_path) == ["global_step10"]
    write_latest(tmp_path, "global_step20")
    assert rule.committed(tmp_path) == ["global_step10", "global_step20"]
    assert rule.root_files == ("latest",)
    assert rule.global_files(tmp_path / "global_step10") == ["mp_rank_00_model_states.pt"]
    assert rule.global_files(tmp_path / "global_step20") == []


def test_deepspeed_memory_is_per_rule_object(tmp_path):
    for step in (1, 2):
        write(tmp_path / f"global_step{step}" / "x.pt")
    write_latest(tmp_path, "global_step2")
    # A fresh rule (agent restart) only learns what `latest` names now.
    assert DeepSpeedRule().committed(tmp_path) == ["global_step2"]


def test_deepspeed_latest_before_dir_and_torn_latest(tmp_path):
    rule = DeepSpeedRule()
    write_latest(tmp_path, "")
    assert rule.committed(tmp_path) == []
    write_latest(tmp_path, "global_step7\n")
    assert rule.committed(tmp_path) == []
    write(tmp_path / "global_step7" / "x.pt")
    assert rule.committed(tmp_path) == ["global_step7"]
    write_latest(tmp_path, "../etc")
    assert rule.committed(tmp_path) == ["global_step7"]


def test_deepspeed_recreated_dir_waits_for_new_latest(tmp_path):
    rule = DeepSpeedRule()
    ckpt = write(tmp_path / "global_step5" / "x.pt").parent
    write_latest(tmp_path, "global_step5")
    assert rule.committed(tmp_path) == ["global_step5"]
    (ckpt / "x.pt").unlink()
    ckpt.rmdir()
    assert rule.committed(tmp_path) == []
    write(ckpt / "x.pt")                          # re-created, being written again
    assert rule.committed(tmp_path) == []
    write_latest(tmp_path, "global_step5")        # the new save finished
    assert rule.committed(tmp_path) == ["global_step5"]
    rule.forget("global_step5")
    assert rule.committed(tmp_path) == []


def test_deepspeed_custom_tag(tmp_path):
    rule = DeepSpeedRule()
    write(tmp_path / "best" / "mp_rank_00_model_states.pt")
    write_latest(tmp_path, "best")
    assert rule.committed(tmp_path) == ["best"]


# -- marker ----------------------------------------------------------------------------

def test_marker_glob(tmp_path):
    rule = make_rule("marker:*/COMMITTED", settle=0)
    assert isinstance(rule, MarkerRule) and rule.name == "marker:*/COMMITTED"
    write(tmp_path / "step_2" / "data.bin")
    write(tmp_path / "step_1" / "data.bin")
    write(tmp_path / ".step_3" / "COMMITTED")
    write(tmp_path / "COMMITTED")
    assert rule.committed(tmp_path) == []
    write(tmp_path / "step_2" / "COMMITTED")
    write(tmp_path / "step_1" / "COMMITTED")
    assert rule.committed(tmp_path) == ["step_1", "step_2"]
    assert rule.global_files(tmp_path / "step_1") == ["COMMITTED"]


def test_marker_nested_and_wildcards(tmp_path):
    rule = MarkerRule("step_*/meta/*.done")
    write(tmp_path / "step_1" / "meta" / "a.done")
    write(tmp_path / "step_2" / "meta" / "a.done.tmp")
    write(tmp_path / "other" / "meta" / "a.done")
    assert rule.committed(tmp_path) == ["step_1"]
    assert rule.global_files(tmp_path / "step_1") == ["meta/a.done"]
    assert rule.global_files(tmp_path / "other") == []


def test_marker_double_star(tmp_path):
    rule = MarkerRule("**/DONE")
    write(tmp_path / "DONE")
    write(tmp_path / "step_1" / "deep" / "er" / "DONE")
    write(tmp_path / "step_2" / "DONE")
    write(tmp_path / "step_3" / "x")
    assert rule.committed(tmp_path) == ["step_1", "step_2"]
    assert rule.global_files(tmp_path / "step_1") == ["deep/er/DONE"]
    assert rule.global_files(tmp_path / "step_2") == ["DONE"]


@pytest.mark.parametrize("spec", ["marker:", "marker:/abs/*/DONE", "marker:../*/DONE",
                                  "marker:*/../DONE", "marker:DONE"])
def test_marker_bad_globs(spec):
    with pytest.raises(ConfigError, match="commit.rule"):
        make_rule(spec, settle=0)


# -- quiescence ------------------------------------------------------------------------

def test_quiescence_settle(tmp_path):
    clock = FakeClock()
    rule = QuiescenceRule(settle=2.0, clock=clock)
    assert rule.needs_polling and rule.settle == 2.0
    ckpt = tmp_path / "run1"
    write(ckpt / "model.bin", b"a")
    assert rule.committed(tmp_path) == []
    clock.advance(1.0)
    write(ckpt / "model.bin", b"ab")              # still changing: timer restarts
    assert rule.committed(tmp_path) == []
    clock.advance(1.5)
    assert rule.committed(tmp_path) == []
    clock.advance(0.6)
    assert rule.committed(tmp_path) == ["run1"]
    assert rule.committed(tmp_path) == ["run1"]   # stays committed while unchanged
    write(ckpt / "extra.bin")
    assert rule.committed(tmp_path) == []
    assert rule.global_files(ckpt) == []


def test_quiescence_rename_restarts_timer(tmp_path):
    clock = FakeClock()
    rule = QuiescenceRule(settle=1.0, clock=clock)
    write(tmp_path / "c" / "a")
    rule.committed(tmp_path)
    clock.advance(0.9)
    os.rename(tmp_path / "c" / "a", tmp_path / "c" / "b")   # same size, same mtime
    assert rule.committed(tmp_path) == []
    clock.advance(0.9)
    assert rule.committed(tmp_path) == []
    clock.advance(0.2)
    assert rule.committed(tmp_path) == ["c"]


def test_quiescence_empty_and_temp_only_dirs_never_commit(tmp_path):
    clock = FakeClock()
    rule = QuiescenceRule(settle=0.5, clock=clock)
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    write(tmp_path / "temps" / "x.tmp")
    rule.committed(tmp_path)
    clock.advance(100)
    assert rule.committed(tmp_path) == []


def test_quiescence_open_writer_blocks(tmp_path):
    clock = FakeClock()
    rule = QuiescenceRule(settle=1.0, clock=clock)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys,time; f=open(sys.argv[1],'wb'); f.write(b'x'); f.flush();"
         " print('ready', flush=True); time.sleep(120)", str(ckpt / "shard.bin")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert rule.committed(tmp_path) == []
        clock.advance(10)
        assert rule.committed(tmp_path) == []     # unchanged, but still open for writing
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    assert rule.committed(tmp_path) == []         # a writer was seen: settle again
    clock.advance(1.0)
    assert rule.committed(tmp_path) == ["ckpt"]


def test_quiescence_forgets_removed_dirs(tmp_path):
    clock = FakeClock()
    rule = QuiescenceRule(settle=1.0, clock=clock)
    ckpt = write(tmp_path / "c" / "a").parent
    rule.committed(tmp_path)
    clock.advance(2)
    assert rule.committed(tmp_path) == ["c"]
    (ckpt / "a").unlink()
    ckpt.rmdir()
    assert rule.committed(tmp_path) == []
    write(ckpt / "a")
    assert rule.committed(tmp_path) == []         # a new directory starts a new timer


# -- auto ------------------------------------------------------------------------------

def test_auto_per_directory(tmp_path):
    clock = FakeClock()
    rule = AutoRule(settle=1.0, clock=clock)
    commit_dcp(write(tmp_path / "step_2" / "__0_0.distcp").parent)
    write(tmp_path / "step_1" / "__1_0.distcp")   # DCP, this node lacks .metadata
    write(tmp_path / "plain" / "model.pt")        # generic
    assert rule.committed(tmp_path) == ["step_2"]
    assert rule.needs_polling
    clock.advance(5)
    # The DCP directory without .metadata never commits by quiescence.
    assert rule.committed(tmp_path) == ["plain", "step_2"]
    assert rule.global_files(tmp_path / "step_2") == [".metadata"]
    assert rule.global_files(tmp_path / "plain") == []


def test_auto_deepspeed(tmp_path):
    clock = FakeClock()
    rule = AutoRule(settle=1.0, clock=clock)
    write(tmp_path / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert rule.committed(tmp_path) == []
    clock.advance(10)
    assert rule.committed(tmp_path) == []         # no `latest` on this node: not by settle
    assert not rule.needs_polling
    write_latest(tmp_path, "global_step3")
    assert rule.committed(tmp_path) == ["global_step3"]
    assert rule.root_files == ("latest",)


def test_auto_latest_makes_custom_tags_deepspeed(tmp_path):
    clock = FakeClock()
    rule = AutoRule(settle=1.0, clock=clock)
    write_latest(tmp_path, "other")
    write(tmp_path / "mytag" / "weights.pt")
    rule.committed(tmp_path)
    clock.advance(10)
    assert rule.committed(tmp_path) == []
    write_latest(tmp_path, "mytag")
    assert rule.committed(tmp_path) == ["mytag"]


def test_detect_kind(tmp_path):
    latest = frozenset({"latest"})
    assert detect_kind(write(tmp_path / "a" / ".metadata").parent) == "dcp"
    assert detect_kind(write(tmp_path / "b" / "__3_0.distcp").parent, latest) == "dcp"
    assert detect_kind(write(tmp_path / "global_step9" / "x").parent) == "deepspeed"
    assert detect_kind(write(tmp_path / "c" / "mp_rank_00_model_states.pt").parent
                       ) == "deepspeed"
    assert detect_kind(write(tmp_path / "d" / "x").parent, latest) == "deepspeed"
    assert detect_kind(write(tmp_path / "e" / "x").parent) == "quiescence"


def test_auto_forget(tmp_path):
    rule = AutoRule(settle=0)
    write_latest(tmp_path, "global_step1")
    write(tmp_path / "global_step1" / "x.pt")
    assert rule.committed(tmp_path) == ["global_step1"]
    rule.forget("global_step1")
    assert rule.committed(tmp_path) == []


# -- make_rule -------------------------------------------------------------------------

def test_make_rule_kinds():
    assert isinstance(make_rule("auto", 2.0), AutoRule)
    assert isinstance(make_rule("dcp", 2.0), DcpRule)
    assert isinstance(make_rule("deepspeed", 2.0), DeepSpeedRule)
    quiet = make_rule("quiescence", 0.3)
    assert isinstance(quiet, QuiescenceRule) and quiet.settle == 0.3
    for rule in (make_rule("dcp", 1), make_rule("marker:*/X", 1)):
        assert isinstance(rule, CommitRule) and not rule.needs_polling


@pytest.mark.parametrize("spec", ["megatron", "hf", "orbax", "torch"])
def test_make_rule_framework_rules(spec):
    rule = make_rule(spec, 2.0)
    assert rule.name == spec and rule.kind("any") == spec


def test_make_rule_rejects_unknown_and_negative_settle():
    with pytest.raises(ConfigError, match="commit.rule"):
        make_rule("bogus", 2.0)
    with pytest.raises(ConfigError, match="commit.settle"):
        make_rule("quiescence", -1)


# -- does the marker vouch for every node's files? ----------------------------------------

def test_framework_markers_vouch_for_every_node_others_do_not(tmp_path):
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    # DCP's .metadata follows a gather, Megatron's tracker a barrier
    assert DcpRule().vouches_for(ckpt) and DcpRule.marker_implies_complete
    assert MegatronRule().vouches_for(ckpt) and MegatronRule.marker_implies_complete
    # DeepSpeed's rank 0 writes `latest` before the barrier (engine.py save_checkpoint)
    assert not DeepSpeedRule().vouches_for(ckpt)
    # a user's glob and a settle measured on another node say nothing about this one
    assert not MarkerRule("*/COMMITTED").vouches_for(ckpt)
    assert not QuiescenceRule(2.0).vouches_for(ckpt)


def test_auto_vouches_for_dcp_saves_not_deepspeed_nor_its_quiescence_fallback(tmp_path):
    rule = AutoRule(2.0)
    dcp = tmp_path / "step_1"
    dcp.mkdir()
    (dcp / "__2_0.distcp").write_bytes(b"x")        # a non-coordinator node: no .metadata
    deepspeed = tmp_path / "global_step10"
    deepspeed.mkdir()
    generic = tmp_path / "run_3"
    generic.mkdir()
    (generic / "weights.bin").write_bytes(b"x")
    assert rule.vouches_for(dcp)
    assert not rule.vouches_for(deepspeed)      # `latest` comes before the barrier
    assert not rule.vouches_for(generic)
    assert not rule.vouches_for(tmp_path / "not_there_yet")
