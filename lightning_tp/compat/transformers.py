"""The private names of Transformers that lightning_tp uses, each with why: its marks on models and tensors, config
reads (heterogeneous configs, encoded floats), what ``save_pretrained`` leaves out or renames, its TP and expert
parallelism internals, the attention and mask interfaces' registries, its causal-LM loss and the per-module step of
weight initialisation. Transformers is imported inside the functions: importing this module does not import it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "FSDP_MANAGED_ATTR",
    "set_loss_function",
    "is_hf_initialized",
    "mark_hf_initialized",
    "config_value",
    "layer_configs",
    "decode_config_floats",
    "no_split_modules",
    "keys_to_ignore_on_save",
    "remove_tied_weights_from_state_dict",
    "revert_weight_conversion",
    "remove_transformers_grad_allreduce",
    "transformers_apply_expert_parallelism",
    "uses_experts_interface",
    "attention_implementation",
    "set_attention_implementation",
    "register_attention_implementation",
    "causal_lm_loss_function",
    "wrapped_initialize_weights",
]

#: Transformers' mark of a model it sharded with FSDP2 itself (``transformers/distributed/fsdp.py``): ``generate``
#: then defaults to ``synced_gpus=True`` when the world has more than one rank. No public switch.
FSDP_MANAGED_ATTR = "_is_fsdp_managed_module"

#: Transformers' mark of a tensor its weight initialisation must leave alone (loaded from a checkpoint).
_HF_INITIALIZED_ATTR = "_is_hf_initialized"


def is_hf_initialized(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _HF_INITIALIZED_ATTR, False)


def mark_hf_initialized(tensor: torch.Tensor) -> None:
    """Make Transformers' ``initialize_weights`` skip ``tensor``, as its own loading does; no public API."""
    setattr(tensor, _HF_INITIALIZED_ATTR, True)


def config_value(config: Any, name: str, *, default: Any = None) -> Any:
    """``config.<name>``, or ``default`` where the config has no single value: a heterogeneous config (values per
    layer, ``per_layer_config``) raises Transformers' ``AmbiguousGlobalPerLayerAttributeError`` on a global read of
    a per-layer attribute (Dots 3's head counts); its opt-in flag is internal."""
    try:
        return getattr(config, name, default)
    except RuntimeError as err:
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":  # its module path is internal
            raise
        return default


def layer_configs(config: Any) -> list[Any]:
    """The per-layer configs of a heterogeneous config (``per_layer_config``), else ``[config]``."""
    if not getattr(config, "is_heterogeneous", False):
        return [config]
    return list(config.per_layer_config)


