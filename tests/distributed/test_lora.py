"""PEFT LoRA under TP and 2-D: adapters sharded with their base layers, saved and reloaded the PEFT way."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.cases import CASES, _checkpoint
from tests.helpers.models import PROBE, build_causal_lm, lm_batches, reference_run, tiny_config
from tests.helpers.selection import scenario_result as _result
from tests.helpers.tolerances import fp32_logits_gap, fp32_loss_gap, fp32_roundings

LORA_CASES = ["qwen3_lora", "llama_rslora"]


@pytest.mark.parametrize(
    ("layout", "name"),
    [("tp2", n) for n in [*LORA_CASES, "qwen3_lora_embedding", "qwen3_lora_from_adapter"]]
    + [("2d", n) for n in LORA_CASES],
)
@pytest.mark.scenarios("{layout}", "{name}")
def test_only_adapters_train(layout_results: list[dict], layout: str, name: str) -> None:
    """Frozen base weights get no gradient and no optimizer state; the optimizer holds the adapters only."""
    result = _result(layout_results, name)
    assert result["frozen_with_grad"] == 0
    assert result["optimizer_states"] == result["trainable"] > 0
    peft_model = CASES[name].build()
    assert result["trainable"] == sum(p.requires_grad for p in peft_model.parameters())
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.parametrize("name", LORA_CASES)
@pytest.mark.scenarios("{layout}", "{name}")
def test_saved_adapter_reloads_on_one_process(layout_results: list[dict], layout: str, name: str) -> None:
    """`save_pretrained` on every rank wrote one standard adapter directory with whole tensors; PEFT loads it on one
    process and gives the sharded model's logits."""
    from peft import PeftModel

    result = _result(layout_results, name)
    directory = Path(result["adapter"]["dir"])
    assert json.loads((directory / "adapter_config.json").read_text())["r"] == 4
    tensors = load_file(directory / "adapter_model.safetensors")
    kind = "qwen3" if name.startswith("qwen3") else "llama"
    config = tiny_config(kind)
    q_proj_b = next(v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" in k)
    o_proj_a = next(v for k, v in tensors.items() if "layers.0.self_attn.o_proj.lora_A" in k)
    assert q_proj_b.shape == (config.num_attention_heads * 16, 4)  # whole, not a TP shard
    assert o_proj_a.shape == (4, config.num_attention_heads * 16)
    assert not list(directory.parent.glob(f".{directory.name}.*"))  # no temporary directory left behind
    model = PeftModel.from_pretrained(build_causal_lm(config), directory).eval()
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    # The same weights, another layout's forward: within fp32's bound (tests/helpers/tolerances.py).
    forward, _ = fp32_roundings([v.shape for v in model.state_dict().values()], 0)
    bound = fp32_logits_gap(forward, logits.abs().max().item())
    torch.testing.assert_close(result["adapter"]["logits"], logits, atol=bound, rtol=0)


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.scenarios("{layout}", "qwen3_meta_lora")
def test_meta_model_with_new_lora_starts_from_the_base_model(layout_results: list[dict], layout: str) -> None:
    """lightning_tp.from_pretrained + get_peft_model: the base is loaded from its files, the adapters initialised the
    PEFT way (B = 0, A random), each sharded lora_A the slice of the matrix one process draws from the same seed (not
    the same rows on every rank), so the first loss is the base model's."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import ParityModule

    reference = CASES["qwen3_meta_lora"].reference_build().state_dict()
    result = _result(layout_results, "qwen3_meta_lora")
    initial = result["initial_state"]
    # Every adapter of the one-process build, and no other: B all zeros, A finite and not zero.
    for part in ("lora_A", "lora_B"):
        expected = sorted(k for k in reference if part in k)
        assert expected and sorted(k for k in initial if part in k) == expected, part
    assert all(torch.count_nonzero(v) == 0 for k, v in initial.items() if "lora_B" in k)
    a = {k: v for k, v in initial.items() if "lora_A" in k}
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in a.values())
    for key, value in a.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        assert not torch.equal(*value.chunk(2, dim=1)), key  # o_proj/down_proj's lora_A is sharded on dim 1
    base = AutoModelForCausalLM.from_pretrained(_checkpoint("qwen3"), dtype=torch.float32)
    for key, value in base.state_dict().items():
        peft_key = f"base_model.model.{key}".replace(".weight", ".base_layer.weight")
        got = initial.get(peft_key, initial.get(f"base_model.model.{key}"))
        assert got is not None, key
        torch.testing.assert_close(got, value, rtol=0, atol=0)
    ref = reference_run(ParityModule(partial(copy.deepcopy, base)), lm_batches(1))
    # The base model's first loss, another layout's forward: within fp32's bound (tests/helpers/tolerances.py).
    forward, _ = fp32_roundings([v.shape for v in initial.values()], ref["output_rows"])
    scale, rows, classes = ref["output_scales"][0], ref["output_rows"], ref["output_classes"]
    bound = fp32_loss_gap(forward, scale, ref["losses"][0], rows=rows, classes=classes)
    assert abs(result["losses"][0] - ref["losses"][0]) <= bound, (result["losses"][0], ref["losses"][0], bound)


@pytest.mark.parametrize(
    ("layout", "name"), [("tp2", "llama_rslora"), ("2d", "llama_rslora"), ("tp2", "qwen3_lora_embedding")]
)
@pytest.mark.scenarios("{layout}", "{name}")
def test_merged_model_is_a_standard_transformers_directory(layout_results: list[dict], layout: str, name: str) -> None:
    """lightning_tp.save_merged on every rank: one directory that AutoModelForCausalLM loads on one process, giving
    the sharded LoRA model's logits."""
    from transformers import AutoModelForCausalLM

    result = _result(layout_results, name)
    model = AutoModelForCausalLM.from_pretrained(result["adapter"]["merged"], dtype=torch.float32).eval()
    assert not any("lora" in name for name in model.state_dict())
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    # The same weights merged, another layout's forward: within fp32's bound (tests/helpers/tolerances.py), the
    # adapters' path counted as the forward again (it sums over each adapted matrix's input again, and over the rank).
    forward, _ = fp32_roundings([v.shape for v in model.state_dict().values()], 0)
    bound = fp32_logits_gap(2 * forward, logits.abs().max().item())
    torch.testing.assert_close(result["adapter"]["logits"], logits, atol=bound, rtol=0)


@pytest.mark.scenarios("tp2", "save_failure")
def test_a_failed_save_raises_on_every_rank(tp2_results: list[dict]) -> None:
    """Rank 0 cannot write the adapter: each rank raises the same error instead of waiting for rank 0."""
    for results in tp2_results:
        error = results["save_failure"]
        assert error["type"] == "RuntimeError", error
        assert "Writing failed on rank 0" in error["message"]
