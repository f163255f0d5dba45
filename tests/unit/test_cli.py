"""The `cachex` command line on hand-made runs: real config files, real HDF5 bundles.

Successful commands go through click's CliRunner on `main_group`. Failures go through
`cli.main()` (what the `cachex` script runs), because only it turns a CachexError into
the documented one-line message and exit code; one test runs the installed script.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from support import run_main

from cachex_agent import cli
from cachex_agent import config as configuration
from cachex_agent.checksum import file_checksum
from cachex_agent.flush.bundle import write_bundle
from cachex_agent.fsutil import write_json
from cachex_agent.layout import bundle_name
from cachex_agent.manifest import FileEntry, GlobalManifest, LocalManifest

RUN = "run1"
CKPT = "step_00100"
CACHEX = Path(sys.executable).parent / "cachex"


# ------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def clean_environment(cli_environment):
    """Every test here: conftest.cli_environment."""


def invoke(config_file: Path, *args: str):
    """CliRunner on main_group; `--config` appended to the subcommand's options."""
    return CliRunner().invoke(cli.main_group, [*args, "--config", str(config_file)])


def status_doc(updated: float | None, level: str, state: str = "running") -> dict:
    return {"format": "cachex-status", "version": 1, "run": RUN, "updated": updated,
            "state": state, "nodes": 2, "checkpoints": [
                {"id": "step_00050", "seq": 50, "level": "flushed", "bytes": 2048,
                 "path": "direct", "rule": "dcp", "nodes_captured": 2, "nodes_flushed": 2,
                 "flush": True, "errors": {},
                 "progress": {}, "reason": None, "times": {}},
                {"id": CKPT, "seq": 100, "level": level, "bytes": 4096,
                 "path": "peer", "rule": "dcp", "nodes_captured": 2, "nodes_flushed": 1,
                 "flush": True,
                 "errors": {"1": "pfs: Not a directory"},
                 "progress": {"0": {"stage": "flush", "done": 1024, "total": 2048}},
                 "reason": None, "times": {}}]}


def journal_status_path(cfg: configuration.Config) -> Path:
    return cfg.node_paths(0).journal / "status.json"


def pfs_status_path(cfg: configuration.Config) -> Path:
    return cfg.node_paths(0).pfs / "status.json"


