"""Configuration: precedence, parsing, templates, and errors that name the key."""

from __future__ import annotations

import pytest

from cachex_agent.config import (
    MEMORY_RESERVE,
    GiB,
    MiB,
    check_memory,
    check_paths,
    load,
    parse_duration,
    parse_size,
    upfront_memory,
)
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
    (BASE + "[stage]\ncapture = \"reflink\"\n", "stage.capture"),
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
    # refused by load, which renders node 0's paths to check them
    with pytest.raises(ConfigError, match=r"paths\.spool.*\{nod\}"):
        load(write(tmp_path, '[paths]\nspool = "/s/{nod}"\npfs = "/p"\n'), environ={})


def test_commit_globals_list_and_env(tmp_path):
    path = write(tmp_path, BASE + '[commit]\nglobals = ["__0_0.distcp", "extra/x"]\n')
    assert load(path, environ={}).commit.globals == ("__0_0.distcp", "extra/x")
    env = {"CACHEX_COMMIT_GLOBALS": "a, b"}
    assert load(write(tmp_path, BASE), environ=env).commit.globals == ("a", "b")
    with pytest.raises(ConfigError, match="commit.globals"):
        load(write(tmp_path, BASE + '[commit]\nglobals = ["../escape"]\n'), environ={})
    with pytest.raises(ConfigError, match="commit.globals"):
        load(write(tmp_path, BASE + "[commit]\nglobals = 3\n"), environ={})


# ------------------------------------------------------------- numbers and their ranges
HUGE = "1" * 400


@pytest.mark.parametrize("key,toml", [
    ("flush.bandwidth", f'"{HUGE}"'),           # float() of it is inf: once a traceback
    ("flush.bandwidth", f'"{HUGE}KiB"'),
    ("flush.bandwidth", "inf"), ("flush.bandwidth", "nan"), ("flush.bandwidth", '"2TiB"'),
    ("flush.bandwidth", '"-5"'),
    ("commit.timeout", "inf"), ("commit.timeout", f'"{HUGE}s"'), ("commit.timeout", '"31d"'),
    ("commit.timeout", '"1000h"'), ("commit.timeout", '"0"'), ("commit.settle", "nan"),
    ("commit.scan", '"0s"'), ("agent.poll", "0"), ("agent.timeout", '"0.5s"'),
    ("flush.retry_max", "-1"), ("flush.drain_timeout", "1e400"), ("model.period", "-inf"),
    ("peer.slot", '"64TiB"'), ("peer.slot", '"2GiB"'), ("peer.slot", '"1KiB"'),
    ("flush.chunk", '"1TiB"'), ("flush.chunk", '"1.5GiB"'), ("flush.chunk", "inf"),
    ("peer.slots", "100000"), ("peer.copies", "65"), ("peer.stride", "9999999999"),
    ("flush.concurrency", "1000"), ("flush.nice", "40"), ("flush.every", "0"),
    ("flush.writers", "0"), ("flush.writers", "65"),
    ("keep.stage", "10000000"), ("keep.pfs", "-1"), ("model.window", "2"),
    ("model.crash_rate", "nan"), ("model.node_rate", "inf"), ("model.job_rate", f'"{HUGE}"'),
])
def test_numbers_out_of_range_name_key_and_value(tmp_path, key, toml):
    section, name = key.split(".")
    with pytest.raises(ConfigError) as caught:
        load(write(tmp_path, BASE + f"[{section}]\n{name} = {toml}\n"), environ={})
    message = str(caught.value)
    assert message.startswith(key + ":") and "\n" not in message
    assert len(message) < 200                       # a 400-digit value is shortened
    shown = "inf" if toml == "1e400" else toml.strip('"')[:20]   # TOML reads 1e400 as inf
    assert shown in message, message                # the value, as given


@pytest.mark.parametrize("key,value", [
    ("peer.slots", "9" * 5000),     # more digits than int() converts: a ValueError
    ("flush.bandwidth", HUGE), ("commit.timeout", "nan"), ("flush.chunk", "1TiB")])
def test_overflow_from_flags_and_environment(tmp_path, key, value):
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError, match=f"^{key}: .*"):
        load(path, {key: value}, environ={})
    env = {"CACHEX_" + key.upper().replace(".", "_"): value}
    with pytest.raises(ConfigError, match=f"^{key}: .*"):
        load(path, environ=env)


@pytest.mark.parametrize("key,toml,expected", [
    ("flush.bandwidth", '"1TiB"', 1024**4), ("flush.bandwidth", "0", 0),
    ("flush.chunk", '"1GiB"', GiB), ("peer.slot", '"4KiB"', 4096),
    ("commit.timeout", '"720h"', 720 * 3600.0), ("commit.settle", "0", 0.0),
    ("agent.poll", '"1ms"', 0.001), ("flush.nice", "19", 19), ("peer.slots", "1024", 1024),
])
def test_numbers_at_the_limits_are_accepted(tmp_path, key, toml, expected):
    section, name = key.split(".")
    cfg = load(write(tmp_path, BASE + f"[{section}]\n{name} = {toml}\n"), environ={})
    assert getattr(getattr(cfg, section), name) == expected


def test_parse_size_refuses_overflow():
    with pytest.raises(ConfigError, match="--size.*not a finite number"):
        parse_size(HUGE, "--size")
    with pytest.raises(ConfigError, match="--period"):
        parse_duration(float("nan"), "--period")


