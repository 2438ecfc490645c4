"""Standard Hugging Face directories written from a sharded model while it keeps training: ``save_pretrained`` of a
sharded Transformers model, PEFT's adapter save, and the model with its adapters merged (:func:`save_merged`). The
ranks gather one tensor at a time; rank 0 writes, published by renames once complete."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from lightning_tp.checkpoint.publish import (
    arrive_together,
    is_main,
    on_every_rank,
    publish_directory,
    run_on_main_and_share_failure,
    watch_for_exit,
)
from lightning_tp.parallel.gather import whole_tensor
from lightning_tp.parallel.lora import adapter_keys, check_mergeable, merged_weight
from lightning_tp.parallel.pipeline import pipeline_runner
from lightning_tp.parallel.pipeline_gather import gather_stages
from lightning_tp.patches import install, installed


def install_distributed_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(dir)``, called on every rank of a sharded Transformers model, write one standard
    directory (whole tensors, ``config.json``, generation config) from rank 0, published by renames once complete.

    Transformers' own ``save_pretrained`` fails on DTensor parameters ("invalid python storage"). The ranks gather one
    tensor at a time; rank 0 keeps them on the CPU and hands them to Transformers' writer (which names, shards and
    de-duplicates tied weights), so the peak on rank 0 is the model's size in host memory. For a checkpoint of any
    size, ``python -m lightning_tp.export`` streams one tensor at a time instead."""

    def gather(is_main: bool) -> dict[str, Any]:
        state = {}
        gathered: dict[int, torch.Tensor | None] = {}
        # Under pipeline parallelism each rank gathers its own stages' tensors, and rank 0 all of them after.
        keep = is_main or pipeline_runner(model) is not None
        # `keep_vars`: tied weights (`lm_head.weight` of a tied model) come as one object under two names. Gathered
        # once and kept as one tensor, so that Transformers sees the shared storage and writes only its own keys.
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in gathered:
                gathered[id(tensor)] = whole_tensor(tensor, keep=keep)  # a collective, on every rank
            if keep:
                state[name] = gathered[id(tensor)]
        return gather_stages(model, state)

    # A given `state_dict`: the caller gathered the tensors already and may call from one rank only (`save_merged`
    # does), so no collective.
    install_publishing_save_pretrained(model, gather, given_state="call_through")


def install_publishing_save_pretrained(
    model: nn.Module,
    gather: Callable[[bool], dict[str, Any]],
    *,
    given_state: Literal["call_through", "publish"],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Replace ``model.save_pretrained`` (on this instance, once: a model patched already keeps its save; a patch
    of :mod:`lightning_tp.patches` owned by the model) by a collective one: every rank calls it, every rank
    runs ``gather(is_main)`` (the state dict to write, whole, needed on the main rank only), the main rank writes it
    with the original method into a temporary directory renamed into place once complete, and a failure there raises
    on every rank. ``is_main_process`` picks the writing rank (default: rank 0).

    A caller's own ``state_dict``: ``given_state="call_through"`` hands the call to the original method as it is (no
    collective: the caller may be on one rank only); ``"publish"`` writes it from the main rank as above, without
    ``gather``. ``defaults``: keyword arguments for the original method unless the caller passes them."""
    if installed(model, "save_pretrained") is not None:
        return
    original = model.save_pretrained
    watch_for_exit()

    def save_pretrained(save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        state = kwargs.pop("state_dict", None)
        if state is not None and given_state == "call_through":
            return original(save_directory, *args, state_dict=state, **kwargs)
        arrive_together(f"`save_pretrained` of a sharded {type(model).__name__}")
        main = kwargs.pop("is_main_process", None)
        main = is_main() if main is None else main
        if state is None:
            state = gather(main)
        for key, value in (defaults or {}).items():
            kwargs.setdefault(key, value)

        def write() -> None:
            with publish_directory(save_directory) as tmp:
                original(tmp, *args, state_dict=state, is_main_process=True, **kwargs)

        run_on_main_and_share_failure(write, is_main=is_main)

    install(model, "save_pretrained", save_pretrained, owner=model)


def gather_adapter_state_dict(peft_model: nn.Module) -> dict[str, Any]:
    """The adapter tensors (``lora_`` entries of the state dict) and other trainable tensors, whole, on the CPU of
    every rank. Every rank must call it: gathering a shard is a collective."""
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    state = {}
    for name, tensor in peft_model.state_dict().items():
        # PEFT selects what to save from these: adapters, and trainable biases (`bias="all"` / `"lora_only"`).
        if "lora_" not in name and name not in trainable:
            continue
        state[name] = whole_tensor(tensor, keep=True).contiguous()
    return state


def install_distributed_save(peft_model: nn.Module) -> None:
    """Make ``peft_model.save_pretrained(dir)``, called on every rank, write one standard adapter directory (whole
    tensors, ``adapter_config.json``) from rank 0, into a temporary directory renamed into place once complete.

    PEFT's own ``save_pretrained`` would write each rank's DTensor shards (or fail on them). Once per model: every
    setup (fit, then validate) calls it."""
    if installed(peft_model, "save_pretrained") is not None:
        return
    if pipeline_runner(peft_model) is not None:
        install_pipelined_adapter_save(peft_model)
        return
    install_publishing_save_pretrained(
        peft_model,
        lambda is_main: gather_stages(peft_model, gather_adapter_state_dict(peft_model)),  # every rank keeps them
        given_state="publish",
        defaults={"save_embedding_layers": False},  # "auto" may ask the hub about the base model
    )


def install_pipelined_adapter_save(peft_model: nn.Module) -> None:
    """:func:`install_distributed_save` for a pipelined model: PEFT selects the adapter entries to write by the LoRA
    layers the model holds, and each rank holds its stages' only. So each rank selects its own (PEFT's
    ``get_peft_model_state_dict``, which also drops the adapter name), rank 0 gathers every stage's and writes them
    with the adapter's config, under PEFT's file names."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, get_peft_model_state_dict
    from safetensors.torch import save_file

    watch_for_exit()

    def save_pretrained(save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and k != "is_main_process") + (
            ["positional arguments"] if args else []
        )
        if unsupported:
            raise ValueError(
                f"`save_pretrained` of a pipelined PEFT model takes the directory only; got {unsupported}. Save "
                "without them, or with pp_size=1."
            )
        arrive_together("`save_pretrained` of a pipelined PEFT model")
        adapter = peft_model.active_adapter
        own = get_peft_model_state_dict(
            peft_model,
            state_dict=gather_adapter_state_dict(peft_model),
            adapter_name=adapter,
            save_embedding_layers=False,  # "auto" may ask the hub about the base model, on some ranks only
        )
        state = gather_stages(peft_model, {k: v.contiguous() for k, v in own.items()})
        main = is_main()

        def write() -> None:
            with publish_directory(save_directory) as tmp:
                config = copy.deepcopy(peft_model.peft_config[adapter])
                config.inference_mode = True  # as PEFT's own save writes it
                if config.base_model_name_or_path is None:
                    config.base_model_name_or_path = getattr(peft_model.get_base_model().config, "name_or_path", None)
                config.save_pretrained(tmp)
                save_file(state, os.path.join(tmp, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})

        run_on_main_and_share_failure(write, is_main=main)

    install(peft_model, "save_pretrained", save_pretrained, owner=peft_model)


