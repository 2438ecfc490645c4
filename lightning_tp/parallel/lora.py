"""PEFT LoRA under tensor parallelism: each adapter is sharded with its base layer.

PEFT 0.21 sizes adapters from the local shard when it sees a TP model, which crashes row-wise layers and, where its
TP detection does not fire, trains silently wrong. Here PEFT is applied as usual to the whole (unsharded or meta)
model, and the plan is extended to the LoRA wrappers before sharding:

- a column-wise base (``colwise``, ``colwise_rep``, ...) gives ``lora_B`` the same style: its output rows are sharded
  like the base's, and ``lora_A`` (whose input is replicated) stays whole;
- a row-wise base (``rowwise``, ...) gives ``lora_A`` the same style: it reads the same input shard as the base and its
  small output is all-reduced; ``lora_B`` stays whole;
- any other target (an embedding, a replicated module) keeps its adapters whole, with complete gradients on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from lightning_tp.parallel.random_init import whole_parameters
from lightning_tp.plans.resolved import ResolvedPlan, Style
from lightning_tp.plans.styles import facts

#: LoRA configuration options this strategy cannot shard, merge or save correctly, with the reason.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA normalises each output row of W + BA over the input dimension, which row-wise layers shard",
    "lora_bias": "the adapter's bias is not merged or sharded by this strategy yet",
}


def has_peft(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


def check_peft_supported(model: nn.Module) -> None:
    """Refuse, by name, PEFT methods and LoRA options whose sharding this strategy does not implement, before any
    weight moves: they would crash mid-step or train silently wrong."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer) and not isinstance(module, LoraLayer):
            raise ValueError(
                f"{name} is a {type(module).__name__} ({type(module).__module__.split('.')[2]}): only LoRA adapters "
                "are sharded by TensorParallelStrategy. Use `peft.LoraConfig`."
            )
        if isinstance(module, LoraLayer) and not isinstance(module, _supported_lora_layers()):
            raise ValueError(
                f"{name} is a LoRA {type(module).__name__}: LoRA on nn.Linear and nn.Embedding is supported under "
                "tensor parallelism; leave this module out of `target_modules`."
            )
        if isinstance(module, LoraLayer):
            for option, reason in _REFUSED_OPTIONS.items():
                # LoRA layers keep each option per adapter: {adapter name: value}
                adapters = [adapter for adapter, on in getattr(module, option, {}).items() if on]
                if adapters:
                    raise ValueError(
                        f"LoRA adapter(s) {adapters} on {name} use `{option}=True`, which is not supported under "
                        f"tensor parallelism: {reason}. Use plain LoRA (rsLoRA and lora_dropout work)."
                    )
        if isinstance(module, LoraLayer) and getattr(module, "lora_variant", None):
            variants = {a: type(v).__name__ for a, v in module.lora_variant.items()}
            raise ValueError(
                f"LoRA variant(s) {variants} on {name} are not supported under tensor parallelism (their forward and "
                "merge read the whole base weight). Use plain LoRA (rsLoRA and lora_dropout work)."
            )
        if isinstance(module, ModulesToSaveWrapper):
            raise ValueError(
                f"{name} is in PEFT's `modules_to_save` (a full trainable copy): not supported under tensor "
                "parallelism yet. Train it with LoRA instead, or leave it out."
            )


def _supported_lora_layers() -> tuple[type, ...]:
    from peft.tuners import lora

    return (lora.Linear, lora.Embedding)


