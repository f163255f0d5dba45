"""The frameworks `auto` recognises, asked in the order of their `priority`: to add
one, write its rule in a module of its own and name it here."""

from __future__ import annotations

from .accelerate import AccelerateRule
from .base import CommitRule
from .dcp import DcpRule
from .deepspeed import DeepSpeedRule
from .hf import HfRule
from .megatron import MegatronRule
from .orbax import OrbaxRule

FRAMEWORKS: tuple[type[CommitRule], ...] = tuple(sorted(
    (MegatronRule, DcpRule, DeepSpeedRule, AccelerateRule, HfRule, OrbaxRule),
    key=lambda rule: rule.priority))
