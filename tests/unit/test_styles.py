"""The style table (lightning_tp/plans/styles.py) against Transformers' own registry and layers: every registered style
is known, and each table fact is what the style really does to real parameters (sharded on a one-rank gloo group, in
this process)."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp import REFUSED_STYLES, SUPPORTED_STYLES, resolve_plan
from lightning_tp.parallel.lora import extend_plan_to_adapters
from lightning_tp.plans.styles import STYLES
from lightning_tp.tools.inspect import inspect_model, local_shape
from tests.helpers.models import build_causal_lm, tiny_config
from tests.helpers.process_group import one_rank_mesh as one_rank_mesh_of_gloo


def registered_styles() -> dict:
    """Transformers' registry, filled: its modules register their styles when imported, so an import of
    `parallel_utils` alone sees an empty registry (a check against it would pass on nothing)."""
    import transformers.distributed.expert_parallel  # noqa: F401
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    styles = dict(ALL_PARALLEL_STYLES.items())
    assert len(styles) >= 20, sorted(styles)
    return styles


def test_every_registered_style_is_in_the_table_and_every_entry_is_registered():
    registered = set(registered_styles())
    table = {name for name, fact in STYLES.items() if fact.registered}
    assert registered - table == set(), "Transformers registers styles the table does not know"
    assert table - registered == set(), "the table names styles Transformers no longer registers"
    assert not {name for name in STYLES if name not in table} & registered, "an own style shadows a registered one"


def test_supported_and_refused_are_views_of_the_table():
    assert SUPPORTED_STYLES == {n: f.description for n, f in STYLES.items() if f.refused is None}
    assert REFUSED_STYLES == {n: f.refused for n, f in STYLES.items() if f.refused is not None}
    assert set(SUPPORTED_STYLES) | set(REFUSED_STYLES) == set(STYLES)
    assert not set(SUPPORTED_STYLES) & set(REFUSED_STYLES)
    assert all(reason.strip() for reason in REFUSED_STYLES.values())


@pytest.fixture(scope="module")
def one_rank_mesh():
    with one_rank_mesh_of_gloo() as mesh:
        yield mesh


def _params():
    """(name, module, parameter name) of the parameters a style meets: a linear layer, an embedding, stacked expert
    weights (3-D) and a 1-D parameter that is not named `bias`."""
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.zeros(3, 12, 8))
    experts.gate_bias = nn.Parameter(torch.zeros(8))
    return [
        ("linear.weight", nn.Linear(8, 12), "weight"),
        ("linear.bias", nn.Linear(8, 12), "bias"),
        ("embedding.weight", nn.Embedding(10, 4), "weight"),
        ("experts.gate_up_proj", experts, "gate_up_proj"),
        ("experts.gate_bias", experts, "gate_bias"),
    ]


def _real_layout(param: torch.Tensor) -> str:
    if not isinstance(param, DTensor):
        return "replicated"
    (placement,) = param.placements
    if isinstance(placement, _StridedShard):
        return f"strided shard({placement.dim})"
    if isinstance(placement, Shard):
        return f"shard({placement.dim})"
    return "replicated"


@pytest.mark.parametrize("style", sorted(n for n, f in STYLES.items() if f.registered))
def test_table_layout_is_what_the_style_does_to_real_parameters(one_rank_mesh, style):
    transformers_style = registered_styles()[style]
    fact = STYLES[style]
    for label, module, param_name in _params():
        ndim = module._parameters[param_name].ndim
        try:
            transformers_style.shard_param(module, param_name, one_rank_mesh)
        except IndexError:  # the style cannot split this parameter (embedding_colwise on a vector): nor can the table
            with pytest.raises(ValueError, match="cannot split"):
                fact.split_dim(ndim, is_bias=param_name == "bias")
            continue
        real = _real_layout(module._parameters[param_name])
        assert fact.layout(ndim, is_bias=param_name == "bias") == real, f"{style} on {label}"


@pytest.mark.parametrize("style", sorted(n for n in SUPPORTED_STYLES if STYLES[n].registered))
def test_inspect_local_shapes_follow_the_real_split(one_rank_mesh, style):
    transformers_style = registered_styles()[style]
    for label, module, param_name in _params():
        shape = tuple(module._parameters[param_name].shape)
        try:
            transformers_style.shard_param(module, param_name, one_rank_mesh)
        except IndexError:
            continue
        param = module._parameters[param_name]
        expected = list(shape)
        if isinstance(param, DTensor) and isinstance(param.placements[0], (Shard, _StridedShard)):
            dim = param.placements[0].dim
            expected[dim] = math.ceil(shape[dim] / 4)
        assert local_shape(shape, style, 4, is_bias=param_name == "bias") == tuple(expected), f"{style} on {label}"


def test_layer_facts_follow_the_style_classes():
    """Output layout, LoRA half and what sequence parallelism may rewrite, from each registered style's attributes."""
    from transformers.distributed.tensor_parallel import (
        ColwiseParallel,
        PackedColwiseParallel,
        PackedRowwiseParallel,
        RowwiseParallel,
    )

    for name, style in registered_styles().items():
        fact = STYLES[name]
        if isinstance(style, ColwiseParallel):
            assert fact.kind == "column" and fact.lora_half == "lora_B", name
            assert fact.output_sharded == isinstance(style.output_layouts, Shard), name
            # torch's ColwiseParallel (the rewrite's target): replicated input, output sharded on the last dim
            assert fact.rewritable == (style.output_layouts == Shard(-1)), name
        elif isinstance(style, RowwiseParallel):
            assert fact.kind == "row" and fact.lora_half == "lora_A" and not fact.output_sharded, name
            # torch's RowwiseParallel: input sharded on the last dim (not a replicated input split locally)
            assert fact.rewritable == (style.input_layouts == Shard(-1)), name
        elif isinstance(style, PackedRowwiseParallel):
            # Expert weights stored [in, out]: the packed output features (last dim) split, each rank its slice of
            # gate and of up; not a LoRA target.
            assert fact.kind == "column" and fact.output_sharded and fact.strided and fact.weight_dim == -1, name
            assert fact.lora_half is None and not fact.rewritable, name
        elif isinstance(style, PackedColwiseParallel):
            assert fact.output_sharded and style.use_local_output, name  # each rank keeps its local slice
            assert fact.lora_half is None and not fact.rewritable, name
        else:
            assert fact.lora_half is None and not fact.output_sharded, name
    assert {n for n, f in STYLES.items() if f.sums_gradients} == {"replicated_with_grad_allreduce"}


