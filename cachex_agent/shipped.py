"""The files that ship beside the package: the job templates and the demo's trainer.

In the repository they stay where the tests, the docs and the templates themselves name
them (`scripts/...`, `examples/trainer.py`); a wheel installs them under
`<prefix>/share/cachex-agent/` (pyproject's data-files). A checkout, which is also what
an editable install points at, is preferred so that an edit there is what runs.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from .errors import ConfigError, OperationError
from .fsutil import atomic_open, makedirs

# the directories of `scripts/` that `cachex templates DIR` writes out (not `ci/`, which
# sets up this repository's test machine); the files are what pyproject ships
TEMPLATE_DIRS = ("slurm", "pbs", "lib")
TRAINER = "examples/trainer.py"
_MARK = "scripts/lib/cachex-job.sh"     # present in every candidate that has the files


def _candidates() -> list[Path]:
    checkout = Path(__file__).resolve().parents[1]
    installed = [Path(sysconfig.get_path("data", scheme)) / "share" / "cachex-agent"
                 for scheme in (sysconfig.get_default_scheme(), f"{os.name}_user")
                 if scheme in sysconfig.get_scheme_names()]
    # a checkout has its pyproject beside the package; site-packages has none
    return ([checkout] if (checkout / "pyproject.toml").is_file() else []) + installed


def shipped_root() -> Path:
    """The directory holding `scripts/` and `examples/trainer.py`."""
    candidates = _candidates()
    for root in candidates:
        if (root / _MARK).is_file() and (root / TRAINER).is_file():
            return root
    raise OperationError("the job templates and the example trainer are not installed"
                         f" (looked in {', '.join(map(str, candidates))}): reinstall"
                         " cachex-agent from its wheel or a checkout")


def trainer() -> Path:
    return shipped_root() / TRAINER


def templates() -> dict[str, Path]:
    """Each template's path relative to the templates directory, and where it is now."""
    scripts = shipped_root() / "scripts"
    return {p.relative_to(scripts).as_posix(): p for d in TEMPLATE_DIRS
            for p in sorted((scripts / d).iterdir()) if p.is_file()}


def write_templates(dest: Path, force: bool = False) -> list[Path]:
    """Copy the templates to `dest/<slurm|pbs|lib>/...`, each with its own mode bits.
    Nothing is written when one would replace an existing file and `force` is not set."""
    sources = templates()
    targets = {dest / name: source for name, source in sources.items()}
    existing = next((t for t in targets if t.exists() or t.is_symlink()), None)
    if existing is not None and not force:
        raise ConfigError(f"{existing}: exists (give --force to overwrite it)")
    for target, source in targets.items():
        makedirs(target.parent)
        with atomic_open(target, source.stat().st_mode) as handle:
            handle.write(source.read_bytes())
    return list(targets)
