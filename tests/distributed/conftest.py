"""One torchrun launch per layout, holding every case the selected tests read: a cold multi-process start costs far
more than a case. Which cases each test reads: its ``@pytest.mark.scenarios`` (see tests/helpers/selection.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cases import CHECKPOINT_ENV, LAUNCHES, _lora
from tests.helpers.launch import workers
from tests.helpers.models import build_causal_lm, build_vlm, tiny_config
from tests.helpers.selection import selected_scenarios

WORKER = Path(__file__).with_name("worker.py")

#: The multi-process tests of the fast tier (``pytest -m "not slow"``): one small launch per world size, each folding
#: only the scenario its test reads. Every other test of this directory is marked ``slow``.
FAST_TIER = {
    "test_tp_parity.py::test_tp2_matches_single_process[qwen3_sgd]",  # 2 processes: TP 2
    "test_tp_parity.py::test_2d_matches_single_process[qwen3_sgd]",  # 4 processes: dp_shard 2 x tp 2
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents and f"{item.path.name}::{item.name}" not in FAST_TIER:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checkpoint")
    for kind in ("qwen3", "tied", "qwen3_moe"):
        build_causal_lm(tiny_config(kind)).save_pretrained(path / kind)
    for kind in ("gemma3", "llava"):  # written under their original layouts' names (`language_model.model.*`)
        build_vlm(kind).save_pretrained(path / kind)
    _lora("qwen3").save_pretrained(path / "qwen3_adapter")
    return path


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_env(checkpoint: Path, monkeypatch_session: pytest.MonkeyPatch) -> None:
    monkeypatch_session.setenv(CHECKPOINT_ENV, str(checkpoint))


@pytest.fixture(scope="session")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _launch(request: pytest.FixtureRequest, out: Path, launch: str, nprocs: int, *extra: str) -> list[dict]:
    """Run the scenarios of ``launch`` that the selected tests read, on ``nprocs`` processes; what each rank saw."""
    fixture, default = LAUNCHES[launch]
    scenarios = selected_scenarios(request.session.items, launch=launch, fixture=fixture, default=default)
    if not scenarios:  # requested by a test that reads nothing of it (getfixturevalue without a mark)
        return [{} for _ in range(nprocs)]
    workers(WORKER, nprocs, str(out), *extra, *scenarios)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


@pytest.fixture(scope="session")
def tp2_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None
) -> list[dict]:
    """The TP cases on 2 processes (tp_size inferred: 2)."""
    return _launch(request, tmp_path_factory.mktemp("tp2"), "tp2", 2)


@pytest.fixture(scope="session")
def two_d_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None
) -> list[dict]:
    """2-D cases on 4 processes: dp_shard 2 x tp 2."""
    return _launch(request, tmp_path_factory.mktemp("2d"), "2d", 4, "--tp-size", "2")


@pytest.fixture(scope="session")
def three_d_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _checkpoint_env: None
) -> list[dict]:
    """3-D cases on 8 processes: pp 2 x dp_shard 2 x tp 2."""
    return _launch(request, tmp_path_factory.mktemp("3d"), "3d", 8, "--tp-size", "2")


@pytest.fixture
def layout_results(request: pytest.FixtureRequest, layout: str) -> list[dict]:
    """The launch of the test's ``layout`` parameter ("tp2" or "2d") only: the other one is not started."""
    return request.getfixturevalue(LAUNCHES[layout][0])
