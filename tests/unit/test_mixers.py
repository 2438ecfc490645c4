"""The head-parallel mixers as data (lightning_tp/plans/mixer_kinds.py, read by mixers.py) and the rows each rank
takes of packed blocks."""

from __future__ import annotations

import pytest
import torch

from lightning_tp.parallel.blocks import rank_rows
from lightning_tp.plans.coverage import kept_whole
from lightning_tp.plans.mixers import MIXER_KINDS, find_mixers
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.plans.source import key_regex
from lightning_tp.tools.inspect_report import inspect_model
from tests.helpers.models import build_causal_lm, coverage_model, tiny_config


def _with_plan(family: str, plan: dict[str, str] | None = None, *, without: tuple[str, ...] = ()):
    """``family``'s coverage model built with its own ``base_model_tp_plan``: ``plan``, or the one its config class
    ships less every rule whose key holds one of ``without`` (the rules Transformers 5.24 or 5.25 lack, whichever is
    installed), so that a test does not depend on what a release ships."""
    from benchmarks import coverage

    config = coverage.tiny_config(family)
    if plan is None:
        plan = {k: v for k, v in (type(config).base_model_tp_plan or {}).items() if not any(w in k for w in without)}
    config.base_model_tp_plan = plan
    return build_causal_lm(config)


@pytest.mark.parametrize(
    ("blocks", "whole", "tp_size"),
    [((4, 4, 8), (), 2), ((16, 16, 32), (), 4), ((8, 2, 2), (1, 2), 2), ((6, 6, 6), (), 3), ((12, 1, 1), (1, 2), 4)],
)
def test_the_row_exchange_gives_each_rank_its_rows_and_sends_the_gradients_back(blocks, whole, tp_size):
    """The all-to-all of the packed parameters, simulated in one process: what each rank receives, in the ranks'
    order, is its rows of every block; sending the gradients back sums, on the rank that holds each row, what every
    rank that read it computed; without blocks taken whole no rank receives more than a shard's rows from the
    others, and with them less than a gather of the whole tensor."""
    from lightning_tp.parallel.blocks import row_exchange
    from lightning_tp.parallel.collectives import chunk_sizes

    whole_tensor = torch.arange(float(sum(blocks)))
    shards = whole_tensor.split(chunk_sizes(sum(blocks), tp_size))
    plans = [row_exchange(blocks, tp_size=tp_size, rank=r, whole=whole) for r in range(tp_size)]
    sent = [shard[plan.send_rows].split(list(plan.send)) for shard, plan in zip(shards, plans, strict=True)]
    grads = torch.zeros(sum(blocks))
    for rank, plan in enumerate(plans):
        received = torch.cat([sent[source][rank] for source in range(tp_size)])
        assert received.tolist() == whole_tensor[rank_rows(blocks, tp_size=tp_size, rank=rank, whole=whole)].tolist()
        assert plan.received <= (max(len(shard) for shard in shards) if not whole else sum(blocks) - len(shards[rank]))
        grads[received.long()] += rank + 1  # what this rank's gradient gives each row it read
    for rank, plan in enumerate(plans):
        back = torch.cat([torch.full((plans[d].recv[rank],), d + 1.0) for d in range(tp_size)])
        start = sum(len(shard) for shard in shards[:rank])
        local = torch.zeros(len(shards[rank])).index_add_(0, plan.send_rows, back)
        assert local.tolist() == grads[start : start + len(shards[rank])].tolist()