def put(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    return path


def levels(doc: dict) -> dict[str, str]:
    return {row["id"]: row["level"] for row in doc["checkpoints"]}


# ---------------------------------------------------------------------- ls and status

@pytest.mark.timeout(20)
def test_status_json_path_is_node0_journal(tmp_path, cfg):
    assert journal_status_path(cfg) == tmp_path / "cache" / "0" / RUN / "journal" / "status.json"
    assert pfs_status_path(cfg) == tmp_path / "pfs" / RUN / "status.json"


@pytest.mark.timeout(20)
def test_ls_and_status_json_from_the_journal(cfg, config_file):
    # agents long gone: a heartbeat (of a short period) that does not move
    put(journal_status_path(cfg), {**status_doc(1000.0, "captured"), "heartbeat": {
        "beat": 7, "life": "x", "t": 1000.0, "pid": 1, "host": "h", "period": 0.1}})

    ls = invoke(config_file, "ls", "--json")
    assert ls.exit_code == 0, ls.output
    listing = json.loads(ls.stdout)
    assert isinstance(listing, dict)
    assert [(r["id"], r["level"]) for r in listing["checkpoints"]] == [
        ("step_00050", "flushed"), (CKPT, "captured")]
    assert listing["run"] == RUN

    status = invoke(config_file, "status", "--json")
    assert status.exit_code == 0, status.output
    doc = json.loads(status.stdout)
    assert levels(doc) == {"step_00050": "flushed", CKPT: "captured"}
    # ls says of each checkpoint what status says
    keys = ("id", "seq", "level", "bytes", "path", "rule")
    assert [{k: r[k] for k in keys} for r in listing["checkpoints"]] == [
        {k: r[k] for k in keys} for r in doc["checkpoints"]]
    assert listing["unknown"] is None
    assert all("id" in row and "level" in row for row in doc["checkpoints"])
    # watched standing still for 5 periods: no longer `running`
    assert (doc["state"], doc["recorded_state"], doc["live"]) == ("not running", "running",
                                                                  False)
    assert doc["heartbeat"]["age"] > 0.5


@pytest.mark.timeout(20)
def test_liveness_is_a_heartbeat_seen_to_move_never_its_time_against_the_readers_clock():
    """Timestamps far in the past or future change nothing: only `beat` moving does."""
    from cachex_agent.beats import Unchanged
    from cachex_agent.status import with_liveness

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now
    clock = Clock()

    def doc(beat: int, t: float, state: str = "running") -> dict:
        return {"state": state, "updated": t,
                "heartbeat": {"beat": beat, "life": "a", "t": t, "period": 2.0}}
    seen = Unchanged(clock)
    first = with_liveness(doc(1, 9e9), seen)        # written by a clock far ahead
    assert (first["state"], first["live"]) == ("running", None)     # not known yet
    clock.now = 1.5
    moved = with_liveness(doc(2, 9e9 + 2), seen)
    assert (moved["state"], moved["live"], moved["heartbeat"]["age"]) == ("running", True, 0)
    clock.now = 9.0
    assert with_liveness(doc(2, 9e9 + 2), seen)["live"] is True     # 7.5 s: within 5 periods
    clock.now = 12.0
    stale = with_liveness(doc(2, 9e9 + 2), seen)
    assert (stale["state"], stale["live"], stale["heartbeat"]["age"]) == ("not running",
                                                                         False, 10.5)
    behind = Unchanged(clock)           # a heartbeat written an hour before the reader's
    with_liveness(doc(5, 100.0), behind)
    clock.now = 13.0
    assert with_liveness(doc(6, 102.0), behind)["live"] is True
    stopped = with_liveness(doc(6, 102.0, "stopped"), Unchanged(clock))
    assert (stopped["state"], stopped["live"]) == ("stopped", False)


@pytest.mark.timeout(20)
def test_ls_and_status_human_output(cfg, config_file):
    put(journal_status_path(cfg), status_doc(1000.0, "captured"))
    ls = invoke(config_file, "ls")
    assert ls.exit_code == 0, ls.output
    assert CKPT in ls.stdout and "captured" in ls.stdout and "4.0 KiB" in ls.stdout
    row = next(line for line in ls.stdout.splitlines() if line.startswith(CKPT))
    assert row.split()[-2:] == ["peer", "dcp"]
    status = invoke(config_file, "status")
    assert status.exit_code == 0, status.output
    assert f"run {RUN}" in status.stdout
    assert "flushed on 1/2" in status.stdout
    assert "Not a directory" in status.stdout


@pytest.mark.timeout(20)
@pytest.mark.parametrize("newer", ["journal", "pfs"])
def test_the_newer_status_copy_wins(cfg, config_file, newer):
    journal_t, pfs_t = (2000.0, 1000.0) if newer == "journal" else (1000.0, 2000.0)
    put(journal_status_path(cfg), status_doc(journal_t, "captured"))
    put(pfs_status_path(cfg), status_doc(pfs_t, "flushed", state="stopped"))
    expected = "captured" if newer == "journal" else "flushed"

    for command in ("ls", "status"):
        result = invoke(config_file, command, "--json")
        assert result.exit_code == 0, result.output
        assert levels(json.loads(result.stdout))[CKPT] == expected, command


@pytest.mark.timeout(20)
def test_only_the_pfs_copy(cfg, config_file):
    put(pfs_status_path(cfg), status_doc(1000.0, "replicated"))
    result = invoke(config_file, "ls", "--json")
    assert result.exit_code == 0, result.output
    assert levels(json.loads(result.stdout))[CKPT] == "replicated"


@pytest.mark.timeout(20)
def test_ls_falls_back_to_the_pfs_index(cfg, config_file):
    put(cfg.node_paths(0).pfs / "index.json", {
        "format": "cachex-index", "version": 1, "run": RUN, "current": "step_00100",
        "checkpoints": [
            {"id": "step_00050", "seq": 50, "state": "failed", "bytes": 10, "flushed_at": None},
            {"id": CKPT, "seq": 100, "state": "valid", "bytes": 4096, "flushed_at": 5.0}]})

    result = invoke(config_file, "ls", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(r["id"], r["level"]) for r in doc["checkpoints"]] == [
        ("step_00050", "failed"), (CKPT, "flushed")]
    # the index keeps no path or rule: null, and ls says why
    assert {(r["path"], r["rule"]) for r in doc["checkpoints"]} == {(None, None)}
    assert "PFS index" in doc["unknown"]
    listed = invoke(config_file, "ls")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(CKPT))
    assert row.split()[-2:] == ["?", "?"]
    assert listed.stdout.splitlines()[-1].startswith("? path and rule unknown")

    status = invoke(config_file, "status", "--json")
    assert status.exit_code == 0, status.output
    assert levels(json.loads(status.stdout)) == {"step_00050": "failed", CKPT: "flushed"}
    human = invoke(config_file, "status")
    assert human.exit_code == 0, human.output
    assert CKPT in human.stdout


