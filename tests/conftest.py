"""Marks shared by every test directory."""

from __future__ import annotations

import pytest

from tests.helpers.launch import SCENARIO_TIMES, WALL_TIMES
from tests.helpers.selection import MARK_HELP


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARK_HELP)
    config.addinivalue_line(
        "markers",
        "slow: a multi-process test outside the fast tier (`pytest -m 'not slow'`: the unit tests and one small launch "
        "per world size, tests/distributed/conftest.py's FAST_TIER)",
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each multi-process launch's wall time, slowest first: a launch shared by many tests hides inside the one test
    that started it, so ``--durations`` alone does not show which launch to fold or trim."""
    if not WALL_TIMES:
        return
    total = sum(seconds for seconds, _ in WALL_TIMES)
    terminalreporter.write_sep("=", f"{len(WALL_TIMES)} launches, {total:.0f} s of wall time")
    for seconds, label in sorted(WALL_TIMES, reverse=True):
        terminalreporter.write_line(f"{seconds:7.1f} s  {label}")
    if SCENARIO_TIMES:  # inside the largest launches: what to fold or trim first
        terminalreporter.write_sep("-", "slowest scenarios inside launches")
        for seconds, label in sorted(SCENARIO_TIMES, reverse=True)[:15]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {label}")
