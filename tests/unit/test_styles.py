"""The style table (lightning_tp/plans/styles.py) against Transformers' own registry and layers: every registered style
is known, and each table fact is what the style really does to real parameters (sharded on a one-rank gloo group, in
this process)."""

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_tp.parallel.layers import LAYERS, ColumnParallel, EmbeddingParallel, RowParallel, shard_parameter
from lightning_tp.parallel.lora import extend_plan_to_adapters
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.plans.styles import REFUSED_STYLES, STYLES, SUPPORTED_STYLES
from lightning_tp.tools.inspect_report import inspect_model, local_shape
from tests.helpers.models import build_causal_lm, tiny_config
from tests.helpers.process_group import one_rank_mesh as one_rank_mesh_of_gloo


def shipped_styles() -> dict[str, set[str]]:
    """Every style name the installed Transformers' configs use in their plans (``base_model_tp_plan``,
    ``base_model_ep_plan``), with the configs using each: data this package must know, whatever the release."""
    from transformers import CONFIG_MAPPING

    used: dict[str, set[str]] = {}
    for config_class in CONFIG_MAPPING.values():
        classes = [config_class, *getattr(config_class, "sub_configs", {}).values()]
        for cls in classes:
            for attribute in ("base_model_tp_plan", "base_model_ep_plan"):
                for style in (getattr(cls, attribute, None) or {}).values():
                    if isinstance(style, str):
                        used.setdefault(style, set()).add(cls.__name__)
    assert len(used) >= 10, sorted(used)  # a check over nothing would pass
    return used


def test_every_style_the_installed_transformers_plans_use_is_in_the_table():
    unknown = {style: sorted(users)[:3] for style, users in shipped_styles().items() if style not in STYLES}
    assert not unknown, "Transformers' plans use styles the table does not know (add them to plans/styles.py)"


def test_every_applied_style_has_a_layer_and_every_own_name_is_no_transformers_name():
    assert set(LAYERS) == set(SUPPORTED_STYLES)
    own = {name for name, fact in STYLES.items() if not fact.registered}
    assert not own & set(shipped_styles()), "an own style shadows a name Transformers' plans use"
    for name, fact in STYLES.items():
        if fact.same_as:
            target = STYLES[fact.same_as]
            assert (target.kind, target.weight_dim, target.output_sharded) == (
                fact.kind,
                fact.weight_dim,
                fact.output_sharded,
            ), name


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


def _lay_out(module: nn.Module, param_name: str, fact, mesh) -> bool:
    """Lay out one parameter as a plan's parameter entry does; ``False`` where the style cannot split it."""
    try:
        shard_parameter(module, param_name, fact, mesh)
    except ValueError as error:
        assert "cannot split" in str(error)
        return False
    return True


@pytest.mark.parametrize("style", sorted(SUPPORTED_STYLES))
def test_table_layout_is_what_the_layer_does_to_real_parameters(one_rank_mesh, style):
    fact = STYLES[style]
    for label, module, param_name in _params():
        ndim = module._parameters[param_name].ndim
        if not _lay_out(module, param_name, fact, one_rank_mesh):
            with pytest.raises(ValueError, match="cannot split"):
                fact.split_dim(ndim, is_bias=param_name == "bias")
            continue
        real = _real_layout(module._parameters[param_name])
        assert fact.layout(ndim, is_bias=param_name == "bias") == real, f"{style} on {label}"
        if fact.strided and real != "replicated":
            assert module._parameters[param_name].placements[0].split_factor == fact.blocks, style


@pytest.mark.parametrize("style", sorted(SUPPORTED_STYLES))
def test_inspect_local_shapes_follow_the_real_split(one_rank_mesh, style):
    for label, module, param_name in _params():
        shape = tuple(module._parameters[param_name].shape)
        if not _lay_out(module, param_name, STYLES[style], one_rank_mesh):
            continue
        param = module._parameters[param_name]
        expected = list(shape)
        if isinstance(param, DTensor) and isinstance(param.placements[0], (Shard, _StridedShard)):
            dim = param.placements[0].dim
            expected[dim] = math.ceil(shape[dim] / 4)
        assert local_shape(shape, style, 4, is_bias=param_name == "bias") == tuple(expected), f"{style} on {label}"


_LAYER_CASES = {
    # style: (module, input, what its forward must give on one rank: the unsharded module's output)
    "colwise": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "colwise_gather_output": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "colwise_rep": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "packed_colwise": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "rowwise": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "rowwise_rep": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "rowwise_split_input": lambda: (nn.Linear(8, 12), torch.randn(2, 3, 8)),
    "embedding_rowwise": lambda: (nn.Embedding(10, 4, padding_idx=3), torch.tensor([[1, 3, 9]])),
    "embedding_colwise": lambda: (nn.Embedding(10, 4), torch.tensor([[1, 3, 9]])),
}


@pytest.mark.parametrize("style", sorted(_LAYER_CASES))
def test_each_layer_computes_what_the_module_computes_and_its_output_is_its_own(one_rank_mesh, style):
    """On one rank every collective is the identity: the layer's hooks (local shards, hidden bias, masked ids) must
    give the unsharded module's output and gradients, and a row-wise or vocabulary-parallel output must take an
    in-place change (it is no view of a DTensor's internals)."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    reference, x = _LAYER_CASES[style]()
    module = copy.deepcopy(reference)
    parallelize_module(module, one_rank_mesh, LAYERS[style](style, None, {}))
    expected, out = reference(x), module(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    if STYLES[style].kind in ("row", "embedding"):
        out.mul_(2)  # raises where the output is a view a custom autograd Function returned
        expected = expected * 2
    out.sum().backward()
    expected.sum().backward()
    for name, param in module.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=0, atol=0, msg=f"{style}: {name}")


def test_each_style_s_layer_follows_its_facts():
    """The layer class of each applied style is the one its kind says, and the column-wise ones gather their output
    exactly where the facts say the output is not left sharded."""
    by_kind = {"column": ColumnParallel, "row": RowParallel, "embedding": EmbeddingParallel}
    for name, fact in STYLES.items():
        if not fact.supported or not fact.registered or name in ("mla_kv_a_proj",):
            continue
        layer = LAYERS[name](name, None, {})
        expected = by_kind.get(fact.kind)
        if expected is None:
            assert layer is None or fact.kind == "module", name
        else:
            assert isinstance(layer, expected) and layer.fact is fact, name
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
