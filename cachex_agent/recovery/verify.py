"""`cachex verify CKPT`: checksums of every copy visible from here, level by level."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..checksum import file_checksum
from ..config import Config
from ..errors import OperationError, describe
from ..flush.bundle import verify_bundle
from ..layout import bundle_path, parity_dir, replica_dir, replica_manifest_path
from ..manifest import FileEntry
from ..peer.parity import ParityManifest, check_member
from ..peer.partners import replication_map
from ..peer.redundancy import redundancy_of
from ..progress import Done, Progress, quiet
from .catalog import global_manifest, level_of, local_manifests, node_count

# What each level promises (docs/levels.md): a copy the level does not promise is skipped
# with the reason, never judged, so a checkpoint still flushing (or on a full PFS) passes.
_RANK = {"written": 0, "captured": 1, "replicated": 2, "flushed": 3}
_PROMISED_AT = {"stage": 1, "replica": 2, "parity": 2, "pfs": 3}
_NOT_YET = {"stage": "not yet captured", "replica": "not yet replicated",
            "parity": "not yet encoded", "pfs": "not yet flushed"}


@dataclass
class Finding:
    level: str              # stage | replica | parity | pfs
    node: int               # whose data
    where: str
    checked: bool           # False: not visible here, not kept, or not promised
    problems: list[str] = field(default_factory=list)
    note: str = "not visible here"
    bytes: int = 0          # what checking it reads
    check: Callable[[Done], list[str]] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.checked and not self.problems


def verify(config: Config, ckpt: str, progress: Progress | None = None) -> list[Finding]:
    """Every copy found first, then each visible one read (so the bytes are known)."""
    progress = progress or quiet()
    gm = global_manifest(config, ckpt)
    nodes = len(gm.nodes) if gm else node_count(config)
    locals_ = local_manifests(config, ckpt, nodes)
    expected = {n: gm.node_files(n) for n in range(nodes)} if gm else {
        n: m.files for n, m in locals_.items()}
    if not expected:
        raise OperationError(f"{ckpt}: unknown checkpoint (no global or local manifest found)")
    hosts = {n["node"]: n["host"] for n in gm.nodes} if gm else {
        n: m.host for n, m in locals_.items()}
    findings = [_stage(config, ckpt, node, hosts.get(node), files)
                for node, files in sorted(expected.items())]
    findings += _replicas(config, ckpt, expected, hosts, nodes)
    if redundancy_of(config).parity:
        findings += [_parity(config, ckpt, node, hosts.get(node)) for node in sorted(expected)]
    if gm:
        findings += [_bundle(config, ckpt, node, files) for node, files in sorted(expected.items())]
    _skip_unpromised(findings, level_of(config, ckpt))
    _check_all(ckpt, [f for f in findings if f.checked], progress)
    return findings


def _skip_unpromised(findings: list[Finding], level: str | None) -> None:
    """Unchecks each copy `level` does not promise, naming why."""
    for finding in findings:
        note = _unpromised(finding.level, level)
        if note and finding.checked:
            finding.checked, finding.check, finding.note = False, None, note


def _unpromised(kind: str, level: str | None) -> str | None:
    """Why a copy of `kind` is not expected at `level`, or None when it is promised.
    `level` None: no status or index visible here and no global manifest on the PFS (it
    is written only once every bundle is), so no bundle is promised."""
    if level is None:
        return "not yet flushed (no global manifest on the PFS)" if kind == "pfs" else None
    if level in _RANK:
        return None if _RANK[level] >= _PROMISED_AT[kind] else _NOT_YET[kind]
    return f"not expected ({level})"        # failed, evicted, purged: nothing is promised


def _check_all(ckpt: str, findings: list[Finding], progress: Progress) -> None:
    progress.step(f"verifying {len(findings)} copies of {ckpt}")
    progress.start(f"verify {ckpt}", sum(f.bytes for f in findings))
    for finding in findings:
        assert finding.check is not None
        finding.problems = finding.check(progress.advance)
    progress.finish()


def _stage(config: Config, ckpt: str, node: int, host: str | None,
           files: list[FileEntry]) -> Finding:
    directory = config.node_paths(node, host=host).stage_dir(ckpt)
    # another host's stage is not visible, and one of an unknown host may be anyone's
    here = host == socket.gethostname()
    return _visible(Finding("stage", node, str(directory), here and directory.is_dir()),
                    directory, files)


def _visible(finding: Finding, directory: Path, files: list[FileEntry]) -> Finding:
    """A finding to be checked file by file when it is visible."""
    if finding.checked:
        finding.bytes = sum(e.size for e in files)
        finding.check = lambda done: check_files(directory, files, done)
    return finding


def _replicas(config: Config, ckpt: str, expected: dict[int, list[FileEntry]],
              hosts: dict[int, str], nodes: int) -> list[Finding]:
    pmap = replication_map(config, [hosts[n] for n in range(nodes)]) \
        if sorted(hosts) == list(range(nodes)) else None
    if pmap is None or not redundancy_of(config).replicas:
        return []
    return [_replica(config, ckpt, owner, partner, hosts[partner], files)
            for owner, files in sorted(expected.items()) for partner in pmap[owner]]


def _replica(config: Config, ckpt: str, owner: int, partner: int, host: str,
             files: list[FileEntry]) -> Finding:
    root = config.node_paths(partner, host=host).replicas
    directory = replica_dir(root, owner, ckpt)
    here = host == socket.gethostname()
    finding = Finding("replica", owner, f"{directory} (on node {partner})", here)
    if here and not replica_manifest_path(root, owner, ckpt).exists():
        finding.checked, finding.note = False, "not held (not replicated, or evicted)"
    return _visible(finding, directory, files)


def _parity(config: Config, ckpt: str, node: int, host: str | None) -> Finding:
    """The node's share of its erasure group's parity (peer.scheme xor, rs:K+M), and its
    staged part's data chunks as encoded: each chunk against the parity manifest."""
    paths = config.node_paths(node, host=host)
    here = host in (None, socket.gethostname())
    finding = Finding("parity", node, str(parity_dir(paths.parity, ckpt)), here)
    if not here:
        return finding
    try:
        manifest = ParityManifest.load(paths.parity, ckpt)
    except (OSError, ValueError, OperationError) as exc:
        finding.checked, finding.note = False, f"not held ({describe(exc)})"
        return finding
    source = paths.stage_dir(ckpt)
    source = source if source.is_dir() else None
    finding.bytes = manifest.m * manifest.chunk + (manifest.k * manifest.chunk if source else 0)

    def check(done: Done) -> list[str]:
        problems = check_member(paths.parity, ckpt, source)
        done(finding.bytes)
        return [f"{what}: {why}" for what, why in problems.items()]
    finding.check = check
    return finding


def _bundle(config: Config, ckpt: str, node: int, files: list[FileEntry]) -> Finding:
    path = bundle_path(config.node_paths(0).pfs, ckpt, node)
    size = sum(e.size for e in files)

    def check(done: Done) -> list[str]:
        problems = verify_bundle(path, files) if path.exists() else [f"{path}: missing"]
        done(size)
        return problems
    return Finding("pfs", node, str(path), True, bytes=size, check=check)


def check_files(directory: Path, files: list[FileEntry], done: Done | None = None
                ) -> list[str]:
    problems = []
    for entry in files:
        path = directory / entry.path
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{path}: size {path.stat().st_size}, expected {entry.size}")
        elif file_checksum(path) != entry.checksum:
            problems.append(f"{path}: checksum mismatch")
        if done is not None:
            done(entry.size)
    return problems
