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
