"""Fold into one launch only the scenarios of the tests pytest selected.

A session fixture that launches a worker once for many tests (a cold multi-process start costs far more than a case)
asks :func:`selected_scenarios` which scenarios to run. Each test says what it reads with a mark::

    @pytest.mark.scenarios("tp2", "qwen3_sgd")            # launch "tp2", one scenario
    @pytest.mark.parametrize("name", [...])
    @pytest.mark.scenarios("{layout}", "error:{name}")    # fields filled from the test's parameters

so ``pytest -k qwen3_sgd`` launches the TP 2 job with ``qwen3_sgd`` alone, and the whole run still folds every case
into one launch per layout. A selected test that requests the launch's fixture but carries no mark for it gets every
scenario of the launch (slow, never wrong). A scenario named by a mark and missing from the launch's default list is
run too (after the others), so a new test needs only its mark and the worker's registered scenario.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

MARK = "scenarios"
MARK_HELP = (
    f"{MARK}(launch, *names): the scenarios of a folded multi-process launch that the test reads; "
    "'{param}' fields are filled from the test's parameters"
)


def _params(item: pytest.Item) -> dict:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def marked_scenarios(item: pytest.Item) -> dict[str, list[str]]:
    """Launch -> scenario names, from the item's marks (parameter fields filled in)."""
    params = _params(item)
    found: dict[str, list[str]] = {}
    for mark in item.iter_markers(MARK):
        launch, *names = (str(arg).format(**params) for arg in mark.args)
        found.setdefault(launch, []).extend(names)
    return found


def selected_scenarios(items: Iterable[pytest.Item], *, launch: str, fixture: str, default: Sequence[str]) -> list[str]:
    """The scenarios of ``launch`` that the selected ``items`` need, in the order of ``default`` (then the extra
    ones, in the order met)."""
    wanted: dict[str, None] = {}
    for item in items:
        marked = marked_scenarios(item)
        if launch in marked:
            wanted.update(dict.fromkeys(marked[launch]))
        elif fixture in getattr(item, "fixturenames", ()):  # reads the launch but does not say what: run it all
            wanted.update(dict.fromkeys(default))
    return [name for name in default if name in wanted] + [name for name in wanted if name not in default]


def scenario_result(results: list[dict], name: str, *, rank: int = 0) -> dict:
    """What ``rank`` recorded for scenario ``name`` of a folded launch; fails with the worker's traceback if it
    crashed, or with the fix if the launch did not run it."""
    if name not in results[rank]:
        raise AssertionError(
            f"scenario {name!r} was not launched (ran: {sorted(results[rank])}); name it in the test's "
            f"`@pytest.mark.{MARK}(...)`"
        )
    result = results[rank][name]
    assert "crash" not in result, result.get("crash")
    return result
