"""versions.py: a save under a reused name gets an id of its own."""

from __future__ import annotations

from cachex_agent.versions import next_version, split, trainer_name, versioned


def test_the_first_save_keeps_the_name_and_later_ones_are_numbered():
    assert versioned("ckpt.pt", 1) == "ckpt.pt"
    assert versioned("ckpt.pt", 3) == "ckpt.pt@v3"
    assert split("ckpt.pt@v3") == ("ckpt.pt", 3)
    assert trainer_name("latest@v12") == "latest"


def test_names_that_only_look_like_versions_stay_names():
    for name in ("run@v", "@v2", "x@v1", "x@v02", "x@vtwo", "step_00008"):
        assert split(name) == (name, 1)


def test_next_version_counts_only_that_name():
    known = ["ckpt.pt", "ckpt.pt@v2", "other.pt@v7", "latest"]
    assert next_version("ckpt.pt", known) == "ckpt.pt@v3"
    assert next_version("latest", known) == "latest@v2"
    assert next_version("new.pt", known) == "new.pt"
