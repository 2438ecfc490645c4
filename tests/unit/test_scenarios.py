"""The test machinery itself: the scenario registry of the workers, and which scenarios a folded launch runs for the
tests pytest selected (tests/helpers/selection.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.helpers.cases import CASES, ERROR_CASES, LAUNCHES
from tests.helpers.scenarios import Scenarios
from tests.helpers.selection import marked_scenarios, scenario_result, selected_scenarios


def test_registry_runs_by_name_and_names_the_known_ones_for_an_unknown_name() -> None:
    scenarios = Scenarios("worker.py")

    @scenarios.register("double")
    def double(x: int) -> int:
        return 2 * x

    scenarios.add("triple", lambda x: 3 * x)
    assert scenarios.run("double", 4) == 8 and scenarios.run("triple", 2) == 6
    assert list(scenarios) == ["double", "triple"] and "double" in scenarios
    with pytest.raises(ValueError, match=r"worker.py: unknown scenario 'quadruple'; the known ones are \['double', "):
        scenarios.run("quadruple", 1)
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        scenarios.check(["double", "nope"])
    with pytest.raises(ValueError, match="'double' is registered twice"):
        scenarios.add("double", double)


def test_every_scenario_of_the_parity_launches_is_registered_in_the_worker() -> None:
    from tests.distributed.worker import SCENARIOS

    for _, default in LAUNCHES.values():
        SCENARIOS.check(default)
    assert set(CASES) | {f"error:{name}" for name in ERROR_CASES} <= set(SCENARIOS)


@dataclass
class Item:
    """What selection reads of a pytest item: its marks, parameters and fixtures."""

    marks: list[Any] = field(default_factory=list)
    params: dict[str, Any] | None = None
    fixturenames: tuple[str, ...] = ()

    @property
    def callspec(self) -> Any:
        return None if self.params is None else type("CallSpec", (), {"params": self.params})()

    def iter_markers(self, name: str):
        return (mark.mark for mark in self.marks if mark.mark.name == name)


DEFAULT = ["a", "b", "error:x", "c"]


def _select(*items: Item) -> list[str]:
    return selected_scenarios(items, launch="tp2", fixture="tp2_results", default=DEFAULT)


def test_marks_fill_their_fields_from_the_parameters() -> None:
    item = Item(
        [pytest.mark.scenarios("{layout}", "{name}", "b"), pytest.mark.scenarios("2d", "c")],
        params={"layout": "tp2", "name": "error:x"},
    )
    assert marked_scenarios(item) == {"tp2": ["error:x", "b"], "2d": ["c"]}


def test_only_the_selected_tests_scenarios_are_launched_in_the_default_order() -> None:
    assert _select(Item([pytest.mark.scenarios("tp2", "c", "a")])) == ["a", "c"]
    # Another launch's scenarios are not this one's.
    assert _select(Item([pytest.mark.scenarios("2d", "a")], fixturenames=("two_d_results",))) == []
    # Parametrized: one test id selects one case.
    param = Item([pytest.mark.scenarios("tp2", "error:{name}")], params={"name": "x"}, fixturenames=("tp2_results",))
    assert _select(param) == ["error:x"]


def test_a_test_without_a_mark_gets_the_whole_launch_and_new_names_run_last() -> None:
    unmarked = Item(fixturenames=("tp2_results",))
    assert _select(unmarked) == DEFAULT
    assert _select(Item([pytest.mark.scenarios("tp2", "new", "b")])) == ["b", "new"]
    assert _select(unmarked, Item([pytest.mark.scenarios("tp2", "new")])) == [*DEFAULT, "new"]
    assert _select(Item(fixturenames=("something_else",))) == []


def test_a_scenario_that_was_not_launched_names_the_fix() -> None:
    results = [{"a": {"losses": [1.0]}, "b": {"crash": "Traceback: boom"}}]
    assert scenario_result(results, "a") == {"losses": [1.0]}
    with pytest.raises(AssertionError, match=r"scenario 'c' was not launched .*@pytest.mark.scenarios"):
        scenario_result(results, "c")
    with pytest.raises(AssertionError, match="boom"):
        scenario_result(results, "b")
