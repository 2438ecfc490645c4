"""examples/cli.py and its configs: every config trains a few steps under torchrun (the configs of one world size in
one launch); --print_config round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.launch import run_script, workers
from tests.helpers.selection import selected_scenarios

WORKER = Path(__file__).with_name("cli_worker.py")
CONFIGS = {"tp.yaml": 2, "lora.yaml": 2, "2d.yaml": 4, "cp.yaml": 2, "ep.yaml": 2}


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Each selected config's global step on every rank, by config: one launch per world size."""
    steps: dict[str, list[dict]] = {}
    for nprocs in sorted(set(CONFIGS.values())):
        launch = f"cli{nprocs}"
        default = [name for name, size in CONFIGS.items() if size == nprocs]
        configs = selected_scenarios(request.session.items, launch=launch, fixture="trained", default=default)
        if not configs:
            continue
        out = tmp_path_factory.mktemp(launch)
        workers(WORKER, nprocs, str(out / "steps"), str(out / "runs"), *configs)
        ranks = [json.loads((out / "steps" / f"rank{rank}.json").read_text()) for rank in range(nprocs)]
        steps.update({config: [r[config] for r in ranks] for config in configs})
    return steps


@pytest.mark.parametrize(("config", "nprocs"), CONFIGS.items())
@pytest.mark.scenarios("cli{nprocs}", "{config}")
def test_config_trains(trained: dict[str, list[int]], config: str, nprocs: int) -> None:
    assert trained[config] == [3] * nprocs  # every rank reached max_steps


def _print_config(*args: str) -> dict:
    # run_script puts this checkout on the path, so the test does not depend on which lightning_tp is installed.
    return yaml.safe_load(run_script("examples/cli.py", "fit", *args, "--print_config", timeout=300))


def test_print_config_round_trips_every_strategy_argument(tmp_path) -> None:
    printed = _print_config(
        "--config", "examples/configs/2d.yaml", "--trainer.strategy.init_args.tp_plan", '{"lm_head": "replicate"}'
    )
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_tp.TensorParallelStrategy"
    assert strategy["init_args"]["dp_shard_size"] == 2 and strategy["init_args"]["activation_checkpointing"] is True
    assert strategy["init_args"]["tp_plan"] == {"lm_head": "replicate"}
    path = tmp_path / "printed.yaml"
    path.write_text(yaml.safe_dump(printed))
    assert _print_config("--config", str(path)) == printed


def test_strategy_by_registered_name() -> None:
    assert _print_config("--config", "examples/configs/tp.yaml", "--trainer.strategy=tp")["trainer"]["strategy"] == "tp"