def _gather_base_state(
    peft_model: nn.Module, *, keep: bool
) -> tuple[dict[str, nn.Module], dict[str, Any], dict[str, str]]:
    """The LoRA layers of the base model, its state dict whole on the CPU where ``keep`` (empty elsewhere), and the
    names under which a tensor is seen again (tied weights: ``{"lm_head.weight": "model.embed_tokens.weight"}``),
    gathered once. Every rank must call it (gathering a shard is a collective); what can be wrong is checked before,
    on every rank (under pipeline parallelism each rank checks its stages' layers, and every rank raises the first
    problem found)."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    if pipeline_runner(peft_model) is None:
        check_mergeable(layers)
    else:
        on_every_rank(lambda: check_mergeable(layers), what="save_merged")
    full: dict[str, Any] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in base.state_dict(keep_vars=True).items():  # `keep_vars`: one object under each tied name
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        whole = whole_tensor(tensor, keep=keep)  # a collective: one tensor at a time, in slices
        if keep:
            full[name] = whole
    return layers, full, aliases


def _merge(layers: dict[str, nn.Module], full: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """The active adapters merged (:func:`merged_weight`), under the base model's own names (what
    ``merge_and_unload`` gives); inactive adapters are left out, as ``merge_and_unload`` drops them. A tied name holds
    the very tensor of the name it is tied to, so that Transformers writes it once, as its own ``save_pretrained``;
    merging an adapter into one of them unties them."""
    for alias, source in aliases.items():
        full[alias] = full[source]
    for name, layer in layers.items():
        adapters = {key: full.pop(f"{name}.{key}") for key in adapter_keys(layer)}
        key = f"{name}.base_layer.weight"
        full[key] = merged_weight(layer, base_weight=full[key], adapters=adapters)
    return {k.replace(".base_layer.", "."): v for k, v in full.items() if ".lora_" not in k}


def save_merged(peft_model: nn.Module, directory: str | os.PathLike, **save_kwargs: Any) -> None:
    """Write the model with its LoRA adapters merged (:func:`merged_weight`: PEFT's own delta, ``Conv1D`` included)
    as a standard Transformers directory (``config.json``, safetensors), loadable with
    ``AutoModelForCausalLM.from_pretrained`` on one process, without changing the sharded model that keeps training.
    Call it on every rank: they gather one tensor at a time; rank 0 merges and writes (under pipeline parallelism each
    rank merges its stages' and rank 0 gathers the merged tensors), and a failure raises on every rank.

    Args:
        peft_model: a sharded ``PeftModel`` with LoRA adapters (the strategy's, or one ``parallelize`` sharded).
        directory: where to write (files of this package's earlier saves there are replaced, nothing else removed).
        **save_kwargs: passed to Transformers' ``save_pretrained`` (``safe_serialization``, ``max_shard_size``, ...).

    Raises:
        RuntimeError: not every rank called it (within :data:`~lightning_tp.checkpoint.publish.ARRIVAL_TIMEOUT`, or
            another rank exited or reached a barrier instead), or the write failed on rank 0.
        ValueError: an adapter cannot be merged.
    """
    arrive_together("`save_merged`")
    main = is_main()
    if pipeline_runner(peft_model) is not None:
        # Each rank merges its own stages' adapters into their base weights; the first rank gathers every stage's
        # merged tensors, one at a time.
        layers, full, aliases = _gather_base_state(peft_model, keep=True)
        merged = gather_stages(peft_model, on_every_rank(lambda: _merge(layers, full, aliases), what="save_merged"))
    else:
        layers, full, aliases = _gather_base_state(peft_model, keep=main)
        merged = None

    def write() -> None:
        state = merged if merged is not None else _merge(layers, full, aliases)
        with publish_directory(directory) as tmp:
            peft_model.get_base_model().save_pretrained(tmp, state_dict=state, is_main_process=True, **save_kwargs)

    run_on_main_and_share_failure(write, is_main=main)
