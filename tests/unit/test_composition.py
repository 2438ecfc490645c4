"""The composition table (lightning_tp/composition.py): the checks raise and warn with its rules' words, the docs'
tables are rendered from it, and the cases it cites as evidence exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_tp.composition import BY_KEY, RULES, rendered
from lightning_tp.layout import ParallelLayout
from lightning_tp.parallel_options import ParallelOptions

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)

#: Each refused or ignored rule of `ParallelOptions.check_layout`: options, layout and device that meet it.
CHECKED = {
    "pp+compile+split_backward": (
        {"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 2, "compile": True},
        ParallelLayout.resolve(4, tp_size=2, pp_size=2),
        CPU,
    ),
    "pp_options_without_pp": ({"pp_microbatches": 4}, ParallelLayout(tp_size=2), CPU),
    "cp_comm_without_cp": ({"cp_comm": "ring"}, ParallelLayout(tp_size=2), CPU),
    "cp+compile+fullgraph": ({"compile": {"fullgraph": True}}, ParallelLayout.resolve(4, tp_size=2, cp_size=2), CPU),
    "cpu_offload+cpu": ({"cpu_offload": True}, ParallelLayout.resolve(4, tp_size=2), CPU),
    "cpu_offload+no_fsdp": ({"cpu_offload": True}, ParallelLayout(tp_size=2), CUDA),
    "fsdp_param_dtype+full_precision": (
        {"fsdp_param_dtype": "bf16", "precision": "32-true"},
        ParallelLayout.resolve(4, tp_size=2),
        CPU,
    ),
    "fsdp_param_dtype+bf16_true": (
        {"fsdp_param_dtype": "bf16", "precision": "bf16-true"},
        ParallelLayout.resolve(4, tp_size=2),
        CPU,
    ),
    "fsdp_param_dtype+no_fsdp": (
        {"fsdp_param_dtype": "bf16", "precision": "bf16-mixed"},
        ParallelLayout(tp_size=2),
        CPU,
    ),
}


def _meta_model(kind: str, **config):
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind, **config))


def _cp(model: torch.nn.Module):
    from lightning_tp.parallel.cp_checks import context_parallel_problem

    return context_parallel_problem(model)


def _pp(kind: str):
    from lightning_tp.parallel.pipeline_plan import pipeline_problem

    return pipeline_problem(_meta_model(kind))


def _custom_loss_model():
    model = _meta_model("qwen3")
    model._loss_function = lambda *args, **kwargs: None  # what the `loss_function` property's setter stores
    return model


def _pp_model(change):
    from lightning_tp.parallel.pipeline_plan import pipeline_problem

    model = _meta_model("qwen3")
    change(model)
    return pipeline_problem(model)


def _norm_second(model):
    plan = dict(model.config.base_model_pp_plan)
    model.config.base_model_pp_plan = {key: plan[key] for key in ("embed_tokens", "norm", "layers")}


def _extra_parameters(model):
    with torch.device("meta"):
        model.model.extra = torch.nn.Linear(2, 2)


def _region(styles: dict):
    from lightning_tp.plans.rewrite import region_problem

    return region_problem(styles, "model.layers.0")


def _ep(**options):
    from lightning_tp.parallel.expert_parallel import expert_parallel_problem

    kwargs = {"sequence_parallel": False, "precision": "32-true", "presharded": None, **options}
    return expert_parallel_problem(_meta_model("qwen3_moe"), **kwargs)


#: Model-dependent refused rules: what meets each (a model's check returning the problem).
MODEL_CHECKED = {
    "cp+not_transformers": lambda: _cp(torch.nn.Linear(2, 2)),
    "cp+not_causal": lambda: _cp(_meta_model("qwen3", is_causal=False)),
    "cp+router_loss": lambda: _cp(_meta_model("qwen3", output_router_logits=True)),
    "cp+own_attention": lambda: _cp(_meta_model("mpt")),
    "cp+custom_loss": lambda: _cp(_custom_loss_model()),
    "pp+no_plan": lambda: _pp("gpt2"),
    "sp+no_rowwise": lambda: _region({"model.layers.0.mlp.up_proj": "colwise"}),
    "sp+style_not_rewritable": lambda: _region({"model.layers.0.mlp.up_proj": "local_colwise"}),
    "sp+rowwise_in_layer": lambda: _region({"model.layers.0.up": "colwise", "model.layers.0.down": "rowwise"}),
    "pp+plan_not_layers": lambda: _pp_model(_norm_second),
    "pp+parameters_outside_plan": lambda: _pp_model(_extra_parameters),
    "ep+presharded": lambda: _ep(presharded=object()),
    "ep+sequence_parallel": lambda: _ep(sequence_parallel=True),
    "ep+fp16": lambda: _ep(precision="16-true"),
}


#: Refused rules whose checks other tests meet, where: a model or a call these tables do not build.
CHECKED_ELSEWHERE = {
    "cp+composite": "tests/unit/test_context_split.py (Gemma 3), test_inspect.py",
    "cp+attn_implementation": "tests/unit/test_context_split.py",
    "cp+sequence_mixers": "tests/unit/test_context_split.py",
    "pp+v_shaped+tied+dp": "tests/unit/test_pipeline_plan.py",
    "ep+tp_not_multiple": "tests/unit/test_expert_plan.py",
    "ep+no_plan": "tests/helpers/cases.py (ep_dense_model, a distributed refusal case)",
    "tp+dp+uneven_kv": "tests/unit/test_kv_heads.py, test_inspect.py",
    "save_frozen_weights+full_file": "tests/unit/test_strategy.py",
}
#: Refused rules no test meets yet, and why: each needs processes (a model Transformers sharded at load time, a
#: pipelined model) or a root the suite's launches do not build.
NOT_YET_MET = {
    "cp+stack_signature": "a decoder stack whose forward lacks `position_ids` or `attention_mask`: no family here",
    "pp+not_transformers": "a pipeline over a non-Transformers root or a load-time-sharded model: needs a launch",
    "pp+custom_loss": "`set_pipeline_loss` on a pipelined model under CP or loss parallelism: needs a launch",
    "tp+presharded+kv_replicated": "a model Transformers sharded at load time (`distributed_config`): needs a launch",
}


def test_every_refusal_and_warning_is_checked_here_or_named_where_it_is():
    """Each refused or ignored rule is met by a case of this file, or named with the tests that meet it, or listed as
    not met yet with why."""
    refused = {r.key for r in RULES if r.verdict != "allowed"}
    groups = [set(CHECKED), set(MODEL_CHECKED), set(CHECKED_ELSEWHERE), set(NOT_YET_MET)]
    assert set().union(*groups) == refused, sorted(refused - set().union(*groups))
    assert sum(map(len, groups)) == len(refused), "a rule is listed twice"


@pytest.mark.parametrize("key", sorted(MODEL_CHECKED))
def test_a_models_check_gives_the_rules_reason_and_fix(key: str):
    rule = BY_KEY[key]
    message = MODEL_CHECKED[key]()
    assert message is not None and message.endswith(f"{rule.reason} {rule.fix}".removesuffix(".")), message


def _rule_keys_used_in_the_package() -> dict[str, list[str]]:
    """Each rule key the package's checks pass to :func:`refusal`, :func:`problem` or :func:`ignored`, with where."""
    import ast

    used: dict[str, list[str]] = {}
    for path in sorted((ROOT / "lightning_tp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("refusal", "problem", "ignored")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                used.setdefault(node.args[0].value, []).append(path.relative_to(ROOT).as_posix())
    return used


def test_every_refused_or_ignored_rule_is_what_a_check_raises_and_every_check_names_a_rule():
    """The table is the checks' one source: each refusal and warning of a rule is raised by some check of the
    package (a rule nobody raises is a table out of date), and every key a check names is a rule."""
    used = _rule_keys_used_in_the_package()
    assert not set(used) - set(BY_KEY), sorted(set(used) - set(BY_KEY))
    unused = {r.key for r in RULES if r.verdict != "allowed"} - set(used)
    assert not unused, f"rules no check raises: {sorted(unused)}"


@pytest.mark.parametrize("key", sorted(CHECKED))
def test_the_check_raises_or_warns_with_the_rules_reason_and_fix(key: str):
    kwargs, layout, device = CHECKED[key]
    rule = BY_KEY[key]
    options = ParallelOptions(**kwargs)
    expected = re.escape(f"{rule.reason} {rule.fix}")
    if rule.verdict == "refused":
        with pytest.raises(ValueError, match=expected):
            options.check_layout(layout, device=device)
    else:
        with pytest.warns(UserWarning, match=expected):
            options.check_layout(layout, device=device)


def test_the_docs_tables_are_the_tables_rendered():
    pages = [page for page in sorted((ROOT / "docs").glob("*.md")) if "<!-- composition:" in page.read_text()]
    assert pages, "no page has a composition table"
    for page in pages:
        text = page.read_text()
        assert rendered(text) == text, (
            f"{page.relative_to(ROOT)} differs from lightning_tp/composition.py: run "
            f"`python -m lightning_tp.composition {page.relative_to(ROOT)}`"
        )


def test_the_cases_a_rule_cites_exist():
    from tests.helpers.cases import CASES

    cited = {
        name for rule in RULES for name in re.findall(r"`([a-z0-9_]+)`", rule.evidence) if re.search(r"_pp\d", name)
    }
    assert cited and not cited - set(CASES), sorted(cited - set(CASES))


def test_the_rules_name_what_the_code_names():
    """A rule's words that restate a constant of the code: the schedules that split the backward, the pipeline's
    options."""
    from lightning_tp.options import OPTIONS
    from lightning_tp.parallel.pipeline_plan import SPLIT_BACKWARD_SCHEDULES

    assert all(f"`{name}`" in BY_KEY["pp+compile+split_backward"].when for name in SPLIT_BACKWARD_SCHEDULES)
    pp_options = [o.name for o in OPTIONS if o.name.startswith("pp_") and o.name != "pp_size"]
    assert pp_options and all(f"`{name}`" in BY_KEY["pp_options_without_pp"].when for name in pp_options)
