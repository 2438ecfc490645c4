import pytest

from lightning_tp.tools.inspect import build_meta_model, inspect_model, local_shape, main
from tests.helpers.models import build_causal_lm, tiny_config, tiny_vlm_config


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    configs = {
        "qwen3": tiny_config("qwen3"),
        "kv1": tiny_config("llama", num_key_value_heads=1),
        "heads3": tiny_config("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48),
        "qwen2_5_vl": tiny_vlm_config("qwen2_5_vl"),  # AutoModelForCausalLM does not take its config
        "gemma3": tiny_vlm_config("gemma3"),  # tied lm_head
    }
    for name, config in configs.items():
        config.save_pretrained(root / name)
    return root


@pytest.mark.parametrize(
    ("shape", "style", "is_bias", "expected"),
    [
        ((64, 32), "colwise", False, (32, 32)),
        ((64,), "colwise", True, (32,)),
        ((64, 32), "rowwise", False, (64, 16)),
        ((64,), "rowwise", True, (64,)),
        ((95, 16), "embedding_rowwise", False, (48, 16)),  # uneven: rank 0 holds the most
        ((95, 16), "embedding_colwise", False, (95, 8)),
        ((4, 64, 32), "packed_colwise", False, (4, 32, 32)),  # stacked experts
        ((64, 32), "replicate", False, (64, 32)),
    ],
)
def test_local_shape(shape, style, is_bias, expected):
    assert local_shape(shape, style, 2, is_bias=is_bias) == expected


def test_valid_layout_exit_code_and_report(config_dirs, capsys):
    assert main([str(config_dirs / "qwen3"), "--tp-size", "2", "--dp-shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "[64, 64] -> [16, 64]" in out  # tp 2, then fsdp 2
    assert "model.norm.weight" in out  # replicated
    assert "The layout is valid." in out


def test_invalid_layout_names_the_problem_and_the_sizes_that_work(config_dirs, capsys):
    assert main([str(config_dirs / "heads3"), "--tp-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "num_attention_heads=3 not divisible by tp_size=2" in out and "one of [1, 3]" in out


def test_replicated_kv_heads_are_explained_per_rank(config_dirs, capsys):
    assert main([str(config_dirs / "kv1"), "--tp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "1 KV heads for 4 query heads, not divisible by tp_size=4: the KV heads are replicated in 2" in out
    assert "rank 3: query heads 3 read KV heads 0" in out
    assert "model.layers.0.self_attn.k_proj.weight" in out and "colwise_kv_heads" in out
    assert "[16, 64] -> [4, 64]" in out  # stored split like colwise
    assert "K/V activations of up to 1 head(s) per rank" in out and "The layout is valid." in out


def test_memory_per_rank_divides_and_lora_counts_trainable_only(config_dirs):
    full = build_causal_lm(tiny_config("qwen3"))
    total = sum(p.numel() for p in full.parameters())
    one = inspect_model(build_meta_model(str(config_dirs / "qwen3")), tp_size=1).memory["fp32"]
    four = inspect_model(build_meta_model(str(config_dirs / "qwen3")), tp_size=2, dp_shard_size=2).memory["fp32"]
    assert one["parameters"] == 4 * total
    norms = sum(p.numel() for n, p in full.named_parameters() if "norm" in n)
    assert four["parameters"] <= (total - norms) * 4 / 4 + norms * 4 / 2  # shards, plus norms (FSDP-sharded only)
    lora = inspect_model(build_meta_model(str(config_dirs / "qwen3"), lora_r=4), tp_size=2).memory["fp32"]
    assert lora["gradients"] < one["gradients"] / 10  # r=4 adapters on a 86k-parameter model
    assert lora["adamw_states"] == 2 * lora["gradients"]


@pytest.mark.parametrize(("kind", "vision"), [("qwen2_5_vl", "model.visual"), ("gemma3", "model.vision_tower")])
def test_vision_language_model_parts(config_dirs, capsys, kind, vision):
    """A VLM is built from its config; the report says which parts the plan shards (the language model) and which
    stay whole on every TP rank (the vision tower, the projector: no plan entries)."""
    assert main([str(config_dirs / kind), "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    parts = out.split("Parts (elements per TP rank):")[1].split("\n\n")[0]
    rows = {line.split()[0]: line for line in parts.strip().splitlines()}
    assert "replicated over TP" in rows[vision]
    assert "sharded (" in rows["model.language_model"]
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in out
    if kind == "gemma3":
        assert "replicated over TP" in rows["model.multi_modal_projector"]
        assert "tied" in rows["lm_head"]
    else:
        assert "sharded (1 of 1" in rows["lm_head"]


def test_context_parallel_layout_is_explained(config_dirs, capsys):
    """cp 2 x tp 2: what each rank holds of a sequence and what each attention layer gathers; FSDP2 shards over
    dp_shard x cp, so the per-rank memory is that of tp 2 x dp_shard 2."""
    assert main([str(config_dirs / "qwen3"), "--tp-size", "2", "--cp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "Layout: tp=2 x cp=2 x dp_shard=1" in out and "Context parallelism (cp=2):" in out
    assert "split into 4 pieces" in out and "1/2 of the tokens" in out
    # 2 KV heads over tp 2: 1 per rank, x head_dim 16 x K and V = 32 values per token and layer.
    assert "Each of the 2 attention layers all-gathers its keys and values" in out and "32 values per token" in out
    assert "[64, 64] -> [16, 64]" in out  # q_proj: tp 2, then FSDP2 over cp 2
    model = build_meta_model(str(config_dirs / "qwen3"))
    with_cp = inspect_model(model, tp_size=2, cp_size=2).memory["fp32"]
    with_dp = inspect_model(model, tp_size=2, dp_shard_size=2).memory["fp32"]
    assert with_cp == with_dp


def test_context_parallel_refusals_are_problems(config_dirs, capsys):
    assert main([str(config_dirs / "gemma3"), "--tp-size", "1", "--cp-size", "2"]) == 1
    assert "cp_size=2: Gemma3ForConditionalGeneration is a composite" in capsys.readouterr().out


@pytest.mark.parametrize(("intermediate", "working"), [(96, [1, 3]), (144, [1, 3, 9])])
def test_lists_the_tp_sizes_that_work_and_why_the_others_fail(intermediate: int, working: list[int]) -> None:
    """SmolLM2's head counts (9 query heads, 3 KV heads): the query heads allow 1, 3 and 9; at 9 the KV heads are
    replicated, and an MLP width that 9 does not divide (SmolLM2's 1536) rules 9 out too."""
    from transformers import LlamaConfig

    from lightning_tp.tools.inspect import format_report, tp_sizes

    config = LlamaConfig(
        vocab_size=90,
        hidden_size=72,
        intermediate_size=intermediate,
        num_hidden_layers=1,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    model = build_causal_lm(config)
    sizes, reasons = tp_sizes(model)
    assert sizes == working
    assert set(reasons) == set(range(1, 10)) - set(working)
    assert "num_attention_heads=9 not divisible by tp_size" in reasons[2]
    if 9 not in working:
        assert "not divisible by tp_size" in reasons[9] and "mlp" in reasons[9]
    report = format_report(inspect_model(model, tp_size=3), tp_size=3, dp_shard_size=1)
    assert f"accepts (1 to 9): {', '.join(map(str, working))}" in report
    assert "not 2, 4, 5, 6, 7, 8: num_attention_heads=9" in report
