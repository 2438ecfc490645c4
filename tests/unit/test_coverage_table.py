"""The pure parts of ``benchmarks/coverage.py`` (the generated table of causal-LM families): tiny configs from generic
overrides, the largest TP size of a config, and the table writer. The benchmark itself runs under torchrun, not here."""

import json

import pytest

from benchmarks import coverage


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen3", "gpt2", "gpt_neo", "opt", "mpt", "bloom", "falcon", "gemma3", "deepseek_v3", "mixtral"],
)
def test_tiny_config_applies_the_generic_overrides(family):
    config = coverage.tiny_config(family)
    text = config.get_text_config()
    heads, kv = coverage.head_counts(config)
    assert heads == 4
    assert text.vocab_size == coverage.VOCAB
    assert coverage._int_attribute(text, coverage.TINY[0][0]) == 2  # layers, whatever the family calls them
    assert coverage._int_attribute(text, coverage.TINY[1][0]) == 64  # hidden size
    dropouts = {k: v for k, v in text.to_dict().items() if coverage.DROPOUT.search(k) and isinstance(v, float)}
    assert all(v == 0.0 for v in dropouts.values()), dropouts
    if family == "deepseek_v3":  # latent attention: a KV head per query head, head_dim is the rotary part
        assert kv == 4 and text.head_dim == text.qk_rope_head_dim
    elif hasattr(text, "num_key_value_heads") and family != "falcon":
        assert kv == 2


def test_tiny_config_kv_heads_and_skips():
    assert coverage.head_counts(coverage.tiny_config("llama", kv_heads=1)) == (4, 1)
    with pytest.raises(coverage.Skip, match="encoder-decoder"):
        coverage.tiny_config("bart")
    assert set(coverage.EXCEPTIONS) <= set(coverage.families())


def test_largest_tp_from_heads_and_split_sizes():
    sizes = {"other": {3072: "mlp.up_proj.weight", 768: "attn.q_proj.weight"}, "kv": {256: "attn.k_proj.weight"}}
    assert coverage.largest_tp(12, 4, sizes, replicate_kv=True) == 12  # 4 KV heads replicated on 3 ranks each
    assert coverage.largest_tp(12, 4, sizes, replicate_kv=False) == 4
    fused = {**sizes, "fused_qkv": True}  # a fused QKV projection: its KV part cannot be replicated alone
    assert coverage.largest_tp(12, 4, fused, replicate_kv=True) == 4
    odd_vocab = {"vocab": {50257: "lm_head.weight"}, "other": {3072: "mlp.c_fc.weight"}}
    assert coverage.largest_tp(12, 12, odd_vocab, replicate_kv=True) == 1
    assert coverage.largest_tp(12, 12, odd_vocab, replicate_kv=True, even_vocab=False) == 12
    assert coverage.largest_tp(128, 128, {}, replicate_kv=False) == coverage.MAX_TP
    assert coverage.largest_tp(12, 3, {}, replicate_kv=True) == 12
    assert coverage.largest_tp(None, None, {}, replicate_kv=True) is None


@pytest.mark.parametrize(
    ("family", "with_kv", "without_kv"),
    [
        ("llama", 32, 32),  # 32 heads, intermediate 11008 = 2^8 * 43, vocabulary 32000
        ("mixtral", 32, 8),  # 32 query heads, 8 KV heads
        ("gpt2", 1, 1),  # derived plan: its vocabulary (50257, odd) is split
    ],
)
def test_default_tp_of_published_configs(family, with_kv, without_kv):
    row = coverage.default_tp(family)
    assert (row["max_tp_kv_replication"], row["max_tp_no_kv_replication"]) == (with_kv, without_kv), row
    if family == "gpt2":  # 12 heads, 3072 MLP features: 12 once the vocabulary may split unevenly
        assert row["max_tp_kv_replication_uneven_vocab"] == 12


def test_write_table(tmp_path):
    parity = {"status": "parity", "plan_source": "model", "model_class": "LlamaForCausalLM", "loss_gap": 1e-7}
    rows = {
        "llama": {"max_tp_kv_replication": 32, "max_tp_no_kv_replication": 32, "cases": {"tp2": {**parity}}},
        "gpt2": {"cases": {"tp2": {**parity, "plan_source": "derived", "param_gap": 2e-6, "loss_gap": 0.0}}},
        "bert": {"cases": {"tp2": {"status": "refused", "detail": "BertLMHeadModel has no plan. Pass tp_plan."}}},
        "bart": {"cases": {"tp2": {"status": "skipped", "detail": "encoder-decoder"}}},
        "phi": {
            "cases": {
                "tp2": {**parity, "status": "not at parity", "loss_gap": 0.5, "param_gap": 0.1},
                "kv_replication": {"status": "refused", "detail": "a | b"},
            }
        },
    }
    md, js = tmp_path / "c.md", tmp_path / "c.json"
    coverage.write_table(rows, md=md, js=js, meta={"versions": "v", "command": "c"})
    data = json.loads(js.read_text())
    assert data["families"] == rows
    stats = data["summary"]
    assert stats["status"] == {"parity": 2, "refused": 1, "skipped": 1, "not at parity": 1}
    assert stats["plan_source_of_trained"] == {"model": 2, "derived": 1}
    assert stats["refused_by_reason"] == {"<model> has no plan": 1}
    assert list(stats["worst_gaps"])[0] == "phi"
    text = md.read_text()
    assert "| bert |  | refused: BertLMHeadModel has no plan. Pass tp_plan. |" in text
    assert "| bart |  | skipped: encoder-decoder |" in text
    assert "refused: a \\| b" in text  # a pipe in a message does not break the row
    assert "| llama | LlamaForCausalLM | model | 32 | 32 | parity (1.0e-07 / ) |" in text
    assert "| not at parity, worst parameter None | phi |" in text  # the work items, by reason
    assert "| refused: <model> has no plan | bert |" in text
