import pytest
import torch

from lightning_tp.composition import BY_KEY
from lightning_tp.tools.inspect import build_meta_model, compact_names, format_report, main
from lightning_tp.tools.inspect_report import inspect_model, local_shape
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
        # a Gated DeltaNet mixer (2 key heads, 4 value heads)
        "qwen3_5": tiny_config("qwen3_5", linear_num_key_heads=2, linear_num_value_heads=4),
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
        # A mixer's packed parameters: stored as a plain Shard(0) of the whole tensor, a bias too.
        ((100, 64), "colwise_blocks", False, (50, 64)),
        ((100,), "colwise_blocks", True, (50,)),
        ((64, 1, 4), "local_blocks", False, (32, 1, 4)),  # conv1d weight [channels, 1, kernel]
        ((64,), "local_blocks", True, (32,)),
        ((4,), "local_blocks", False, (2,)),  # A_log, dt_bias, D
    ],
)
def test_local_shape(shape, style, is_bias, expected):
    assert local_shape(shape, style, 2, is_bias=is_bias) == expected


def test_valid_layout_exit_code_and_report(config_dirs, capsys):
    assert main([str(config_dirs / "qwen3"), "--tp-size", "2", "--dp-shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj.weight" in out and "[64, 64] -> [16, 64]" in out  # tp 2, then fsdp 2
    assert "model.norm.weight" in out  # replicated
    # The repeated layers' replicated parameters one line each (2 layers; the norms FSDP-sharded over 2).
    assert "  model.layers.*.input_layernorm.weight [32] x 2\n" in out
    assert "counted by the dry run" in out  # the memory is the dry run's count, as `python -m lightning_tp.plan`'s
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
    lora_model = build_meta_model(str(config_dirs / "qwen3"), lora_r=4)
    adapters = sum(1 for p in lora_model.parameters() if p.requires_grad)
    report = inspect_model(lora_model, tp_size=2)
    lora = report.memory["fp32"]
    assert lora["gradients"] < one["gradients"] / 10  # r=4 adapters on a 86k-parameter model
    # Counted by the dry run: AdamW's two moments of each adapter and its step count (a float32 scalar each).
    assert report.memory_counted and lora["adamw_states"] == 2 * lora["gradients"] + 4 * adapters


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
    assert "Each of the 2 attention layers receives 32 values per token" in out
    # What each rank holds, from the split's own functions; how the keys and values travel, from the table's rule.
    assert "Of 8,192 tokens, rank 0: [0, 2,048) + [6,144, 8,192), rank 1: [2,048, 4,096) + [4,096, 6,144)" in out
    assert f"cp_comm='all_gather': {BY_KEY['cp+all_gather'].reason}" in out
    assert "[64, 64] -> [16, 64]" in out  # q_proj: tp 2, then FSDP2 over cp 2
    model = build_meta_model(str(config_dirs / "qwen3"))
    with_cp = inspect_model(model, tp_size=2, cp_size=2).memory["fp32"]
    with_dp = inspect_model(model, tp_size=2, dp_shard_size=2).memory["fp32"]
    assert with_cp == with_dp


def test_the_ring_exchange_is_explained_by_its_rule(config_dirs, capsys):
    assert main([str(config_dirs / "qwen3"), "--tp-size", "1", "--cp-size", "4", "--cp-comm", "ring"]) == 0
    out = capsys.readouterr().out
    assert f"cp_comm='ring': {BY_KEY['cp+ring'].reason}" in out and "rank 3: [3,072, 4,096) + [4,096, 5,120)" in out


def test_context_parallel_refusals_are_problems(config_dirs, capsys):
    assert main([str(config_dirs / "gemma3"), "--tp-size", "1", "--cp-size", "2"]) == 1
    assert "cp_size=2: Gemma3ForConditionalGeneration is a composite" in capsys.readouterr().out


@pytest.mark.parametrize(("intermediate", "working"), [(96, [1, 3]), (144, [1, 3, 9])])
def test_lists_the_tp_sizes_that_work_and_why_the_others_fail(intermediate: int, working: list[int]) -> None:
    """SmolLM2's head counts (9 query heads, 3 KV heads): the query heads allow 1, 3 and 9; at 9 the KV heads are
    replicated, and an MLP width that 9 does not divide (SmolLM2's 1536) rules 9 out too."""
    from transformers import LlamaConfig

    from lightning_tp.tools.inspect import format_report
    from lightning_tp.tools.inspect_report import tp_sizes

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


@pytest.fixture(scope="module")
def hybrid_models():
    small = {
        "qwen3_5": {"linear_num_key_heads": 2, "linear_num_value_heads": 4},  # 2 key heads, 4 value heads
        # A plan of its own that leaves the attention layer whole, as Transformers 5.24's does (5.25's splits it).
        "nemotron_h": {"base_model_tp_plan": {"embeddings": "embedding_rowwise"}},
    }
    return {
        kind: build_causal_lm(tiny_config(kind, **small.get(kind, {})))
        for kind in ("qwen3_5", "nemotron_h", "deepseek_v3")
    }


def _text(report, tp_size: int) -> str:
    return format_report(report, tp_size=tp_size, dp_shard_size=1)


def _shard0_shapes_hold(report, tp_size: int) -> None:
    """The reported per-rank shape of every packed parameter is rank 0's Shard(0) of the whole tensor."""
    packed = [(shape, local) for _, style, shape, local in report.rows if style in ("colwise_blocks", "local_blocks")]
    assert packed
    for shape, local in packed:
        assert local == tuple(torch.empty(shape, device="meta").chunk(tp_size, dim=0)[0].shape)


def test_gated_deltanet_heads_and_blocks_per_rank(hybrid_models):
    """Qwen3.5 at TP 2: the Gated DeltaNet mixer's size attributes halve, its fused [q | k | v] projection and the
    conv over those channels give each rank half of every block, stored as a plain split of dim 0."""
    report = inspect_model(hybrid_models["qwen3_5"], tp_size=2)
    assert report.valid and not report.whole_mixers and not report.whole_mixer_sizes.get(2)
    (group,) = report.mixers
    assert group.names == ["model.layers.0.linear_attn"] and group.kind == "gated_deltanet"
    assert group.counts == {
        "num_v_heads": (4, 2),
        "num_k_heads": (2, 1),
        "key_dim": (16, 8),
        "value_dim": (32, 16),
        "conv_dim": (64, 32),
    }
    assert group.blocks == {
        "in_proj_qkv.weight": ((16, 16, 32), (8, 8, 16)),
        "conv1d.weight": ((16, 16, 32), (8, 8, 16)),
    }
    # Each rank holds half of the rows ([q | k] or v) and receives the half of its rows the other holds: 16 rows of
    # in_proj_qkv and of conv1d, not the whole weights (64 rows each).
    assert group.exchanged == 16 * 64 + 16 * 4
    rows = {name: (style, shape, local) for name, style, shape, local in report.rows}
    assert rows["model.layers.0.linear_attn.in_proj_qkv.weight"] == ("colwise_blocks", (64, 64), (32, 64))
    assert rows["model.layers.0.linear_attn.conv1d.weight"] == ("local_blocks", (64, 1, 4), (32, 1, 4))
    assert rows["model.layers.0.linear_attn.A_log"] == ("local_blocks", (4,), (2,))
    _shard0_shapes_hold(report, 2)
    assert "model.layers.0.linear_attn" not in dict(report.local_heads)  # a mixer, not attention
    text = _text(report, 2)
    assert "model.layers.0.linear_attn: gated_deltanet, Gated DeltaNet" in text
    assert "num_v_heads 4 -> 2, num_k_heads 2 -> 1, key_dim 16 -> 8, value_dim 32 -> 16, conv_dim 64 -> 32" in text
    assert "in_proj_qkv.weight  blocks [16, 16, 32] -> rank's rows [8, 8, 16]" in text
    assert "at 4: 1 sequence mixer(s) stay whole (model.layers.0.linear_attn)" in text


def test_a_mixer_the_tp_size_cannot_split_is_listed_whole_with_the_reason(config_dirs, capsys):
    """Qwen3.5 at TP 4: 2 key heads do not split 4 ways, so the mixer stays whole (every rank computes its whole
    recurrence): a valid layout that trains, the mixer listed with why and the sizes that split it."""
    assert main([str(config_dirs / "qwen3_5"), "--tp-size", "4"]) == 0
    out = capsys.readouterr().out
    whole = out.split("Sequence mixers not split by heads at tp_size=4")[1].split("\n\n")[0]
    assert "model.layers.0.linear_attn: gated_deltanet:" in whole
    assert "tp_size=4 does not divide {'num_k_heads': 2}" in whole and "TP sizes that split it: [2]" in whole
    assert "Sequence mixers split by heads" not in out and "colwise_blocks" not in out
    assert "The layout is valid." in out


def test_mamba2_mixer_blocks_and_completed_attention(hybrid_models):
    """Nemotron-H at TP 2: the Mamba2 mixer's [z | x | B | C | dt] projection and conv over [x | B | C] split block
    by block; its attention layer, which the model's plan leaves whole (the fixture's plan), is split by the config's
    heads."""
    model = hybrid_models["nemotron_h"]
    report = inspect_model(model, tp_size=2)
    assert report.valid and not report.whole_mixers
    groups = {group.names[0]: group for group in report.mixers}
    mamba = groups["model.layers.0.mixer"]
    assert mamba.kind == "mamba2"
    assert mamba.counts == {
        "intermediate_size": (32, 16),
        "conv_dim": (64, 32),
        "num_heads": (4, 2),
        "n_groups": (2, 1),
    }
    assert mamba.blocks["in_proj.weight"] == ((32, 32, 16, 16, 4), (16, 16, 8, 8, 2))
    assert mamba.blocks["conv1d.weight"] == mamba.blocks["conv1d.bias"] == ((32, 16, 16), (16, 8, 8))
    attention = groups["model.layers.1.mixer"]
    assert attention.kind == "attention" and not attention.blocks
    assert attention.counts == {"num_attention_heads (config)": (4, 2), "num_key_value_heads (config)": (2, 1)}
    rows = {name: local for name, _, _, local in report.rows}
    assert rows["model.layers.0.mixer.in_proj.weight"] == (50, 64)  # 100 rows: Shard(0), not 1/2 of each block
    assert rows["model.layers.0.mixer.norm.weight"] == (16,)
    _shard0_shapes_hold(report, 2)
    assert report.whole_mixer_sizes[4] == ["model.layers.0.mixer"]  # 2 groups: 4 does not split them
    assert report.whole_mixer_sizes[3] == ["model.layers.0.mixer", "model.layers.1.mixer"]
    three = inspect_model(model, tp_size=3)
    assert three.valid and not three.mixers
    whole = {tuple(names): (kind, why) for names, kind, why in three.whole_mixers}
    assert (
        whole[("model.layers.0.mixer",)][0] == "mamba2"
        and "tp_size=3 does not divide" in whole[("model.layers.0.mixer",)][1]
    )
    assert whole[("model.layers.1.mixer",)] == (
        "attention",
        "NemotronHAttention has 4 query and 2 KV heads: tp_size=3 cannot split them",
    )


def test_latent_attention_layers_are_grouped(hybrid_models):
    """DeepSeek-V3 at TP 2: both latent-attention layers alike, shown once; no packed blocks (plain column splits)."""
    report = inspect_model(hybrid_models["deepseek_v3"], tp_size=2)
    assert report.valid
    # Its MoE layer's experts are listed too where the model's plan leaves them whole (Transformers 5.25's).
    (group,) = [group for group in report.mixers if group.kind != "experts"]
    assert group.names == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert (group.kind, group.counts, group.blocks) == ("latent_attention", {"num_heads": (4, 2)}, {})
    assert not report.local_heads
    text = _text(report, 2)
    assert "model.layers.{0,1}.self_attn (2 modules): latent_attention, multi-head latent attention" in text
    assert "    num_heads 4 -> 2" in text
    assert report.whole_mixer_sizes == {8: ["model.layers.0.self_attn", "model.layers.1.self_attn"]}


def test_compact_names():
    assert compact_names(["a.layers.0.mixer"]) == "a.layers.0.mixer"
    assert compact_names([f"a.layers.{i}.mixer" for i in (0, 1, 2, 3, 5, 7, 8)]) == "a.layers.{0-3,5,7,8}.mixer"
    assert compact_names(["a.0.x", "b.1.x"]) == "a.0.x, b.1.x"


def test_uneven_replicated_kv_projections_under_fsdp_are_a_problem():
    """One KV head of width 6 over TP 4 is replicated with uneven shards: TP alone trains it, FSDP2 on top is refused
    by the strategy, so the inspector does not call that layout valid."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=96, hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, head_dim=6
    )
    config.num_key_value_heads = 1
    model = build_causal_lm(config)
    assert inspect_model(model, tp_size=4).valid
    problems = inspect_model(model, tp_size=4, dp_shard_size=2).problems
    assert len(problems) == 1 and "model.layers.0.self_attn.k_proj are replicated over tp_size=4" in problems[0]
    assert "width (6: KV heads x head_dim)" in problems[0]


def test_pipeline_stages_per_rank_are_shown_and_memory_is_the_heaviest_ranks(tmp_path, capsys):
    """pp 2 over a 4-layer model: each pipeline rank's stages (layers, embedding, norm and head) and its share of the
    parameters; the memory table is the heaviest rank's. A model a pipeline cannot cut is a problem, named."""
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    build_causal_lm(config).save_pretrained(tmp_path / "deep")
    assert main([str(tmp_path / "deep"), "--tp-size", "1", "--pp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "Layout: pp=2 x tp=1" in out and "Pipeline parallelism (pp=2):" in out
    assert (
        "pp rank 0: stage 0: layers 0-1 + embedding" in out and "pp rank 1: stage 1: layers 2-3 + norm + lm_head" in out
    )
    model = build_meta_model(str(tmp_path / "deep"))
    whole = inspect_model(model, tp_size=1).memory["fp32"]["parameters"]
    staged = inspect_model(model, tp_size=1, pp_size=2).memory["fp32"]["parameters"]
    assert whole / 2 <= staged < whole
    tied = build_meta_model_from(tiny_config("tied"), tmp_path / "tied")
    assert not inspect_model(tied, tp_size=1, pp_size=2).problems  # tied across stages: each end's rank keeps a copy


def build_meta_model_from(config, path):
    build_causal_lm(config).save_pretrained(path)
    return build_meta_model(str(path))