def test_each_rank_takes_its_slice_of_every_block_and_the_whole_blocks():
    rows = [rank_rows((4, 4, 8), tp_size=2, rank=r).tolist() for r in (0, 1)]
    assert rows == [[0, 1, 4, 5, 8, 9, 10, 11], [2, 3, 6, 7, 12, 13, 14, 15]]
    # The union over the ranks is every row once: a plain reduce-scatter of the gathered gradient is the sum.
    assert sorted(rows[0] + rows[1]) == list(range(16))
    # Multi-query attention: q split, the one K/V head taken whole by every rank.
    assert rank_rows((4, 2, 2), tp_size=2, rank=1, whole=(1, 2)).tolist() == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    ("kind", "mixer", "name", "blocks"),
    [
        ("qwen3_5", "model.layers.0.linear_attn", "gated_deltanet", {"in_proj_qkv.weight": (32, 32, 64)}),
        ("nemotron_h", "model.layers.0.mixer", "mamba2", {"in_proj.weight": (32, 32, 16, 16, 4)}),
        ("bamba", "model.layers.0.mamba", "mamba2_one_group", {"in_proj.weight": (128, 128, 8, 8, 4)}),
        ("deepseek_v3", "model.layers.0.self_attn", "latent_attention", {}),
    ],
)
def test_mixers_are_recognised_by_structure_and_split_by_their_blocks(kind, mixer, name, blocks):
    model = build_causal_lm(tiny_config(kind))
    assert find_mixers(model)[mixer].name == name
    plan = resolve_plan(model, "auto", tp_size=2)
    assert mixer in plan.mixers and mixer in plan.local_heads
    for path, sizes in blocks.items():
        assert plan.blocks[f"{mixer}.{path}"] == sizes
    if name == "mamba2_one_group":
        # B and C whole on every rank; the conv's width is the rank's rows; the gated norm spans the ranks.
        assert plan.whole_blocks[f"{mixer}.in_proj.weight"] == (2, 3)
        assert plan.mixer_sizes(2)[mixer] == {"conv_dim": 128 // 2 + 16}
        assert plan.norms_across_ranks[f"{mixer}.norm"] == 128


def test_a_mixer_the_tp_size_cannot_split_stays_whole_and_says_why():
    model = build_causal_lm(tiny_config("qwen3_5", linear_num_key_heads=2, linear_num_value_heads=4))
    plan = resolve_plan(model, "auto", tp_size=4)
    mixer = "model.layers.0.linear_attn"
    assert mixer not in plan.mixers and mixer not in plan.local_heads
    assert "num_k_heads" in plan.whole_mixers[mixer] and "TP sizes that split it: [2]" in plan.whole_mixers[mixer]
    # Its rules are `replicate`, not the model's gathered ones (which would not fit a whole mixer either way).
    assert plan.styles[f"{mixer}.in_proj_qkv"] == "replicate"
    assert "Qwen3_5GatedDeltaNet" in kept_whole(model, plan)


def test_a_user_rule_inside_a_mixer_leaves_it_to_the_user():
    model = build_causal_lm(tiny_config("qwen3_5"))
    plan = resolve_plan(model, {"model.layers.0.linear_attn": "replicate"}, tp_size=2)
    assert "model.layers.0.linear_attn" not in plan.mixers


def test_every_kind_names_styles_of_the_table_and_blocks_of_its_parameters():
    from lightning_tp.plans.styles import STYLES

    for kind in MIXER_KINDS:
        assert all(style in STYLES and STYLES[style].supported for style in kind.styles.values()), kind.name
        for path in kind.blocks:
            owner = path.rpartition(".")[0]
            assert not owner or owner in kind.styles, (kind.name, path)


def test_the_one_group_norm_matches_the_whole_norm_on_one_rank():
    """The gated norm over one group spread over the ranks, on a one-rank group, is Transformers' own norm."""
    from lightning_tp.parallel.blocks import norm_across_ranks
    from tests.helpers.process_group import one_rank_mesh

    model = build_causal_lm(tiny_config("bamba"))
    norm = model.model.layers[0].mamba.norm
    x, gate = torch.randn(2, 5, 128), torch.randn(2, 5, 128)
    expected = norm(x, gate)
    with one_rank_mesh() as mesh:
        norm_across_ranks(norm, mesh, width=128)
        torch.testing.assert_close(norm(x, gate), expected)


def test_stacked_gate_up_weights_split_plainly_by_a_plan_are_split_per_half():
    """Inkling 2's plan in Transformers 5.24 gives its experts' `gate_up_proj` (chunked into gate and up halves) plain
    `colwise`, which would give one rank the gates and the other the ups (its coverage row was off parity): each half
    is split. The plan is the model's own, as that release shipped it."""
    experts = "layers.*.mlp.experts"
    plain = {f"{experts}.gate_up_proj": "colwise", f"{experts}.down_proj": "rowwise", experts: "moe_tp_experts"}
    model = _with_plan("inkling2_text", {"embed_tokens": "replicate", **plain})
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.styles["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan.styles["model.layers.0.mlp.experts.down_proj"] == "rowwise"
    assert "model.layers.0.mlp.experts" not in plan.mixers  # the plan's rules, fixed, not the package's own


#: The rules of AFMoE's attention and MLPs (Transformers 5.25 ships them, 5.24 does not).
_AFMOE_DENSE = ("self_attn.", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize(
    ("family", "mixer", "name", "styles"),
    [
        # Per-KV-head scores from every head's values: summed, then each rank keeps its heads' (and its `A`).
        (
            "doge",
            "model.layers.0.self_attn",
            "dynamic_mask_attention",
            {"dt_proj": "rowwise_local_output", "A": "local_blocks", "q_norm": "replicated_with_grad_allreduce"},
        ),
        # Kimi-Linear: the forget gate's low-rank down-projection whole, its up-projection and A_log split.
        (
            "kimi_linear",
            "model.layers.0.self_attn",
            "kimi_delta_attention",
            {"forget_gate.f_b_proj": "colwise", "forget_gate.A_log": "local_blocks", "g_b_proj": "colwise"},
        ),
        ("bailing_hybrid", "model.layers.0.self_attn", "kimi_delta_attention_full_gate", {"g_proj": "colwise"}),
        # Ling 3's latent attention: its head-wise output gate split with the heads.
        ("bailing_hybrid", "model.layers.1.self_attn", "latent_attention", {"g_proj": "colwise"}),
        ("minimax", "model.layers.1.self_attn", "lightning_attention", {"qkv_proj": "colwise", "norm": "local_blocks"}),
        # Attention a plan leaves whole, with an output gate per query feature (AFMoE) or per head (LFM3).
        ("afmoe", "model.layers.0.self_attn", "attention", {"gate_proj": "colwise"}),
        ("lfm3", "model.layers.1.self_attn", "attention", {"g_proj": "colwise"}),
    ],
)
def test_2026_mixer_kinds_are_recognised_and_split(family, mixer, name, styles):
    # AFMoE's attention is the package's to split where the model's plan leaves it whole (as 5.24's does).
    model = _with_plan(family, without=_AFMOE_DENSE) if family == "afmoe" else coverage_model(family)
    assert find_mixers(model)[mixer].name == name
    plan = resolve_plan(model, "auto", tp_size=2)
    assert mixer in plan.mixers and not plan.whole_mixers
    for path, style in styles.items():
        assert plan.styles[f"{mixer}.{path}"] == style
    if name == "kimi_delta_attention":  # A_log is [1, 1, heads, 1]: split on its heads
        assert plan.block_dims == {f"model.layers.{i}.self_attn.forget_gate.A_log": 2 for i in (0,)}
    if name == "lightning_attention":  # the norm spans every head; the decays are sliced per call
        assert plan.norms_across_ranks[f"{mixer}.norm"] == 64
        assert plan.buffer_blocks[f"{mixer}.diagonal_decay"] == (1, (4,), ())


def test_a_heterogeneous_config_is_read_per_layer():
    from benchmarks import coverage
    from lightning_tp.compat import config_value, layer_configs

    config = coverage.tiny_config("dots3_note_text")
    with pytest.raises(RuntimeError):  # Transformers refuses the global read of a per-layer value
        _ = config.num_attention_heads
    assert config_value(config, "num_attention_heads") is None
    assert [c.num_attention_heads for c in layer_configs(config)] == [4, 64]
    plan = resolve_plan(build_causal_lm(config), "auto", tp_size=2)
    assert plan.styles["model.layers.0.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a_proj"
    # Each layer by its own heads: at TP 8 the first (4 heads) stays whole, the second (64) is split.
    plan = resolve_plan(build_causal_lm(config), "auto", tp_size=8)
    assert list(plan.whole_mixers) == ["model.layers.0.self_attn"] and "model.layers.1.self_attn" in plan.mixers


def test_a_latent_attention_without_a_rotary_width_stays_whole_or_is_refused_by_name():
    from types import SimpleNamespace

    from lightning_tp.plans.mixers import rotary_width

    model = build_causal_lm(tiny_config("deepseek_v3"))
    attention = model.model.layers[0].self_attn
    assert rotary_width(attention) == attention.qk_rope_head_dim
    for layer in model.model.layers:  # neither the module nor its config holds the width
        del layer.self_attn.qk_rope_head_dim
        layer.self_attn.config = SimpleNamespace()
    assert rotary_width(attention) is None
    plan = resolve_plan(model, "auto", tp_size=2)
    assert "qk_rope_head_dim" in plan.whole_mixers["model.layers.0.self_attn"]
    # A plan that names the style itself is refused before anything moves, with the fix.
    with pytest.raises(ValueError, match=r"qk_rope_head_dim.*'model.layers.0.self_attn': 'replicate'"):
        resolve_plan(model, {"model.layers.0.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, tp_size=2)


def test_modules_reading_the_input_embedding_weight_themselves_are_found(monkeypatch):
    from torch import nn

    from lightning_tp.parallel.tensor_parallel import EMBEDDING_READERS, embedding_readers

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(8, 4)

        def forward(self, ids):
            return self.embed_tokens(ids.to(self.embed_tokens.weight.device))  # its device only: not a read

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def get_input_embeddings(self):
            return self.inner.embed_tokens

        def forward(self, ids):
            pad = self.inner.embed_tokens.weight[0]  # a row of the table, read without calling it
            return self.inner(ids) + pad

    assert embedding_readers(Outer()) == []  # a class is a reader by the table, not by its code
    monkeypatch.setitem(EMBEDDING_READERS, "Outer", "inner.embed_tokens")
    monkeypatch.setitem(EMBEDDING_READERS, "Inner", "other")  # another path: not this embedding
    assert embedding_readers(Outer()) == [""]


def test_gemma_4_reads_its_embedding_table_at_both_levels():
    from benchmarks import coverage
    from lightning_tp.parallel.tensor_parallel import embedding_readers

    model = coverage.build_model(coverage.tiny_config("gemma4"), device="meta")
    assert embedding_readers(model) == ["model", "model.language_model"]


def test_an_attention_gate_of_another_width_keeps_the_attention_whole():
    from torch import nn

    model = _with_plan("afmoe", without=_AFMOE_DENSE)  # a plan that leaves the attention whole
    model.model.layers[0].self_attn.gate_proj = nn.Linear(64, 8, bias=False)  # neither per head nor per q feature
    plan = resolve_plan(model, "auto", tp_size=2)
    assert "gate_proj has 8 features" in plan.whole_mixers["model.layers.0.self_attn"]
    assert "model.layers.1.self_attn" in plan.mixers


def test_a_kind_splitting_a_parameter_on_another_dim_gives_it_one_block():
    # `block_view` takes the rank's rows of packed blocks on dim 0 only.
    for kind in MIXER_KINDS:
        assert not set(kind.dims) & set(kind.blocks), kind.name
        assert set(kind.dims) <= {path for path, style in kind.styles.items() if style == "local_blocks"}, kind.name


def test_a_module_reading_the_embedding_weight_sees_it_whole_and_the_embedding_its_shard(monkeypatch):
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from lightning_tp.compat import parameter_dict
    from lightning_tp.parallel.tensor_parallel import EMBEDDING_READERS, gather_embedding_for_direct_reads
    from tests.helpers.process_group import one_rank_mesh

    monkeypatch.setitem(EMBEDDING_READERS, "Outer", "inner.embed_tokens")
    monkeypatch.setitem(EMBEDDING_READERS, "Inner", "embed_tokens")

    seen = {}

    class Table(nn.Embedding):
        def forward(self, ids):
            seen["own call"] = type(self.weight)
            return self.weight.to_local()[ids]

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = Table(8, 4)

        def forward(self, ids):  # a reader too, calling the embedding inside its call
            out = self.embed_tokens(ids)
            seen["inner reader"] = type(self.embed_tokens.weight)
            return out + self.embed_tokens.weight[0]

    class Outer(nn.Module):
        fail = False

        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def get_input_embeddings(self):
            return self.inner.embed_tokens

        def forward(self, ids):
            out = self.inner(ids)
            seen["reader"] = type(self.inner.embed_tokens.weight)
            if self.fail:
                raise RuntimeError("boom")
            return out + self.inner.embed_tokens.weight[0]

    with one_rank_mesh() as mesh:
        model = Outer()
        table = model.inner.embed_tokens
        sharded = nn.Parameter(distribute_tensor(table.weight.data.clone(), mesh, [Shard(0)]))
        parameter_dict(table)["weight"] = sharded
        gather_embedding_for_direct_reads(model)
        model(torch.tensor([1, 2])).sum().backward()
        assert seen == {"own call": DTensor, "inner reader": torch.Tensor, "reader": torch.Tensor}
        assert table.weight is sharded and isinstance(sharded.grad, DTensor)
        # Rows 1 and 2 from the lookup, row 0 from the two direct reads (each once per token).
        assert sharded.grad.to_local()[:3].sum(-1).tolist() == [16.0, 4.0, 4.0]
        Outer.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.tensor([1]))
        assert table.weight is sharded  # put back when the forward raises


_GATED = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
_TRANSPOSED = {"gate_up_proj": "packed_rowwise", "down_proj": "colwise"}


@pytest.mark.parametrize(
    ("family", "key", "layer", "kind", "rules"),
    [
        # Most families: gate|up [experts, 2 x intermediate, hidden], down [experts, hidden, intermediate].
        ("qwen3_moe", "layers.*.mlp.experts", 0, "experts", _GATED),
        # Aria: stored transposed for `x @ weight`, gate|up packed on the last dim.
        ("aria_text", "layers.*.mlp.experts", 0, "experts_transposed", _TRANSPOSED),
        # Nemotron-H: no gate (its layer 1 is the mixture-of-experts one).
        ("nemotron_h", "layers.*.mixer.experts", 1, "experts_ungated", {"up_proj": "colwise", "down_proj": "rowwise"}),
    ],
)
def test_experts_a_plan_leaves_whole_are_split_as_the_expert_rules_split_them(family, key, layer, kind, rules):
    """Transformers 5.25's plans dropped the expert rules of 5.24's: the package gives a mixture-of-experts layer's
    stacked experts those rules itself, by their structure, so both plans split the same parameters the same way."""
    experts = "model." + key.replace("*", str(layer))
    stripped = _with_plan(family, without=("experts",))
    assert find_mixers(stripped)[experts].name == kind
    derived = resolve_plan(stripped, "auto", tp_size=2)
    assert derived.styles[experts] == "moe_tp_experts" and experts in derived.mixers and not derived.whole_mixers
    for weight, style in rules.items():
        assert derived.styles[f"{experts}.{weight}"] == style
    assert not [name for name in kept_whole(stripped, derived) if name.endswith("Experts")]
    # The same model with 5.24's expert rules in its plan, which the package follows as they are.
    own = {f"{key}.{weight}": style for weight, style in rules.items()} | {key: "moe_tp_experts"}
    planned = resolve_plan(_with_plan(family, {**stripped.config.base_model_tp_plan, **own}), "auto", tp_size=2)
    assert experts not in planned.mixers
    assert planned.styles == derived.styles and planned.grad_allreduce == derived.grad_allreduce


@pytest.mark.parametrize("kind", ["gpt_oss", "granitemoehybrid"])
def test_every_matrix_but_the_router_is_split_at_tp2(kind):
    """A check from outside the project found gpt-oss's experts and Granite 4's shared MLP whole on every TP rank: on
    these tiny configs a rank held 0.79 (gpt-oss) and 0.75 (Granite 4) of the parameters at TP 2. Every matrix is
    split now but the router's, kept whole so that every rank routes each token alike."""
    with torch.device("meta"):
        model = build_causal_lm(tiny_config(kind))
    report = inspect_model(model, tp_size=2)
    held = sum(part[4] for part in report.parts) / sum(part[3] for part in report.parts)
    assert not report.problems and held <= 0.70, held
    whole = kept_whole(model, resolve_plan(model, "auto", tp_size=2))
    assert [name for name in whole if not name.endswith("TopKRouter")] == [], whole


def test_gpt_oss_experts_are_split_in_whole_gate_up_pairs_and_add_their_bias_once():
    """gpt-oss's experts are stored [in, out], gate and up interleaved feature by feature, with biases: a contiguous
    slice of the last dim (whole (gate, up) pairs) and of the down-projection's input features; the down-projection's
    bias is kept whole and the experts' layer adds 1/tp of it on each rank."""
    from lightning_tp.parallel.layers import LAYERS

    with torch.device("meta"):
        model = build_causal_lm(tiny_config("gpt_oss"))
    experts = "model.layers.0.mlp.experts"
    assert find_mixers(model)[experts].name == "experts_interleaved"
    plan = resolve_plan(model, "auto", tp_size=2)
    styles = {key.removeprefix(f"{experts}."): style for key, style in plan.styles.items() if experts in key}
    assert styles == {
        experts: "moe_tp_experts",
        "gate_up_proj": "colwise_transposed",
        "gate_up_proj_bias": "colwise_transposed",
        "down_proj": "colwise",
        "down_proj_bias": "partial_bias",
    }
    report = inspect_model(model, tp_size=2)
    shapes = {name.removeprefix(f"{experts}."): local for name, _, _, local in report.rows if experts in name}
    # [experts, hidden, 2 x 32] -> 32 of the interleaved gate|up features; [experts, 32, hidden] -> 16 rows.
    assert shapes == {"gate_up_proj": (4, 64, 32), "gate_up_proj_bias": (4, 32), "down_proj": (4, 16, 64)}
    assert LAYERS["moe_tp_experts"](experts, plan, dict(model.named_modules())).added_once == ("down_proj_bias",)


def test_a_share_of_a_whole_parameter_keeps_the_whole_gradient():
    from lightning_tp.parallel.layers import _ShareOfWhole

    whole = torch.tensor([2.0, -4.0], requires_grad=True)
    share = _ShareOfWhole.apply(whole, 2)
    assert share.tolist() == [1.0, -2.0]
    (share * torch.tensor([3.0, 5.0])).sum().backward()
    assert whole.grad.tolist() == [3.0, 5.0]  # each rank's share meets the summed output's whole gradient


@pytest.mark.parametrize(
    ("family", "module", "kind"),
    [
        # Shared MLPs with gate and up packed in `input_linear` (Granite 4's, GraniteMoE-Shared's).
        ("granitemoehybrid", "model.layers.0.shared_mlp", "mlp_packed"),
        ("granitemoeshared", "model.layers.0.shared_mlp", "mlp_packed"),
        # MLPs without a gate (Nemotron-H's dense layers and shared experts, Ergo's dense layers).
        ("nemotron_h", "model.layers.3.mixer", "mlp_ungated"),
        ("nemotron_h", "model.layers.1.mixer.shared_experts", "mlp_ungated"),
        ("ergo", "model.layers.0.mlp", "mlp_ungated"),
        # JetMoE's mixture of MLP experts, its router and bias whole; its mixture of attention experts stays whole.
        ("jetmoe", "model.layers.0.mlp", "mlp_experts_modules"),
    ],
)
def test_mlps_and_experts_modules_a_plan_leaves_whole_are_split(family, module, kind):
    from transformers import CONFIG_MAPPING

    from benchmarks import coverage

    if family not in CONFIG_MAPPING:  # Ergo came with Transformers 5.25; the lower bound, 5.24, lacks it
        pytest.skip(f"{family} is not a family of this Transformers")
    with torch.device("meta"):
        model = build_causal_lm(coverage.tiny_config(family))
    plan = resolve_plan(model, "auto", tp_size=2)
    assert plan.mixers[module].kind.name == kind
    kinds = {type(model.get_submodule(name)).__name__ for name in plan.mixers}
    assert not {name for name in kept_whole(model, plan) if name in kinds}
    if family == "jetmoe":
        assert "model.layers.0.self_attention.experts" in plan.whole_mixers
        assert plan.styles["model.layers.0.mlp.input_linear"] == "packed_colwise"
        assert "model.layers.0.mlp.router.layer" not in plan.styles


def test_a_packed_shared_mlp_with_adapters_on_its_packed_projection_stays_whole():
    """LoRA adapters cannot follow a packed projection's halves (refused by name where a plan gives the style): a
    shared MLP the package would split itself stays whole instead, as before it was split; adapters on its output
    projection alone do not keep it whole."""
    from peft import LoraConfig, get_peft_model

    mlp = "model.layers.0.shared_mlp"
    for targets, whole in ((["input_linear"], True), (["output_linear"], False)):
        model = build_causal_lm(tiny_config("granitemoehybrid"))
        model = get_peft_model(model, LoraConfig(r=2, target_modules=targets)).base_model.model
        plan = resolve_plan(model, "auto", tp_size=2)
        assert (mlp in plan.whole_mixers) is whole, targets
        if whole:
            assert "LoRA layer" in plan.whole_mixers[mlp]
        else:
            assert plan.styles[f"{mlp}.input_linear"] == "packed_colwise"


def test_experts_the_kinds_do_not_describe_stay_whole_and_say_why():
    """An experts module holding anything else, or whose shapes do not fit the layout its flags declare, stays whole
    with the reason."""
    from torch import nn

    from lightning_tp.plans.fallback_kinds import MIXER_KIND_EXPERTS
    from lightning_tp.plans.mixers import stacked_sizes

    model = _with_plan("qwen3_moe", without=("experts",))
    first, second = (layer.mlp.experts for layer in model.model.layers)
    assert stacked_sizes(first, MIXER_KIND_EXPERTS) == {"experts": 4, "intermediate": 32, "hidden": 64}
    first.scale = nn.Parameter(torch.ones(4))
    # Declared [experts, hidden, 2 x intermediate] (Aria's), stored [experts, 2 x intermediate, hidden].
    second.is_transposed = True
    plan = resolve_plan(model, "auto", tp_size=2)
    assert "also holds ['scale']" in plan.whole_mixers["model.layers.0.mlp.experts"]
    why = plan.whole_mixers["model.layers.1.mlp.experts"]
    assert "are not laid out as stacked experts, gate|up [experts, hidden, 2 x intermediate]" in why
    assert plan.styles["model.layers.0.mlp.experts.gate_up_proj"] == "replicate"
    assert "Qwen3MoeExperts" in kept_whole(model, plan)


def test_experts_the_users_tp_plan_names_are_left_to_it():
    model = _with_plan("qwen3_moe", without=("experts",))
    plan = resolve_plan(model, {"model.layers.*.mlp.experts": "replicate"}, tp_size=2)
    assert not [name for name in plan.mixers if name.endswith(".experts")]
    assert plan.styles["model.layers.0.mlp.experts"] == "replicate"
    assert plan.styles["model.layers.0.mlp.experts.gate_up_proj"] == "replicate"  # the module's style, inherited


def test_a_tp_size_that_does_not_divide_the_experts_is_refused_as_the_expert_rules_are():
    """Kept whole there, the experts (most of a mixture-of-experts model) would be on every rank: refused, naming the
    sizes that work, with the expert rules in the plan (5.24's) or without (5.25's) alike."""
    key = "layers.*.mlp.experts"
    rules = {f"{key}.gate_up_proj": "packed_colwise", f"{key}.down_proj": "rowwise", key: "moe_tp_experts"}
    plan = {k: v for k, v in tiny_config("qwen3_moe").base_model_tp_plan.items() if "experts" not in k}
    errors = []
    for own in (plan, {**plan, **rules}):
        config = tiny_config("qwen3_moe", moe_intermediate_size=6, base_model_tp_plan=own)
        with pytest.raises(ValueError, match=r"experts.down_proj': 6.*one of \[1, 2, 3, 6\]") as err:
            resolve_plan(build_causal_lm(config), "auto", tp_size=4)
        errors.append(str(err.value))
    assert errors[0] == errors[1]


_QKV = dict.fromkeys(("q_proj", "k_proj", "v_proj"), "colwise")
_ATTENTION = {**_QKV, "o_proj": "rowwise"}
_MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
_SUMMED = "replicated_with_grad_allreduce"


def _rules(prefix: str, rules: dict[str, str]) -> dict[str, str]:
    return {f"layers.*.{prefix}.{path}": style for path, style in rules.items()}


@pytest.mark.parametrize(
    ("family", "rules"),
    [
        # Transformers 5.25's rules for modules its 5.24 plans leave whole (and the package splits itself).
        (
            "afmoe",
            _rules("self_attn", {**_ATTENTION, "gate_proj": "colwise", "q_norm": _SUMMED, "k_norm": _SUMMED})
            | _rules("mlp", _MLP),
        ),
        ("phimoe", _rules("self_attn", _ATTENTION)),
        ("granitemoe", _rules("self_attn", _ATTENTION)),
        (
            "hunyuan_v1_moe",
            _rules("self_attn", {**_ATTENTION, "query_layernorm": _SUMMED, "key_layernorm": _SUMMED})
            | _rules("mlp.shared_mlp", _MLP),
        ),
        ("nemotron_h", _rules("mixer", _ATTENTION)),
        ("bamba", _rules("feed_forward", _MLP)),
        ("deepseek_v4", _rules("mlp.shared_experts", _MLP)),
        # Latent attention with a low-rank query (no `q_proj`).
        (
            "deepseek_v3",
            _rules("self_attn", {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"})
            | _rules("self_attn", {"kv_a_proj_with_mqa": "mla_kv_a_proj"}),
        ),
    ],
)
def test_attention_and_mlps_a_plan_names_are_split_as_the_package_splits_them_whole(family, rules):
    """Transformers 5.25's plans name attention, MLPs and shared experts that 5.24's leave whole for the package to
    split: both plans split the same parameters the same way, with the same gradient sums."""
    whole = _with_plan(family, without=tuple(rules))
    named = _with_plan(family, {**whole.config.base_model_tp_plan, **rules})
    derived, planned = (resolve_plan(model, "auto", tp_size=2) for model in (whole, named))
    for key, style in rules.items():  # each rule splits something, and the package splits its module itself
        assert style in [s for name, s in planned.styles.items() if key_regex(f"model.{key}").fullmatch(name)], key
        owner = key_regex(f"model.{key.rpartition('.')[0]}")
        assert [name for name in derived.mixers if owner.fullmatch(name)], key
    assert not derived.whole_mixers
    # The decoder layers' (Transformers adds an embedding rule to a plan only where it has others).
    layers = [{k: v for k, v in plan.styles.items() if ".layers." in k} for plan in (derived, planned)]
    assert layers[0] == layers[1]
    assert planned.grad_allreduce == derived.grad_allreduce and planned.kv_replicated == derived.kv_replicated


def test_a_refused_shared_experts_rule_is_kept_whole_with_the_rules_under_it():
    """Inkling's plan in Transformers 5.24 sums its shared experts with `all_reduce` (refused: it would not sum their
    input's gradient) over column-/row-wise weights; 5.25's plan leaves them whole. The refusal's fix keeps the rules
    under that module whole too, which gives the 5.25 plan's split."""
    shared = "layers.*.mlp.shared_experts"
    experts = "layers.*.mlp.experts"
    rules = {f"{experts}.gate_up_proj": "colwise", f"{experts}.down_proj": "rowwise", experts: "moe_tp_experts"}
    weights = {f"{shared}.gate_proj": "colwise", f"{shared}.up_proj": "colwise", f"{shared}.down_proj": "rowwise"}
    # The embedding as 5.25's plan keeps it (5.24's Transformers adds `embedding_rowwise` to every plan, which would
    # normalise Inkling's partial lookups: its embedding holds a norm).
    dense = _rules("mlp", _MLP) | {"embed_tokens": "replicate"}
    old = _with_plan("inkling_text", {**rules, **weights, shared: "all_reduce", **dense})
    with pytest.raises(ValueError, match=r"'all_reduce'.*To keep those modules whole, pass tp_plan=") as err:
        resolve_plan(old, "auto", tp_size=2)
    fix = {f"model.{key}": "replicate" for key in (*weights, shared)}
    assert str(err.value).endswith(f"pass tp_plan={fix}.")
    fixed = resolve_plan(old, fix, tp_size=2)
    new = resolve_plan(_with_plan("inkling_text", dense), "auto", tp_size=2)
    split = [{k: v for k, v in plan.styles.items() if v != "replicate"} for plan in (fixed, new)]
    assert split[0] == split[1] and split[0]["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert "InklingSharedExperts" in kept_whole(old, fixed) and "InklingSharedExperts" in kept_whole(old, new)
