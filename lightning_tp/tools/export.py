"""``python -m lightning_tp.export CHECKPOINT OUT_DIR [--merge] [--dtype bfloat16] [--max-shard-size 5GB]``: turn a
checkpoint of ``TensorParallelStrategy`` (a distributed checkpoint directory, or the single file written with
``save_distributed_checkpoint=False``) into a standard Transformers directory (``config.json``, safetensors shards,
tokenizer), or, for a LoRA run, a PEFT adapter directory (``--merge``: the merged model).

Tensors stream one at a time, from the checkpoint (:mod:`lightning_tp.checkpoint.readers`) to the output files
(:mod:`lightning_tp.checkpoint.safetensors`): memory stays about one tensor, not the model. What the tensors are
(architecture, config, adapters, names) comes from the ``MODELS_KEY`` entry the strategy writes into Lightning's
checkpoint (`discovery.describe_models`); the model is rebuilt from it on the meta device only to learn names, shapes,
tied weights and LoRA scalings, never to hold weights. This module is that orchestration: rebuild, names, merge
(:func:`lightning_tp.parallel.lora.merged_weight`), write; and the command line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_tp.checkpoint import remote
from lightning_tp.checkpoint.format import MODELS_KEY
from lightning_tp.checkpoint.publish import publish_directory
from lightning_tp.checkpoint.readers import DcpCheckpoint, FileCheckpoint, SafetensorsDirectory, open_checkpoint
from lightning_tp.checkpoint.safetensors import Item, Spec, write_safetensors, write_weights
from lightning_tp.compat import (
    decode_config_floats,
    keys_to_ignore_on_save,
    remove_tied_weights_from_state_dict,
    revert_weight_conversion,
)
from lightning_tp.parallel.lora import adapter_keys, check_mergeable, merged_weight
from lightning_tp.plans.discovery import FORMAT_VERSION, name_prefix

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------------
# The model to export, from the checkpoint's entry


def _select_model(meta: dict[str, Any], model_prefix: str | None, *, path: Path) -> dict[str, Any]:
    """The entry of the model to export, from the ``MODELS_KEY`` entry of the checkpoint."""
    entry = meta.get(MODELS_KEY)
    if not entry:
        raise ValueError(
            f"{path} has no {MODELS_KEY!r} entry: it was not written by TensorParallelStrategy, and the model's "
            "config and its prefix in the state dict (`--model-prefix`) cannot be guessed from the tensors. Export "
            "checkpoints written by TensorParallelStrategy, or load this one in your LightningModule and call "
            "`save_pretrained`."
        )
    if entry.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: {MODELS_KEY!r} entry of format {entry.get('format_version')}, not {FORMAT_VERSION}.")
    models = entry["models"]
    prefixes = [m["prefix"] for m in models]
    if model_prefix is not None:
        wanted = name_prefix(model_prefix.removesuffix("."))
        models = [m for m in models if m["prefix"] == wanted]
        if not models:
            raise ValueError(f"--model-prefix {model_prefix!r} matches no model of {path}; its models: {prefixes}.")
    if len(models) != 1:
        raise ValueError(
            f"{path} holds {len(models)} Transformers models, with prefixes {prefixes}: pass `--model-prefix` "
            "(`model_prefix=`) to choose one."
        )
    return models[0]


# ---------------------------------------------------------------------------------------------------------------------
# The model, rebuilt on the meta device from the entry (names, shapes, tied weights, LoRA layers; no memory)


def _config(entry: dict[str, Any], *, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig

    values = decode_config_floats(dict(entry["config"]))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.architectures = [entry["architecture"]]
    config.dtype = str(dtype).removeprefix("torch.")
    return config


def _model_class(entry: dict[str, Any]) -> type:
    import transformers

    cls = getattr(transformers, entry["architecture"], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):  # the checkpoint names it
        raise ValueError(
            f"{entry['architecture']} is not a class of Transformers {transformers.__version__} (remote code?): "
            "export rebuilds the model from Transformers' own classes."
        )
    return cls


def _check_entry(entry: dict[str, Any]) -> None:
    """What the checkpoint names that export builds or writes from, checked before anything is written."""
    _model_class(entry)
    for name in (entry.get("peft") or {}).get("adapters", {}):
        _check_adapter_name(name)


def _meta_model(entry: dict[str, Any]) -> nn.Module:
    with torch.device("meta"):
        return _model_class(entry)(_config(entry, dtype=torch.float32))


def _meta_peft_model(entry: dict[str, Any]) -> nn.Module:
    from peft import PeftConfig, get_peft_model

    info = entry["peft"]
    configs = {name: PeftConfig.from_peft_type(**values) for name, values in info["adapters"].items()}
    names = list(configs)
    with warnings.catch_warnings():  # PEFT warns about meta weights and unset base paths; there are no weights here
        warnings.simplefilter("ignore")
        model = get_peft_model(_meta_model(entry), configs[names[0]], adapter_name=names[0], low_cpu_mem_usage=True)
        for name in names[1:]:
            model.add_adapter(name, configs[name], low_cpu_mem_usage=True)
        model.base_model.set_adapter(info["active_adapters"])
    return model


def _check_adapter_name(name: Any) -> None:
    """Adapter names come from the checkpoint and become directory names (PEFT writes adapter ``X`` into ``X/``):
    nothing may lead out of the output directory."""
    if not isinstance(name, str) or not re.fullmatch(r"[^/\\\x00]+", name) or name in (".", "..") or ":" in name:
        raise ValueError(
            f"The checkpoint names a LoRA adapter {name!r}: adapter names become directory names, so a name with a "
            "path separator, '..' or a drive is refused. Rename the adapter in the training script."
        )


def _saved_names(model: nn.Module) -> list[str]:
    """The state-dict names ``save_pretrained`` writes, in its order: without ``_keys_to_ignore_on_save`` and
    without the tied copies (``lm_head.weight`` of a tied model)."""
    state = model.state_dict()  # meta tensors; tied ones are found through the model's parameters
    for key in keys_to_ignore_on_save(model):
        state.pop(key, None)
    return list(remove_tied_weights_from_state_dict(state, model))


def _converted_names(model: nn.Module, names: list[str]) -> bool:
    """Whether ``save_pretrained`` would rename the tensors back to an original layout (fused mixture-of-experts
    weights, say); export writes the model's own names, which Transformers loads as they are."""
    state = model.state_dict()
    reverted = revert_weight_conversion(model, {k: state[k] for k in names})
    return reverted is not None and set(reverted) != set(names)


