"""API keys read from flag values and files."""

from __future__ import annotations

import pytest

from frontend.auth import read_keys

pytestmark = pytest.mark.unit


def test_api_keys_from_values_and_files(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nk3\n\nk1\n")
    assert read_keys(["k1, k2", f"@{path}", ""]) == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="does not exist"):
        read_keys(["@/nonexistent/keys"])
