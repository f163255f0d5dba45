"""Commit rules: when is a checkpoint in the spool complete?

A checkpoint is a top-level directory of the spool (or a single file at its root); its
id is that name. Data files are never written atomically, so a rule trusts only
something the framework writes last (usually on one node only: the agents forward what
they see to the coordinator, which announces the commit to everyone). A rule also says
which files only one node writes ("global files", mirrored to every node after a
commit), which files are temporary and never captured, and, for a framework, how `auto`
recognises its layout.

One module per framework (frameworks.py lists them); what each read in its framework's
code is in docs/levels.md. Rules keep memory between calls (trackers, settle timers)
and are not thread-safe: one caller (the SpoolWatcher) serializes them; the methods the
capture thread calls say that they keep no state.
"""

from __future__ import annotations

from ..names import is_checkpoint_name, natural_key, natural_sorted
from .accelerate import AccelerateRule
from .auto import AutoRule, detect_kind
from .base import CommitRule, checkpoint_names, is_temp_file
from .dcp import DcpRule
from .deepspeed import DeepSpeedRule
from .hf import HfRule
from .marker import MarkerRule
from .megatron import MegatronRule
from .orbax import OrbaxRule
from .registry import RULE_NAMES, RULES, make_rule, rules_table, tracker_names, tracker_text
from .settle import QuiescenceRule
from .torch_file import TorchFileRule

__all__ = [
    "RULES",
    "RULE_NAMES",
    "AccelerateRule",
    "AutoRule",
    "CommitRule",
    "DcpRule",
    "DeepSpeedRule",
    "HfRule",
    "MarkerRule",
    "MegatronRule",
    "OrbaxRule",
    "QuiescenceRule",
    "TorchFileRule",
    "checkpoint_names",
    "detect_kind",
    "is_checkpoint_name",
    "is_temp_file",
    "make_rule",
    "natural_key",
    "natural_sorted",
    "rules_table",
    "tracker_names",
    "tracker_text",
]