def decode_config_floats(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict as ``to_json_string`` wrote it, with infinity and NaN (written ``{"__float__": "Infinity"}``)
    back as floats (Nemotron-H's ``time_step_limit``): Transformers' private decoder of its own encoding."""
    from transformers import PreTrainedConfig

    return PreTrainedConfig._decode_special_floats(values)


def no_split_modules(module: nn.Module) -> Iterable[str]:
    """The class names Transformers keeps whole when splitting a model (``_no_split_modules``, a class attribute):
    our default FSDP2 units. No public accessor."""
    return getattr(module, "_no_split_modules", None) or ()


def keys_to_ignore_on_save(model: nn.Module) -> Iterable[str]:
    """The state-dict names ``save_pretrained`` leaves out (``_keys_to_ignore_on_save``); no public accessor."""
    return getattr(model, "_keys_to_ignore_on_save", None) or ()


def remove_tied_weights_from_state_dict(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``save_pretrained``'s own de-duplication of tied weights (``transformers.modeling_utils``, not exported)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict as remove

    return remove(state, model)


def revert_weight_conversion(model: nn.Module, state: dict[str, Any]) -> dict[str, Any] | None:
    """``save_pretrained``'s renaming back to a checkpoint's original layout (``transformers.core_model_loading``, not
    exported), or ``None`` where Transformers has none."""
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:  # pragma: no cover - older Transformers
        return None
    return revert(model, state)


def remove_transformers_grad_allreduce(module: nn.Module) -> None:
    """Undo Transformers' ``replicated_with_grad_allreduce`` layer on a module that ``from_pretrained`` sharded: 5.24
    replaces the instance's ``forward``, 5.25 registers a forward pre-hook (a local function of
    ``ReplicatedWithGradAllReduce.install_forward``) that hooks each parameter's gradient with an all-reduce of a plain
    tensor. This package sums that gradient itself, on the replicated DTensor it makes of the parameter."""
    module.__dict__.pop("forward", None)
    hooks = module._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if "ReplicatedWithGradAllReduce." in getattr(hook, "__qualname__", ""):
            del hooks[key]


def transformers_apply_expert_parallelism() -> Callable[..., Any]:
    """Transformers' expert parallelism (``grouped_gemm`` weights, ``ep_dispatch_experts`` all-to-all dispatch) on a
    built model: internal, like its TP."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    return apply_expert_parallelism


def uses_experts_interface(experts: Any) -> bool:
    """Whether an experts module goes through Transformers' experts interface (``@use_experts_implementation``, which
    sets ``_is_expert_parallel``): its expert-parallel dispatch relies on it to skip the expert ids of other ranks."""
    return hasattr(experts, "_is_expert_parallel")


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a Transformers config selects (``config._attn_implementation``: the models read
    it at every forward; ``attn_implementation`` is only the constructor's argument)."""
    return config._attn_implementation


def set_attention_implementation(config: Any, name: str) -> None:
    """Select an implementation registered with ``AttentionInterface.register`` for one model's config, without the
    checks of ``PreTrainedModel.set_attn_implementation`` (which loads kernels and refuses names it does not ship);
    the config's setter passes it on to the sub-configs."""
    config._attn_implementation = name


def set_loss_function(model: Any, function: Callable[..., Any], *, owner: object) -> Any:
    """Set a Transformers model's ``loss_function`` on this instance through :func:`lightning_tp.patches.install`:
    the property's setter stores it in the instance's ``_loss_function`` (private), which is patched instead, recorded
    with what the instance held (usually nothing: the property then maps the model's ``loss_type``). A loss function
    this package set earlier (loss parallelism's, which context parallelism then wraps) is replaced, its record
    keeping the original, so that undoing the last restores the model's own. Returns the patch.

    Raises:
        ValueError: as :func:`lightning_tp.patches.install` (``owner`` cannot be weakly referenced).
    """
    from lightning_tp import patches

    earlier = patches.installed(model, "_loss_function")
    if earlier is not None:
        earlier.undo()
    return patches.install(model, "_loss_function", function, owner=owner)


def register_attention_implementation(
    name: str, *, attention: Callable[..., Any], mask: Callable[..., Any], owner: object
) -> None:
    """Register ``attention`` and ``mask`` under ``name`` in Transformers' attention and mask interfaces, for
    ``owner``: a strategy's teardown gives them up (:func:`lightning_tp.patches.undo_owned`), and the last owner's
    removes them. Transformers' ``register`` (public) has no counterpart that removes an entry, so the entries of the
    registries' class-level mappings (``_global_mapping``, private) are set and removed through
    :func:`lightning_tp.patches.install_entry`. Registering the same functions again for another owner shares them.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from lightning_tp import patches

    for interface, function in ((AttentionInterface, attention), (AttentionMaskInterface, mask)):
        mapping = interface._global_mapping
        existing = patches.installed_entry(interface, mapping, name)
        if existing is not None and existing.value is function:
            existing.add_owner(owner)
        else:
            if existing is not None:
                existing.undo()
            patches.install_entry(interface, mapping, name, function, owner=owner)


def causal_lm_loss_function() -> Callable[..., Any]:
    """Transformers' ``ForCausalLMLoss``, what ``PreTrainedModel.loss_function`` resolves to for causal LMs; its
    module (``transformers.loss.loss_utils``) is not exported."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


@contextmanager
def wrapped_initialize_weights(
    models: Iterable[nn.Module], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Inside the block, each of ``models`` (Transformers models) runs ``wrap(original)`` as its private
    ``_initialize_weights(module)``, the per-module step of the public ``initialize_weights``; there is no public hook
    around it. Instances that carry their own already are left alone; every wrapper is removed on exit."""
    attr = "_initialize_weights"
    wrapped = []
    try:
        for model in models:
            if attr not in model.__dict__:
                setattr(model, attr, wrap(getattr(model, attr)))
                wrapped.append(model)
        yield
    finally:
        for model in wrapped:
            delattr(model, attr)