class _TiedPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight


@pytest.mark.parametrize("other", ["replicate", "colwise"])
def test_tied_packed_colwise_weight_is_a_layout_of_its_own(other):
    # packed_colwise shards a strided slice of each half: neither whole (it counted as replicated before) nor a plain
    # row shard, so the shared parameter cannot serve both modules.
    with pytest.raises(ValueError, match=r"'a.weight' and 'b.weight' would be sharded differently"):
        resolve_plan(_TiedPair(), {"a": "packed_colwise", "b": other}, tp_size=2)
    resolve_plan(_TiedPair(), {"a": "packed_colwise", "b": "packed_colwise"}, tp_size=2)


def test_lora_on_a_packed_colwise_linear_is_refused_by_name():
    # Its base's output stays a strided slice; a whole lora_B would add a full-width output to it in forward.
    model = get_peft_model(
        build_causal_lm(tiny_config("llama")), LoraConfig(r=4, target_modules=["up_proj"])
    ).base_model.model
    plan = resolve_plan(model, {"model.layers.*.mlp.up_proj": "packed_colwise"}, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.0.mlp.up_proj'\] = 'packed_colwise' on a LoRA"):
        extend_plan_to_adapters(model, plan)


class _WithVectors(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.proj.gate_bias = nn.Parameter(torch.zeros(8))  # a 1-D parameter not named `bias`


def test_inspect_decides_a_bias_by_its_name_as_transformers_does():
    # Transformers' row-wise layer replicates the parameter named `bias` and splits any other (`gate_bias`).
    report = inspect_model(_WithVectors(), tp_size=2, tp_plan={"proj": "rowwise"})
    sharded = {name: local for name, _, _, local in report.rows}
    assert sharded == {"proj.weight": (6, 4), "proj.gate_bias": (4,)}
    assert ("proj.bias", (6,)) in report.replicated


def test_a_plan_may_hold_unhashable_torch_styles():
    # Derived name sets are tested with `in` against plan values that may be any ParallelStyle, hashable or not.
    import dataclasses

    from torch.distributed.tensor.parallel import ColwiseParallel

    @dataclasses.dataclass(eq=True)
    class Unhashable(ColwiseParallel):
        tag: int = 0

    plan = resolve_plan(
        nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)),
        {"0": Unhashable(), "1": "replicated_with_grad_allreduce"},
        tp_size=2,
    )
    # The norm follows a custom style, not a known column-wise one: its gradient is not summed.
    assert plan.grad_allreduce == [] and list(plan.torch_styles) == ["0"]