# ---------------------------------------------------------------------------------------------------------------------
# What to write: one item per output tensor, read only when written


class _Sources:
    """The checkpoint, and the base directory for what it does not hold; names relative to the LightningModule for
    the checkpoint, the Transformers model's own for the base directory."""

    def __init__(self, checkpoint: DcpCheckpoint | FileCheckpoint, base: SafetensorsDirectory | None):
        self.checkpoint = checkpoint
        self.base = base
        self.missing: list[str] = []

    def item(self, name: str, key: str, *, dtype: torch.dtype | None) -> Item | None:
        """``name`` in the output, read from ``key`` in the checkpoint, else ``name`` in the base directory."""
        if key in self.checkpoint.specs:
            source, source_key = self.checkpoint, key
        elif self.base is not None and name in self.base.specs:
            source, source_key = self.base, name
        else:
            self.missing.append(key)
            return None
        spec = source.specs[source_key]
        cast = dtype if dtype is not None and spec.dtype.is_floating_point else None
        return Item(name, Spec(spec.shape, cast or spec.dtype), lambda: _cast(source.read(source_key), cast))

    def check_complete(self, *, what: str) -> None:
        if self.missing:
            raise ValueError(
                f"The checkpoint does not hold {len(self.missing)} tensor(s) that {what} needs, e.g. "
                f"{self.missing[:4]}, and no base directory provides them: pass `--base PATH` (`base=`), a "
                "Transformers directory with the base model's safetensors."
            )


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None else tensor.to(dtype)


