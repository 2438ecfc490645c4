"""Pipeline parallelism without processes: the layout's pp axis, the split of the layers, the plans and refusals
that are decided before anything moves, and the stages themselves (run one after the other on one process, each
stage computing what its layers need from the model's own forward) against the whole model, across families."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_tp import ParallelLayout
from lightning_tp.parallel.pipeline import PipelineOutput, labelled_tokens
from lightning_tp.parallel.pipeline_plan import balanced_split, generate_owners, pipeline_problem, resolve_pipeline_plan
from lightning_tp.parallel.pipeline_stages import ROUTER_TOTALS, PipelineStageModule, keep_stages
from lightning_tp.parallel.router_loss import RouterTotals
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.patches import undo_owned
from lightning_tp.strategies.shared import StrategyOptions
from tests.helpers.models import build_causal_lm, tiny_config

#: A device object only (nothing runs on it): what the layout's checks are told the strategy runs on.
CUDA = torch.device("cuda", 0)


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
        ({"pad_to_multiple_of": 0}, "pp_pad_to_multiple_of"),
    ],
)
def test_bad_pipeline_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _plan(_deep(), **kwargs)


def test_models_a_pipeline_cannot_cut_are_refused_by_name():
    assert pipeline_problem(build_causal_lm(tiny_config("tied"))) is None  # tied across stages (test_pipeline.py)
    assert "base_model_pp_plan" in pipeline_problem(build_causal_lm(tiny_config("gpt2")))
    assert pipeline_problem(_deep()) is None


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_a_router_loss_is_refused_with_schedules_that_run_a_backward_before_the_last_forward(schedule):
    """The loss is a product of two means over the whole batch: the first micro-batch's gradient needs the last one's
    routing."""
    moe = _deep("qwen3_moe", output_router_logits=True)
    per_rank = 2 if schedule != "1F1B" else 1
    with pytest.raises(ValueError, match=rf"pp_schedule='{schedule}'` runs the first micro-batch's backward.*'GPipe'"):
        _plan(moe, schedule=schedule, stages_per_rank=per_rank)
    assert _plan(moe, schedule="GPipe").router.top_k == moe.config.num_experts_per_tok
    assert _plan(moe, schedule="LoopedBFS", stages_per_rank=2).router.coefficient == moe.config.router_aux_loss_coef
    assert _plan(_deep("qwen3_moe"), schedule="1F1B").router is None  # no router loss: any schedule


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("qwen3_moe", {}), ("mixtral", {}), ("qwen3_moe", {"mlp_only_layers": [0, 2]})],  # stages without a router
    ids=["qwen3_moe", "mixtral", "qwen3_moe_dense_layers"],
)
def test_a_pipelined_router_loss_is_the_whole_batchs_in_value_and_gradient(kind, overrides):
    """Four stages of one layer on two "ranks" (two copies of the model, each keeping its stages, as LoopedBFS places
    them), two micro-batches run as that schedule runs them (every forward, then every backward), one row padded:
    each stage adds its layers' router statistics to the ones it received, and the last stage's loss, summed over
    the micro-batches with the whole batch's router loss counted once, is one process's loss of the whole batch, with
    its gradients. The copies run no forward before their stages do (Transformers hooks the routers at the first)."""
    model = _deep(kind, output_router_logits=True, router_aux_loss_coef=0.5, **overrides)
    plan = _plan(model, schedule="LoopedBFS", stages_per_rank=2, microbatches=2)
    ranks = [copy.deepcopy(model), copy.deepcopy(model)]
    stages = []
    for rank, copied in enumerate(ranks):
        stages += [PipelineStageModule(copied, plan, stage) for stage in plan.stages_of(rank, 2)]
        keep_stages(copied, plan, plan.stages_of(rank, 2))
    stages.sort(key=lambda stage: stage.stage)
    ids = torch.randint(0, 90, (4, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    totals = RouterTotals(plan.router, microbatches=2, group=None, size=1)
    items = labelled_tokens(labels).expand(4)
    token = ROUTER_TOTALS.set(totals)
    try:
        chains = []  # per micro-batch, each stage's (inputs, outputs)
        for rows in (slice(0, 2), slice(2, 4)):
            chain, sent = [], (ids[rows],)
            for stage in stages:
                inputs = [value.detach().requires_grad_(value.is_floating_point()) for value in sent]
                kwargs = {"attention_mask": mask[rows]}
                if stage.is_last:
                    kwargs.update(labels=labels[rows], num_items_in_batch=items[rows])
                output = stage(*inputs, **kwargs)
                sent = output if isinstance(output, tuple) else (output,)
                chain.append((inputs, sent))
            chains.append(chain)
        total = sum(chain[-1][1][0].sum() for chain in chains) + totals.loss()
        # fp32 sums in another order (micro-batches, stages): a few units in the last place of the loss.
        torch.testing.assert_close(total, expected.loss, rtol=1e-5, atol=1e-6)
        for chain in chains:
            chain[-1][1][0].sum().backward()
            for (_, outputs), (received, _) in reversed(list(zip(chain[:-1], chain[1:], strict=True))):
                pairs = [(out, got.grad) for out, got in zip(outputs, received, strict=True) if out.requires_grad]
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    finally:
        ROUTER_TOTALS.reset(token)
        for copied in ranks:
            undo_owned(copied, instances=False)
    staged = {n: p.grad for copied in ranks for n, p in copied.named_parameters() if p.grad is not None}
    whole = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert staged.keys() == whole.keys()
    for name, grad in whole.items():
        torch.testing.assert_close(staged[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_options_that_pp_does_not_support_yet_are_refused_before_processes():
    layout = ParallelLayout.resolve(4, tp_size=2, pp_size=2)
    # FSDP2's CPU offload composes with pp where it composes without: an accelerator, and data parallelism.
    ParallelOptions(cpu_offload=True).check_layout(ParallelLayout.resolve(4, tp_size=1, pp_size=2), device=CUDA)
    with pytest.raises(ValueError, match="needs data or context parallelism"):
        ParallelOptions(cpu_offload=True).check_layout(layout, device=CUDA)
    ParallelOptions(sequence_parallel=True, loss_parallel=True).check_layout(layout, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="zero-bubble schedules split each backward"):
        ParallelOptions(pp_schedule="zbvzerobubble", pp_stages_per_rank=2, compile=True).check_layout(
            layout, device=torch.device("cpu")
        )
    StrategyOptions.build(  # a single-file checkpoint gathers every stage (tests/distributed/test_checkpoint.py)
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
    from lightning_tp.stages import resolve_targets
    from tests.helpers.process_group import one_rank_mesh

    layout = ParallelLayout.resolve(4, tp_size=1, pp_size=2)  # dp_shard 2
    options = ParallelOptions(pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2)
    tied = build_causal_lm(tiny_config("tied", num_hidden_layers=4, layer_types=["full_attention"] * 4))
    with one_rank_mesh() as mesh:
        with pytest.raises(ValueError, match="one parameter in two stages, which FSDP2 shards"):
            resolve_targets(tied, layout=layout, tp_mesh=mesh, dp_mesh=None, options=options)
        untied = _deep()
        resolve_targets(untied, layout=layout, tp_mesh=mesh, dp_mesh=None, options=options)  # fine


def test_padding_to_a_multiple_leaves_a_causal_models_loss_as_it_was():
    """`pp_pad_to_multiple_of`: the padded batch's loss (labels -100 on the padding, which comes after every real token)
    is the batch's own, with and without an attention mask and position ids; the mask is made where asked for."""
    from lightning_tp.parallel.pipeline import labelled_tokens, pad_batch

    model = build_causal_lm(tiny_config("llama")).eval()
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    labels = ids.masked_fill(torch.arange(11) < 2, -100)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding of the second row, as a tokenizer pads for a decoder
    positions = torch.arange(11).expand(2, 11)
    for kwargs in ({}, {"attention_mask": mask}, {"position_ids": positions}):
        padded_ids, padded_labels, padded = pad_batch(ids, labels, kwargs, length=16, pad_token_id=0, with_mask=False)
        assert padded_ids.shape == (2, 16) and padded_labels.shape == (2, 16)
        assert labelled_tokens(padded_labels) == labelled_tokens(labels)
        with torch.no_grad():
            expected = model(input_ids=ids, labels=labels, **kwargs).loss
            got = model(input_ids=padded_ids, labels=padded_labels, **padded).loss
        torch.testing.assert_close(got, expected, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    _, _, made = pad_batch(ids, labels, {}, length=16, pad_token_id=0, with_mask=True)
    assert made["attention_mask"].tolist() == [[1] * 11 + [0] * 5] * 2
    assert pad_batch(ids, labels, {}, length=11, pad_token_id=0, with_mask=True)[0] is ids  # a multiple already
    _, _, counted = pad_batch(ids, labels, {"position_ids": positions}, length=16, pad_token_id=0, with_mask=False)
    assert counted["position_ids"][0].tolist() == list(range(16))
    with pytest.raises(ValueError, match="pads a \\(rows, length\\) attention mask"):
        pad_batch(ids, labels, {"attention_mask": mask[:, None, None]}, length=16, pad_token_id=0, with_mask=False)