@pytest.mark.timeout(20)
def test_ls_with_no_status_at_all(monkeypatch, capsys, config_file):
    code, out, err = run_main(monkeypatch, capsys, "ls", "--json", "--config", str(config_file))
    assert code == 1
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cachex: error: ")
    assert "no status found" in lines[0] and RUN in lines[0]
    assert "Traceback" not in err


@pytest.mark.timeout(20)
def test_unknown_set_key_is_a_usage_error(monkeypatch, capsys, cfg, config_file):
    put(journal_status_path(cfg), status_doc(1000.0, "captured"))
    code, out, err = run_main(monkeypatch, capsys, "ls", "--config", str(config_file),
                              "--set", "nosuch.key=1")
    assert code == 2
    assert "nosuch.key" in err
    assert err.startswith("cachex: error: ")
    assert len(err.strip().splitlines()) == 1
    assert out == ""


@pytest.mark.timeout(20)
def test_bad_set_value_names_the_key(monkeypatch, capsys, config_file):
    code, _, err = run_main(monkeypatch, capsys, "ls", "--config", str(config_file),
                            "--set", "flush.bandwidth=fast")
    assert code == 2
    assert "flush.bandwidth" in err and "Traceback" not in err


# ------------------------------------------------------------------- verify and export

def write_files(root: Path, files: dict[str, tuple[bytes, int]]) -> list[FileEntry]:
    entries = []
    for name, (data, mode) in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, mode)
        entries.append(FileEntry(name, len(data), mode, file_checksum(path)))
    return entries


def flush_by_hand(cfg: configuration.Config, ckpt: str,
                  per_node: dict[int, dict[str, tuple[bytes, int]]],
                  global_files: list[str], hosts: list[str] | None = None) -> GlobalManifest:
    """Stage each node's files, write its bundle, then the global manifest (last)."""
    pfs_ckpt = cfg.node_paths(0).pfs / "ckpt" / ckpt
    pfs_ckpt.mkdir(parents=True, exist_ok=True)
    parts = []
    for node, files in per_node.items():
        staged = cfg.node_paths(node).stage_dir(ckpt)
        manifest = LocalManifest(run=cfg.run, ckpt=ckpt, seq=int(ckpt.rsplit("_", 1)[1]),
                                 node=node, host=hosts[node] if hosts else socket.gethostname(),
                                 rank=node,
                                 files=write_files(staged, files))
        write_bundle(pfs_ckpt / bundle_name(node), manifest, staged)
        parts.append(manifest)
    gm = GlobalManifest.build(parts, global_files, times={"written": 1.0, "flushed": 2.0},
                              bundles={n: bundle_name(n) for n in per_node})
    write_json(pfs_ckpt / "manifest.json", gm.to_json())
    return gm


def random_bytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


METADATA = (b"global metadata, mirrored to every node\n", 0o644)
NODE_FILES = {
    0: {".metadata": METADATA,
        "__0_0.distcp": (random_bytes(0, 300_000), 0o600),
        "optim/rank0/state.bin": (random_bytes(1, 5000), 0o640),
        "empty.txt": (b"", 0o644)},
    1: {".metadata": METADATA,
        "__1_0.distcp": (random_bytes(2, 250_001), 0o600),
        "run.sh": (b"#!/bin/sh\nexec train\n", 0o755)},
}


@pytest.fixture
def flushed(cfg) -> GlobalManifest:
    return flush_by_hand(cfg, CKPT, NODE_FILES, global_files=[".metadata"])


def flip_byte(bundle: Path, rel: str, index: int = 10) -> None:
    with h5py.File(bundle, "r+", locking=False) as h5:
        for dataset in h5["files"].values():
            path = dataset.attrs["path"]
            if (path.decode() if isinstance(path, bytes) else path) == rel:
                dataset[index] = dataset[index] ^ 0xFF
                return
    raise AssertionError(f"{rel} not in {bundle}")


