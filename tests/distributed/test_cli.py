"""examples/cli.py and its configs: every config trains a few steps under torchrun; --print_config round-trips."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers.launch import ROOT, run_script, torchrun

CONFIGS = {"tp.yaml": 2, "lora.yaml": 2, "2d.yaml": 4, "cp.yaml": 2, "ep.yaml": 2}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_config_trains(config: str, tmp_path) -> None:
    out = torchrun(
        ROOT / "examples/cli.py",
        CONFIGS[config],
        "fit",
        "--config",
        f"examples/configs/{config}",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",  # where LightningCLI saves the config it ran
    )
    assert "`Trainer.fit` stopped: `max_steps=3` reached." in out


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
