"""Expert parallelism without processes: the layout's EP axis, the expert plan resolved and refused before anything
moves, the router's load-balancing loss reimplemented exactly, and the inspector's EP report."""

from __future__ import annotations

import pytest
import torch

from lightning_tp.layout import ParallelLayout
from lightning_tp.parallel.expert_parallel import EP_STYLES, resolve_expert_plan
from lightning_tp.parallel.router_loss import global_load_balancing_loss, router_loss_module
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.tools.inspect import format_report
from lightning_tp.tools.inspect_report import inspect_model
from tests.helpers.models import build_causal_lm, tiny_config


@pytest.mark.parametrize(
    ("world", "sizes", "efsdp"),
    [
        (4, {"tp_size": 2, "ep_size": 2}, 2),
        (4, {"tp_size": 2, "ep_size": 4}, 1),
        (2, {"tp_size": 1, "ep_size": 2}, 1),
        (8, {"tp_size": 2, "dp_replicate_size": 2, "ep_size": 2}, 2),
        (4, {"tp_size": 1, "cp_size": 2, "ep_size": 4}, 1),
    ],
)
def test_the_ep_axis_borrows_ranks_below_dp_replicate(world: int, sizes: dict, efsdp: int) -> None:
    layout = ParallelLayout.resolve(world, **sizes)
    assert layout.efsdp_size == efsdp
    assert layout.world_size == world  # the EP axis adds no ranks
    assert layout.efsdp_size * layout.ep_size * layout.dp_replicate_size == world