# ------------------------------------------------------------------ up-front memory
def test_upfront_memory_counts_window_send_buffer_and_chunks(tmp_path):
    cfg = load(write(tmp_path, BASE + '[peer]\ncopies = 2\n[flush]\nconcurrency = 3\n'),
               environ={})
    # 2 regions x 4 slots x 16MiB, one 16MiB send buffer, (3 flush + capture) x 8MiB
    assert upfront_memory(cfg) == (2 * 4 + 1) * 16 * MiB + 4 * 8 * MiB
    writers = load(write(tmp_path, BASE + '[flush]\nconcurrency = 3\nwriters = 2\n'),
                   environ={})
    # one partner: the feed's two slots too; a chunk buffer per writer of each bundle
    # in flight, plus capture's
    assert upfront_memory(writers) == (4 + 1 + 2) * 16 * MiB + (3 * 2 + 1) * 8 * MiB
    direct = load(write(tmp_path, BASE + '[model]\npath = "direct"\n'), environ={})
    assert upfront_memory(direct) == 2 * 8 * MiB          # flush-only: no window


def test_window_past_available_memory_is_refused(tmp_path):
    cfg = load(write(tmp_path, BASE + '[peer]\nslot = "1GiB"\nslots = 8\n'), environ={})
    need = upfront_memory(cfg)
    check_memory(cfg, available=need + MEMORY_RESERVE)          # fits, reserve kept
    with pytest.raises(ConfigError) as caught:
        check_memory(cfg, available=need + MEMORY_RESERVE - 1)  # eats into the reserve
    message = str(caught.value)
    assert message.startswith("peer.slot, peer.slots") and "\n" not in message
    with pytest.raises(ConfigError, match="2 agents on h1"):   # agents sharing a host
        check_memory(cfg, agents=2, available=need + MEMORY_RESERVE, host="h1")
    with pytest.raises(ConfigError, match="peer.slot"):        # this machine, for real
        check_memory(load(write(tmp_path, BASE + '[peer]\nslot = "1GiB"\nslots = 1024\n'),
                          environ={}))


# ------------------------------------------------------------ overlapping directories
def _paths(root, spool, pfs, stage="{root}/shm", cache="{root}/nvme", run="t"):
    return (f'run = "{run}"\n[paths]\nspool = "{spool}"\npfs = "{pfs}"\n'
            f'stage = "{stage}"\ncache = "{cache}"\n').replace("{root}", str(root))


@pytest.mark.parametrize("spool,pfs,stage,cache,keys", [
    ("{root}/pfs/t", "{root}/pfs", "{root}/shm", "{root}/nvme", ("paths.spool", "paths.pfs")),
    ("{root}/pfs", "{root}/pfs", "{root}/shm", "{root}/nvme", ("paths.spool", "paths.pfs")),
    ("{root}/x", "{root}/x/t/sub/..", "{root}/shm", "{root}/nvme",
     ("paths.spool", "paths.pfs")),                                   # `..` resolved
    ("{root}/s", "{root}/pfs", "{root}/s", "{root}/nvme", ("paths.stage", "paths.spool")),
    ("{root}/shm/t/spool", "{root}/pfs", "{root}/shm", "{root}/nvme",
     ("paths.spool", "paths.stage")),                                 # spool inside stage
    ("{root}/s", "{root}/pfs", "{root}/shm", "{root}/shm", ("paths.stage", "paths.cache")),
    ("{root}/s", "{root}/pfs", "{root}/shm", "{root}/pfs/t",
     ("paths.cache", "paths.pfs")),                                   # cache inside PFS run
    ("{root}/s", "{root}/shm/t/p", "{root}/shm", "{root}/nvme",
     ("paths.pfs", "paths.stage")),                                   # PFS inside stage
    ("{root}/node{node}", "{root}/node0", "{root}/shm", "{root}/nvme",
     ("paths.pfs", "paths.spool")),                                   # rendered for node 0
])
def test_overlapping_directories_name_both_keys(tmp_path, spool, pfs, stage, cache, keys):
    text = _paths(tmp_path, spool, pfs, stage, cache)
    with pytest.raises(ConfigError) as caught:
        load(write(tmp_path, text), environ={})
    message = str(caught.value)
    named, _, _ = message.partition(" overlap: ")
    assert set(named.split(" and ")) == set(keys), message
    assert "\n" not in message


def test_overlap_through_a_symlink(tmp_path):
    (tmp_path / "pfs" / "t").mkdir(parents=True)
    (tmp_path / "spool").symlink_to(tmp_path / "pfs" / "t")
    with pytest.raises(ConfigError, match="paths.spool and paths.pfs overlap"):
        load(write(tmp_path, _paths(tmp_path, "{root}/spool", "{root}/pfs")), environ={})


def test_siblings_with_a_common_prefix_do_not_overlap(tmp_path):
    cfg = load(write(tmp_path, _paths(tmp_path, "{root}/s", "{root}/s2", "{root}/s3",
                                      "{root}/s/../s4")), environ={})
    check_paths(cfg.node_paths(1))


def test_overlap_of_another_node_is_found_by_its_own_rendering(tmp_path):
    # node 0 is fine; node 1's spool is the PFS run directory (the agent checks its own)
    text = _paths(tmp_path, "{root}/s{node}", "{root}/s1", run="t").replace(
        'spool = "' + str(tmp_path) + '/s{node}"', 'spool = "' + str(tmp_path) + '/s{node}/t"')
    cfg = load(write(tmp_path, text), environ={})
    with pytest.raises(ConfigError, match="paths.spool and paths.pfs overlap"):
        check_paths(cfg.node_paths(1))
