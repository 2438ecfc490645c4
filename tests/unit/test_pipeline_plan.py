"""Pipeline parallelism without processes: the layout's pp axis, the split of the layers, the plans and refusals
that are decided before anything moves, and the stages themselves (run one after the other on one process, each
stage computing what its layers need from the model's own forward) against the whole model, across families."""

from __future__ import annotations

import pytest
import torch

from lightning_tp import ParallelLayout
from lightning_tp.parallel.pipeline import (
    PipelineOutput,
    PipelineStageModule,
    balanced_split,
    generate_owners,
    keep_stages,
    labelled_tokens,
    pipeline_problem,
    resolve_pipeline_plan,
)
from lightning_tp.parallelize import ParallelOptions
from lightning_tp.strategies.shared import StrategyOptions
from tests.helpers.models import build_causal_lm, tiny_config


def _plan(model, **kwargs):
    options = {"pp_size": 2, "schedule": None, "microbatches": None, "stages_per_rank": 1, "split": None, **kwargs}
    return resolve_pipeline_plan(model, **options)


def _deep(kind: str = "llama", layers: int = 4, **overrides):
    config = tiny_config(kind, **overrides)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = (config.layer_types * layers)[:layers]
    return build_causal_lm(config)


def test_layout_puts_pp_outermost_and_splits_the_rest():
    layout = ParallelLayout.resolve(8, tp_size=2, pp_size=2)
    assert (layout.pp_size, layout.dp_shard_size, layout.tp_size, layout.world_size) == (2, 2, 2, 8)
    assert layout.mesh_axes == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert ParallelLayout.resolve(4, tp_size=2).mesh_axes == ("dp_replicate", "dp_shard", "cp", "tp")
    assert str(layout).startswith("pp=2 x ")
    with pytest.raises(ValueError, match="not divisible by pp_size=3"):
        ParallelLayout.resolve(4, pp_size=3)
    # Every axis composes with pp: cp and ep inside each stage.
    both = ParallelLayout.resolve(8, tp_size=1, cp_size=2, ep_size=2, pp_size=2)
    assert (both.pp_size, both.dp_shard_size, both.cp_size, both.ep_size) == (2, 2, 2, 2)


def test_balanced_split_gives_the_first_and_last_stage_fewer_layers():
    # The embedding and the head each weigh one average layer.
    assert balanced_split([10] * 7, 3) == [2, 3, 2]
    assert balanced_split([10] * 6, 2) == [3, 3]
    sizes = balanced_split([1, 1, 1, 100, 1, 1], 3)
    assert sum(sizes) == 6 and min(sizes) >= 1
    assert balanced_split([5, 5], 2) == [1, 1]


def test_a_v_shaped_split_balances_the_ranks_not_the_stages():
    # 32 equal layers over 4 stages on 2 ranks, V-shaped: rank 0 holds stages 0 and 3 (with the embedding and the head).
    owners = generate_owners(2, 4, v_shaped=True)
    assert owners == [0, 1, 1, 0] and generate_owners(2, 4, v_shaped=False) == [0, 1, 0, 1]

    def rank_loads(sizes: list[int]) -> list[int]:
        stages = [size + (s in (0, 3)) for s, size in enumerate(sizes)]  # in layers; the extras weigh one each
        return [stages[0] + stages[3], stages[1] + stages[2]]

    by_stage = balanced_split([10] * 32, 4)
    by_rank = balanced_split([10] * 32, 4, owners=owners)
    assert sum(by_rank) == 32 and min(by_rank) >= 1
    assert max(rank_loads(by_rank)) < max(rank_loads(by_stage)), (by_rank, by_stage)
    assert rank_loads(by_rank) == [17, 17]


def test_plan_names_the_stages_modules_and_schedules():
    model = _deep()
    plan = _plan(model)
    assert plan.schedule == "1F1B" and plan.microbatches == 2 and [list(r) for r in plan.layers] == [[0, 1], [2, 3]]
    assert plan.modules_of(0) == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert plan.modules_of(1) == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    interleaved = _plan(model, stages_per_rank=2)
    assert interleaved.schedule == "Interleaved1F1B" and interleaved.stages_of(0, 2) == (0, 2)
    assert _plan(model, schedule="LoopedBFS", stages_per_rank=2).stages_of(1, 2) == (1, 3)
    assert [len(r) for r in _plan(model, split=[1, 3]).layers] == [1, 3]
    # The V-shaped schedules place stages down the ranks and back up: the first and the last on rank 0.
    v = _plan(model, schedule="ZBVZeroBubble", stages_per_rank=2)
    assert v.v_shaped and (v.stages_of(0, 2), v.stages_of(1, 2)) == ((0, 3), (1, 2))
    assert not _plan(model, schedule="InterleavedZeroBubble", stages_per_rank=2).v_shaped


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "Zigzag"}, "pp_schedule='Zigzag'.*unknown schedule name"),
        ({"schedule": "PipelineScheduleSingle"}, "unknown schedule name"),
        ({"schedule": "1F1B", "microbatches": 1}, "at least as many micro-batches as stages"),
        ({"schedule": "1F1B", "stages_per_rank": 2}, "runs one stage per rank"),
        ({"schedule": "ZBVZeroBubble"}, "exactly 2 stages on each rank"),
        ({"schedule": "DualPipeV", "stages_per_rank": 3}, "exactly 2 stages on each rank"),
        ({"schedule": "DualPipeV", "stages_per_rank": 2, "microbatches": 2}, "DualPipeV.*at least as many"),
        ({"stages_per_rank": 2, "microbatches": 3}, "divisible by pp_size=2"),
        ({"split": [2, 1]}, r"pp_split=\[2, 1\].*add up to the model's 4 layers"),
        ({"stages_per_rank": 4}, "has 4 decoder layers, fewer than its 8 pipeline stages"),
        ({"microbatches": 0}, "pp_microbatches"),
    ],
)
def test_bad_pipeline_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _plan(_deep(), **kwargs)


