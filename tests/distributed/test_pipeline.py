"""Pipeline parallelism for real: tiny Llama and Qwen3 models of 4 decoder layers cut into stages over 2 gloo processes
(1F1B, Interleaved1F1B with 2 stages per rank, GPipe with accumulation and clipping, LoRA) and over 4 (pp 2 x tp 2,
pp 2 x dp 2 with FSDP2 on each stage), against one process training the whole model on the whole batch. The cases live
in tests/helpers/cases.py (``PP_CASES``, ``PP_2D_CASES``) and run in the folded launches of
tests/distributed/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.cases import CASES, PP_2D_CASES, PP_CASES, THREE_D_CASES
from tests.helpers.models import PP_PROBE
from tests.helpers.parity import assert_parity, reference_of
from tests.helpers.selection import scenario_result as _result
from tests.helpers.tolerances import fp32_loss_gap, fp32_roundings, output_scale


def _reference_eval_loss(name: str) -> tuple[float, float]:
    """The loss of the reference's trained weights on the probe batch, on one process, and its fp32 bound against
    another layout's forward of its own trained weights (tests/helpers/tolerances.py, :func:`fp32_loss_gap`): the
    forward's roundings and the training's before it, counted as the parity's losses count them."""
    ref = reference_of(name)
    module = CASES[name].module(reference=True)
    module.configure_model()
    module.model.load_state_dict(ref["state"])
    module.model.eval()
    batch = {"input_ids": PP_PROBE, "labels": PP_PROBE}
    with torch.no_grad():
        loss = module.model(**batch).loss.item()
    forward, step = fp32_roundings(
        [v.shape for v in ref["state"].values()], ref["output_rows"] * CASES[name].accumulate
    )
    roundings = forward + len(ref["grad_norms"]) * step
    scale = output_scale(module.model, [batch])
    return loss, fp32_loss_gap(roundings, scale, loss, rows=PP_PROBE.numel(), classes=ref["output_classes"])


def _check_pretrained(name: str, result: dict) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    directory = Path(result["split"]["pretrained"])
    if "lora" in name:
        saved = load_file(directory / "adapter_model.safetensors")
        lora = {k.replace(".default.", "."): v for k, v in result["state"].items() if "lora_" in k}
        assert saved.keys() == lora.keys(), (sorted(saved)[:2], sorted(lora)[:2])
        for key, value in lora.items():
            torch.testing.assert_close(saved[key], value, atol=0, rtol=0)
        # save_merged: the trained run's weights merged as PEFT merges them on one process.
        reference = CASES[name].module(reference=True)
        reference.configure_model()
        reference.model.load_state_dict(result["state"])
        expected = reference.model.merge_and_unload().state_dict()
        merged = AutoModelForCausalLM.from_pretrained(result["split"]["merged"], dtype=torch.float32).state_dict()
        assert merged.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(merged[key], value, atol=0, rtol=0)
        return

    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    trained = result["state"]
    assert reloaded.keys() == trained.keys()
    for key, value in trained.items():
        torch.testing.assert_close(reloaded[key], value, atol=0, rtol=0)


def _check(results: list[dict], name: str, *, world_size: int) -> None:
    case = CASES[name]
    assert_parity(_result(results, name), reference_of(name), name)
    kwargs = case.strategy_kwargs
    pp, tp, cp = kwargs["pp_size"], kwargs.get("tp_size", 2), kwargs.get("cp_size", 1)
    stages_per_rank = kwargs.get("pp_stages_per_rank", 1)
    dp = world_size // pp // tp // cp
    everything = set(reference_of(name)["state"])
    held: dict[int, set[str]] = {}
    for rank, r in enumerate(results):
        split = r[name]["split"]
        pp_rank = rank // (world_size // pp)  # `pp` is the outermost axis
        # Each rank holds its stages (interleaved: pp_rank, pp_rank + pp, ...; V-shaped: pp_rank and 2 pp - 1 -
        # pp_rank) and their parameters only.
        if kwargs.get("pp_schedule") in ("ZBVZeroBubble", "DualPipeV"):
            assert split["stages"] == [pp_rank, 2 * pp - 1 - pp_rank], split["stages"]
        else:
            assert split["stages"] == [pp_rank + k * pp for k in range(stages_per_rank)], split["stages"]
        held.setdefault(pp_rank, set(split["held"]))
        assert set(split["held"]) == held[pp_rank]
        assert set(split["held"]) < everything
        # MFU's parameter count is the whole model's on every rank, not its own stages' (a pp-th of it); a tied
        # embedding once, as one process counts its parameters (its state dict holds it under both names).
        reference = reference_of(name)
        tied = reference["state"]["lm_head.weight"].numel() if reference["tied"] else 0
        assert split["model_numel"] == sum(value.numel() for value in reference["state"].values()) - tied
        # Every rank of the pipeline reports the same loss (the last stage's), a data-parallel rank its own rows'.
        assert r[name]["losses"] == results[rank % (world_size // pp)][name]["losses"]
        assert r[name]["sampler"] == {"num_replicas": dp, "rank": rank % (world_size // pp) // (cp * tp)}
    # The stages together hold every parameter, each once.
    assert set.union(*held.values()) == everything
    assert not set.intersection(*held.values())
    # save_pretrained on every rank writes one standard directory with every stage's weights (a LoRA model's adapters).
    _check_pretrained(name, results[0][name])
    # `Trainer.validate` (a forward-only schedule in inference mode; through FSDP2 where dp > 1) gives one
    # process's loss of the trained model, on every rank.
    loss, bound = _reference_eval_loss(name)
    for r in results:
        assert r[name]["split"]["eval_loss"] == pytest.approx(loss, abs=bound)


@pytest.mark.parametrize("name", PP_CASES)
@pytest.mark.scenarios("tp2", "{name}")
def test_pp2_matches_single_process(tp2_results: list[dict], name: str) -> None:
    _check(tp2_results, name, world_size=2)


@pytest.mark.parametrize("name", PP_2D_CASES)
@pytest.mark.scenarios("2d", "{name}")
def test_pp2_on_4_ranks_matches_single_process(two_d_results: list[dict], name: str) -> None:
    _check(two_d_results, name, world_size=4)


@pytest.mark.parametrize("name", THREE_D_CASES)
@pytest.mark.scenarios("3d", "{name}")
def test_pp2_tp2_dp2_on_8_ranks_matches_single_process(three_d_results: list[dict], name: str) -> None:
    _check(three_d_results, name, world_size=8)


@pytest.mark.scenarios("tp2", "llama_pp2_dynamic_lengths", "llama_pp2_bucketed_lengths")
def test_pp2_keeps_a_bounded_set_of_stages_under_dynamic_padding(tp2_results: list[dict]) -> None:
    """12 steps of 12 lengths (at parity: test_pp2_matches_single_process): the pipeline keeps the stages of its last
    KEPT_SHAPES shapes, and the stages it let go are gone from memory (not left for a garbage collection that
    training turns off); padded to multiples of 8 the 12 lengths are 2 shapes."""
    from lightning_tp.parallel.pipeline import KEPT_SHAPES

    for result in tp2_results:
        dynamic = result["llama_pp2_dynamic_lengths"]["split"]
        assert dynamic["kept_shapes"] == KEPT_SHAPES, dynamic["kept_shapes"]
        assert dynamic["live_stages"] == KEPT_SHAPES * len(dynamic["stages"]), dynamic["live_stages"]
        bucketed = result["llama_pp2_bucketed_lengths"]["split"]
        assert bucketed["kept_shapes"] == 2 and bucketed["live_stages"] == 2 * len(bucketed["stages"]), bucketed
