"""The parity assertion of the multi-process tests: a case trained sharded against the same case trained on one
process (the reference, trained here, in the test's process)."""

from __future__ import annotations

import functools

import torch

from tests.helpers.cases import CASES
from tests.helpers.models import reference_run

SGD_TOL = 1e-5  # fp32, the bound for 5 SGD steps
ADAMW_TOL = 1e-4  # AdamW divides by sqrt(v): tiny gradient differences grow a little


@functools.cache
def reference_of(name: str) -> dict:
    """Case ``name`` trained on one process: computed once per test session (the TP 2 and 2-D tests of a case, and
    the tests reading several, share it); read it, never change it."""
    case = CASES[name]
    return reference_run(case.module(reference=True), case.batches(), clip=case.clip, accumulate=case.accumulate)


def assert_parity(result: dict, ref: dict, name: str) -> None:
    tol = ADAMW_TOL if CASES[name].optimizer == "adamw" else SGD_TOL
    assert len(result["losses"]) == len(ref["losses"]) and len(result["grad_norms"]) == len(ref["grad_norms"])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=SGD_TOL, rtol=0)
    # The first step's gradients are the same computation; after AdamW steps the weights differ by ~1e-6.
    grad_norms, ref_norms = torch.tensor(result["grad_norms"]), torch.tensor(ref["grad_norms"])
    torch.testing.assert_close(grad_norms[:1], ref_norms[:1], atol=0, rtol=1e-5)
    torch.testing.assert_close(grad_norms, ref_norms, atol=0, rtol=1e-5 if tol == SGD_TOL else 1e-4)
    assert result["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(result["state"][key], value, atol=tol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
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
