"""Namespaced virtual nodes cannot see each other's node-local files, shared memory,
processes or hostname; the PFS is shared; MPI between them goes over their veths."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_node_cannot_see_another_nodes_files(ns_cluster):
    c = ns_cluster(nodes=2)
    zero, one = c.live
    written = zero.run("sh", "-ec", f"mkdir -p {c.local}/nvme/t/journal /dev/shm/cachex/t\n"
                       f"echo zero > {c.local}/nvme/t/journal/mine\n"
                       "echo zero > /dev/shm/cachex/t/staged\n"
                       f"echo shared > {c.root}/pfs/both\n"
                       "sleep 600 >/dev/null 2>&1 & echo $!")
    assert written.returncode == 0, written.stderr
    sleeper = written.stdout.split()[-1]
    for path in (f"{c.local}/nvme/t/journal/mine", "/dev/shm/cachex/t/staged"):
        assert zero.run("cat", path).stdout == "zero\n"
        seen = one.run("cat", path)
        assert seen.returncode != 0 and "No such file" in seen.stderr, seen
        assert not (c.root / "local" / "nvme").exists()       # nor from the host
    assert one.run("cat", f"{c.root}/pfs/both").stdout == "shared\n"
    assert zero.run("hostname").stdout.split() == ["cx-node0"]
    assert one.run("hostname").stdout.split() == ["cx-node1"]
    assert one.run("kill", "-0", sleeper).returncode != 0    # node 0's pid is not on node 1
    assert one.run("ip", "-o", "-4", "addr", "show", "eth0").stdout.split()[3] == \
        f"{one.address}/24"


def test_mpi_ranks_see_their_own_hostnames_and_reach_each_other_over_eth0(ns_cluster):
    c = ns_cluster(nodes=2)
    before = c.live[1].sent()
    program = ("from mpi4py import MPI; import socket, numpy as n; c = MPI.COMM_WORLD;"
               " a = n.full(1 << 22, c.rank, n.uint8); b = n.empty_like(a);"
               " c.Sendrecv(a, 1 - c.rank, recvbuf=b, source=1 - c.rank);"
               " seen = c.gather(f'{c.rank} {socket.gethostname()} {int(b[0])}');"
               " c.rank or print('|'.join(seen), flush=True)")
    proc = c.mpiexec(c.bin.joinpath("python").as_posix(), "-c", program)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, out
    # one line from rank 0 (two ranks' prints can interleave in mpiexec's output)
    assert "0 cx-node0 1|1 cx-node1 0" in out.splitlines(), out
    # node 1's 4 MiB went out through its veth, not through memory
    assert c.live[1].sent() - before >= 1 << 22
