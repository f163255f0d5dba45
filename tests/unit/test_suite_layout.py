"""`pytest tests` from the root collects: no two test modules (or helpers beside them)
share a basename, which pytest's default import mode cannot tell apart."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_every_test_module_has_a_basename_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert [n for n, count in names.items() if count > 1] == []
