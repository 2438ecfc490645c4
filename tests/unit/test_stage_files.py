"""Single files of pipelined models (lightning_tp/checkpoint/stage_files.py), without processes: one process's
parameter order rebuilt from stages whose other modules are empty slots, and a file's entries loaded into a model with
what is missing or left over refused by name (the multi-process save and load: tests/distributed/test_checkpoint.py,
test_fabric.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_tp.checkpoint.stage_files import _position, load_stage_file, whole_parameter_order
from lightning_tp.parallel.pipeline_plan import resolve_pipeline_plan
from lightning_tp.parallel.pipeline_stages import keep_stages
from tests.helpers.models import build_causal_lm, tiny_config


@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_the_stages_parameter_positions_sort_into_one_processs_order(kind):
    config = tiny_config(kind)
    config.num_hidden_layers = 4
    if getattr(config, "layer_types", None):
        config.layer_types = (config.layer_types * 4)[:4]
    model = build_causal_lm(config)
    expected = [name for name, _ in model.named_parameters()]
    plan = resolve_pipeline_plan(model, pp_size=2, schedule=None, microbatches=None, stages_per_rank=2, split=None)
    positions = {}
    for rank in (1, 0):  # each "rank" a copy keeping its stages (0 and 2, or 1 and 3): the others' slots empty
        copied = copy.deepcopy(model)
        keep_stages(copied, plan, plan.stages_of(rank, 2))
        for name, _ in copied.named_parameters():
            positions.setdefault(name, _position(copied, name))
    # A tied head's weight is the embedding's on one process; a pipeline's last stage holds it as its own.
    assert sorted(set(positions) & set(expected), key=positions.__getitem__) == expected
    assert whole_parameter_order(model) == expected  # without a pipeline: the model's own


def _checkpoint(model, optimizer):
    ids = {id(p): index for index, p in enumerate(model.parameters())}
    state = optimizer.state_dict()  # torch's: by position in the optimizer, here the model's order
    assert [ids[id(p)] for p in optimizer.param_groups[0]["params"]] == state["param_groups"][0]["params"]
    return {"state_dict": dict(model.state_dict()), "optimizer_states": [state], "epoch": 3}


def test_a_file_loads_by_position_and_what_is_missing_or_left_over_is_refused_by_name():
    model = build_causal_lm(tiny_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.arange(8).reshape(1, 8), labels=torch.arange(8).reshape(1, 8)).loss.backward()
    optimizer.step()
    saved = _checkpoint(model, optimizer)
    other = build_causal_lm(tiny_config("llama"), seed=7)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
    kwargs = {"module_key": "state_dict", "strict": True, "optimizer_states_from_list": True, "shown": "ckpt"}
    rest = load_stage_file(copy.deepcopy(saved), module=other, optimizers={"optimizer_0": other_optimizer}, **kwargs)
    assert rest == {"epoch": 3}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[name], value, atol=0, rtol=0)
    for mine, theirs in zip(
        optimizer.param_groups[0]["params"], other_optimizer.param_groups[0]["params"], strict=True
    ):
        torch.testing.assert_close(other_optimizer.state[theirs]["exp_avg"], optimizer.state[mine]["exp_avg"])
    missing = copy.deepcopy(saved)
    del missing["state_dict"]["model.norm.weight"]
    with pytest.raises(ValueError, match=r"ckpt misses weights of this model: \['model.norm.weight'\]"):
        load_stage_file(missing, module=other, optimizers={}, **kwargs)
    extra = copy.deepcopy(saved)
    extra["state_dict"]["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"holds weights that no stage of this model has: \['model.extra.weight'\]"):
        load_stage_file(extra, module=other, optimizers={}, **kwargs)


@pytest.mark.parametrize("named", [False, True])
def test_the_gathered_optimizer_state_is_one_processs(named):
    """Without a pipeline the gathered state is the optimizer's own: by position it is torch's ``state_dict()``; by
    name each parameter's, the names torch keeps beside them (an optimizer built from ``named_parameters()``) in the
    parameters' order."""
    from lightning_tp.checkpoint.stage_files import full_optimizer_state

    model = build_causal_lm(tiny_config("tied"))
    params = list(model.named_parameters()) if named else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    model(input_ids=torch.arange(8).reshape(1, 8), labels=torch.arange(8).reshape(1, 8)).loss.backward()
    optimizer.step()
    own = optimizer.state_dict()
    by_position = full_optimizer_state(model, optimizer, by_position=True)
    assert by_position["param_groups"] == own["param_groups"]
    assert by_position["state"].keys() == own["state"].keys()
    for index, entries in own["state"].items():
        for entry, value in entries.items():
            torch.testing.assert_close(by_position["state"][index][entry], value, atol=0, rtol=0)
    by_name = full_optimizer_state(model, optimizer, by_position=False)
    names = [name for name, _ in model.named_parameters()]
    assert by_name["param_groups"][0]["params"] == names and list(by_name["state"]) == names
    assert ("param_names" in by_name["param_groups"][0]) is named
    if named:
        assert by_name["param_groups"][0]["param_names"] == names