def test_models_a_pipeline_cannot_cut_are_refused_by_name():
    assert pipeline_problem(build_causal_lm(tiny_config("tied"))) is None  # tied across stages (test_pipeline.py)
    assert "base_model_pp_plan" in pipeline_problem(build_causal_lm(tiny_config("gpt2")))
    moe = build_causal_lm(tiny_config("qwen3_moe", output_router_logits=True))
    assert "output_router_logits=True" in pipeline_problem(moe)
    assert pipeline_problem(_deep()) is None


def test_options_that_pp_does_not_support_yet_are_refused_before_processes():
    layout = ParallelLayout.resolve(4, tp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="does not support cpu_offload=True"):
        ParallelOptions(cpu_offload=True).check_layout(layout, device=torch.device("cpu"))
    ParallelOptions(sequence_parallel=True, loss_parallel=True).check_layout(layout, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="zero-bubble schedules split each backward"):
        ParallelOptions(pp_schedule="zbvzerobubble", pp_stages_per_rank=2, compile=True).check_layout(
            layout, device=torch.device("cpu")
        )
    with pytest.raises(ValueError, match="needs `save_distributed_checkpoint=True`"):
        StrategyOptions.build(
            tp_size=2,
            dp_shard_size=None,
            dp_replicate_size=1,
            parallelism_config=None,
            tp_plan="auto",
            pp_size=2,
            fsdp_blocks=None,
            save_distributed_checkpoint=False,
        )
    with pytest.warns(UserWarning, match="pp_size=1 runs no pipeline"):
        ParallelOptions(pp_microbatches=4).check_layout(ParallelLayout(tp_size=2), device=torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown schedule name"):
        ParallelOptions(pp_schedule="nope")


def test_a_rank_keeps_its_stages_modules_under_their_own_names():
    model = _deep()
    names = set(model.state_dict())
    keep_stages(model, _plan(model), [1])
    kept = set(model.state_dict())
    assert model.model.embed_tokens is None and model.model.layers[0] is None and model.lm_head is not None
    assert kept < names and all(
        k.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")) for k in kept
    )


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        "qwen3",
        "mixtral",
        "phi3",
        "gemma2",
        "granite_swa",
        "llama4_text",
        "qwen3_5",
        "deepseek_v3",
        "nemotron_h",
        "bamba",
        "falcon_h1",
    ],
)
def test_stages_run_one_after_the_other_give_the_whole_models_logits_and_gradients(kind):
    """Each stage runs the model's own forward with stand-ins for the layers it does not hold: masks, rotary
    embeddings and per-layer-type masks (Gemma 2's sliding layers, Qwen3.5's linear attention) are computed on the
    stage, the way the model computes them."""
    overrides = {"tie_word_embeddings": False} if kind == "gemma2" else {}
    model = build_causal_lm(tiny_config(kind, **overrides))
    assert pipeline_problem(model) is None
    plan = _plan(model)
    ids = torch.randint(0, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    expected = model(input_ids=ids, attention_mask=mask).logits
    expected.sum().backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    first, last = PipelineStageModule(model, plan, 0), PipelineStageModule(model, plan, 1)
    hidden = first(ids, attention_mask=mask)
    received = hidden.detach().requires_grad_()
    logits = last(received, attention_mask=mask)
    # The stages run the whole model's operations on the same values, in the same order: bit for bit.
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    logits.sum().backward()
    hidden.backward(received.grad)
    staged = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert staged.keys() == whole.keys()
    for name, grad in whole.items():
        torch.testing.assert_close(staged[name], grad, atol=0, rtol=0, msg=name)


def test_the_loss_counts_the_labelled_tokens_after_the_shift_and_the_output_names_what_to_do():
    labels = torch.tensor([[-100, 1, 2, -100], [3, 4, -100, 5]])
    assert labelled_tokens(labels).item() == 4  # next-token labels: [1, 2, -100], [4, -100, 5]
    out = PipelineOutput(torch.tensor(1.0))
    assert out.loss.item() == 1.0 and out["loss"].item() == 1.0
    with pytest.raises(AttributeError, match="logits exist only on the last stage"):
        _ = out.logits


def test_a_v_schedule_with_tied_embeddings_and_data_parallelism_is_refused_before_anything_moves():
    """ZBV and DualPipeV put the first and the last stage on one rank: a tied embedding is one parameter in two
    stages, which FSDP2 (each stage sharded on its own) would split in two."""
    from lightning_tp.parallelize import resolve_targets
    from tests.helpers.process_group import one_rank_mesh

    layout = ParallelLayout.resolve(4, tp_size=1, pp_size=2)  # dp_shard 2
    options = ParallelOptions(pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2)
    tied = build_causal_lm(tiny_config("tied", num_hidden_layers=4, layer_types=["full_attention"] * 4))
    with one_rank_mesh() as mesh:
        with pytest.raises(ValueError, match="one parameter in two stages; FSDP2"):
            resolve_targets(tied, layout=layout, tp_mesh=mesh, dp_mesh=None, options=options)
        untied = _deep()
        resolve_targets(untied, layout=layout, tp_mesh=mesh, dp_mesh=None, options=options)  # fine
