import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_tp.plans.resolve import resolve_plan
from tests.helpers.models import MLP, tiny_config


def meta_model(kind="qwen3", **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))


def test_auto_plan_expands_to_concrete_names_params_before_modules():
    plan = resolve_plan(meta_model("qwen3"), "auto", tp_size=2)
    names = list(plan.styles)
    assert plan.styles["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.1.self_attn.q_proj.weight"] == "colwise"
    assert names.index("model.layers.0.mlp.down_proj.weight") < names.index("model.layers.0.mlp.down_proj")
    assert plan.styles["lm_head"] == "colwise_gather_output"
    assert plan.styles["model.embed_tokens"] == "embedding_rowwise"
    assert not any("*" in n for n in names)
    # q/k norms are summed by this package, not by Transformers' hook layer.
    assert plan.grad_allreduce == [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")]
    assert plan.tied == {}


def test_overrides_merge_key_by_key():
    plan = resolve_plan(
        meta_model("llama"), {"lm_head": "replicate", "model.layers.*.mlp.up_proj": "colwise_rep"}, tp_size=2
    )
    assert plan.styles["lm_head"] == "replicate"
    assert plan.styles["model.layers.0.mlp.up_proj"] == "colwise_rep"
    assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"  # untouched rule stays


def test_specific_key_wins_over_wildcard():
    plan = resolve_plan(meta_model("llama"), {"model.layers.1.mlp.up_proj": "colwise_rep"}, tp_size=2)
    assert plan.styles["model.layers.1.mlp.up_proj"] == "colwise_rep"
    assert plan.styles["model.layers.0.mlp.up_proj"] == "colwise"


def test_tied_embeddings_are_sharded_once():
    plan = resolve_plan(meta_model("tied"), "auto", tp_size=2)
    assert plan.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in plan.styles  # Transformers would raise KeyError on the duplicate
    assert plan.styles["lm_head"] == "colwise_gather_output"


def test_tied_weights_with_different_layouts_are_refused():
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' and 'lm_head.weight'.*sharded differently"):
        resolve_plan(meta_model("tied"), {"model.embed_tokens": "embedding_colwise"}, tp_size=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"model.layers.*.mlp.up_proj": "colwize"},
            r"tp_plan\['model.layers.\*.mlp.up_proj'\] = 'colwize' is not a style this strategy knows.*"
            r"tp_plan=\{'model.layers.\*.mlp.up_proj': 'replicate'\} keeps that module whole",
        ),
        ({"model.layers.*.mlp.up_proj": "sequence_parallel"}, r"'sequence_parallel' \(Transformers' sequence-parallel"),
        ({"model.layers.*.mlp.up_proj": "grouped_gemm"}, r"'grouped_gemm' \(it is expert parallelism"),
        (
            {"model.layers.*.mlp.up_proj": "moe_identity_expert", "model.layers.*.mlp.down_proj": "all_reduce"},
            r"'model.layers.\*.mlp.up_proj': 'moe_identity_expert'.*'model.layers.\*.mlp.down_proj': 'all_reduce'.*"
            r"tp_plan=\{'model.layers.\*.mlp.up_proj': 'replicate', 'model.layers.\*.mlp.down_proj': 'replicate'\}",
        ),
        ({"model.layers.*.mlp.up_proj": 3}, r"must be a Transformers style name or a torch `ParallelStyle`"),
        ({"model.layer.*.mlp": "colwise"}, r"tp_plan keys \['model.layer.\*.mlp'\] match no module"),
        ({}, r"Qwen3ForCausalLM has no tensor-parallel plan"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        resolve_plan(meta_model("qwen3"), overrides, tp_size=2)


def test_plan_must_be_auto_or_dict():
    with pytest.raises(ValueError, match='must be "auto" or a dict'):
        resolve_plan(meta_model("qwen3"), "colwise", tp_size=2)


@pytest.mark.parametrize(
    ("kind", "overrides", "tp_plan", "tp_size", "message"),
    [
        (
            "llama",
            {"num_attention_heads": 6, "num_key_value_heads": 6},
            "auto",
            4,
            r"num_attention_heads=6 not.*\[1, 2, 3, 6\]",
        ),
        # A fused QKV projection sharded column-wise cannot hand each rank other KV heads than its slice.
        (
            "phi3",
            {"num_key_value_heads": 1},
            {"model.layers.*.self_attn.qkv_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"},
            2,
            r"qkv_proj packs the KV heads with the query heads.*one of \[1\]",
        ),
        # Only nn.Linear K/V projections with 'colwise' are replicated.
        (
            "llama",
            {"num_key_value_heads": 1},
            {"model.layers.*.self_attn.k_proj": "packed_colwise"},
            2,
            r"k_proj \(Linear, style 'packed_colwise'\) is not an nn.Linear with 'colwise'",
        ),
    ],
)
def test_heads_not_divisible_by_tp_size(kind, overrides, tp_plan, tp_size, message):
    with pytest.raises(ValueError, match=message):
        resolve_plan(meta_model(kind, **overrides), tp_plan, tp_size=tp_size)


@pytest.mark.parametrize(("kv_heads", "tp_size"), [(1, 2), (2, 4), (1, 4)])
def test_kv_heads_the_tp_size_does_not_divide_are_replicated(kv_heads, tp_size):
    plan = resolve_plan(meta_model("qwen3", num_key_value_heads=kv_heads), "auto", tp_size=tp_size)
    attention = "model.layers.1.self_attn"
    assert plan.kv_replicated == {f"model.layers.{i}.self_attn": (4, kv_heads) for i in range(2)}
    assert plan.styles[f"{attention}.k_proj"] == plan.styles[f"{attention}.v_proj.weight"] == "colwise_kv_heads"
    assert plan.styles[f"{attention}.q_proj"] == "colwise"
    assert plan.kv_heads_of(f"{attention}.k_proj") == (4, kv_heads)
    # k_norm normalises the rank's KV heads: its gradient is still summed over the TP group.
    assert f"{attention}.k_norm" in plan.grad_allreduce
    assert resolve_plan(meta_model("qwen3", num_key_value_heads=2), "auto", tp_size=2).kv_replicated == {}


def test_heads_are_not_checked_when_attention_stays_whole():
    plan = {f"model.layers.*.self_attn.{p}": "replicate" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    resolve_plan(meta_model("llama", num_key_value_heads=1), plan, tp_size=2)


def test_device_map_is_refused():
    model = meta_model("qwen3")
    model.hf_device_map = {"": 0}
    with pytest.raises(ValueError, match="`device_map`.*conflicts with tensor parallelism"):
        resolve_plan(model, "auto", tp_size=2)


def test_plain_module_needs_a_plan_and_takes_torch_styles():
    module = nn.Sequential(MLP())
    with pytest.raises(ValueError, match="not a Transformers model"):
        resolve_plan(module, "auto", tp_size=2)
    plan = resolve_plan(
        module, {"0.up": ColwiseParallel(), "0.down": RowwiseParallel(), "0.head": "replicate"}, tp_size=2
    )
    assert set(plan.torch_styles) == {"0.up", "0.down"}
    names = {name: style for name, style in plan.styles.items() if isinstance(style, str)}
    assert names == {"0.head.weight": "replicate", "0.head.bias": "replicate", "0.head": "replicate"}


def test_user_override_wins_over_a_more_specific_model_rule():
    plan = resolve_plan(meta_model("llama"), {"model.layers.0.mlp.*": "replicate"}, tp_size=2)
    assert plan.styles["model.layers.0.mlp.up_proj"] == "replicate"
    assert plan.styles["model.layers.1.mlp.up_proj"] == "colwise"


def test_norm_gradients_are_summed_only_behind_a_sharded_projection():
    gathered = {f"model.layers.*.self_attn.{p}": "colwise_rep" for p in ("q_proj", "k_proj", "v_proj")}
    plan = resolve_plan(
        meta_model("qwen3"), {**gathered, "model.layers.*.self_attn.o_proj": "rowwise_split_input"}, tp_size=2
    )
    assert plan.grad_allreduce == []
    only_k = resolve_plan(meta_model("qwen3"), {"model.layers.*.self_attn.q_proj": "colwise_rep"}, tp_size=2)
    assert only_k.grad_allreduce == [f"model.layers.{i}.self_attn.k_norm" for i in range(2)]


def test_heads_are_checked_per_layer():
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        resolve_plan(
            meta_model("llama", num_key_value_heads=1),
            {
                "model.layers.*.self_attn.k_proj": "colwise_rep",
                "model.layers.*.self_attn.v_proj": "colwise_rep",
                "model.layers.0.self_attn.k_proj": "colwise",  # one layer left sharded
            },
            tp_size=2,
        )


def test_an_mlp_split_unevenly_is_refused_and_the_vocabulary_may_be_uneven():
    with pytest.raises(
        ValueError, match=r"not divisible by tp_size=2.*'model.layers.0.mlp.gate_proj.weight': 63.*one of \[1, 3, 7"
    ):
        resolve_plan(meta_model("qwen3", intermediate_size=63), "auto", tp_size=2)
    resolve_plan(meta_model("qwen3", vocab_size=97), "auto", tp_size=2)  # padded by DTensor, tested at parity


def test_a_learnable_activation_between_split_projections_sums_its_gradient():
    from transformers import ApertusConfig, AutoModelForCausalLM

    config = ApertusConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert any(True for _ in model.model.layers[0].mlp.act_fn.parameters())  # xIELU's alpha_p, alpha_n
    plan = resolve_plan(model, "auto", tp_size=2)
    assert {f"model.layers.{i}.mlp.act_fn" for i in range(2)} <= set(plan.grad_allreduce)
    assert not [name for name in plan.grad_allreduce if name.endswith("layernorm")]  # norms: the plan's call
    model.model.layers[0].mlp.act_fn = nn.PReLU(128)  # one slope per feature of up_proj's (split) output
    with pytest.raises(ValueError, match=r"act_fn \(PReLU\) holds \['weight \[128\]'\], one value per feature"):
        resolve_plan(model, "auto", tp_size=2)


def test_uneven_layers_that_go_through_dtensor_are_not_refused():
    # phi3's fused gate_up is 'colwise_gather_output' and down 'rowwise_split_input': DTensor pads uneven shards.
    resolve_plan(meta_model("phi3", intermediate_size=33), "auto", tp_size=2)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3", "llava"])
def test_vision_language_model_plan_leaves_the_vision_tower_alone(kind):
    """The class plan's keys are prefixed (`model.language_model.layers.*`): the language model's layers are planned,
    the vision tower and projector have no entries (they stay whole), and the dense rewrite's stack is the text one."""
    from transformers import AutoModelForImageTextToText

    from lightning_tp.plans.structure import block_classes, decoder_layers
    from tests.helpers.models import tiny_vlm_config

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_vlm_config(kind))
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.styles["model.language_model.layers.0.self_attn.q_proj"] == "colwise"
    assert not [n for n in plan.styles if n.startswith(("model.visual", "model.vision_tower", "model.multi_modal"))]
    layers = decoder_layers(model, plan.styles, block_classes(model))  # _no_split_modules lists vision blocks too
    assert layers == ["model.language_model.layers.0", "model.language_model.layers.1"]


def test_sequence_parallel_takes_the_stack_on_the_token_embeddings():
    """With a vision tower planned too there are two stacks of planned layers; sequence parallelism splits the one
    under the module holding the input embedding."""
    from transformers import AutoModelForImageTextToText

    from lightning_tp.plans.structure import block_classes, decoder_layers, layer_stacks, text_decoder_layers
    from tests.helpers.cases import LLAVA_VISION_PLAN
    from tests.helpers.models import tiny_vlm_config

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_vlm_config("llava"))
    plan = resolve_plan(model, LLAVA_VISION_PLAN, tp_size=2)
    layers = decoder_layers(model, plan.styles, block_classes(model))
    assert sorted(layer_stacks(layers)) == ["model.language_model.layers", "model.vision_tower.encoder.layers"]
    assert text_decoder_layers(model, layers) == ["model.language_model.layers.0", "model.language_model.layers.1"]


