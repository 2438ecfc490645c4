"""``lightning_tp.parallelize`` without Lightning: a plain PyTorch loop under torchrun trains at parity with one
process, from sizes (TP; context parallelism) and from a mesh the script built (FSDP2 with activation checkpointing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import workers

WORKER = Path(__file__).with_name("plain_worker.py")


@pytest.fixture(scope="module")
def plain_results() -> dict[str, dict]:
    output = workers(WORKER, 2)
    results = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in results}


@pytest.mark.parametrize("case", ["tp_from_sizes", "cp_from_sizes", "ep_from_sizes", "fsdp_from_mesh"])
def test_plain_pytorch_loop_matches_one_process(plain_results: dict[str, dict], case: str) -> None:
    result = plain_results[case]
    assert result["names_match"] and result["all_dtensors"]
    assert result["loss_diff"] < 1e-5, result
    assert result["weight_diff"] < 1e-5, result


def test_clip_grad_norm_of_a_pipelined_model_covers_every_stage(plain_results: dict[str, dict]) -> None:
    """``clip_grad_norm_(model, ...)`` with no group under pp 2: every stage's norm, as one process's."""
    result = plain_results["pp_clip_from_sizes"]
    assert result["names_match"] and result["clipped"], result
    assert result["norm_rel_diff"] < 1e-5 and result["loss_diff"] < 1e-5 and result["weight_diff"] < 1e-5, result


@pytest.mark.parametrize("model", ["tp", "cp", "pp", "moe_dp", "moe_tp"])
def test_models_parallelised_differently_train_in_turn_each_at_parity(plain_results: dict[str, dict], model: str):
    """No state of one model's parallelisation reaches another's: TP 2 (sequence and loss parallelism), CP 2, PP 2
    and two MoE models of one family with their router loss (FSDP2 over 2 ranks, TP 2) in one process, a step of each
    in turn."""
    result = plain_results["models_in_turn"][model]
    assert result["held"], result
    assert result["loss_diff"] < 1e-5 and result["weight_diff"] < 1e-5, result


def test_clip_grad_norm_with_a_gradient_on_one_rank_only(plain_results: dict[str, dict]) -> None:
    """Without the fix rank 0 runs two reductions and rank 1 one: a hang (the launch's tripwire) or a wrong norm."""
    result = plain_results["grad_norm_missing_gradient"]
    assert result["norm_diff"] <= 4 * torch.finfo(torch.float32).eps * result["expected"], result
