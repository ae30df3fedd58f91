"""docs/cli.md is what the parsers say today."""

import pytest

from deploy.cli_reference import DOC, render

pytestmark = pytest.mark.unit


def test_cli_reference_is_current():
    assert DOC.read_text() == render(), "docs/cli.md is stale: run python -m deploy.cli_reference"


def test_configuration_reference_is_current():
    from deploy.cli_reference import CONFIG_DOC, render_configuration

    assert CONFIG_DOC.read_text() == render_configuration(), \
        "docs/configuration.md is stale: run python -m deploy.cli_reference"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--bogus"]])
def test_help_and_unknown_arguments_write_nothing(argv, tmp_path, monkeypatch, capsys):
    """``python -m deploy.cli_reference --help`` prints help (an unknown argument: a usage error) and
    touches neither file."""
    import deploy.cli_reference as ref

    docs = {name: tmp_path / f"{name}.md" for name in ("cli", "configuration")}
    for path in docs.values():
        path.write_text("untouched")
    monkeypatch.setattr(ref, "DOC", docs["cli"])
    monkeypatch.setattr(ref, "CONFIG_DOC", docs["configuration"])
    monkeypatch.setattr(ref, "ROOT", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        ref.main(argv)
    assert exit_.value.code == (2 if argv == ["--bogus"] else 0)
    assert [p.read_text() for p in docs.values()] == ["untouched", "untouched"]
    out = capsys.readouterr()
    assert "usage: python -m deploy.cli_reference" in (out.err if argv == ["--bogus"] else out.out)


def test_without_arguments_it_writes_both(tmp_path, monkeypatch):
    import deploy.cli_reference as ref

    monkeypatch.setattr(ref, "DOC", tmp_path / "cli.md")
    monkeypatch.setattr(ref, "CONFIG_DOC", tmp_path / "configuration.md")
    monkeypatch.setattr(ref, "ROOT", tmp_path)
    monkeypatch.setattr(ref, "render", lambda: "cli")
    monkeypatch.setattr(ref, "render_configuration", lambda: "configuration")
    ref.main([])
    assert (tmp_path / "cli.md").read_text() == "cli" and (tmp_path / "configuration.md").read_text() == "configuration"
    with pytest.raises(SystemExit):  # --check against a stale file fails
        (tmp_path / "cli.md").write_text("old")
        ref.main(["--check"])
