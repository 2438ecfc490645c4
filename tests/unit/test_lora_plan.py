import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model

from lightning_tp.checkpoint.publish import publish_directory
from lightning_tp.parallel.lora import check_peft_supported, extend_plan_to_adapters
from lightning_tp.plans.resolve import resolve_plan
from tests.helpers.models import build_causal_lm, tiny_config


def peft(config, kind="qwen3"):
    return get_peft_model(build_causal_lm(tiny_config(kind)), config).base_model.model


def test_adapters_follow_their_base_layer():
    model = peft(LoraConfig(r=4, target_modules="all-linear"))
    plan = extend_plan_to_adapters(model, resolve_plan(model, "auto", tp_size=2))
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert plan.styles[f"{q}.base_layer"] == plan.styles[f"{q}.lora_B.default"] == "colwise"
    assert plan.styles[f"{o}.base_layer"] == plan.styles[f"{o}.lora_A.default"] == "rowwise"
    assert f"{q}.lora_A.default" not in plan.styles and f"{o}.lora_B.default" not in plan.styles  # whole
    assert q not in plan.styles  # the wrapper itself gets no style
    assert plan.styles["lm_head"] == "colwise_gather_output"  # not a LoRA target (all-linear skips the head)


def test_gathered_base_gathers_its_adapter():
    model = peft(LoraConfig(r=4, target_modules=["up_proj"]), kind="llama")
    plan = extend_plan_to_adapters(model, resolve_plan(model, {"model.layers.*.mlp.up_proj": "colwise_rep"}, tp_size=2))
    assert plan.styles["model.layers.0.mlp.up_proj.lora_B.default"] == "colwise_rep"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), r"use `use_dora=True`, which is not supported"),
        (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "only LoRA adapters"),
        (LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        (LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True), r"use `lora_bias=True`"),
    ],
)
def test_unsupported_peft_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        check_peft_supported(peft(config))


def test_publish_directory_writes_whole_files_and_keeps_the_others(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "tokenizer.json").write_text("kept")
    (target / "adapter_config.json").write_text("old")
    with pytest.raises(RuntimeError), publish_directory(target) as tmp:
        (torch.ones(1).numpy()).tofile(f"{tmp}/adapter_config.json")
        raise RuntimeError("killed midway")
    assert (target / "adapter_config.json").read_text() == "old"  # nothing half-written was published
    with publish_directory(target) as tmp:
        open(f"{tmp}/adapter_config.json", "w").write("new")
    assert (target / "adapter_config.json").read_text() == "new"
    assert (target / "tokenizer.json").read_text() == "kept"  # a file the save does not write is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary directory left