@pytest.mark.timeout(20)
def test_verify_a_good_checkpoint(cfg, config_file, flushed):
    result = invoke(config_file, "verify", CKPT)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    pfs_ckpt = cfg.node_paths(0).pfs / "ckpt" / CKPT
    for node in (0, 1):
        assert any(" pfs " in line and " ok " in line and str(pfs_ckpt / bundle_name(node))
                   in line for line in lines), result.stdout
        assert any(" stage " in line and " ok " in line
                   and str(cfg.node_paths(node).stage_dir(CKPT)) in line
                   for line in lines), result.stdout
    assert "BAD" not in result.stdout
    assert f"{CKPT}: verified 4 copies" in result.stdout


@pytest.mark.timeout(20)
def test_verify_finds_a_flipped_byte_in_a_bundle(monkeypatch, capsys, cfg, config_file,
                                                flushed):
    bundle = cfg.node_paths(0).pfs / "ckpt" / CKPT / bundle_name(1)
    flip_byte(bundle, "__1_0.distcp")

    code, out, err = run_main(monkeypatch, capsys, "verify", CKPT, "-q", "--config",
                              str(config_file))
    assert code == 1
    bad = [line for line in out.splitlines() if "BAD" in line]
    assert len(bad) == 1 and str(bundle) in bad[0] and "node 1" in bad[0], out
    problems = [line for line in out.splitlines() if "__1_0.distcp" in line]
    assert problems and str(bundle) in problems[0] and "checksum" in problems[0], out
    assert "__0_0.distcp" not in out
    assert err.startswith("cachex: error: ") and "1 bad" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.timeout(20)
def test_verify_finds_a_changed_stage_copy(monkeypatch, capsys, cfg, config_file, flushed):
    staged = cfg.node_paths(0).stage_dir(CKPT) / "optim/rank0/state.bin"
    data = bytearray(staged.read_bytes())
    data[0] ^= 1
    staged.write_bytes(bytes(data))
    code, out, _ = run_main(monkeypatch, capsys, "verify", CKPT, "--config", str(config_file))
    assert code == 1
    assert f"{staged}: checksum mismatch" in out


@pytest.mark.timeout(20)
def test_verify_on_node0_with_a_stage_path_shared_by_all_nodes(tmp_path):
    """With a stage path that has no {node} field (the design's own example,
    `stage = "/dev/shm/cachex"`), every node's stage renders to the same local path.
    Run on node 0, `cachex verify` checks node 1's files against node 0's /dev/shm,
    finds them "missing" and reports node 1's stage copy BAD (exit 1) although every
    copy is good: a copy not visible from this machine must be reported as such.
    Simulated here: one shared stage dir that holds only node 0's files.
    """
    shared = tmp_path / "shared.toml"
    shared.write_text(f"""\
run = "{RUN}"
[paths]
spool = "{tmp_path}/spool"
stage = "{tmp_path}/shm"
cache = "{tmp_path}/nvme"
pfs = "{tmp_path}/pfs"
[topology]
domain = "rank"
""")
    cfg = configuration.load(shared, environ={})
    assert cfg.node_paths(0).stage_dir(CKPT) == cfg.node_paths(1).stage_dir(CKPT)
    flush_by_hand(cfg, CKPT, NODE_FILES, global_files=[".metadata"],
                  hosts=[socket.gethostname(), "nid0001"])      # node 1 is another machine
    for name in set(NODE_FILES[1]) - set(NODE_FILES[0]):     # these live on node 1 only
        (cfg.node_paths(1).stage_dir(CKPT) / name).unlink()

    result = invoke(shared, "verify", CKPT)
    assert "BAD" not in result.stdout and result.exit_code == 0, (
        "verify reports a healthy checkpoint as bad: node 1's stage copy was checked in"
        f" node 0's stage directory (exit {result.exit_code}):\n{result.stdout}")


@pytest.mark.timeout(20)
def test_verify_an_unknown_checkpoint(monkeypatch, capsys, config_file, flushed):
    code, out, err = run_main(monkeypatch, capsys, "verify", "step_99999",
                              "--config", str(config_file))
    assert code == 1
    assert "step_99999" in err and err.startswith("cachex: error: ")