def extend_plan_to_adapters(model: nn.Module, plan: ResolvedPlan) -> ResolvedPlan:
    """Move each style that names a LoRA wrapper onto its ``base_layer``, and give the adapter half that shares the
    base's sharded dimension the same style (see the module docstring)."""
    from peft.tuners.lora import LoraLayer

    modules = dict(model.named_modules())
    styles: dict[str, Style] = {}
    for name, style in plan.styles.items():
        wrapper = modules.get(name)
        if not isinstance(wrapper, LoraLayer):
            styles[name] = style
            continue
        if facts(style) is not None and facts(style).output_hook:
            # Its hook sums part of the output's gradient: on the wrapper, it covers base and adapters alike.
            styles[name] = style
            continue
        base = f"{name}.base_layer"
        styles.update({f"{base}.{p}": style for p, _ in wrapper.base_layer.named_parameters(recurse=False)})
        styles[base] = style
        if not isinstance(style, str):
            raise ValueError(
                f"tp_plan[{name!r}] is a torch ParallelStyle on a LoRA-wrapped layer: its adapters cannot follow it. "
                "Use a Transformers style name for LoRA targets, or leave this layer out of `target_modules`."
            )
        own = facts(style)
        if own is not None and not own.registered and own.kind in ("column", "row") and own.lora_half is None:
            raise ValueError(
                f"tp_plan[{name!r}] = {style!r} on a LoRA-wrapped layer: adapters do not follow this package's own "
                "layer styles (GPT-2's Conv1D, a row-wise layer whose output stays split) yet. Leave this layer out of "
                "`target_modules`, or use tp_size=1."
            )
        if not isinstance(wrapper.get_base_layer(), nn.Linear):
            continue  # embeddings keep their adapters whole
        fact = facts(style)
        half = fact.lora_half if fact is not None else None
        if half is None:
            if fact is not None and fact.output_sharded:
                # A whole adapter's output has the full width, the base's only this rank's slice: the sum would fail.
                raise ValueError(
                    f"tp_plan[{name!r}] = {style!r} on a LoRA-wrapped linear layer: its output stays sharded in a "
                    "layout the adapters cannot follow. Use 'colwise' for this layer, or leave it out of "
                    "`target_modules`."
                )
            continue  # replicated and gathered targets keep their adapters whole
        for adapter, layer in getattr(wrapper, half).items():
            prefix = f"{name}.{half}.{adapter}"
            styles.update({f"{prefix}.{p}": style for p, _ in layer.named_parameters(recurse=False)})
            styles[prefix] = style
    return replace(plan, styles=styles)


def initialize_adapters(peft_model: nn.Module) -> None:
    """Initialise the LoRA weights of a model materialised from the meta device, as PEFT does at creation
    (``to_empty`` leaves them as garbage and Transformers' initialisation does not know them).

    Sharded adapter halves are drawn whole and sliced (:func:`lightning_tp.parallel.random_init.whole_parameters`): a
    row-wise ``lora_A`` gets the slices of one random matrix, not the same rows on every rank. Run it inside
    :func:`lightning_tp.parallel.random_init.random_state_of_rank_zero` so that every rank draws the same matrices."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [
            *module.lora_A.values(),
            *module.lora_B.values(),
            *(getattr(module, name) for name in ("lora_embedding_A", "lora_embedding_B") if hasattr(module, name)),
        ]
        with whole_parameters(adapters):
            _reset_adapters(peft_model, module)


def _reset_adapters(peft_model: nn.Module, module: nn.Module) -> None:
    for adapter in module.lora_A:
        init = peft_model.peft_config[adapter].init_lora_weights
        if init is False:  # PEFT's "random": both halves keep nn.Linear's default initialisation
            module.lora_A[adapter].reset_parameters()
            module.lora_B[adapter].reset_parameters()
        else:
            module.reset_lora_parameters(adapter, init)
    for adapter in getattr(module, "lora_embedding_A", {}):
        init = peft_model.peft_config[adapter].init_lora_weights
        if init is False:  # PEFT's "random" for embeddings: both halves from a standard normal
            torch.nn.init.normal_(module.lora_embedding_A[adapter])
            torch.nn.init.normal_(module.lora_embedding_B[adapter])
        else:
            module.reset_lora_parameters(adapter, init)


def check_mergeable(layers: Mapping[str, nn.Module]) -> None:
    """Refuse, naming the layers, what :func:`merged_weight` cannot merge exactly: LoRA on anything but linear
    (``nn.Linear``, GPT-2's ``Conv1D``) and embedding layers, DoRA, LoRA biases and variants (their merge reads more
    than the adapter), and adapters already merged."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed linear: PEFT's LoRA with fan_in_fan_out

    bad = [n for n, m in layers.items() if not isinstance(m.get_base_layer(), (nn.Linear, nn.Embedding, Conv1D))]
    bad += [n for n, m in layers.items() for option in _REFUSED_OPTIONS if any(getattr(m, option, {}).values())]
    bad += [n for n, m in layers.items() if getattr(m, "lora_variant", None) or m.merged]
    if bad:
        raise ValueError(
            f"Cannot merge the adapters of {sorted(set(bad))[:4]}: plain, unmerged LoRA on linear, Conv1D and "
            "embedding layers only. Export the adapters instead (without merging)."
        )


