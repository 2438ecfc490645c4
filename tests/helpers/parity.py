"""The parity assertion of the multi-process tests: a case trained sharded against the same case trained on one
process (the reference, trained here, in the test's process)."""

from __future__ import annotations

import functools
import math

import torch

from tests.helpers.cases import CASES
from tests.helpers.models import reference_run
from tests.helpers.tolerances import (
    adamw_rms_gap,
    adamw_weight_gap,
    assert_step_gaps,
    fp32_grad_norm_gap,
    fp32_logits_gap,
    fp32_loss_gap,
    fp32_roundings,
    rms_gap,
    sgd_weight_gap,
    weight_drift,
)


@functools.cache
def reference_of(name: str) -> dict:
    """Case ``name`` trained on one process: computed once per test session (the TP 2 and 2-D tests of a case, and
    the tests reading several, share it); read it, never change it."""
    case = CASES[name]
    return reference_run(
        case.module(reference=True),
        case.batches(),
        clip=case.clip,
        accumulate=case.accumulate,
        val_every=case.val_every,
        val_batches=case.val_batches() if case.val_batches is not None else None,
    )


def fp32_bounds(ref: dict, *, optimizer: str, lr: float, accumulate: int = 1, drift: float = 0.0) -> dict:
    """The fp32 bounds of a sharded run against its one-process reference ``ref`` (:func:`reference_run`'s), from
    tests/helpers/tolerances.py: ``loss`` (per micro-batch), ``grad_norm_rel`` (per step; after the first with the
    runs' weights' ``drift``, :func:`weight_drift`), ``state`` (each weight) and ``state_rms`` (AdamW: the root mean
    square over all of them; ``None`` for SGD, whose ``state`` bounds the norm)."""
    shapes = [value.shape for value in ref["state"].values()]
    forward, step = fp32_roundings(shapes, ref["output_rows"] * accumulate)
    steps = len(ref["grad_norms"])
    loss = [
        fp32_loss_gap(
            forward + (i // accumulate) * step,
            scale,
            value,
            rows=ref["output_rows"],
            classes=ref["output_classes"],
        )
        for i, (scale, value) in enumerate(zip(ref["output_scales"], ref["losses"], strict=True))
    ]
    largest = max(
        (v.abs().max().item() for v in ref["state"].values() if v.is_floating_point() and v.numel()), default=0
    )
    conditions = [terms / norm for terms, norm in zip(ref["grad_terms"], ref["grad_norms"], strict=True)]
    if optimizer == "adamw":
        state = adamw_weight_gap([lr] * steps, largest)
        state_rms = adamw_rms_gap([lr] * steps, step, conditions)
    else:
        assert optimizer == "sgd", optimizer
        state, state_rms = sgd_weight_gap(lr, ref["grad_terms"], step, largest), None
    return {
        "loss": loss,
        "grad_norm_rel": [
            fp32_grad_norm_gap((t + 1) * step, condition) + (drift if t else 0.0)
            for t, condition in enumerate(conditions)
        ],
        "state": state,
        "state_rms": state_rms,
    }


def trained_logits_gap(result: dict, ref: dict, expected: torch.Tensor, name: str) -> float:
    """Bound on each logit of case ``name``'s sharded run's trained weights (``result``) against ``expected``, the
    reference's trained weights' on one process (:func:`fp32_logits_gap`): the forward's roundings and the training's
    before it, and the two runs' trained weights' gap (:func:`weight_drift`, over ``sqrt(2)``: a forward's share)."""
    shapes = [value.shape for value in ref["state"].values()]
    forward, step = fp32_roundings(shapes, ref["output_rows"] * CASES[name].accumulate)
    drift = weight_drift(result["state"], ref["state"]) / math.sqrt(2)
    return fp32_logits_gap(forward + len(ref["grad_norms"]) * step, expected.abs().max().item(), drift=drift)


def assert_parity(result: dict, ref: dict, name: str) -> None:
    """Losses, gradient norms and trained weights within fp32's bounds of the reference (:func:`fp32_bounds`), and
    the layout facts every sharded run must show."""
    case = CASES[name]
    assert case.precision == "32-true", (name, case.precision)  # bf16 cases have their own bounds
    assert case.clip is None or case.optimizer == "adamw", name  # AdamW's bounds hold for clipped gradients as well
    assert result["state"].keys() == ref["state"].keys()
    drift = weight_drift(result["state"], ref["state"])
    bounds = fp32_bounds(ref, optimizer=case.optimizer, lr=case.lr, accumulate=case.accumulate, drift=drift)
    assert len(result["losses"]) == len(ref["losses"]) and len(result["grad_norms"]) == len(ref["grad_norms"])
    assert_step_gaps(result["losses"], ref["losses"], bounds["loss"], relative=False, what=f"{name} losses")
    assert_step_gaps(
        result["grad_norms"], ref["grad_norms"], bounds["grad_norm_rel"], relative=True, what=f"{name} gradient norms"
    )
    for key, value in ref["state"].items():
        torch.testing.assert_close(
            result["state"][key], value, atol=bounds["state"], rtol=0, msg=lambda m, k=key: f"{k}: {m}"
        )
    if bounds["state_rms"] is not None:
        gap = rms_gap(result["state"], ref["state"])
        assert gap <= bounds["state_rms"], f"{name}: weights' root mean square gap {gap} beyond {bounds['state_rms']}"
    # Every parameter is a DTensor: what lets foreach/fused optimizers and clipping run.
    assert result["all_dtensor"]
    # Tied embeddings stay one parameter through sharding (and meta-device materialisation), untied ones two: as the
    # same model on one process.
    assert result["tied"] is ref["tied"]
    # At every optimizer step each sharded gradient is laid out as its parameter (same mesh, same placements), and
    # there were sharded gradients to check.
    layouts = result["grad_layouts"]
    assert len(layouts) == len(ref["grad_norms"]), layouts
    assert all(step["checked"] > 0 and step["mismatched"] == [] for step in layouts), layouts
    # `compile=True` compiled every decoder layer in place (and torch.compile built graphs); else none is compiled.
    if "compiled" in result:
        wanted = bool(CASES[name].strategy_kwargs.get("compile"))
        assert (result["compiled"]["layers"] > 0) == wanted, result["compiled"]
        assert result["compiled"]["graphs_so_far"] > 0 or not wanted, result["compiled"]
        # `fullgraph`: one graph per layer, shared by the layers (qwen3_compile has 12). A recompilation per layer
        # (guards on a training forward's KV cache, or on the ids of hooks inside the layers) built one per layer up
        # to dynamo's recompile limit, and `fullgraph` then fails on it.
        compile_options = CASES[name].strategy_kwargs.get("compile")
        if isinstance(compile_options, dict) and compile_options.get("fullgraph"):
            assert result["compiled"]["graphs"] <= 2, result["compiled"]
