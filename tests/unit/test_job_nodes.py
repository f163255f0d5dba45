"""The job's node set (job/nodes.py) and its configuration file (job/config_file.py):
what the job's start (job/start.py) and its relaunches (job/life.py) choose and write."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from cachex_agent import cli
from cachex_agent.config import load
from cachex_agent.errors import ConfigError, OperationError
from cachex_agent.job.config_file import JobConfig, write_job_config
from cachex_agent.job.nodes import choose, expand_hosts, replace
from cachex_agent.job.state import state_words
from cachex_agent.layout import journal_stop_file, pfs_stop_file

pytestmark = pytest.mark.timeout(30)
HOSTS = [f"n{i:03d}" for i in range(1, 6)]


def test_host_lists_expand_as_slurm_writes_them():
    assert expand_hosts("n[001-003,007],x1 gpu[8-10]-ib") == [
        "n001", "n002", "n003", "n007", "x1", "gpu8-ib", "gpu9-ib", "gpu10-ib"]
    assert expand_hosts("") == [] and expand_hosts(" a , b ") == ["a", "b"]
    for bad in ("n[001-", "n[3-1]", "n[a-b]", "bad/host", "n[1-999999]"):
        with pytest.raises(ConfigError, match=r"^EXCLUDE_NODES: "):
            expand_hosts(bad)


def test_the_first_hosts_train_the_rest_wait_as_spares():
    chosen = choose(list(reversed(HOSTS)), 4, 1, [], 0)     # numbered in sorted order
    assert (chosen.nodes, chosen.spares) == (HOSTS[:4], ["n005"])
    assert choose(HOSTS, None, 2, [], 0).nodes == HOSTS[:3]     # all but the spares


def test_excluded_hosts_stay_out_and_the_minimum_is_kept():
    chosen = choose(HOSTS, 4, 1, ["n002"], 0)
    assert chosen.nodes == ["n001", "n003", "n004", "n005"] and chosen.spares == []
    assert chosen.notes[0] == "left out (EXCLUDE_NODES): n002"
    with pytest.raises(ConfigError, match=r"^NODES=4 but the allocation has only 2 usable"
                                          r" hosts \(MIN_NODES=0\)$"):
        choose(HOSTS, 4, 1, HOSTS[:3], 0)
    fewer = choose(HOSTS, 4, 1, HOSTS[:3], 2)
    assert fewer.nodes == ["n004", "n005"] and "going on with 2" in fewer.notes[1]
    with pytest.raises(ConfigError, match="below MIN_NODES=5"):
        choose(HOSTS, 4, 0, [], 5)
    with pytest.raises(OperationError, match="no hosts"):
        choose([], 1, 0, [], 0)


def test_a_lost_node_is_replaced_by_a_spare_that_is_up():
    after = replace(HOSTS[:4], ["n005"], {"n001", "n003", "n004", "n005"}, 0)
    assert (after.nodes, after.spares) == (["n001", "n003", "n004", "n005"], [])
    assert after.notes == ["lost n002; replaced by spares; node set now n001,n003,n004,n005"]
    same = replace(HOSTS[:4], ["n005"], set(HOSTS), 0)
    assert same.nodes == HOSTS[:4] and same.notes == ["every node of the set is up"]
    down_spare = replace(HOSTS[:4], ["n005"], set(HOSTS[:4]), 0)
    assert down_spare.spares == []                          # a spare that is down is gone


def test_too_few_spares_shrink_down_to_min_nodes_or_end_the_job():
    up = {"n001", "n004", "n005"}
    shrunk = replace(HOSTS[:4], ["n005"], up, 3)
    assert shrunk.nodes == ["n001", "n004", "n005"] and shrunk.spares == []
    assert shrunk.notes[0].startswith("lost 2 nodes (n002 n003), only 1 spares left:"
                                      " going on with 3 of 4 nodes (MIN_NODES=3)")
    with pytest.raises(OperationError, match=r"3 nodes, below MIN_NODES=4$"):
        replace(HOSTS[:4], ["n005"], up, 4)
    with pytest.raises(OperationError, match=r"recovery needs 4 nodes \(MIN_NODES=0"):
        replace(HOSTS[:4], ["n005"], up, 0)


def test_the_config_is_real_toml_read_back_as_the_agents_read_it(tmp_path):
    odd = 'we"ird\\path\n'
    job = JobConfig(run="r", spool=f"/s/{odd}", stage="/t", cache="/c", pfs=str(tmp_path),
                    exclude=["n001", "n002"], min_nodes=2, extra='[keep]\nreplica = 1',
                    job="42")
    cfg = write_job_config(tmp_path / "sub" / "c.toml", job)
    assert cfg.paths.spool == f"/s/{odd}"                  # escaped, not broken
    assert cfg.topology.exclude == ("n001", "n002") and cfg.topology.min_nodes == 2
    assert cfg.keep.replica == 1
    assert stat.S_IMODE(os.stat(tmp_path / "sub" / "c.toml").st_mode) == 0o600
    assert load(tmp_path / "sub" / "c.toml", environ={}).run == "r"


def test_a_bad_extra_line_ends_the_job_naming_its_key(tmp_path):
    job = JobConfig(run="r", spool="/s", stage="/t", cache="/c", pfs=str(tmp_path),
                    extra="[keep]\nreplica = -1")
    with pytest.raises(ConfigError, match=r"^keep.replica: "):
        write_job_config(tmp_path / "c.toml", job)


def test_the_loop_reads_the_newest_held_checkpoint_in_one_line():
    status = {"state": "not running", "heartbeat": {"life": "abc"}, "checkpoints": [
        {"id": "s3", "seq": 3, "level": "failed"}, {"id": "s1", "seq": 1, "level": "flushed"},
        {"id": "s2", "seq": 2, "level": "captured"}, {"id": "s4", "seq": 4, "level": "written"}]}
    assert state_words(status) == ["not-running", "abc", "s4", "written", "2", "1"]
    assert state_words({}) == ["-", "-", "-", "-", "0", "0"]


def test_withdraw_stop_removes_the_runs_stop_requests(tmp_path):
    cfg_file = tmp_path / "c.toml"
    write_job_config(cfg_file, JobConfig(run="r", spool=str(tmp_path / "s"),
                                         stage=str(tmp_path / "t"), cache=str(tmp_path / "c"),
                                         pfs=str(tmp_path / "p"), domain="rank"))
    here = load(cfg_file, environ={}).node_paths(0)
    requests = [pfs_stop_file(here.pfs), journal_stop_file(here.journal)]
    for path in requests:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    out = CliRunner().invoke(cli.main_group, ["job", "withdraw-stop", "--config", str(cfg_file)])
    assert out.exit_code == 0, out.output
    assert not any(path.exists() for path in requests)
