"""Pretrained weights loaded already sharded: the model is built on the meta device, sharded (TP, then FSDP2), and
only then materialised, each rank reading its own slices of the safetensors files.

Reading goes through torch's distributed checkpointing with its Hugging Face safetensors reader
(``HuggingFaceStorageReader``): it plans, for every DTensor whatever its placements (TP, FSDP2, both), the slices a
rank owns, and reads only those bytes. Transformers then initialises what no file holds (non-persistent buffers such
as rotary ``inv_freq``, which ``to_empty`` leaves as garbage and which would otherwise train silently wrong).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_tp.checkpoint.dcp_layouts import load_in_place
from lightning_tp.compat import distributed_is_initialized, mark_hf_initialized, revert_weight_conversion
from lightning_tp.parallel.random_init import (
    initialize_transformers_weights,
    random_state_of_rank_zero,
    whole_parameters,
)
from lightning_tp.parallel.tensor_parallel import retie

#: Attribute set on a meta model by :func:`from_pretrained`: the directory of its safetensors files.
CHECKPOINT_ATTR = "_lightning_tp_checkpoint"
#: Set beside it: the files' names of tensors they hold under another name (see :func:`_checkpoint_names`), found
#: while the model is still its own class (FSDP2 renames the class of each unit, which Transformers' lookup needs).
CHECKPOINT_NAMES_ATTR = "_lightning_tp_checkpoint_names"


def from_pretrained(
    name_or_path: str | os.PathLike,
    *,
    model_class: Any = None,
    dtype: str | torch.dtype = "auto",
    revision: str | None = None,
    **config_kwargs: Any,
) -> nn.Module:
    """Build a Transformers model on the meta device (no memory for weights) that the strategy loads after sharding.

    Use it in ``configure_model`` where you would call ``AutoModelForCausalLM.from_pretrained``::

        def configure_model(self):
            if self.model is None:
                self.model = lightning_tp.from_pretrained("Qwen/Qwen3-0.6B", dtype=torch.bfloat16)

    Args:
        name_or_path: A local directory with ``config.json`` and ``*.safetensors`` files, or a hub id (downloaded
            once with ``huggingface_hub``, like Transformers does).
        model_class: A Transformers model class or auto class (default ``AutoModelForCausalLM``, or
            ``AutoModelForImageTextToText`` for a config the former does not take).
        dtype: ``"auto"`` takes the checkpoint's dtype from its config (as Transformers does), or a torch dtype.
        revision: Hub revision.
        config_kwargs: Overrides for the config, e.g. ``attn_implementation="sdpa"``.

    Raises:
        ValueError: the folder holds no safetensors files (the message says how to convert it); Transformers' own
            errors (no config, an unknown architecture) are raised as Transformers raises them.
    """
    from transformers import AutoConfig

    path = _local_directory(name_or_path, revision)
    if not list(path.glob("*.safetensors")):
        raise ValueError(
            f"{name_or_path}: no *.safetensors files in {path}. lightning_tp loads safetensors only; convert the "
            "checkpoint with `model.save_pretrained(dir)` (safe_serialization is the default)."
        )
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype) if model_class else model_from_config(config, dtype=dtype)
    setattr(model, CHECKPOINT_ATTR, str(path))
    setattr(model, CHECKPOINT_NAMES_ATTR, _checkpoint_names(model, model.state_dict(), checkpoint_keys(path)))
    return model


def model_from_config(config: Any, **kwargs: Any) -> nn.Module:
    """A model with its head for ``config``: a causal LM, else an image-text-to-text model (a vision-language model
    whose config ``AutoModelForCausalLM`` does not take, such as Qwen2.5-VL's or LLaVA's)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as causal_lm_error:  # "Unrecognized configuration class ..."
        try:
            return AutoModelForImageTextToText.from_config(config, **kwargs)
        except ValueError:
            raise causal_lm_error from None


def _local_directory(name_or_path: str | os.PathLike, revision: str | None) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    def download(**kwargs: Any) -> Path:
        return Path(snapshot_download(str(name_or_path), revision=revision, allow_patterns=_HUB_FILES, **kwargs))

    if not distributed_is_initialized():
        return download()
    # One process per node downloads (the cache may not be shared between nodes), and every rank learns whether all of
    # them succeeded: a download failing on one rank raises on every rank instead of leaving the others waiting in the
    # strategy's first collective.
    error = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        try:
            download()
        except Exception as err:  # reported to every rank below
            error = f"{type(err).__name__}: {err}"
    errors: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise OSError(f"Downloading {name_or_path!r} failed on rank {failed[0][0]}: {failed[0][1]}")
    return download(local_files_only=True)


_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]


