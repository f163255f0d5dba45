"""Peer replication between two nodes that share no memory (root): benchmarks/replicate.py
run on two namespaced virtual nodes (benchmarks/namespaces.py), MPI over TCP through
their veths (UCX_TLS=tcp,self, UCX_NET_DEVICES=eth0), with a raw TCP stream between the
same two namespaces over the same eth0 in the same run (replicate.py --tcp: put, write,
replicate and tcp alternate, rotated every repeat).

Each node's stage (/dev/shm) and cache (the replicas, on a private tmpfs) are its own;
the configuration and the benchmark's shared directory sit on the host's /tmp, which the
nodes share. Prints replicate.py's lines; its last ones are the ratios (`tcp ratio`:
replication against min(raw TCP, raw write); raw Put against raw TCP), also in --json.

    sudo python benchmarks/replicate_tcp.py [--size 512MiB] [--repeat 3] [--json FILE]
                                            [replicate.py options]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from namespaces import Nodes

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--tmpfs", default="2g", help="size of each node's private tmpfs"
                                                      " and /dev/shm (room for --size)")
    args, rest = parser.parse_known_args(argv)
    if os.geteuid() != 0:
        print("replicate_tcp: needs root (namespaces, veths, mounts)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="cachex-bench-tcp-"))
    local = workdir / "local"
    nodes = Nodes(workdir, local, sizes=(args.tmpfs, args.tmpfs))
    try:
        nodes.add()
        nodes.add()
        shared = workdir / "shared"
        shared.mkdir()
        command = [sys.executable, str(HERE / "replicate.py"), "--size", args.size, "--dir",
                   str(shared), "--cache", str(local), "--tcp", "--iface", "eth0", *rest]
        return subprocess.run(nodes.mpiexec(command), env=nodes.env(),
                              timeout=3600).returncode
    finally:
        nodes.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
