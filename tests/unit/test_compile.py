"""``compile=True`` at depth, on one rank: no KV cache in a forward under grad, and the decoder layers of a 12-layer
model sharing their compiled graphs instead of recompiling per layer (dynamo's ``recompile_limit`` is 8, past which
the remaining layers run eager). The ``eager`` backend: what is counted is dynamo's tracing and guards, not kernels.
TP 2 with sequence parallelism at 12 layers is the distributed parity case ``qwen3_compile``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_tp import parallelize
from lightning_tp.compat import compiled_graph_count
from lightning_tp.parallel_options import ParallelOptions
from tests.helpers.models import build_causal_lm, lm_batches, tiny_config
from tests.helpers.process_group import one_rank_mesh

LAYERS = 12


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_mesh():
        yield


def _model(layers: int, **options):
    model = build_causal_lm(tiny_config("llama", num_hidden_layers=layers))
    reference = copy.deepcopy(model)
    parallelize(model, tp_size=1, options=ParallelOptions(**options))
    return model, reference


def test_a_forward_under_grad_builds_no_cache_unless_asked_for(one_rank) -> None:
    """`use_cache` defaults to the config's (True): a training forward built a cache nothing reads. Under grad it is
    off unless given (by keyword or position); without grad (validation, a decoding loop) Transformers' default holds,
    and so does `use_cache=True` given under grad."""
    model, reference = _model(2)
    batch = lm_batches(1)[0]
    assert reference(**batch).cache is not None  # the upstream default
    out = model(**batch)
    assert out.cache is None
    torch.testing.assert_close(out.loss, reference(**batch).loss, atol=0, rtol=0)
    assert model(**batch, use_cache=True).cache is not None
    assert model(**batch, use_cache=None).cache is None  # None: the config's, i.e. not given
    with torch.no_grad():
        assert model(**batch).cache is not None
    positional = (batch["input_ids"], None, None, None, None, batch["labels"], True)  # ..., labels, use_cache
    assert model(*positional).cache is not None


def test_twelve_compiled_layers_share_their_graphs(one_rank) -> None:
    """A 12-layer model trained as the README trains (`model(input_ids, labels=...)`, `use_cache` left at its default),
    then with `use_cache=False`: the layers share their graphs (each recompiled before: guards on each layer's cache
    layer, `cache.layers[i].is_initialized`, and on the ids of the strategy's always-called hooks), and the losses and
    gradients are the uncompiled model's."""
    torch.compiler.reset()
    model, reference = _model(LAYERS, compile={"backend": "eager"})
    before = compiled_graph_count()
    for batch, kwargs in zip(lm_batches(2), ({}, {"use_cache": False}), strict=True):
        out, ref = model(**batch, **kwargs), reference(**batch, **kwargs)
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
        out.loss.backward()
        ref.loss.backward()
    graphs = compiled_graph_count() - before
    assert 1 <= graphs <= 2, f"{graphs} graphs for {LAYERS} layers: the layers recompile"
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
