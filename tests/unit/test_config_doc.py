"""docs/configuration.md is the generator's output, and the generator covers every key."""

from pathlib import Path

from cachex_agent import config
from cachex_agent.config_doc import markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_md_is_generated_from_config():
    assert DOC.read_text() == markdown(), (
        "docs/configuration.md differs from the definitions in cachex_agent/config.py;"
        " regenerate it: python -m cachex_agent.config_doc > docs/configuration.md")


def test_every_key_has_a_meaning_and_no_meaning_is_orphaned():
    keys = {row.key for row in config.reference()}
    parsed = {f"{section}.{name}" for section, names in config._PARSERS.items()
              for name in names} | {"run"}
    assert keys == parsed == set(config.MEANINGS)


def test_reference_ranges_are_the_parsers_ranges():
    rows = {row.key: row for row in config.reference()}
    assert rows["peer.copies"].limits == "1 to 64"
    assert rows["peer.slot"].limits == "4KiB to 1GiB"
    assert rows["commit.timeout"].limits == "1s to 720h"
    assert rows["paths.spool"].default == "required"
    assert rows["flush.chunk"].default == "`8MiB`"


def test_the_example_file_loads_to_the_defaults(tmp_path):
    """The generated full file is valid TOML the loader reads back to the defaults."""
    body = markdown().split("## Every key at its default")[1]
    body = body.split("```toml\n", 1)[1].split("```", 1)[0]
    body = (body.replace('spool = "..."', f'spool = "{tmp_path}/spool"')
            .replace('pfs = "..."', f'pfs = "{tmp_path}/pfs"'))
    path = tmp_path / "cachex.toml"
    path.write_text(body)
    loaded = config.load(path, environ={})
    for section in ("topology", "commit", "peer", "flush", "keep", "model", "agent"):
        assert getattr(loaded, section) == type(getattr(loaded, section))(), section
    assert loaded.paths == config.Paths(spool=f"{tmp_path}/spool", pfs=f"{tmp_path}/pfs")
    assert loaded.run == "cachex"
