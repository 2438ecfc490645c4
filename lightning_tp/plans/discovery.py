"""Which modules of a LightningModule are Transformers models, which are not, and what a checkpoint records about
them (its ``MODELS_KEY`` entry, which export reads). Used by the strategies, the pipeline and export."""

from __future__ import annotations

import json
from typing import Any

from torch import nn

from lightning_tp.plans.source import is_transformers_model


def peft_models(root: nn.Module) -> list[nn.Module]:
    """The ``PeftModel`` instances inside ``root``."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return []
    return [m for m in root.modules() if isinstance(m, PeftModel)]


#: Version of the ``MODELS_KEY`` entry's layout.
FORMAT_VERSION = 1


def modules_outside(root: nn.Module, models: list[nn.Module]) -> list[nn.Module]:
    """The top-most submodules of ``root`` that neither are nor contain one of ``models``."""
    inside = {id(m) for model in models for m in model.modules()}
    containing = {id(m) for m in root.modules() if any(id(c) in inside for c in m.modules())}
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in inside:
                continue
            if id(child) in containing:
                visit(child)
            else:
                found.append(child)

    if id(root) not in inside:
        visit(root)
    return found


def torchmetrics_in(root: nn.Module) -> list[nn.Module]:
    """The torchmetrics ``Metric`` modules under ``root`` (none where torchmetrics is missing)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning depends on torchmetrics
        return []
    return [module for module in root.modules() if isinstance(module, Metric)]


def transformers_models(root: nn.Module) -> list[nn.Module]:
    """Transformers models inside ``root`` that are not inside another one (``Qwen3ForCausalLM``, not its ``model``)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if is_transformers_model(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    # The same model reachable twice (`self.backbone = self.model.model`): keep the outermost.
    inner = {id(m) for model in found for m in model.modules() if m is not model}
    unique: list[nn.Module] = []
    for model in found:
        if id(model) not in inner and all(model is not m for m in unique):
            unique.append(model)
    return unique


def describe_models(root: nn.Module) -> dict[str, Any]:
    """The ``MODELS_KEY`` checkpoint entry: what export needs to rebuild a Transformers directory.

    One entry per top-level Transformers model in ``root`` (a ``PeftModel`` wrapping one counts as that model, with
    its adapters). Reads configs only, never tensors, so it works on sharded and meta models. Plain JSON data."""
    names = {id(module): name for name, module in root.named_modules()}
    wrappers = {id(p.get_base_model()): p for p in peft_models(root)}
    models = []
    for model in transformers_models(root):
        wrapper = wrappers.get(id(model))
        owner = model if wrapper is None else wrapper
        entry = _describe_model(model, prefix=name_prefix(names[id(owner)]))
        if wrapper is not None:
            inner = names[id(model)].removeprefix(names[id(wrapper)]).removeprefix(".")
            entry["peft"] = _describe_peft(wrapper, prefix_in_model=name_prefix(inner))
        models.append(entry)
    return {"format_version": FORMAT_VERSION, "models": models}


def name_prefix(name: str) -> str:
    """The prefix of a module's entries in its root's state dict."""
    return f"{name}." if name else ""


def _describe_model(model: nn.Module, *, prefix: str) -> dict[str, Any]:
    generation = getattr(model, "generation_config", None) if model.can_generate() else None  # as save_pretrained
    return {
        "prefix": prefix,
        "architecture": _architecture(model),
        "config": json.loads(model.config.to_json_string(use_diff=False)),
        "generation_config": None if generation is None else json.loads(generation.to_json_string(use_diff=False)),
        "source": model.config.name_or_path or None,
        "peft": None,
    }


def _architecture(model: nn.Module) -> str:
    """The Transformers class of ``model``, through FSDP2's subclass (``FSDPQwen3ForCausalLM``) and user subclasses;
    else (remote code) its own name, which export refuses by name. Never raises: it runs while checkpointing."""
    import transformers
    from transformers import PreTrainedModel

    classes = [cls for cls in type(model).__mro__ if issubclass(cls, PreTrainedModel)]
    for cls in classes:
        if getattr(transformers, cls.__name__, None) is cls:
            return cls.__name__
    return classes[0].__name__.removeprefix("FSDP")


def _describe_peft(peft_model: nn.Module, *, prefix_in_model: str) -> dict[str, Any]:
    return {
        "prefix_in_model": prefix_in_model,
        "active_adapters": list(peft_model.active_adapters),
        "adapters": {name: _jsonable(config.to_dict()) for name, config in peft_model.peft_config.items()},
    }


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    """PEFT configs hold sets (``target_modules``) and enums: as PEFT writes them to ``adapter_config.json``."""

    def default(obj: Any) -> Any:
        if isinstance(obj, (set, frozenset)):
            return sorted(obj)
        raise TypeError(f"{type(obj).__name__} in a PEFT config is not JSON serialisable")

    return json.loads(json.dumps(value, default=default))
