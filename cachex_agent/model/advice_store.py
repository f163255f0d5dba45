"""Where `cachex advise` leaves its advice for `cachex status --json` and the metrics:
`<pfs>/<run>/advice.json`, replaced whole (atomic, 0600). Imports nothing of the model's
extra, so `status` reads it without scipy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config
from ..fsutil import read_json, write_json

ADVICE_FILE = "advice.json"


def advice_path(config: Config) -> Path:
    return config.node_paths(0).pfs / ADVICE_FILE


def save_advice(config: Config, advice: dict[str, Any]) -> Path | None:
    """Write the advice beside the run's PFS data; None when the run has no PFS directory
    (events read from elsewhere: nothing to attach it to)."""
    path = advice_path(config)
    if not path.parent.is_dir():
        return None
    write_json(path, advice)
    return path


def load_advice(config: Config) -> dict[str, Any] | None:
    """The last advice, or None (never given, or unreadable: status must not fail on it)."""
    try:
        data = read_json(advice_path(config))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
