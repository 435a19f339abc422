"""Fixtures of the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llama_cpp_reference import fetch_converter


@pytest.fixture(scope="session")
def converter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's own converter folder, fetched once a session (tests/llama_cpp_reference.py)."""
    return fetch_converter(tmp_path_factory.mktemp("sdist"))