def _full_items(entry: dict[str, Any], model: nn.Module, sources: _Sources, *, dtype: torch.dtype | None) -> list:
    """A fully fine-tuned model: each saved tensor as it is in the checkpoint."""
    shapes = dict(model.state_dict())
    items = [sources.item(name, entry["prefix"] + name, dtype=dtype) for name in _saved_names(model)]
    sources.check_complete(what="the model")
    _check_shapes(items, shapes)
    return items


def _check_shapes(items: list[Item], shapes: dict[str, torch.Tensor]) -> None:
    wrong = [(i.name, i.spec.shape, tuple(shapes[i.name].shape)) for i in items if i.spec.shape != shapes[i.name].shape]
    if wrong:
        raise ValueError(f"Tensor shapes differ from the model's config (name, checkpoint, config): {wrong[:4]}")


def _merged_items(entry: dict[str, Any], peft_model: nn.Module, plain: nn.Module, sources: _Sources, *, dtype):
    """A LoRA run merged: each adapted weight through :func:`lightning_tp.parallel.lora.merged_weight` (PEFT's own
    delta, as ``save_merged``), one weight in memory at a time."""
    from peft.tuners.lora import LoraLayer

    inner = entry["prefix"] + entry["peft"]["prefix_in_model"]
    base_model = peft_model.get_base_model()
    layers = {n: m for n, m in base_model.named_modules() if isinstance(m, LoraLayer)}
    check_mergeable(layers)
    items = []
    for name in _saved_names(plain):
        module, _, param = name.rpartition(".")
        layer = layers.get(module)
        key = f"{module}.base_layer.{param}" if layer is not None else name
        item = sources.item(name, inner + key, dtype=dtype)
        if item is not None and layer is not None and param == "weight":
            keys = {local: f"{inner}{module}.{local}" for local in adapter_keys(layer)}
            item = _merged_item(item, layer, keys, sources.checkpoint)
        items.append(item)
    sources.check_complete(what="the merged model")
    _check_shapes(items, dict(plain.state_dict()))
    return items


def _merged_item(item: Item, layer: nn.Module, keys: dict[str, str], checkpoint: Any) -> Item:
    missing = [key for key in keys.values() if key not in checkpoint.specs]
    if missing:
        raise ValueError(f"The checkpoint does not hold the adapter tensors {missing[:4]}: nothing to merge.")

    def load() -> torch.Tensor:
        # The meta layer gives the math; the adapter tensors are read now and freed after this one weight.
        adapters = {local: checkpoint.read(key) for local, key in keys.items()}
        return merged_weight(layer, base_weight=item.load(), adapters=adapters).to(item.spec.dtype)

    return Item(item.name, item.spec, load)


def _adapter_items(entry: dict[str, Any], peft_model: nn.Module, adapter: str, sources: _Sources, *, dtype):
    """One adapter in PEFT's file format, names chosen by PEFT's own ``get_peft_model_state_dict`` (adapter name
    removed; biases per ``bias=``)."""
    from peft.utils import get_peft_model_state_dict

    state = peft_model.state_dict()  # meta tensors: PEFT returns the same objects under its file names
    by_id = {id(tensor): key for key, tensor in state.items()}
    selected = get_peft_model_state_dict(
        peft_model, state_dict=state, adapter_name=adapter, save_embedding_layers=False
    )
    items = [sources.item(name, entry["prefix"] + by_id[id(t)], dtype=dtype) for name, t in selected.items()]
    sources.check_complete(what=f"adapter {adapter!r}")
    return items


# ---------------------------------------------------------------------------------------------------------------------
# Writing what is not a tensor file (tensor files: `lightning_tp.checkpoint.safetensors`)


