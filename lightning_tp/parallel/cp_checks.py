"""What context parallelism can split, checked before anything moves: the model's layer types, its attention
interface, its decoder stack and where its position ids come from. See :mod:`lightning_tp.parallel.context_parallel`.
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_tp.compat import (
    attention_implementation,
)
from lightning_tp.composition import problem
from lightning_tp.parallel.cp_split import (
    ATTENTION_LAYER_TYPES,
    NAME_PREFIX,
    TOKENWISE_LAYER_TYPES,
    UNDECLARED_ATTENTION_INTERFACE,
)

# ---------------------------------------------------------------------------------------------------------------------
# What can run split: checked before anything moves


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot run with its sequences split, or ``None``. Reads the model's structure, class declarations
    and config only (never its code), so every rank decides the same before any collective.

    Args:
        model: the model to split (a Transformers causal LM, else refused).
    """
    from lightning_tp.parallel.loss_parallel import computes_causal_lm_loss
    from lightning_tp.plans.source import is_transformers_model
    from lightning_tp.plans.structure import block_classes

    name = type(model).__name__
    if not is_transformers_model(model):
        return problem("cp+not_transformers", f"{name} is not a Transformers model")
    config = model.config
    if config.get_text_config() is not config:
        return problem("cp+composite", f"{name} is a composite (vision-language or audio) model")
    if not getattr(config, "is_causal", True) or getattr(config, "is_encoder_decoder", False):
        return problem("cp+not_causal", f"{name} does not use causal attention")
    implementation = attention_implementation(config)
    if not _runs_inside(implementation):
        return problem(
            "cp+attn_implementation",
            f"{name} uses attn_implementation={implementation!r}, which context parallelism cannot run inside",
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    other = sorted(layer_types - ATTENTION_LAYER_TYPES - TOKENWISE_LAYER_TYPES)
    if other:
        return problem(
            "cp+sequence_mixers",
            f"{name} has layers of type {other} (`config.layer_types`), which mix the sequence without attention",
        )
    if getattr(config, "output_router_logits", False):
        return problem("cp+router_loss", f"{name} adds its router's load-balancing loss (`output_router_logits=True`)")
    if not computes_causal_lm_loss(model):
        current = model.loss_function
        return problem(
            "cp+custom_loss",
            f"{name} computes its loss with {getattr(current, '__name__', current)!r}, not Transformers' causal-LM "
            "loss",
        )
    if not declares_attention_interface(model):
        return problem(
            "cp+own_attention",
            f"{name} does not declare that its layers compute attention through Transformers' attention interface "
            f"(`{name}.is_backend_compatible()` is False)",
        )
    base = decoder_stack(model, block_classes(model))
    parameters = inspect.signature(base.forward).parameters
    missing = [arg for arg in ("position_ids", "attention_mask") if arg not in parameters]
    if missing:
        return problem("cp+stack_signature", f"{type(base).__name__}.forward takes no {missing}")
    return None


def _runs_inside(implementation: str | None) -> bool:
    """Whether context parallelism can register itself around ``implementation``: ``eager`` or a name Transformers'
    attention interface holds (``sdpa``, ``flash_attention_2``, ``flex_attention``, ...), not a split's own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not isinstance(implementation, str) or implementation.startswith(NAME_PREFIX):
        return False
    return implementation == "eager" or implementation in ALL_ATTENTION_FUNCTIONS


def declares_attention_interface(model: nn.Module) -> bool:
    """Whether ``model``'s layers compute attention through Transformers' attention interface, the registry that
    context parallelism registers its attention in: as the model's class declares it (``is_backend_compatible()``,
    what Transformers' models that dispatch through ``AttentionInterface`` set), or as
    :data:`UNDECLARED_ATTENTION_INTERFACE` lists it. A model that declares nothing is taken not to: what its layers
    do is not read from their code.

    Args:
        model: a Transformers model (:func:`lightning_tp.plans.source.is_transformers_model`).
    """
    declared = getattr(type(model), "is_backend_compatible", None)
    return (callable(declared) and bool(declared())) or type(model).__name__ in UNDECLARED_ATTENTION_INTERFACE


def decoder_stack(model: nn.Module, blocks: set[type] | None = None) -> nn.Module:
    """The module that embeds the tokens and runs the decoder layers (``model.model`` for Llama, ``model.model.decoder``
    for OPT, ``model.transformer`` for GPT-2): the innermost one holding the input embedding and every layer, which
    the causal LM calls with the token ids and positions. ``blocks``: the decoder layer classes (default: the
    model's ``_no_split_modules``)."""
    from lightning_tp.plans.structure import block_classes

    blocks = block_classes(model) if blocks is None else blocks
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = [name for name, m in model.named_modules() if m is embedding or type(m) in blocks]
    if embedding is None or len(names) < 2:
        base = getattr(model, "base_model", None)
        return model if base is None else base
    prefix = names[0].split(".")
    for name in names[1:]:
        parts = name.split(".")
        common = 0
        while common < min(len(prefix), len(parts)) and prefix[common] == parts[common]:
            common += 1
        prefix = prefix[:common]
    return model.get_submodule(".".join(prefix))


def positions_from_mask(stack: nn.Module) -> str | None:
    """The position table of the decoder stack that derives position ids from the attention mask when it gets none,
    as ``"Stack.name (Class)"``, or ``None`` for Transformers' usual ``0 .. length - 1``. Found by structure: a module
    directly in the stack that is an embedding table (``nn.Embedding``, looked up by index) and whose ``forward``
    takes ``attention_mask`` computes its indices from the mask (OPT's and BioGPT's learned positions count a
    left-padded row from its first real token). A stack that derives them in its own ``forward`` without such a table
    is not found; of Transformers' text causal LMs in 5.24 and 5.25, the one stack that does (OPT's) has one too.

    Args:
        stack: the model's decoder stack (:func:`decoder_stack`).
    """
    for name, module in stack.named_children():
        if isinstance(module, nn.Embedding) and "attention_mask" in inspect.signature(module.forward).parameters:
            return f"{type(stack).__name__}.{name} ({type(module).__name__})"
    return None


__all__ = [
    "context_parallel_problem",
    "declares_attention_interface",
    "decoder_stack",
    "positions_from_mask",
]
