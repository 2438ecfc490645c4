"""Plans derived from the module structure for models whose config has no `base_model_tp_plan` (no process group)."""

import pytest
import torch

from lightning_tp.parallel.tensor_parallel import localize_heads
from lightning_tp.plans.derived import FUSED_QKV_LAYOUTS, derive_plan, vocabulary_plan
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.plans.source import plan_source
from lightning_tp.tools.inspect import format_report
from lightning_tp.tools.inspect_report import inspect_model
from tests.helpers.models import DERIVED_KINDS, tiny_config


def meta_model(kind, **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))


def meta_model_of(model_type, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=96, **config))


EXPECTED = {
    "gpt_neo": {
        "transformer.h.*.attn.attention.q_proj": "colwise",
        "transformer.h.*.attn.attention.k_proj": "colwise",
        "transformer.h.*.attn.attention.v_proj": "colwise",
        "transformer.h.*.attn.attention.out_proj": "rowwise",
        "transformer.h.*.attn.attention": "local_heads",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    "opt": {
        "model.decoder.layers.*.self_attn.q_proj": "colwise",
        "model.decoder.layers.*.self_attn.k_proj": "colwise",
        "model.decoder.layers.*.self_attn.v_proj": "colwise",
        "model.decoder.layers.*.self_attn.out_proj": "rowwise",
        "model.decoder.layers.*.self_attn": "local_heads",
        "model.decoder.layers.*.fc1": "colwise",
        "model.decoder.layers.*.fc2": "rowwise",
        "model.decoder.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    "stablelm": {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.self_attn": "local_heads",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    "gpt2": {
        "transformer.h.*.attn.c_attn": "conv1d_colwise_qkv",
        "transformer.h.*.attn.c_proj": "conv1d_rowwise",
        "transformer.h.*.attn": "local_heads",
        "transformer.h.*.mlp.c_fc": "conv1d_colwise",
        "transformer.h.*.mlp.c_proj": "conv1d_rowwise",
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    # query_key_value laid out head by head ([q k v] per head), as GPT-BigCode's c_attn.
    "falcon": {
        "transformer.h.*.self_attention.query_key_value": "colwise",
        "transformer.h.*.self_attention.dense": "rowwise",
        "transformer.h.*.self_attention": "local_heads",
        "transformer.h.*.mlp.dense_h_to_4h": "colwise",
        "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
        "transformer.word_embeddings": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    # Bloom: per head [q k v] too, and the ALiBi biases (built by the model for every head) sliced per rank.
    "bloom": {
        "transformer.h.*.self_attention.query_key_value": "colwise",
        "transformer.h.*.self_attention.dense": "rowwise",
        "transformer.h.*.self_attention": "local_heads_alibi",
        "transformer.h.*.mlp.dense_h_to_4h": "colwise",
        "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
        "transformer.word_embeddings": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    # MPT: [q | k | v] blocks in an nn.Linear, split block by block; its ALiBi position_bias sliced per rank.
    "mpt": {
        "transformer.blocks.*.attn.Wqkv": "packed_colwise_qkv",
        "transformer.blocks.*.attn.out_proj": "rowwise",
        "transformer.blocks.*.attn": "local_heads_alibi",
        "transformer.blocks.*.ffn.up_proj": "colwise",
        "transformer.blocks.*.ffn.down_proj": "rowwise",
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
    # The fused c_attn is laid out head by head ([q k v] per head): a plain column split gives whole heads.
    "gpt_bigcode": {
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.attn": "local_heads",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
    },
}


@pytest.mark.parametrize("kind", DERIVED_KINDS)
def test_plan_is_derived_from_the_module_structure(kind):
    model = meta_model(kind)
    assert not model.config.base_model_tp_plan
    assert plan_source(model) == (EXPECTED[kind], "derived", None)
    plan = resolve_plan(model, "auto", tp_size=2)
    # Every layer's attention computes its own heads.
    layers = [name for name in plan.local_heads]
    assert len(layers) == 2 and all(plan.head_styles[name].startswith("local_heads") for name in layers)
    assert not set(layers) & set(plan.styles)  # a head style is kept apart: the module may take a layer style too
    assert plan.alibi_heads == (layers if kind in ("bloom", "mpt") else [])
    assert not {s for s in plan.styles.values() if isinstance(s, str) and s.startswith("local_heads")}
    first, style = next(iter(EXPECTED[kind].items()))
    assert plan.styles[f"{first.replace('*', '1')}.weight"] == style
    # A tied embedding and lm_head share one vocabulary split.
    assert plan.tied == (
        {
            "lm_head.weight": next(
                k for k in plan.styles if k.endswith(("wte.weight", "embed_tokens.weight", "word_embeddings.weight"))
            )
        }
        if model.config.tie_word_embeddings
        else {}
    )


def test_a_model_with_its_own_plan_keeps_it():
    model = meta_model("llama")
    plan, source, reason = plan_source(model)
    assert source == "model" and reason is None and plan == dict(model.tp_plan)


def test_tp_plan_overrides_a_derived_rule_and_keeps_the_others():
    plan = resolve_plan(meta_model("opt"), {"model.decoder.layers.*.fc1": "colwise_rep"}, tp_size=2)
    assert plan.styles["model.decoder.layers.0.fc1"] == "colwise_rep"
    assert plan.styles["model.decoder.layers.0.fc2"] == "rowwise"
    assert plan.head_styles["model.decoder.layers.0.self_attn"] == "local_heads"


@pytest.mark.parametrize(
    ("model_type", "config", "fragments"),
    [
        (
            "falcon",
            dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=64, parallel_attn=False, alibi=True),
            ["query_key_value", "ALiBi"],
        ),
        (
            "stablelm",
            dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=64, qk_layernorm=True),
            ["model.layers.0.self_attn.q_layernorm", "per-head norms"],
        ),
    ],
)
def test_a_structure_not_understood_keeps_the_layers_whole_naming_the_module(model_type, config, fragments):
    model = meta_model_of(model_type, **config)
    with pytest.raises(ValueError) as err:
        derive_plan(model)
    message = str(err.value)
    for fragment in [*fragments, "has no `base_model_tp_plan`", "Pass `tp_plan`", "tp_size=1"]:
        assert fragment in message, message
    # "auto" trains it: the vocabulary split, the layers whole (the reason in an info line).
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.styles["lm_head"] == "colwise_gather_output"
    # The attention stays whole (its MLP, a plain gated one, may be split).
    attention = [style for name, style in plan.styles.items() if ".self_attn" in name or ".self_attention" in name]
    assert set(attention) <= {"replicate"}, attention
    assert not plan.local_heads
    # ... and a plan written by hand overrides it.
    whole = dict.fromkeys(vocabulary_plan(model), "replicate")
    assert resolve_plan(model, whole, tp_size=2).styles["lm_head"] == "replicate"


@pytest.mark.parametrize(
    ("model_type", "config", "qkv", "blocks", "whole"),
    [
        # Multi-query attention, [q | k | v] with one K/V head: each rank takes its q slice and all of k and v.
        (
            "gpt_bigcode",
            dict(n_layer=1, n_head=4, n_embd=64, multi_query=True),
            "transformer.h.0.attn.c_attn",
            (64, 16, 16),
            (1, 2),
        ),
        (
            "falcon",
            dict(num_hidden_layers=1, num_attention_heads=4, hidden_size=64, multi_query=True),
            "transformer.h.0.self_attention.query_key_value",
            (64, 16, 16),
            (1, 2),
        ),
        # Grouped per KV head ([q.. k v] per group): a plain column split gives each rank whole groups.
        (
            "falcon",
            dict(
                num_hidden_layers=1,
                num_attention_heads=4,
                hidden_size=64,
                new_decoder_architecture=True,
                num_kv_heads=2,
            ),
            "transformer.h.0.self_attention.query_key_value",
            None,
            None,
        ),
    ],
)
def test_fused_multi_query_and_grouped_attention_are_split_by_heads(model_type, config, qkv, blocks, whole):
    plan = resolve_plan(meta_model_of(model_type, **config), "auto", tp_size=2)
    weight = f"{qkv}.weight"
    assert plan.styles[weight] == ("colwise_blocks" if blocks else "colwise")
    assert plan.blocks.get(weight) == blocks
    assert plan.whole_blocks.get(weight) == whole
    assert qkv.rpartition(".")[0] in plan.local_heads


def test_every_fused_layout_is_a_style_of_the_table():
    from lightning_tp.plans.styles import STYLES

    for model_type, layout in FUSED_QKV_LAYOUTS.items():
        assert layout.style in ("colwise", "conv1d_colwise_qkv", "packed_colwise_qkv"), model_type
        assert STYLES[layout.style].output_sharded and STYLES[layout.attention_style].kind == "heads", model_type


def test_heads_not_divisible_by_the_tp_size_are_refused():
    with pytest.raises(ValueError, match="not divisible by tp_size=3"):
        resolve_plan(meta_model("gpt_neo"), "auto", tp_size=3)


def test_local_heads_on_a_module_without_head_counts_is_refused():
    with pytest.raises(ValueError, match="keeps no head count"):
        resolve_plan(meta_model("opt"), {"model.decoder.layers.*.fc1": "local_heads"}, tp_size=2)


def test_local_heads_divides_the_head_counts_of_the_named_modules_only():
    model = meta_model("stablelm")
    plan = resolve_plan(model, "auto", tp_size=2)
    localize_heads(model, plan, tp_size=2, rank=0)
    attention = model.model.layers[1].self_attn
    assert (attention.num_heads, attention.num_key_value_heads, attention.head_dim) == (2, 1, 16)
    assert model.config.num_attention_heads == 4  # the config (what is saved) keeps the whole model's counts


def test_inspector_says_the_plan_was_derived_and_shows_the_local_heads():
    report = inspect_model(meta_model("gpt_bigcode"), tp_size=2)
    assert report.valid and report.source == "derived"
    heads = {"num_heads": (4, 2), "split_size": (64, 32), "embed_dim": (64, 32)}
    assert ("transformer.h.0.attn", heads) in report.local_heads
    text = format_report(report, tp_size=2, dp_shard_size=1)
    assert "Plan: derived from the module structure" in text
    assert "transformer.h.0.attn.c_attn.weight" in text and "[192, 64] -> [96, 64]" in text
    assert "num_heads 4 -> 2" in text
    own = format_report(inspect_model(meta_model("llama"), tp_size=2), tp_size=2, dp_shard_size=1)
    assert "Plan: the model's own" in own
    # Multi-query attention: split by heads, K and V taken whole by every rank.
    multi_query = inspect_model(meta_model("gpt_bigcode", multi_query=True), tp_size=2)
    assert multi_query.valid, multi_query.problems


def test_gpt2_conv1d_layers_get_the_conv1d_styles_and_their_shapes():
    """Conv1D stores its weight [in, out]: column-wise splits dim 1, row-wise dim 0; c_attn's [q | k | v] blocks are
    split block by block, and the attention's `split_size` (one block's width) becomes the rank's."""
    model = meta_model("gpt2")
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.styles["transformer.h.0.attn.c_attn.weight"] == "conv1d_colwise_qkv"
    assert plan.styles["transformer.h.0.attn.c_proj.weight"] == "conv1d_rowwise"
    assert plan.styles["transformer.h.0.mlp.c_fc.weight"] == "conv1d_colwise"
    assert plan.styles["transformer.h.0.mlp.c_proj.weight"] == "conv1d_rowwise"
    report = inspect_model(model, tp_size=2)
    rows = {name: (shape, local) for name, _, shape, local in report.rows}
    assert rows["transformer.h.0.attn.c_attn.weight"] == ((64, 192), (64, 96))
    assert rows["transformer.h.0.attn.c_attn.bias"] == ((192,), (96,))
    assert rows["transformer.h.0.mlp.c_proj.weight"] == ((128, 64), (64, 64))
    assert "transformer.h.0.mlp.c_proj.bias" in dict(report.replicated)
    heads = dict(report.local_heads)["transformer.h.0.attn"]
    assert heads["num_heads"] == (4, 2) and heads["split_size"] == (64, 32)


def test_lora_on_a_conv1d_layer_is_refused_by_name():
    from peft import LoraConfig, get_peft_model

    from lightning_tp.parallel.lora import extend_plan_to_adapters

    model = get_peft_model(meta_model("gpt2"), LoraConfig(r=2, target_modules=["c_attn"])).base_model.model
    with pytest.raises(ValueError, match=r"transformer.h.0.attn.c_attn.*Conv1D"):
        extend_plan_to_adapters(model, resolve_plan(model, "auto", tp_size=2))


def test_sequence_parallel_rewrites_derived_plans_and_keeps_their_head_styles():
    from lightning_tp.parallel.sequence_parallel import GatherSequence, sequence_parallel_plan
    from lightning_tp.plans.derived import decoder_layer_list

    def rewrite(kind):
        model = meta_model(kind)
        plan = resolve_plan(model, "auto", tp_size=2)
        blocks = {type(decoder_layer_list(model)[1][0])}
        return plan, sequence_parallel_plan(model, plan, blocks=blocks)

    plan, sp = rewrite("bloom")
    assert isinstance(sp.styles["transformer.h.0.self_attention"], GatherSequence)
    assert sp.head_styles == plan.head_styles
    assert sp.alibi_heads == [f"transformer.h.{i}.self_attention" for i in (0, 1)]
    assert "transformer.ln_f" in sp.grad_allreduce and "transformer.word_embeddings_layernorm" not in sp.grad_allreduce
    _, neo = rewrite("gpt_neo")  # the region `attn.attention` sits in a wrapper `attn` holding nothing else
    assert isinstance(neo.styles["transformer.h.0.attn.attention"], GatherSequence)
    with pytest.raises(ValueError, match="'model.decoder.layers.0.fc2' sits directly in decoder layer"):
        rewrite("opt")
    with pytest.raises(ValueError, match="has style 'conv1d_colwise_qkv'"):
        rewrite("gpt2")