def _write_configs(directory: Path, entry: dict[str, Any], *, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    _config(entry, dtype=dtype).save_pretrained(directory)
    if entry.get("generation_config") is not None:
        GenerationConfig.from_dict(entry["generation_config"]).save_pretrained(directory)


def _write_adapter(directory: Path, peft_model: nn.Module, adapter: str, items: list[Item]) -> None:
    """What ``PeftModel.save_pretrained`` writes for one adapter: ``adapter_config.json`` (inference mode),
    ``adapter_model.safetensors``; non-default adapters in a subdirectory named after them."""
    import copy

    target = directory if adapter == "default" else directory / adapter
    target.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(peft_model.peft_config[adapter])
    config.inference_mode = True
    mapping = None
    if config.task_type is None:  # PEFT records the base class then, to rebuild the model
        base_class = type(peft_model.get_base_model())
        mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    config.save_pretrained(str(target), auto_mapping_dict=mapping)
    write_safetensors(target / "adapter_model.safetensors", items=items)


def _tokenizer(name_or_path: str | os.PathLike | None, *, explicit: bool) -> Any:
    """The run's tokenizer from a local directory or the local hub cache (no download), or ``None``."""
    from transformers import AutoTokenizer

    if name_or_path is None:
        return None
    try:
        # Never code from the tokenizer's directory (its `auto_map`): the path may come from the checkpoint.
        return AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # any failure means "no tokenizer here"; an explicit one is an error
        if explicit:
            raise ValueError(f"--tokenizer {name_or_path}: cannot load a tokenizer ({type(err).__name__}).") from err
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Export


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    merge: bool = False,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer: str | os.PathLike | None = None,
    model_prefix: str | None = None,
    base: str | os.PathLike | None = None,
    trust_checkpoint: bool = False,
) -> Path:
    """Write a Transformers directory (or, for a LoRA run without ``merge``, a PEFT adapter directory) from a
    ``TensorParallelStrategy`` checkpoint, one tensor in memory at a time, published into ``out_dir`` only once
    complete.

    Args:
        checkpoint: A distributed checkpoint directory, or a single-file checkpoint; a path or an fsspec URL
            (``s3://...``: the filesystem's package, e.g. ``s3fs``, must be installed).
        out_dir: The directory to write; files already there that the export does not write are kept.
        merge: LoRA runs: write the model with the active adapters merged instead of the adapters.
        dtype: Cast floating tensors to this dtype (``"bfloat16"``, ``torch.float16``, ...).
        max_shard_size: Largest safetensors file, as Transformers' ``save_pretrained`` takes it.
        tokenizer: Tokenizer directory or cached hub id (default: the run's model source, when available).
        model_prefix: The model to export when the checkpoint holds several (its prefix, e.g. ``"model."``).
        base: Transformers directory with the base weights the checkpoint does not hold (LoRA runs that leave the
            frozen base out); default: the run's model source when it is a local directory.
        trust_checkpoint: Also unpickle objects other than tensors and plain values (custom hyper-parameter types).
            Unpickling them runs code the file names: only for checkpoints from a source you trust.
    """
    checkpoint = remote.local_path(checkpoint)  # a `file://` URL names a local checkpoint
    path = checkpoint if remote.is_url(checkpoint) else Path(checkpoint)
    cast = _dtype(dtype)
    if not remote.is_url(path) and Path(out_dir).resolve() == path.resolve():
        raise ValueError(f"The output directory {out_dir} is the checkpoint itself: export to another directory.")
    source = open_checkpoint(path, trust=trust_checkpoint)
    entry = _select_model(source.meta, model_prefix, path=path)
    _check_entry(entry)
    if merge and not entry.get("peft"):
        raise ValueError(f"--merge: the model {entry['prefix']!r} of {path} has no LoRA adapters; export it without.")
    sources = _Sources(source, _base_directory(base, entry, needed=bool(entry.get("peft")) and merge))
    found = _tokenizer(tokenizer or entry.get("source"), explicit=tokenizer is not None)
    with publish_directory(out_dir) as tmp:
        if entry.get("peft") and not merge:
            _export_adapters(Path(tmp), entry, sources, dtype=cast)
        else:
            _export_model(Path(tmp), entry, sources, dtype=cast, max_shard_size=max_shard_size, merge=merge)
        if found is not None:
            found.save_pretrained(tmp)
        written = {p.name for p in Path(tmp).iterdir()}
    _remove_stale_weights(Path(out_dir), written)
    if found is None:
        print("No tokenizer written: the run's model source is unknown or not cached; pass --tokenizer to add one.")
    return Path(out_dir)


