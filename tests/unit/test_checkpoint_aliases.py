"""A tensor with several names (tied embeddings, and a pipeline's copy of one) is written and read under one name
(lightning_tp/checkpoint/aliases.py)."""

from __future__ import annotations

import torch

from lightning_tp.checkpoint.aliases import holds, optimizer_state_dict, parameter_aliases, renamed
from tests.helpers.models import build_causal_lm, lm_batches, tiny_config


def test_a_tied_head_is_an_alias_of_the_embedding():
    model = build_causal_lm(tiny_config("tied"))
    assert parameter_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert parameter_aliases(build_causal_lm(tiny_config("qwen3"))) == {}


def test_renamed_handles_nested_and_flat_state_dicts():
    names = {"lm_head.weight": "model.embed_tokens.weight"}
    nested = {
        "state": {"lm_head.weight": {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["lm_head.weight", "x"]}],
    }
    out = renamed(nested, names)
    assert out["state"] == {"model.embed_tokens.weight": {"step": 1}}
    assert out["param_groups"] == [{"lr": 0.1, "params": ["model.embed_tokens.weight", "x"]}]
    flat = {"state.lm_head.weight.exp_avg": 1, "param_groups.lm_head.weight.lr": 2, "state.x.step": 3}
    assert renamed(flat, names) == {
        "state.model.embed_tokens.weight.exp_avg": 1,
        "param_groups.model.embed_tokens.weight.lr": 2,
        "state.x.step": 3,
    }
    assert holds(flat, "lm_head.weight") and holds(nested, "lm_head.weight") and not holds(flat, "model.norm.weight")
    # A nested optimizer state flattens with dots in its entries: the parameter's name is matched, not the dots.
    deep = {"state.lm_head.weight.preconditioner.left": 1, "state.lm_head.weight.step": 2}
    assert renamed(deep, names) == {
        "state.model.embed_tokens.weight.preconditioner.left": 1,
        "state.model.embed_tokens.weight.step": 2,
    }


def test_the_optimizer_state_of_a_tied_weight_is_under_its_canonical_name():
    model = build_causal_lm(tiny_config("tied"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(**lm_batches(1)[0]).loss.backward()
    optimizer.step()
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    for flat in (False, True):
        state = optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        assert holds(state, "model.embed_tokens.weight") and not holds(state, "lm_head.weight")
