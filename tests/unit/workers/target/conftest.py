"""Shared fixtures of the target worker's unit tests."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import tiny_hf_model
from workers.engine.weights import load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama (tests/support/tiny_models.py), loaded once per test module."""
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", path)
    return load_model(path)
