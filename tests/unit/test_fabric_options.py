"""The Fabric strategy without processes: registration, argument checks, the state a save/load takes."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import lightning_tp
from lightning_tp.strategies.fabric import TensorParallelStrategy, _check_fresh, _parameter_names, _split_state


def test_tp_is_registered_in_both_registries_without_one_overriding_the_other() -> None:
    assert STRATEGY_REGISTRY["tp"]["strategy"] is TensorParallelStrategy
    assert StrategyRegistry["tp"]["strategy"] is lightning_tp.TensorParallelStrategy
    assert TensorParallelStrategy is not lightning_tp.TensorParallelStrategy
    assert isinstance(Fabric(strategy="tp", accelerator="cpu", devices=1).strategy, TensorParallelStrategy)
    assert lightning_tp.fabric.TensorParallelStrategy is TensorParallelStrategy  # the public path


@pytest.mark.parametrize("name", ["throughput_monitor", "preemption_signals", "step_timeout", "gc_every_n_steps"])
def test_trainer_only_arguments_are_refused_with_what_to_do(name: str) -> None:
    with pytest.raises(ValueError, match=f"`{name}` is an argument of the Trainer's"):
        TensorParallelStrategy(2, **{name: None})


def test_unknown_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_sise'"):
        TensorParallelStrategy(tp_sise=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_plan": "colwise"}, "`tp_plan` must be"),
        ({"tp_plan": {"model.layers.*.mlp.up_proj": "sideways"}}, "sideways"),
        ({"fsdp_param_dtype": "fp16"}, "`fsdp_param_dtype`"),
        ({"save_frozen_weights": False, "save_distributed_checkpoint": False}, "save_frozen_weights"),
        ({"tp_size": 0}, "tp_size"),
    ],
)
def test_bad_arguments_fail_when_the_strategy_is_built(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TensorParallelStrategy(**kwargs)


def test_precision_reaches_the_pipeline_options() -> None:
    fabric = Fabric(
        strategy=TensorParallelStrategy(1, sequence_parallel=True), accelerator="cpu", precision="bf16-true"
    )
    options = fabric.strategy.parallel_options()
    assert options.precision == "bf16-true" and options.sequence_parallel


def test_unsupported_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        Fabric(strategy=TensorParallelStrategy(1), accelerator="cpu", precision="16-mixed")


def test_an_optimizer_that_stepped_cannot_be_pointed_at_sharded_parameters() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _check_fresh(optimizer, _parameter_names(model))  # fresh: fine
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="has state already"):
        _check_fresh(optimizer, _parameter_names(model))
    with pytest.raises(ValueError, match="not the model's"):
        _check_fresh(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), _parameter_names(model))


def test_tied_parameters_keep_one_name() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False))
    model[1].weight = model[0].weight
    assert _parameter_names(model) == {id(model[0].weight): "0.weight"}


def test_the_state_of_a_save_holds_one_model_and_no_entry_named_like_the_weights() -> None:
    model, optimizer = torch.nn.Linear(2, 2), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _split_state({"model": model, "optimizer": optimizer, "step": 1}, action="save") == (
        "model",
        model,
        {"optimizer": optimizer},
    )
    with pytest.raises(ValueError, match="exactly one model"):
        _split_state({"a": model, "b": torch.nn.Linear(2, 2)}, action="save")
    with pytest.raises(ValueError, match="exactly one model"):
        _split_state({"step": 1}, action="load")
    with pytest.raises(ValueError, match="'state_dict'"):
        _split_state({"model": model, "state_dict": {}}, action="save")


def test_a_parameterless_module_in_the_state_is_stored_like_any_stateful_object() -> None:
    """A torchmetrics-like module (no parameters) next to the model is not a second model."""
    model, counter = torch.nn.Linear(2, 2), torch.nn.Module()
    key, module, optimizers = _split_state({"model": model, "metric": counter, "step": 1}, action="save")
    assert (key, module, optimizers) == ("model", model, {})


def test_a_single_file_save_reaches_an_fsspec_url(tmp_path) -> None:
    """The full-file save goes through Lightning's fsspec-aware writer (plain `torch.save` failed on URLs)."""
    import fsspec

    from lightning_tp import ParallelLayout
    from tests.helpers.models import build_causal_lm, tiny_config

    strategy = TensorParallelStrategy(save_distributed_checkpoint=False)
    strategy._layout = ParallelLayout(tp_size=1)  # what setup_environment resolves; no process group is needed
    model = build_causal_lm(tiny_config("llama"))
    strategy.save_checkpoint("memory://lightning-tp-test/run/last.ckpt", {"model": model, "step": 3})
    fs = fsspec.filesystem("memory")
    with fs.open("/lightning-tp-test/run/last.ckpt", "rb") as f:
        saved = torch.load(f, weights_only=True)
    assert saved["step"] == 3 and set(saved["state_dict"]) == set(model.state_dict())
    fs.rm("/lightning-tp-test", recursive=True)
