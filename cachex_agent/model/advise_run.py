"""`cachex advise` end to end: record a failure if asked, combine the rates, advise, leave
the advice for `status --json` and the metrics, and say it."""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..errors import ConfigError
from .advice_store import save_advice
from .advise import advice_text, advise
from .history import History
from .predict import SystemModel
from .rates import exposure, failure_rates, failures_path, read_failures, record_failure


def run_advise(config: Config, history: History, model: SystemModel, size: float, nodes: int,
               current: float, record: str | None = None, lost: int = 1, drill: bool = False
               ) -> tuple[str, dict[str, Any]]:
    """The advice as text and as JSON; with `record`, the failure is appended first."""
    recorded = failures_path(config.node_paths(0).pfs)
    if record:
        if not recorded.parent.is_dir():
            raise ConfigError(f"--record: the run's PFS directory {recorded.parent} does not"
                              " exist (give --config of a run that started)")
        record_failure(recorded, record, lost if record == "node" else 1, drill)
    rates = failure_rates(config.model, read_failures(recorded), exposure(history.sources))
    advice = advise(model, history, config, size, nodes, current, rates)
    data = advice.to_json()
    save_advice(config, data)
    return advice_text(advice), data
