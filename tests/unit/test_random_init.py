"""Initialisation of sharded parameters, on one process: without shards it is exactly Transformers' and PEFT's own."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_tp.parallel.random_init import (
    initialize_transformers_weights,
    random_state_of_rank_zero,
    whole_parameters,
)
from tests.helpers.models import tiny_config


def _meta_model(kind: str):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(kind))
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


def test_same_draws_in_the_same_order_as_transformers() -> None:
    """Unsharded, the wrapped initialisation is Transformers' own: same values, same generator state afterwards, and
    nothing of the wrapping is left on the model."""
    for kind in ("qwen3", "tied"):
        expected = _meta_model(kind)
        expected.initialize_weights()
        after_expected = torch.rand(3)
        got = _meta_model(kind)
        with random_state_of_rank_zero(torch.device("cpu")):  # no process group: nothing to share
            initialize_transformers_weights(got)
        assert torch.equal(torch.rand(3), after_expected)
        for key, value in expected.state_dict().items():
            torch.testing.assert_close(got.state_dict()[key], value, rtol=0, atol=0)
        assert not any("_initialize_weights" in m.__dict__ for m in got.modules())
        if kind == "tied":
            assert got.lm_head.weight is got.model.embed_tokens.weight


def test_plain_parameters_are_initialised_in_place() -> None:
    linear = torch.nn.Linear(4, 4)
    weight = linear.weight
    with whole_parameters([linear]):
        torch.nn.init.ones_(linear.weight)
    assert linear.weight is weight and torch.equal(weight, torch.ones(4, 4))


def test_a_plain_module_built_on_meta_is_reset_as_its_constructor_draws() -> None:
    """``materialize_modules`` resets layer by layer in the constructor's order: the same values as building it."""
    from lightning_tp.checkpoint.loading import materialize_modules
    from tests.helpers.cases import _meta_mlp, _mlp

    module = _meta_mlp()
    materialize_modules(module, torch.device("cpu"))
    for key, value in _mlp().state_dict().items():
        torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)


def test_dropout_on_shards_is_warned_about_naming_where_and_only_when_tp_or_cp_split() -> None:
    """Dropout under TP/CP draws the same mask on every shard of a group: warned, naming the rates; nothing where
    dropout is off (the tiny models) or nothing is split."""
    import warnings

    from lightning_tp.layout import ParallelLayout
    from lightning_tp.parallel.rng import active_dropout, warn_repeated_dropout
    from tests.helpers.models import build_causal_lm, tiny_config

    model = build_causal_lm(tiny_config("llama", attention_dropout=0.1))
    assert active_dropout(model) == ["model.layers.*.self_attn.attention_dropout=0.1"]
    with pytest.warns(UserWarning, match=r"Dropout is on \(model.layers.\*.self_attn.attention_dropout=0.1\)"):
        warn_repeated_dropout(model, ParallelLayout(tp_size=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_repeated_dropout(model, ParallelLayout(tp_size=1, dp_shard_size=2))  # data parallelism: own masks
        warn_repeated_dropout(build_causal_lm(tiny_config("llama")), ParallelLayout(tp_size=2))
    linear = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    assert active_dropout(linear) == ["* (p=0.5)"]  # indices as `*`


def test_dtensor_random_tracker_is_not_created_on_cpu() -> None:
    """On CUDA the tracker is created at setup without a collective (tests/gpu checks it); on CPU torch has none, and
    asking must neither create one nor warn."""
    import warnings

    from torch.distributed.tensor import _random

    from lightning_tp.parallel.rng import prepare_dtensor_random
    from tests.helpers.process_group import one_rank_mesh

    with one_rank_mesh() as mesh, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare_dtensor_random(mesh) is False
        assert _random._rng_tracker is None
