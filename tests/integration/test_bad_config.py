"""Bad configurations stop the real agent before it starts: under `mpiexec -n 2`, exit 2,
one line on stderr naming the key, no traceback, and nothing created on disk (no stage,
cache or PFS run directory, no MPI window)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from harness import BIN, MPIEXEC, Cluster, kill_tree

HUGE = "1" * 400


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _run_agents(config: Path, timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.Popen([str(MPIEXEC), "-n", "2", str(BIN / "cachex-agent"), "--config",
                             str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError("the agents started instead of refusing the configuration"
                             ) from None
    return proc.returncode, err


# (case, sections appended to the configuration, path lines replaced, keys the error names)
CASES = [
    ("400-digit bandwidth", f'[flush]\nbandwidth = "{HUGE}"\n', {}, ["flush.bandwidth"]),
    ("nan bandwidth", "[flush]\nbandwidth = nan\n", {}, ["flush.bandwidth"]),
    ("infinite drain timeout", "[flush]\ndrain_timeout = inf\n", {}, ["flush.drain_timeout"]),
    ("64TiB slot", '[peer]\nslot = "64TiB"\n', {}, ["peer.slot"]),
    ("1TiB chunk", '[flush]\nchunk = "1TiB"\n', {}, ["flush.chunk"]),
    ("rs group is not K+M", '[peer]\nscheme = "rs:2+2"\ngroup = 5\n', {}, ["peer.group"]),
    ("rs without parity", '[peer]\nscheme = "rs:4+0"\n', {}, ["peer.scheme"]),
    ("unknown capture method", '[stage]\ncapture = "reflink"\n', {}, ["stage.capture"]),
    ("window past memory", '[peer]\nslot = "1GiB"\nslots = 1024\n', {},
     ["peer.slot", "peer.slots"]),
    ("spool is the PFS run directory", "", {"spool": "{root}/pfs/t"},
     ["paths.spool", "paths.pfs"]),
    ("stage is the spool", "", {"stage": "{root}/node{{node}}/spool"},
     ["paths.spool", "paths.stage"]),
    ("cache inside the spool, through ..", "", {"cache": "{root}/node{{node}}/shm/../spool"},
     ["paths.spool", "paths.cache"]),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case,extra,paths,keys", CASES, ids=[c[0] for c in CASES])
def test_bad_configuration_refused_before_start(tmp_path, case, extra, paths, keys):
    c = Cluster(tmp_path, nodes=2, extra=extra)
    try:
        text = c.config.read_text()
        for name, value in paths.items():
            old = next(line for line in text.splitlines() if line.startswith(f"{name} = "))
            text = text.replace(old, f'{name} = "{value.format(root=tmp_path)}"')
        c.config.write_text(text)
        before = _tree(tmp_path)
        code, err = _run_agents(c.config)
        assert code == 2, f"{case}: exit {code}\n{err[-3000:]}"
        assert "Traceback" not in err, err[-3000:]
        lines = err.splitlines()
        assert len(lines) == 1, f"{case}: {len(lines)} lines on stderr:\n{err[-3000:]}"
        assert lines[0].startswith("cachex-agent: error: "), lines[0]
        assert len(lines[0]) < 400, lines[0]            # a huge value is shortened
        for key in keys:
            assert key in lines[0], (key, lines[0])
        assert _tree(tmp_path) == before                # no stage, cache or PFS run dir
    finally:
        c.close()
