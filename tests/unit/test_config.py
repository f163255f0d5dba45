"""Configuration: precedence, parsing, templates, and errors that name the key."""

from __future__ import annotations

import pytest

from cachex_agent.config import load, parse_duration, parse_size
from cachex_agent.errors import ConfigError

BASE = '[paths]\nspool = "/s/{node}"\npfs = "/p"\n'


def write(tmp_path, text: str):
    path = tmp_path / "cachex.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,expected", [
    ("16MiB", 16 * 2**20), ("1GiB", 2**30), ("4096", 4096), ("1.5KB", 1500), (0, 0),
    ("2 kib", 2048)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,expected", [("2s", 2.0), ("500ms", 0.5), ("10min", 600.0),
                                           ("1h", 3600.0), (3, 3.0)])
def test_durations(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["16XB", "-1", "MiB", "", True, "1.2.3"])
def test_bad_size_names_the_key(bad):
    with pytest.raises(ConfigError, match="peer.slot"):
        parse_size(bad, "peer.slot")


def test_defaults_and_file(tmp_path):
    cfg = load(write(tmp_path, 'run = "r1"\n' + BASE + "[peer]\nslot = \"4MiB\"\n"), environ={})
    assert cfg.run == "r1"
    assert cfg.peer.slot == 4 * 2**20 and cfg.peer.slots == 4
    assert cfg.commit.rule == "auto" and cfg.commit.settle == 2.0
    assert cfg.flush.bandwidth == 0 and cfg.keep.stage == 1 and cfg.model.path == "auto"


def test_precedence_file_env_flag(tmp_path):
    path = write(tmp_path, BASE + '[flush]\nbandwidth = "1MiB"\nconcurrency = 2\n')
    env = {"CACHEX_FLUSH_BANDWIDTH": "2MiB", "CACHEX_FLUSH_CONCURRENCY": "3"}
    cfg = load(path, {"flush.bandwidth": "3MiB"}, environ=env)
    assert cfg.flush.bandwidth == 3 * 2**20       # flag beats env beats file
    assert cfg.flush.concurrency == 3             # env beats file


def test_env_key_with_underscore(tmp_path):
    cfg = load(write(tmp_path, BASE), environ={"CACHEX_FLUSH_DRAIN_TIMEOUT": "30s"})
    assert cfg.flush.drain_timeout == 30.0


def test_run_from_slurm_job_name(tmp_path):
    assert load(write(tmp_path, BASE), environ={"SLURM_JOB_NAME": "llm"}).run == "llm"


@pytest.mark.parametrize("text,key", [
    (BASE + "[flush]\nbandwith = 1\n", "flush.bandwith"),
    (BASE + "[nosuch]\nx = 1\n", "nosuch"),
    (BASE + "[peer]\ncopies = 0\n", "peer.copies"),
    (BASE + "[commit]\nrule = \"magic\"\n", "commit.rule"),
    (BASE + "[commit]\nsettle = \"soon\"\n", "commit.settle"),
    (BASE + "[topology]\ndomain = \"regex:\"\n", "topology.domain"),
    ('[paths]\npfs = "/p"\n', "paths.spool"),
    ('run = "a/b"\n' + BASE, "run"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(write(tmp_path, text), environ={})


def test_unknown_env_variable_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="CACHEX_FLUSH_SPEED"):
        load(write(tmp_path, BASE), environ={"CACHEX_FLUSH_SPEED": "1"})
    # a variable naming no section is a job script's own, not a typo of ours
    assert load(write(tmp_path, BASE), environ={"CACHEX_ROOT": "/x"}).flush.every == 1


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "none.toml", environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write(tmp_path, "[paths\n"), environ={})


def test_templates(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch")
    text = ('run = "r"\n[paths]\nspool = "/s/node{node}/{host}"\n'
            'pfs = "$SCRATCH/{job}"\ncache = "/c/{rank}"\n')
    cfg = load(write(tmp_path, text), environ={})
    paths = cfg.node_paths(3, rank=7, host="h1")
    assert str(paths.spool) == "/s/node3/h1"
    assert str(paths.pfs) == "/scratch/local/r"            # run appended; no job id here
    assert str(paths.cache) == "/c/7/r"
    assert paths.journal == paths.cache / "journal"


def test_unknown_template_field(tmp_path):
    cfg = load(write(tmp_path, '[paths]\nspool = "/s/{nod}"\npfs = "/p"\n'), environ={})
    with pytest.raises(ConfigError, match=r"paths\.spool.*\{nod\}"):
        cfg.node_paths(0)


def test_commit_globals_list_and_env(tmp_path):
    path = write(tmp_path, BASE + '[commit]\nglobals = ["__0_0.distcp", "extra/x"]\n')
    assert load(path, environ={}).commit.globals == ("__0_0.distcp", "extra/x")
    env = {"CACHEX_COMMIT_GLOBALS": "a, b"}
    assert load(write(tmp_path, BASE), environ=env).commit.globals == ("a", "b")
    with pytest.raises(ConfigError, match="commit.globals"):
        load(write(tmp_path, BASE + '[commit]\nglobals = ["../escape"]\n'), environ={})
    with pytest.raises(ConfigError, match="commit.globals"):
        load(write(tmp_path, BASE + "[commit]\nglobals = 3\n"), environ={})