def expected_files(nodes: list[int]) -> dict[str, tuple[bytes, int]]:
    merged: dict[str, tuple[bytes, int]] = {}
    for node in nodes:
        merged.update(NODE_FILES[node])
    return merged


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in root.rglob("*") if p.is_file()}


@pytest.mark.timeout(20)
def test_export_merged_is_byte_identical(tmp_path, config_file, flushed):
    dest = tmp_path / "exported"
    result = invoke(config_file, "export", CKPT, str(dest))
    assert result.exit_code == 0, result.output
    assert tree(dest) == expected_files([0, 1])
    assert not [p for p in dest.rglob("*") if ".tmp-" in p.name]
    assert f"{CKPT}: exported" in result.stdout


@pytest.mark.timeout(20)
def test_export_per_node(tmp_path, config_file, flushed):
    dest = tmp_path / "exported"
    result = invoke(config_file, "export", CKPT, str(dest), "--per-node")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dest.iterdir()) == ["node-00000", "node-00001"]
    for node in (0, 1):
        assert tree(dest / f"node-{node:05d}") == NODE_FILES[node]


@pytest.mark.timeout(20)
def test_export_merged_refuses_conflicting_files(monkeypatch, capsys, tmp_path, cfg,
                                                 config_file):
    ckpt = "step_00200"
    flush_by_hand(cfg, ckpt, {0: {"shared.txt": (b"node zero", 0o644)},
                              1: {"shared.txt": (b"node one!", 0o644)}}, global_files=[])
    dest = tmp_path / "exported"
    code, _, err = run_main(monkeypatch, capsys, "export", ckpt, str(dest),
                            "--config", str(config_file))
    assert code == 1
    assert "shared.txt" in err and "--per-node" in err
    assert err.startswith("cachex: error: ") and "Traceback" not in err
    assert not dest.exists() or not any(dest.rglob("*"))

    per_node = invoke(config_file, "export", ckpt, str(tmp_path / "per-node"), "--per-node")
    assert per_node.exit_code == 0, per_node.output
    assert (tmp_path / "per-node" / "node-00000" / "shared.txt").read_bytes() == b"node zero"
    assert (tmp_path / "per-node" / "node-00001" / "shared.txt").read_bytes() == b"node one!"


@pytest.mark.timeout(20)
def test_export_without_a_global_manifest(monkeypatch, capsys, tmp_path, config_file):
    code, _, err = run_main(monkeypatch, capsys, "export", CKPT, str(tmp_path / "out"),
                            "--config", str(config_file))
    assert code == 1
    assert "no global manifest" in err and "manifest.json" in err


# ------------------------------------------------------------------------------- stop

@pytest.mark.timeout(20)
def test_stop_no_wait_writes_the_request(cfg, config_file):
    journal = cfg.node_paths(0).journal
    journal.mkdir(parents=True)
    result = invoke(config_file, "stop", "--no-wait")
    assert result.exit_code == 0, result.output
    request = cfg.node_paths(0).pfs / "control" / "stop"
    assert request == Path(cfg.paths.pfs) / RUN / "control" / "stop"
    assert isinstance(json.loads(request.read_text())["requested"], float)
    assert (journal / "stop").is_file()
    assert str(request) in result.stdout


@pytest.mark.timeout(20)
def test_stop_no_wait_without_a_journal(cfg, config_file):
    result = invoke(config_file, "stop", "--no-wait")
    assert result.exit_code == 0, result.output
    assert (cfg.node_paths(0).pfs / "control" / "stop").is_file()
    assert not cfg.node_paths(0).journal.exists()


# ------------------------------------------------------------------- real subprocess

@pytest.mark.timeout(60)
def test_installed_script_help_and_bad_config(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CACHEX_") and k != "SLURM_JOB_NAME"}
    helped = subprocess.run([str(CACHEX), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=30)
    assert helped.returncode == 0, helped.stderr
    for command in ("status", "ls", "verify", "export", "stop"):
        assert command in helped.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text('[paths]\nspool = "/x"\npfs = "/y"\nnosuch = 3\n')
    result = subprocess.run([str(CACHEX), "ls", "--config", str(bad)], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=30)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("cachex: error: ")
    assert "paths.nosuch" in result.stderr and str(bad) in result.stderr
