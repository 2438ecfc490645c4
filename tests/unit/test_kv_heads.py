"""KV-head replication: which KV heads each rank computes, and the plan entries that ask for it."""

from __future__ import annotations

import pytest
import torch

from lightning_tp.parallel.kv_heads import describe_layouts, kv_head_layout
from lightning_tp.parallel.lora import extend_plan_to_adapters
from lightning_tp.parallel.tensor_parallel import localize_heads
from lightning_tp.plans.resolve import resolve_plan
from tests.helpers.models import tiny_config


def _meta(kind: str, **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))


@pytest.mark.parametrize(
    ("query_heads", "kv_heads", "tp_size", "rank", "first", "count", "groups", "expand"),
    [
        (8, 4, 2, 1, 2, 2, 2, None),  # TP divides the KV heads: the usual split
        (8, 2, 4, 3, 1, 1, 2, None),  # 2 query heads per rank, both read KV head 1
        (4, 1, 4, 2, 0, 1, 1, None),  # multi-query attention: every rank reads the one KV head
        (6, 3, 2, 0, 0, 2, 1, (0, 0, 1)),  # query heads 0-2 read KV heads 0, 0, 1: uneven, expanded
        (6, 3, 2, 1, 1, 2, 1, (0, 1, 1)),
        (12, 4, 3, 1, 1, 2, 2, None),  # query heads 4-7 read 1, 1, 2, 2: even on this rank...
        (12, 4, 3, 0, 0, 2, 1, (0, 0, 0, 1)),  # ...uneven on rank 0
    ],
)
def test_layout_examples(query_heads, kv_heads, tp_size, rank, first, count, groups, expand):
    layout = kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=rank)
    assert (layout.first, layout.count, layout.groups, layout.expand) == (first, count, groups, expand)


def test_every_query_head_reads_its_own_kv_head_for_every_valid_size():
    for query_heads in range(1, 17):
        for kv_heads in (k for k in range(1, query_heads + 1) if query_heads % k == 0):
            group = query_heads // kv_heads
            for tp_size in (t for t in range(1, query_heads + 1) if query_heads % t == 0):
                for rank in range(tp_size):
                    layout = kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=rank)
                    # What the attention does with the local heads: repeat each computed KV head `groups` times
                    # (repeat_kv, SDPA's GQA), after the expansion if there is one.
                    local = list(layout.expand) if layout.expand is not None else list(range(layout.count))
                    reads = [layout.first + head for head in local for _ in range(layout.groups)]
                    assert reads == [q // group for q in layout.query_range], (query_heads, kv_heads, tp_size, rank)
                    if tp_size > 1 and kv_heads % tp_size == 0:
                        assert layout.count == kv_heads // tp_size and layout.expand is None  # the usual split


def test_describe_layouts_names_each_ranks_heads():
    assert describe_layouts(6, 3, tp_size=2) == [
        "rank 0: query heads 0-2 read KV heads 0-1 (expanded to one per query head)",
        "rank 1: query heads 3-5 read KV heads 1-2 (expanded to one per query head)",
    ]


def test_lora_b_of_a_replicated_projection_follows_it():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _meta("qwen3", num_key_value_heads=1), LoraConfig(r=2, target_modules=["k_proj", "v_proj"])
    ).base_model.model
    plan = extend_plan_to_adapters(model, resolve_plan(model, "auto", tp_size=2))
    k_proj = "model.layers.0.self_attn.k_proj"
    assert plan.styles[f"{k_proj}.base_layer"] == plan.styles[f"{k_proj}.lora_B.default"] == "colwise_kv_heads"
    assert f"{k_proj}.lora_A.default" not in plan.styles  # reads the whole input: stays whole
    assert plan.kv_heads_of(f"{k_proj}.lora_B.default") == (4, 1)


@pytest.mark.parametrize("rank", [0, 1])
def test_attention_modules_get_their_ranks_grouping(rank):
    model = _meta("llama", num_attention_heads=6, num_key_value_heads=3)
    localize_heads(model, resolve_plan(model, "auto", tp_size=2), tp_size=2, rank=rank)
    assert model.model.layers[0].self_attn.num_key_value_groups == 1  # expanded: one KV head per query head
    derived = _meta("stablelm", num_key_value_heads=1)  # local_heads: its head counts too
    localize_heads(derived, resolve_plan(derived, "auto", tp_size=4), tp_size=4, rank=rank)
    attention = derived.model.layers[0].self_attn
    assert (attention.num_heads, attention.num_key_value_heads, attention.num_key_value_groups) == (1, 1, 1)
    assert derived.config.num_key_value_heads == 1  # the config (what is saved) keeps the whole model's counts


def test_layers_with_their_own_head_counts_are_decided_one_by_one():
    """A layer with more KV heads than the config says (sliding-window layers of MiMo-V2-Flash, say): split as usual
    where the TP size divides them, replicated elsewhere."""
    model = _meta("llama", num_key_value_heads=1)
    wide = model.model.layers[1].self_attn
    with torch.device("meta"):
        wide.k_proj, wide.v_proj = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)  # 2 KV heads of 16
    wide.num_key_value_groups = 2
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.kv_replicated == {"model.layers.0.self_attn": (4, 1)}
    assert plan.styles["model.layers.1.self_attn.k_proj"] == "colwise"


def test_uneven_kv_widths_are_allowed_under_tp_and_named_for_fsdp():
    from lightning_tp.plans.heads import uneven_kv_projections

    model = _meta("llama", num_attention_heads=6, num_key_value_heads=1, head_dim=10, intermediate_size=96)
    plan = resolve_plan(model, "auto", tp_size=3)  # k_proj's 10 rows over 3 ranks: gathered before use
    assert plan.kv_replicated["model.layers.0.self_attn"] == (6, 1)
    # FSDP2 cannot shard uneven TP shards further: parallelize refuses it when there is data parallelism.
    assert "model.layers.0.self_attn.k_proj" in uneven_kv_projections(model, plan, 3)


def test_a_kv_projection_split_by_its_weight_entry_alone_is_seen():
    """A weight entry that splits k_proj under a module entry that keeps it whole: refused by name, not left to fail
    mid-forward."""
    model = _meta("llama", num_key_value_heads=1)
    overrides = {"model.layers.*.self_attn.k_proj.weight": "colwise", "model.layers.*.self_attn.k_proj": "replicate"}
    with pytest.raises(ValueError, match=r"k_proj \(Linear, style 'replicate'\) is not an nn.Linear with 'colwise'"):
        resolve_plan(model, overrides, tp_size=2)
