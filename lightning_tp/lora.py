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

import os
from typing import Any

import torch
from torch import nn

from lightning_tp.checkpoint import (
    _is_main,
    install_publishing_save_pretrained,
    publish_directory,
    run_on_main_and_share_failure,
)
from lightning_tp.plan import ResolvedPlan, Style
from lightning_tp.random_init import whole_parameters

_COLUMN = ("colwise", "colwise_rep", "colwise_gather_output")
_ROW = ("rowwise", "rowwise_rep", "rowwise_split_input")

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
        base = f"{name}.base_layer"
        styles.update({f"{base}.{p}": style for p, _ in wrapper.base_layer.named_parameters(recurse=False)})
        styles[base] = style
        if not isinstance(style, str):
            raise ValueError(
                f"tp_plan[{name!r}] is a torch ParallelStyle on a LoRA-wrapped layer: its adapters cannot follow it. "
                "Use a Transformers style name for LoRA targets, or leave this layer out of `target_modules`."
            )
        half = "lora_B" if style in _COLUMN else "lora_A" if style in _ROW else None
        if half is None or not isinstance(wrapper.get_base_layer(), nn.Linear):
            continue  # embeddings and replicated targets keep their adapters whole
        for adapter, layer in getattr(wrapper, half).items():
            prefix = f"{name}.{half}.{adapter}"
            styles.update({f"{prefix}.{p}": style for p, _ in layer.named_parameters(recurse=False)})
            styles[prefix] = style
    return ResolvedPlan(styles=styles, grad_allreduce=plan.grad_allreduce, tied=plan.tied)


def peft_models(root: nn.Module) -> list[nn.Module]:
    """The ``PeftModel`` instances inside ``root``."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return []
    return [m for m in root.modules() if isinstance(m, PeftModel)]


def initialize_adapters(peft_model: nn.Module) -> None:
    """Initialise the LoRA weights of a model materialised from the meta device, as PEFT does at creation
    (``to_empty`` leaves them as garbage and Transformers' initialisation does not know them).

    Sharded adapter halves are drawn whole and sliced (:func:`lightning_tp.random_init.whole_parameters`): a row-wise
    ``lora_A`` gets the slices of one random matrix, not the same rows on every rank. Run it inside
    :func:`lightning_tp.random_init.random_state_of_rank_zero` so that every rank draws the same matrices."""
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


def gather_adapter_state_dict(peft_model: nn.Module) -> dict[str, Any]:
    """The adapter tensors (``lora_`` entries of the state dict) and other trainable tensors, whole, on the CPU of
    every rank. Every rank must call it: gathering a shard is a collective."""
    from torch.distributed.tensor import DTensor

    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    state = {}
    for name, tensor in peft_model.state_dict().items():
        # PEFT selects what to save from these: adapters, and trainable biases (`bias="all"` / `"lora_only"`).
        if "lora_" not in name and name not in trainable:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu().contiguous()
    return state


def install_distributed_save(peft_model: nn.Module) -> None:
    """Make ``peft_model.save_pretrained(dir)``, called on every rank, write one standard adapter directory (whole
    tensors, ``adapter_config.json``) from rank 0, into a temporary directory renamed into place once complete.

    PEFT's own ``save_pretrained`` would write each rank's DTensor shards (or fail on them)."""
    install_publishing_save_pretrained(
        peft_model,
        lambda is_main: gather_adapter_state_dict(peft_model),  # every rank keeps them: small
        given_state="publish",
        defaults={"save_embedding_layers": False},  # "auto" may ask the hub about the base model
    )


def _gather_base_state(peft_model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, Any], dict[str, str]]:
    """The LoRA layers of the base model, its state dict whole on the CPU of rank 0 (empty elsewhere), and the names
    under which a tensor is seen again (tied weights: ``{"lm_head.weight": "model.embed_tokens.weight"}``), gathered
    once. Every rank must call it (gathering a shard is a collective); what can be wrong is checked before, on every
    rank."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    keep = _is_main()
    base = peft_model.get_base_model()
    layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    unmergeable = [n for n, m in layers.items() if not isinstance(m.get_base_layer(), (nn.Linear, nn.Embedding))]
    unmergeable += [n for n, m in layers.items() if m.merged]
    if unmergeable:
        raise ValueError(
            f"Cannot merge the adapters of {unmergeable[:4]}: only unmerged LoRA on linear and embedding layers."
        )
    full: dict[str, Any] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in base.state_dict(keep_vars=True).items():  # `keep_vars`: one object under each tied name
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # one tensor at a time
        if keep:
            full[name] = tensor.detach().cpu()
    return layers, full, aliases


def _merge(layers: dict[str, nn.Module], full: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``W + scaling * B @ A`` for each active adapter, under the base model's own names (what ``merge_and_unload``
    gives); inactive adapters are left out, as ``merge_and_unload`` drops them. A tied name holds the very tensor of
    the name it is tied to, so that Transformers writes it once, as its own ``save_pretrained``; merging an adapter
    into one of them unties them."""
    for alias, source in aliases.items():
        full[alias] = full[source]
    for name, module in layers.items():
        weight = full[f"{name}.base_layer.weight"].float()
        for adapter in module.active_adapters:
            if adapter in module.lora_A:  # linear: W[out, in] += s * B[out, r] @ A[r, in]
                a = full.pop(f"{name}.lora_A.{adapter}.weight").float()
                b = full.pop(f"{name}.lora_B.{adapter}.weight").float()
                weight = weight + module.scaling[adapter] * (b @ a)
            elif adapter in module.lora_embedding_A:  # embedding: W[vocab, dim] += s * (B[dim, r] @ A[r, vocab]).T
                a = full.pop(f"{name}.lora_embedding_A.{adapter}").float()
                b = full.pop(f"{name}.lora_embedding_B.{adapter}").float()
                weight = weight + module.scaling[adapter] * (b @ a).T
        full[f"{name}.base_layer.weight"] = weight.to(full[f"{name}.base_layer.weight"].dtype)
    return {k.replace(".base_layer.", "."): v for k, v in full.items() if ".lora_" not in k}


def save_merged(peft_model: nn.Module, directory: str | os.PathLike, **save_kwargs: Any) -> None:
    """Write the model with its LoRA adapters merged (``W + scaling * B @ A``) as a standard Transformers directory
    (``config.json``, safetensors), loadable with ``AutoModelForCausalLM.from_pretrained`` on one process, without
    changing the sharded model that keeps training. Call it on every rank: they gather one tensor at a time; rank 0
    merges and writes, and a failure there raises on every rank."""
    layers, full, aliases = _gather_base_state(peft_model)
    is_main = _is_main()

    def write() -> None:
        state = _merge(layers, full, aliases)
        with publish_directory(directory) as tmp:
            peft_model.get_base_model().save_pretrained(tmp, state_dict=state, is_main_process=True, **save_kwargs)

    run_on_main_and_share_failure(write, is_main=is_main)