def checkpoint_keys(directory: str | os.PathLike) -> set[str]:
    """The tensor names in a directory's safetensors files (from the index when there is one)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def load_sharded(model: nn.Module, directory: str | os.PathLike) -> set[str]:
    """Fill ``model``'s (sharded, materialised) parameters and persistent buffers from the safetensors files in
    ``directory``, each rank reading only its slices. Returns the names loaded. Every rank must call it.

    Args:
        model: the parallelised model, materialised (its sharded parameters allocated).
        directory: a folder of safetensors files (a Transformers checkpoint, or one ``save_pretrained`` wrote).

    Raises:
        ValueError: the checkpoint lacks tensors the model holds, or a tensor's shape differs (named, with the fix).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    available = checkpoint_keys(directory)
    state = _unique_state_dict(model, prefer=available)
    # PEFT applied to the meta model: base weights sit under `<layer>.base_layer.` and the adapters (initialised by
    # PEFT after loading) are in no base checkpoint.
    state = {_base_name(name): t for name, t in state.items() if not _is_adapter(name)}
    in_file = getattr(model, CHECKPOINT_NAMES_ATTR, None)
    if in_file is None:
        in_file = _checkpoint_names(model, state, available)
    missing = sorted(name for name in state if in_file.get(name, name) not in available)
    if missing:
        raise ValueError(
            f"{type(model).__name__}: the checkpoint in {directory} has no tensors named {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all). Its names differ from the model's "
            "(Transformers converts some checkpoints while loading, e.g. per-expert MoE weights); load this one with "
            "`AutoModelForCausalLM.from_pretrained` instead of `lightning_tp.from_pretrained`."
        )
    renamed = {in_file.get(name, name): tensor for name, tensor in state.items()}
    load_in_place(renamed, lambda tensors: dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory))))
    return set(state)


def _checkpoint_names(model: nn.Module, state: dict[str, torch.Tensor], available: set[str]) -> dict[str, str]:
    """The file's name of each tensor the file holds under another name: ``save_pretrained`` writes some models
    under their original layout's names (a vision-language model's ``model.language_model.layers.0...`` as
    ``model.layers.0...`` or ``language_model.model.layers.0...``), which Transformers renames while loading. Only
    plain renames (one tensor to one) are taken; a conversion that splits or fuses tensors stays missing."""
    elsewhere = {name: tensor for name, tensor in state.items() if name not in available}
    reverted = revert_weight_conversion(model, elsewhere) if elsewhere else None
    if not reverted:
        return {}
    # A renamed tensor comes back as itself; a split or fused one as new tensors, found under no name here.
    file_names = {id(tensor): name for name, tensor in reverted.items() if name in available}
    return {name: file_names[id(t)] for name, t in elsewhere.items() if id(t) in file_names}


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def _unique_state_dict(model: nn.Module, *, prefer: set[str]) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers with each shared tensor once, as checkpoints store them: under
    a name in ``prefer`` where one of its names is, else under its first name. Loading writes into these tensors."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    state = {}
    for key, aliases in names.items():
        name = next((n for n in aliases if _base_name(n) in prefer), aliases[0])
        state[name] = tensors[key]
    return state


def materialize(model: nn.Module, device: torch.device, *, tied: dict[str, str]) -> None:
    """Allocate a meta (and already sharded) Transformers model on ``device``, load its checkpoint when it came from
    :func:`from_pretrained`, and let Transformers initialise everything else (all of it without a checkpoint).

    Random weights are drawn whole from rank 0's generator state and sliced (see
    :mod:`lightning_tp.parallel.random_init`): the model equals one process that ran Transformers'
    ``initialize_weights`` on the same meta model. Every rank must call it (one broadcast of the generator state)."""
    model.to_empty(device=device)
    retie(model, tied)
    directory = getattr(model, CHECKPOINT_ATTR, None)
    loaded = load_sharded(model, directory) if directory is not None else set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if _base_name(name) in loaded and not _is_adapter(name):
            mark_hf_initialized(tensor)  # Transformers' initialisation skips what is marked
    if hasattr(model, "initialize_weights"):
        with random_state_of_rank_zero(device):
            initialize_transformers_weights(model)


def materialize_modules(module: nn.Module, device: torch.device) -> None:
    """Lightning's materialisation of meta modules (``to_empty`` on the root, then each submodule's
    ``reset_parameters``), with each submodule's sharded parameters whole while it resets, drawn from rank 0's
    generator state (see :mod:`lightning_tp.parallel.random_init`): the shards of a plain ``nn.Linear`` built on meta
    are the slices of the one matrix a single process draws. Every rank must call it."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to_empty(device=device)  # on the root: FSDP2 re-registers its sharded parameters there
    uninitialized = set()
    with random_state_of_rank_zero(device):
        for submodule in module.modules():
            own = itertools.chain(submodule.parameters(recurse=False), submodule.buffers(recurse=False))
            if next(own, None) is None:
                continue
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                with whole_parameters([submodule]):
                    reset()
            else:
                uninitialized.add(type(submodule).__name__)
    if uninitialized:
        rank_zero_warn(
            "Parameter initialization incomplete: these modules have parameters or buffers left as uninitialized "
            f"memory because they define no `reset_parameters()`: {', '.join(sorted(uninitialized))}."
        )