def adapter_keys(layer: nn.Module) -> list[str]:
    """The tensors a merge of ``layer`` reads: the keys, in the layer's own state dict, of its active adapters
    (``lora_A.default.weight``, ``lora_embedding_B.default``, ...)."""
    active = set(layer.active_adapters)
    keys = [key.split(".") for key in layer.state_dict(keep_vars=True)]
    return [".".join(k) for k in keys if k[0].startswith("lora_") and len(k) > 1 and k[1] in active]


class _DeltaWeights(nn.Module):
    """Runs PEFT's ``get_delta_weight`` of ``layer`` as a forward, so that ``torch.func.functional_call`` can give
    it other tensors than the layer's own."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, adapters: list[str]) -> list[torch.Tensor]:
        return [self.layer.get_delta_weight(adapter) for adapter in adapters]


def merged_weight(layer: nn.Module, *, base_weight: torch.Tensor, adapters: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``base_weight`` with the active adapters of the LoRA ``layer`` merged in, what ``merge_and_unload`` writes into
    that layer: the sum of PEFT's own ``get_delta_weight`` (scaling, rsLoRA, rank and alpha patterns,
    ``fan_in_fan_out`` / ``Conv1D``, embeddings), computed on the whole tensors given, in fp32, and cast back to
    ``base_weight``'s dtype.

    ``adapters``: whole tensors under the keys of :func:`adapter_keys` (gathered from a live sharded run, or read from
    a checkpoint). ``layer`` only supplies the math and the hyper-parameters: it may be on the meta device, or live
    and sharded; its own tensors are swapped for these during the call (``functional_call``) and left as they were.
    Check the layers with :func:`check_mergeable` first."""
    assert set(adapters) == set(adapter_keys(layer)), (sorted(adapters), adapter_keys(layer))  # by the callers
    with torch.no_grad():
        merged = base_weight.float()
        for delta in delta_weights(layer, adapters=adapters):
            merged = merged + delta
    return merged.to(base_weight.dtype)


def delta_weights(layer: nn.Module, *, adapters: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """PEFT's ``get_delta_weight`` of each active adapter of the LoRA ``layer``, in fp32, computed on ``adapters``
    (tensors under the keys of :func:`adapter_keys`; the layer's own are left as they are). Given a slice of the
    rows of each ``lora_B`` (``lora_embedding_B``), each delta is that slice of the whole delta, along the dim its
    layout puts ``B``'s rows on (the output features of a linear layer, the input features of a ``Conv1D``).

    Args:
        layer: a PEFT LoRA layer (checked with :func:`check_mergeable`); it supplies the math and hyper-parameters.
        adapters: the tensors to compute with, whole (or ``lora_B`` sliced by rows), under :func:`adapter_keys`.

    Raises:
        Nothing of its own: PEFT's errors for shapes that do not fit.
    """
    active = [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]
    tensors = {f"layer.{key}": tensor.float() for key, tensor in adapters.items()}
    with torch.no_grad():
        return list(torch.func.functional_call(_DeltaWeights(layer), tensors, (active,), strict=False))
