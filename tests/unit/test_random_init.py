"""Initialisation of sharded parameters, on one process: without shards it is exactly Transformers' and PEFT's own."""

import torch
from transformers import AutoModelForCausalLM

from lightning_tp.random_init import initialize_transformers_weights, random_state_of_rank_zero, whole_parameters
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
    from lightning_tp.loading import materialize_modules
    from tests.helpers.cases import _meta_mlp, _mlp

    module = _meta_mlp()
    materialize_modules(module, torch.device("cpu"))
    for key, value in _mlp().state_dict().items():
        torch.testing.assert_close(module.state_dict()[key], value, rtol=0, atol=0)
