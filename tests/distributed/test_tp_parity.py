"""Real multi-process runs (gloo, CPU) against a single process training the same module on the same data."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.distributed.conftest import TP_PARITY_CASES, TWO_D_CASES
from tests.helpers.cases import CASES, ERROR_CASES
from tests.helpers.models import ParityModule, build_causal_lm, lm_batches, reference_generate, reference_run, tiny_config

SGD_TOL = 1e-5  # fp32, the bound for 5 SGD steps
ADAMW_TOL = 1e-4  # AdamW divides by sqrt(v): tiny gradient differences grow a little


def _result(results: list[dict], name: str) -> dict:
    result = results[0][name]
    assert "crash" not in result, result.get("crash")
    return result


def _reference(name: str) -> dict:
    case = CASES[name]
    return reference_run(case.module(reference=True), case.batches(), clip=case.clip, accumulate=case.accumulate)


def _assert_parity(result: dict, ref: dict, name: str) -> None:
    tol = ADAMW_TOL if CASES[name].optimizer == "adamw" else SGD_TOL
    assert len(result["losses"]) == len(ref["losses"]) and len(result["grad_norms"]) == len(ref["grad_norms"])
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=SGD_TOL, rtol=0)
    torch.testing.assert_close(torch.tensor(result["grad_norms"]), torch.tensor(ref["grad_norms"]), atol=0, rtol=1e-5)
    assert result["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        torch.testing.assert_close(result["state"][key], value, atol=tol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    # Every parameter is a DTensor: what lets foreach/fused optimizers and clipping run.
    assert result["all_dtensor"]
    # Tied embeddings stay one parameter through sharding (and meta-device materialisation).
    assert result["tied"] in (None, True)


@pytest.mark.parametrize("name", TP_PARITY_CASES)
def test_tp2_matches_single_process(tp2_results: list[dict], name: str) -> None:
    result = _result(tp2_results, name)
    _assert_parity(result, _reference(name), name)
    assert result["sampler"] == {"num_replicas": 1, "rank": 0}
    # Both ranks of the TP group saw the same losses.
    assert tp2_results[1][name]["losses"] == result["losses"]


@pytest.mark.parametrize("name", TWO_D_CASES)
def test_2d_matches_single_process(two_d_results: list[dict], name: str) -> None:
    """dp_shard 2 x tp 2: each data-parallel rank trains on half of the global batch."""
    _assert_parity(_result(two_d_results, name), _reference(name), name)
    samplers = [r[name]["sampler"] for r in two_d_results]
    assert samplers == [{"num_replicas": 2, "rank": rank // 2} for rank in range(4)]


def test_2d_accumulation_reduces_once_per_optimizer_step(two_d_results: list[dict]) -> None:
    """6 micro-batches, 3 optimizer steps: FSDP2 reduce-scatters each group's gradients 3 times, not 6."""
    result = _result(two_d_results, "llama_accumulate")
    assert result["optimizer_steps"] == 3 and result["fsdp_groups"] == 3  # 2 decoder layers + the root
    assert result["reduce_scatters"] == result["optimizer_steps"] * result["fsdp_groups"]
    plain = _result(two_d_results, "qwen3_sgd")  # no accumulation: one per step too
    assert plain["reduce_scatters"] == plain["optimizer_steps"] * plain["fsdp_groups"]


def test_hsdp_replicates_instead_of_scattering(two_d_results: list[dict]) -> None:
    """dp_replicate 2 x dp_shard 1 x tp 2: gradients are all-reduced across the replicas, never reduce-scattered."""
    assert _result(two_d_results, "qwen3_hsdp")["reduce_scatters"] == 0


def test_validate_predict_generate_logging(tp2_results: list[dict]) -> None:
    result = _result(tp2_results, "features")
    build = partial(build_causal_lm, tiny_config("qwen3"))
    batches = lm_batches(2)
    # Greedy generation on the sharded model gives the single-process tokens.
    for got, want in zip(result["generated"], reference_generate(build, batches)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # A logged sum and a torchmetrics sum count each sample once, not once per TP rank.
    samples = sum(b["input_ids"].shape[0] for b in batches)
    assert result["validate"]["val_samples"] == samples
    assert result["validate"]["val_metric"] == samples
    assert result["logged"]["samples_metric"] == samples
    assert result["logged"]["mesh_axes"] == ("dp_replicate", "dp_shard", "tp")
    model = build().eval()
    with torch.no_grad():
        for got, batch in zip(result["predict"], batches):
            torch.testing.assert_close(got, model(input_ids=batch["input_ids"]).logits.argmax(-1), rtol=0, atol=0)
    # The second setup (fit after validate/predict) found the model sharded and left it alone.
    assert result["sharded_params_after_fit"] == result["sharded_params"]


def test_distributed_sampler_gives_each_tp_rank_the_same_batch(tp2_results: list[dict]) -> None:
    sums = _result(tp2_results, "features")["batch_sums"]
    assert len(sums) == 2 and len(sums[0]) == 2
    assert sums[0] == sums[1]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_train_close_to_fp32(tp2_results: list[dict], precision: str) -> None:
    result = _result(tp2_results, "features")[precision]
    ref = reference_run(ParityModule(partial(build_causal_lm, tiny_config("qwen3"))), lm_batches(2))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=2e-2, rtol=0)
    assert result["dtype"] == ("torch.bfloat16" if precision == "bf16-true" else "torch.float32")


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_configuration_raises_on_every_rank(tp2_results: list[dict], name: str) -> None:
    """Each rank raises the same clear error before any collective; the worker's barrier after the case proves that
    no rank was left waiting."""
    fragment = ERROR_CASES[name][2]
    for results in tp2_results:
        error = results[f"error:{name}"]
        assert error["type"] == "ValueError", error
        assert fragment in error["message"]