def test_a_vision_tower_with_its_own_plan_is_sharded_by_it_and_inert_refused_rules_pass():
    """Llama 4's plan covers its vision tower (attention column-/row-wise, the adapter MLP, the patch embedding);
    its mixture-of-experts rules (a refused style) match nothing when every text layer is dense, and do not refuse
    the model."""
    from transformers import Llama4ForConditionalGeneration

    from tests.helpers.models import tiny_vlm_config

    with torch.device("meta"):
        model = Llama4ForConditionalGeneration(tiny_vlm_config("llama4"))
    assert "packed_rowwise" in model.tp_plan.values()  # the experts' rule, which matches nothing here
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.styles["vision_model.model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan.styles["vision_model.vision_adapter.mlp.fc2"] == "rowwise"
    assert plan.styles["language_model.model.layers.1.feed_forward.down_proj"] == "rowwise"
    assert "vision_model.model.layers.0.mlp.fc1" not in plan.styles  # no rule: replicated


def test_a_planned_vision_tower_with_heads_the_tp_size_does_not_divide_is_refused_by_name():
    """The text model's head counts divide by 2, the CLIP tower's one head does not: refused before anything moves,
    naming the tower, instead of failing in its first forward."""
    from transformers import AutoModelForImageTextToText

    from tests.helpers.cases import LLAVA_VISION_PLAN
    from tests.helpers.models import tiny_vlm_config

    config = tiny_vlm_config("llava")
    config.vision_config.num_attention_heads = 1
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    resolve_plan(model, "auto", tp_size=2)  # the tower left whole: its heads do not matter
    with pytest.raises(ValueError, match=r"\.model\.vision_tower: num_attention_heads=1 .*not divisible by tp_size=2"):
        resolve_plan(model, LLAVA_VISION_PLAN, tp_size=2)
