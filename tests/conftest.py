"""Marks shared by every test directory."""

from __future__ import annotations

import pytest

from tests.helpers.selection import MARK_HELP


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARK_HELP)
