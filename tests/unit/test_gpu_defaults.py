"""Defaults that cost on GPUs, checked on one rank: FSDP2's bf16 all-gathers under ``bf16-mixed`` (fp32
reduce-scatters), and TP's backward all-reduces of activation gradients in the compute dtype unless
``tp_grad_reduce_dtype="fp32"``. Parity at bf16 tolerances in 2-D is tests/distributed/test_tp_parity.py
(``qwen3_bf16_*``, ``features``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_tp import ParallelLayout, ParallelOptions, TensorParallelStrategy
from lightning_tp.parallel.fsdp import fsdp_mixed_precision
from lightning_tp.parallel.tensor_parallel import apply_tensor_parallel, dense_layers_plan
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.plans.structure import block_classes
from tests.helpers.models import build_causal_lm, lm_batches, tiny_config
from tests.helpers.process_group import one_rank_mesh


def test_bf16_mixed_all_gathers_bf16_and_reduces_fp32_by_default() -> None:
    """torchtitan's recipe by default under ``bf16-mixed``: half the all-gather bytes of fp32 parameters, gradients
    reduced in fp32; ``fsdp_param_dtype=None`` gathers the parameters' own fp32 (one device's numerics)."""
    assert ParallelOptions().fsdp_param_dtype == "auto"
    default = fsdp_mixed_precision("bf16-mixed", param_dtype=ParallelOptions().fsdp_param_dtype)
    assert default.param_dtype == torch.bfloat16 and default.reduce_dtype == torch.float32
    assert fsdp_mixed_precision("bf16-mixed") == default
    for value in ("bf16", torch.bfloat16):
        assert fsdp_mixed_precision("bf16-mixed", param_dtype=value) == default
    own = fsdp_mixed_precision("bf16-mixed", param_dtype=None)
    assert own.param_dtype is None and own.reduce_dtype is None
    for precision in ("32-true", "bf16-true", "16-true"):  # "auto" casts nothing there
        assert fsdp_mixed_precision(precision).param_dtype is None


@pytest.mark.parametrize("precision", ["32-true", "16-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_default_gathers_quietly_on_every_precision_and_layout(precision: str, world: int) -> None:
    """``"auto"`` is not ``"bf16"`` asked for: no refusal under 32-bit compute, no warning where it does nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ParallelOptions(precision=precision).check_layout(
            ParallelLayout.resolve(world, tp_size=2), device=torch.device("cpu")
        )


def test_tp_grad_reduce_dtype_values_are_checked_when_the_strategy_is_built() -> None:
    assert TensorParallelStrategy(tp_grad_reduce_dtype="fp32").options.parallel.tp_grad_reduce_dtype == "fp32"
    with pytest.raises(ValueError, match=r"`tp_grad_reduce_dtype` must be None .* or 'fp32'.*got 'bf16'"):
        TensorParallelStrategy(tp_grad_reduce_dtype="bf16")


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_mesh() as mesh:
        yield mesh


def _all_reduce_dtypes(monkeypatch, model, batch) -> dict[str, list]:
    """The dtypes of the all-reduces the package's autograd functions make in one backward, by what they sum:
    activations (one row per token) or parameters."""
    seen: dict[str, list] = {"activations": [], "parameters": []}
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        per_token = tensor.dim() >= 2 and tensor.shape[:2] == batch["input_ids"].shape
        seen["activations" if per_token else "parameters"].append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    loss = model(**batch).loss  # the forward's all-reduces (row-wise layers' partial outputs) are not counted
    monkeypatch.setattr(dist, "all_reduce", recording)
    loss.backward()
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("regions", [False, True])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_tp_sums_activation_gradients_in_the_compute_dtype_unless_fp32_is_asked_for(
    monkeypatch, one_rank, regions: bool, reduce_dtype
) -> None:
    """A bf16 model (as under bf16 all-gathers or ``bf16-true``): the column-wise layers' input gradients (and, with the
    dense-layer rewrite, each region's) are summed over the TP group in bf16 by default (in fp32 before: twice the bytes
    on the backward's critical path), in fp32 with ``tp_grad_reduce_dtype="fp32"``; the q/k norms' parameter gradients
    in fp32 either way."""
    model = build_causal_lm(tiny_config("qwen3")).to(torch.bfloat16)
    plan = resolve_plan(model, "auto", tp_size=1)
    if regions:
        plan = dense_layers_plan(model, plan, blocks=block_classes(model, None), grad_reduce_dtype=reduce_dtype)
    apply_tensor_parallel(model, one_rank, plan, grad_reduce_dtype=reduce_dtype)
    seen = _all_reduce_dtypes(monkeypatch, model, lm_batches(1)[0])
    assert set(seen["activations"]) == {reduce_dtype or torch.bfloat16}, seen
    assert set(seen["parameters"]) == {torch.float32}, seen
    # Each column-wise projection's input (q, k, v, gate, up) and the head's; with regions one sum per attention and
    # MLP (DTensor's own, not counted here, by default) and the head's.
    layers = model.config.num_hidden_layers
    expected = (2 * layers if reduce_dtype is not None else 0) + 1 if regions else 5 * layers + 1
    assert len(seen["activations"]) == expected, seen
