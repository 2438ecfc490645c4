"""A model's own plan read as data: where it comes from (its config's ``tp_plan``, a plan derived from its decoder's
structure, or none, and why), and plan keys as patterns over module and parameter paths.

A plan maps a module (or parameter) path to a style. Keys use Transformers' convention: ``*`` stands for one path
component (``model.layers.*.mlp.up_proj``). Values are Transformers' registered style names (``"colwise"``,
``"rowwise"``, ...) or, for any module, a ``torch.distributed.tensor.parallel.ParallelStyle`` instance.
"""

from __future__ import annotations

import re

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_tp.plans.derived import derive_plan, vocabulary_plan
from lightning_tp.plans.resolved import Style


def is_transformers_model(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def key_regex(key: str) -> re.Pattern[str]:
    """A plan key as a pattern over module/parameter paths: ``*`` stands for one path component."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


def model_plan(module: nn.Module) -> dict[str, Style]:
    """The module's own plan: a Transformers model's ``tp_plan`` (config ``base_model_tp_plan`` plus class rules such
    as ``lm_head``), or, when its config has none, the plan derived from its decoder structure
    (:mod:`lightning_tp.plans.derived`; empty when the structure is not recognised), or nothing for any other module."""
    return plan_source(module)[0]


def plan_source(module: nn.Module) -> tuple[dict[str, Style], str, str | None]:
    """The module's own plan, where it comes from (``"model"``, ``"derived"``, or ``"none"``) and, when there is none,
    why (the structure a derived plan could not understand, and how to write the plan)."""
    if not is_transformers_model(module):
        return {}, "none", None
    own = dict(getattr(module, "tp_plan", None) or {})
    if set(own) - {_output_embedding_name(module)}:
        return own, "model", None
    try:
        return derive_plan(module), "derived", None
    except ValueError as err:
        # A class rule for lm_head alone (no `base_model_tp_plan`) is kept as it was before plans were derived.
        if own:
            return own, "model", None
        # Layers no derived rule describes stay whole (the mixers of lightning_tp.plans.mixers are split on their
        # own); the vocabulary is split, where there is one.
        vocabulary = vocabulary_plan(module)
        if vocabulary and _has_layers(module):
            rank_zero_info(f"{type(module).__name__}: its decoder layers stay whole on every TP rank ({err})")
            return vocabulary, "derived", None
        return {}, "none", str(err)


def _has_layers(model: nn.Module) -> bool:
    """Whether the model holds a list of layers (a decoder, recurrent or not), as a causal LM does."""
    return any(isinstance(m, nn.ModuleList) and len(m) for m in model.modules())


def _output_embedding_name(model: nn.Module) -> str | None:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, m in model.named_modules() if m is out), None) if out is not None else None


__all__ = [
    "is_transformers_model",
    "key_regex",
    "model_plan",
    "plan_source",
]