@pytest.mark.parametrize(
    ("world", "sizes", "fragment"),
    [
        (4, {"tp_size": 2, "ep_size": 3}, "Use ep_size in [2, 4]"),
        (4, {"tp_size": 4, "ep_size": 2}, "must be a multiple of tp_size=4"),
        (4, {"tp_size": 2, "dp_replicate_size": 2, "ep_size": 4}, "divide dp_shard_size * cp_size * tp_size"),
        (2, {"tp_size": 1, "ep_size": 0}, "`ep_size` must be a positive integer"),
    ],
)
def test_ep_sizes_that_do_not_fit_are_refused_with_the_ones_that_do(world: int, sizes: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        ParallelLayout.resolve(world, **sizes)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_expert_plan_takes_the_experts_from_tp(kind: str) -> None:
    model = build_causal_lm(tiny_config(kind))
    plan = resolve_expert_plan(model, resolve_plan(model, "auto", tp_size=2), ep_size=2)
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert plan.expert_modules == experts
    assert set(plan.experts.values()) == set(EP_STYLES)
    weights = [n for n in plan.experts if n not in experts]
    assert sorted(weights) == sorted(f"{e}.{w}" for e in experts for w in ("gate_up_proj", "down_proj"))
    # Weights before their module (Transformers sets the local expert count while splitting them).
    assert list(plan.experts).index(weights[0]) < list(plan.experts).index(experts[0])
    # TP keeps its rules on attention and drops every rule under the experts.
    assert not [k for k in plan.styles if ".experts" in k]
    assert plan.styles["model.layers.0.self_attn.q_proj"] == "colwise"


@pytest.mark.parametrize(
    ("kind", "overrides", "ep_size", "fragment"),
    [
        ("qwen3", {}, 2, "has no expert-parallel plan"),
        ("qwen3_moe", {"num_experts": 6}, 4, r"has 6 experts, not divisible by ep_size=4.*one of \[1, 2, 3, 6\]"),
    ],
)
def test_models_the_expert_plan_cannot_split_are_refused(kind: str, overrides: dict, ep_size: int, fragment: str):
    model = build_causal_lm(tiny_config(kind, **overrides))
    with pytest.raises(ValueError, match=fragment):
        resolve_expert_plan(model, resolve_plan(model, "auto", tp_size=1), ep_size=ep_size)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_load_balancing_loss_is_the_familys_own(kind: str, masked: bool) -> None:
    """On one rank the reimplemented loss is the modeling file's, value and gradient: what lets it be summed over
    the data-parallel ranks instead."""
    model = build_causal_lm(tiny_config(kind))
    original = router_loss_module(model).load_balancing_loss_func
    original = getattr(original, "_lightning_tp_original", original)
    logits = tuple(torch.randn(12, 4, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]) if masked else None
    expected = original(logits, 4, 2, mask)
    ours, local = global_load_balancing_loss(logits, 4, 2, mask, group=None, size=1)
    torch.testing.assert_close(ours, expected, atol=1e-7, rtol=1e-6)
    grads = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(grads, torch.autograd.grad(expected, logits), atol=1e-7, rtol=1e-6)


def test_the_inspector_shows_the_ep_layout(tmp_path) -> None:
    model = build_causal_lm(tiny_config("qwen3_moe"))
    report = inspect_model(model, tp_size=2, dp_shard_size=2, ep_size=2)
    assert not report.problems, report.problems
    text = format_report(report, tp_size=2, dp_shard_size=2, ep_size=2)
    assert "ep=2 for the experts" in text
    assert "each rank of an EP group holds 2 whole experts per layer" in text
    assert "over the 2 rank(s) holding the same ones" in text
    rows = {name: local for name, _, _, local in report.rows}
    assert rows["model.layers.0.mlp.experts.gate_up_proj"] == (1, 64, 64)  # 4 experts / ep 2 / efsdp 2
    bad = inspect_model(model, tp_size=2, dp_shard_size=1, ep_size=4)
    assert any("ep_size=4" in p for p in bad.problems)


@pytest.mark.parametrize("expert_rules", [True, False], ids=["rules in the plan", "rules derived"])
def test_the_tp_plans_expert_rules_do_not_matter_under_ep(expert_rules: bool) -> None:
    """Aria's experts are split over the TP ranks (`packed_rowwise`), by its plan's rules (Transformers 5.24's) or,
    where its plan has none (5.25's), by the ones the package derives; with ep_size > 1 neither is made (expert
    parallelism places the experts), so the model trains with the rest of its plan."""
    from benchmarks.coverage import build_model
    from benchmarks.coverage import tiny_config as coverage_config
    from lightning_tp.parallel.expert_parallel import expert_modules_of

    config = coverage_config("aria_text")
    key = "layers.*.mlp.experts"
    plan = {k: v for k, v in (type(config).base_model_tp_plan or {}).items() if "experts" not in k}
    rules = {f"{key}.gate_up_proj": "packed_rowwise", f"{key}.down_proj": "colwise", key: "moe_tp_experts"}
    config.base_model_tp_plan = {**plan, **rules} if expert_rules else plan
    model = build_model(config)
    assert resolve_plan(model, "auto", tp_size=2).styles["model.layers.0.mlp.experts.gate_up_proj"] == "packed_rowwise"
    plan = resolve_plan(model, "auto", tp_size=2, leave=expert_modules_of(model))
    assert not [k for k in plan.styles if ".experts" in k] and not [m for m in plan.mixers if ".experts" in m]
    plan = resolve_expert_plan(model, plan, ep_size=2)
    assert plan.expert_modules and not [k for k in plan.styles if ".experts" in k]


def test_fp16_is_refused_and_counts_stay_fp32_under_a_16_bit_default_dtype() -> None:
    """`16-true` is refused with EP (FSDP2 divides fp16 expert gradients twice on a one-rank group); under
    `bf16-true`, Lightning sets a bf16 default dtype for the forward, and the per-expert counts and the router loss's
    statistics stay fp32 (a bf16 `ones` failed in `scatter_add` into the fp32 counts)."""
    from lightning_tp.parallel.expert_parallel import _record_load, expert_parallel_problem

    model = build_causal_lm(tiny_config("qwen3_moe"))
    problem = expert_parallel_problem(model, sequence_parallel=False, precision="16-true", presharded=None)
    assert problem is not None and "16-true" in problem
    assert expert_parallel_problem(model, sequence_parallel=False, precision="bf16-true", presharded=None) is None
    experts = model.model.layers[0].mlp.experts
    experts._lightning_tp_num_experts = 4
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        _record_load(experts, (torch.zeros(3, 64), torch.tensor([[0, 1], [1, 2], [3, 3]]), torch.ones(3, 2)))
        logits = (torch.randn(6, 4, dtype=torch.float32),)
        loss, _ = global_load_balancing_loss(logits, 4, 2, None, group=None, size=1)
    finally:
        torch.set_default_dtype(previous)
    assert experts._lightning_tp_tokens_per_expert.tolist() == [1.0, 2.0, 1.0, 2.0]
    assert loss.dtype == torch.float32
