"""A parallelised model carries its parallel state (``lightning_tp.state``): what ``parallelize`` made of it, read
from the model by what runs on it later. One rank; the pipeline's group is exercised at pp 2 by
tests/distributed/test_parallelize.py (``clip_grad_norm_(model, ...)``) and by every pipeline parity case, whose
gradient norms are ``grad_norm(module)``."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from lightning_tp import ParallelLayout, grad_norm, parallelize
from lightning_tp.state import STATE_ATTR, parallel_state
from tests.helpers.models import build_causal_lm, lm_batches, tiny_config
from tests.helpers.process_group import one_rank_mesh


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_mesh():
        yield


class Holder(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def test_the_state_is_reachable_from_the_module_given_and_from_each_model_inside(one_rank) -> None:
    model = build_causal_lm(tiny_config("qwen3"))
    holder = Holder(model)
    assert parallel_state(holder) is None  # nothing parallelised yet
    parallelize(holder, tp_size=1)
    state = parallel_state(holder)
    assert state is not None and parallel_state(model) is state and getattr(model, STATE_ATTR) is state
    assert state.layout == ParallelLayout(tp_size=1) and state.pp_group is None and state.tp_mesh.size() == 1
    assert [target.module for target in state.targets.models] == [model]
    assert STATE_ATTR not in dict(model.named_modules()) and not any(STATE_ATTR in n for n, _ in model.named_buffers())
    assert STATE_ATTR not in model.state_dict()  # a plain attribute: no submodule, parameter or checkpoint entry


def test_grad_norm_of_a_model_is_that_of_its_parameters(one_rank) -> None:
    model = build_causal_lm(tiny_config("qwen3"))
    reference = copy.deepcopy(model)
    parallelize(model, tp_size=1)
    batch = lm_batches(1)[0]
    model(**batch).loss.backward()
    reference(**batch).loss.backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(grad_norm(model), grad_norm(model.parameters()), atol=0, rtol=0)
    torch.testing.assert_close(grad_norm(model), expected, atol=1e-6, rtol=1e-5)
