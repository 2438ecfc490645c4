"""Expert parallelism for real: the experts of Qwen3-MoE and Mixtral split over 2 gloo processes (ep 2 over the
data-parallel ranks, over the TP group, over a CP group whose ranks hold their pieces of the same rows) and over 4
(ep 2 and ep 4 with tp 2 and FSDP2, HSDP), against one process training the whole model on the whole batch. The cases
live in tests/helpers/cases.py (``EP_CASES``, ``EP_2D_CASES``) and run in the folded launches of
tests/distributed/conftest.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cases import CASES, EP_2D_CASES, EP_CASES
from tests.helpers.models import PROBE
from tests.helpers.parity import assert_parity, reference_of, trained_logits_gap
from tests.helpers.selection import scenario_result as _result


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def _check(results: list[dict], name: str, *, world_size: int) -> None:
    case = CASES[name]
    ref = reference_of(name)
    result = _result(results, name)
    assert_parity(result, ref, name)
    kwargs = case.strategy_kwargs
    tp = kwargs.get("tp_size", 2)
    ep, replicas, cp = kwargs["ep_size"], kwargs.get("dp_replicate_size", 1), kwargs.get("cp_size", 1)
    efsdp = world_size // replicas // ep
    reference = case.module(reference=True)
    reference.configure_model()
    model = reference.model
    total = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n)
    for r in results:
        split = r[name]["split"]
        # Each rank holds 1/(ep x efsdp) of the expert weights: whole experts over `ep`, FSDP2 shards over `efsdp`.
        assert split["expert_numel"] == total // (ep * efsdp), (split["expert_numel"], total, ep, efsdp)
        # On the expert mesh: `ep` alone without data parallelism, else FSDP2's axes too (HSDP: with `dp_replicate`).
        fsdp_axes = () if world_size == tp else ("dp_replicate", "efsdp") if replicas > 1 else ("efsdp",)
        assert {names for names, _ in split["expert_placements"]} == {(*fsdp_axes, "ep")}, split["expert_placements"]
        # Every layer's experts recorded their last forward's tokens: each of this rank's tokens once per choice.
        top_k = model.config.num_experts_per_tok
        assert split["expert_load"], "no expert load recorded"
        for load in split["expert_load"].values():
            assert load.sum() > 0 and load.sum() % top_k == 0, load
        assert "moe/expert_load_max_over_mean" in split["logged"], split["logged"]
    # Exported on every rank to a standard Transformers directory: it loads on one process and gives the logits of
    # the reference's trained weights.
    export = result["split"].get("export")
    if export is not None:
        from transformers import AutoModelForCausalLM

        model.load_state_dict(ref["state"])
        reloaded = AutoModelForCausalLM.from_pretrained(export)
        expected = _logits(model)  # within fp32's bound: the runs' trained weights differ by their roundings
        torch.testing.assert_close(
            _logits(reloaded), expected, atol=trained_logits_gap(result, ref, expected, name), rtol=0
        )
    # The data is split over the data-parallel ranks only (the ranks of a TP or CP group read the same rows).
    assert [r[name]["sampler"]["num_replicas"] for r in results] == [world_size // tp // cp] * world_size


@pytest.mark.parametrize("name", EP_CASES)
@pytest.mark.scenarios("tp2", "{name}")
def test_ep_matches_single_process(tp2_results: list[dict], name: str) -> None:
    _check(tp2_results, name, world_size=2)


@pytest.mark.parametrize("name", EP_2D_CASES)
@pytest.mark.scenarios("2d", "{name}")
def test_ep_with_tp_and_fsdp_matches_single_process(two_d_results: list[dict], name: str) -> None:
    _check(two_d_results, name, world_size=4)