def _remove_stale_weights(directory: Path, written: set[str]) -> None:
    """Weight files of an earlier export into ``directory`` that this one did not replace (``model.safetensors``
    after a sharded export, or shards beyond the new count): Transformers would load them instead of, or with, ours."""
    if not written & {"model.safetensors", "model.safetensors.index.json"}:
        return  # an adapter export: a model directory's weights may lie next to it on purpose
    stale = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
    for file in directory.iterdir():
        if file.name not in written and stale.fullmatch(file.name):
            file.unlink()


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(_DTYPES)}.")
    return _DTYPES[dtype]


def _base_directory(base: str | os.PathLike | None, entry: dict[str, Any], *, needed: bool):
    if base is not None:
        if not Path(base).is_dir():
            raise FileNotFoundError(f"--base {base} is not a directory.")
        return SafetensorsDirectory(Path(base))
    source = entry.get("source")
    if needed and source and Path(source).is_dir() and list(Path(source).glob("*.safetensors")):
        return SafetensorsDirectory(Path(source))
    return None


def _export_model(directory: Path, entry: dict[str, Any], sources: _Sources, *, dtype, max_shard_size, merge) -> None:
    model = _meta_model(entry)
    if merge:
        items = _merged_items(entry, _meta_peft_model(entry), model, sources, dtype=dtype)
    else:
        items = _full_items(entry, model, sources, dtype=dtype)
    if _converted_names(model, [i.name for i in items]):
        print("Tensors keep the model's own names (Transformers loads them; save_pretrained would rename them).")
    floating = [i.spec.dtype for i in items if i.spec.dtype.is_floating_point]
    _write_configs(directory, entry, dtype=dtype or (floating[0] if floating else torch.float32))
    write_weights(directory, items=items, max_shard_size=max_shard_size, total_parameters=model.num_parameters())


def _export_adapters(directory: Path, entry: dict[str, Any], sources: _Sources, *, dtype) -> None:
    model = _meta_peft_model(entry)
    model.create_or_update_model_card(str(directory))
    for adapter in model.peft_config:
        _write_adapter(directory, model, adapter, _adapter_items(entry, model, adapter, sources, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_tp.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a distributed checkpoint directory, or a single-file checkpoint (a path or an fsspec URL)"
    )
    parser.add_argument("out_dir", help="the Transformers (or PEFT adapter) directory to write")
    parser.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapters into the model")
    parser.add_argument("--dtype", choices=list(_DTYPES), default=None, help="cast floating tensors")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file: 5GB, 500MB, bytes")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or cached hub id")
    parser.add_argument("--model-prefix", default=None, help="the model to export, e.g. 'model.'")
    parser.add_argument("--base", default=None, help="Transformers directory with base weights the checkpoint lacks")
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="also unpickle objects other than tensors and plain values: runs code the file names; trusted files only",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out_dir,
            merge=args.merge,
            dtype=args.dtype,
            max_shard_size=int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size,
            tokenizer=args.tokenizer,
            model_prefix=args.model_prefix,
            base=args.base,
            trust_checkpoint=args.trust_checkpoint,
        )
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"Exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
