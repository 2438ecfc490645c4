"""``python -m lightning_tp.export CHECKPOINT OUT_DIR [--merge] [--dtype bfloat16] [--max-shard-size 5GB]``: turn a
checkpoint of ``TensorParallelStrategy`` (a distributed checkpoint directory, or the single file written with
``save_distributed_checkpoint=False``) into a standard Transformers directory (``config.json``, safetensors shards,
tokenizer), or, for a LoRA run, a PEFT adapter directory (``--merge``: the merged model).

Tensors stream one at a time, from the checkpoint to the output files: memory stays about one tensor, not the model.
What the tensors are (architecture, config, adapters, names) comes from the ``"lightning_tp"`` entry the strategy
writes into Lightning's checkpoint (`discovery.describe_models`); the model is rebuilt from it on the meta device
only to learn names, shapes, tied weights and LoRA scalings, never to hold weights.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import struct
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_tp import remote
from lightning_tp.checkpoint import (
    DCP_INDEX,
    META_FILENAME,
    MODEL_KEY,
    MODELS_KEY,
    UntrustedCheckpointError,
    index_reader,
    load_torch_file,
    publish_directory,
)
from lightning_tp.compat import keys_to_ignore_on_save, remove_tied_weights_from_state_dict, revert_weight_conversion
from lightning_tp.discovery import FORMAT_VERSION, name_prefix

_DCP_PREFIX = f"{MODEL_KEY}."
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


# ---------------------------------------------------------------------------------------------------------------------
# Reading checkpoints one tensor at a time


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class _DcpCheckpoint:
    """A distributed checkpoint directory: each tensor is read alone, whatever the layout it was saved with."""

    def __init__(self, path: Path | str, *, trust: bool):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # Never runs code from the index; reads it once. A URL's data directory (checked by `remote.resolve`) reads
        # through fsspec.
        self.reader = remote.dcp_reader(path) if remote.is_url(path) else index_reader(path)
        items = self.reader.read_metadata().state_dict_metadata.items()
        self.specs = {
            key.removeprefix(_DCP_PREFIX): _Spec(tuple(md.size), md.properties.dtype)
            for key, md in items
            if key.startswith(_DCP_PREFIX) and isinstance(md, TensorStorageMetadata)
        }
        if remote.is_url(path):
            self.meta = _load_meta(remote.join(path, META_FILENAME), trust=trust)
        else:
            self.meta = _load_meta(path / META_FILENAME, trust=trust) if (path / META_FILENAME).is_file() else {}

    def read(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        spec = self.specs[key]
        tensor = torch.empty(spec.shape, dtype=spec.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load({_DCP_PREFIX + key: tensor}, storage_reader=self.reader, no_dist=True)
        return tensor


class _FileCheckpoint:
    """A single-file checkpoint (``save_distributed_checkpoint=False``), memory-mapped: tensors are paged in as
    they are written out."""

    def __init__(self, path: Path | str, *, trust: bool):
        try:
            self.meta = _load_meta(path, mmap=not remote.is_url(path), trust=trust)
        except UntrustedCheckpointError:
            raise
        except Exception as err:  # not a torch file, or torch's legacy format (which cannot be memory-mapped)
            raise ValueError(f"{path} is not a checkpoint torch.load can memory-map: {err}") from err
        state = self.meta.pop(MODEL_KEY, None) if isinstance(self.meta, dict) else None
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds no {MODEL_KEY!r}: it is not a Lightning checkpoint.")
        self.state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.specs = {k: _Spec(tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.state[key]


class _SafetensorsDirectory:
    """Base weights from a Transformers directory (``--base``), read one tensor at a time."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--base {path}: no *.safetensors files there (a Transformers model directory is needed).")
        self.files: dict[str, Path] = {}
        self.specs: dict[str, _Spec] = {}
        dtypes = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    self.files[key] = file
                    self.specs[key] = _Spec(tuple(part.get_shape()), dtypes[part.get_dtype()])

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            return f.get_tensor(key)


_TRUST_OPT_IN = "pass `--trust-checkpoint` (`trust_checkpoint=True` in `export_checkpoint`)"


def _load_meta(path: Path | str, *, trust: bool, mmap: bool = False) -> dict[str, Any]:
    if remote.is_url(path):  # read whole into memory: a URL cannot be memory-mapped
        path = io.BytesIO(remote.read_bytes(path))
    # Tensors and plain values only, unless trusted: hyper-parameters of other types are the user's opt-in.
    return load_torch_file(path, weights_only=not trust, opt_in=_TRUST_OPT_IN, mmap=mmap)


def _open_checkpoint(path: Path | str, *, trust: bool) -> _DcpCheckpoint | _FileCheckpoint:
    if remote.is_url(path):
        kind, data = remote.resolve(path)  # a directory without its commit marker is incomplete
        return _DcpCheckpoint(data, trust=trust) if kind == "directory" else _FileCheckpoint(data, trust=trust)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if path.is_dir():
        if not (path / DCP_INDEX).is_file():
            raise ValueError(
                f"{path} is a directory but not a distributed checkpoint (no .metadata file): pass the directory "
                "Lightning's ModelCheckpoint wrote, or a single-file checkpoint."
            )
        return _DcpCheckpoint(path, trust=trust)
    return _FileCheckpoint(path, trust=trust)


def _select_model(meta: dict[str, Any], model_prefix: str | None, *, path: Path) -> dict[str, Any]:
    """The entry of the model to export, from the ``"lightning_tp"`` entry of the checkpoint."""
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

    values = dict(entry["config"])
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


@dataclass
class _Item:
    name: str
    spec: _Spec
    load: Callable[[], torch.Tensor]


class _Sources:
    """The checkpoint, and the base directory for what it does not hold; names relative to the LightningModule for
    the checkpoint, the Transformers model's own for the base directory."""

    def __init__(self, checkpoint: _DcpCheckpoint | _FileCheckpoint, base: _SafetensorsDirectory | None):
        self.checkpoint = checkpoint
        self.base = base
        self.missing: list[str] = []

    def item(self, name: str, key: str, *, dtype: torch.dtype | None) -> _Item | None:
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
        return _Item(name, _Spec(spec.shape, cast or spec.dtype), lambda: _cast(source.read(source_key), cast))

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


def _check_shapes(items: list[_Item], shapes: dict[str, torch.Tensor]) -> None:
    wrong = [(i.name, i.spec.shape, tuple(shapes[i.name].shape)) for i in items if i.spec.shape != shapes[i.name].shape]
    if wrong:
        raise ValueError(f"Tensor shapes differ from the model's config (name, checkpoint, config): {wrong[:4]}")


def _merged_items(entry: dict[str, Any], peft_model: nn.Module, plain: nn.Module, sources: _Sources, *, dtype):
    """A LoRA run merged: ``W + scaling * delta`` per adapted weight, computed by PEFT's own ``get_delta_weight``
    on that one layer (``fan_in_fan_out``, embeddings, rsLoRA and rank/alpha patterns included)."""
    from peft.tuners.lora import LoraLayer

    inner = entry["prefix"] + entry["peft"]["prefix_in_model"]
    base_model = peft_model.get_base_model()
    layers = {n: m for n, m in base_model.named_modules() if isinstance(m, LoraLayer)}
    _check_mergeable(layers)
    items = []
    for name in _saved_names(plain):
        module, _, param = name.rpartition(".")
        layer = layers.get(module)
        key = f"{module}.base_layer.{param}" if layer is not None else name
        item = sources.item(name, inner + key, dtype=dtype)
        if item is not None and layer is not None and param == "weight":
            item = _merged_item(item, layer, _adapter_keys(layer, prefix=f"{inner}{module}."), sources.checkpoint)
        items.append(item)
    sources.check_complete(what="the merged model")
    _check_shapes(items, dict(plain.state_dict()))
    return items


def _check_mergeable(layers: dict[str, nn.Module]) -> None:
    from transformers.pytorch_utils import Conv1D  # GPT-2's transposed linear: LoRA with fan_in_fan_out

    bad = [n for n, m in layers.items() if not isinstance(m.get_base_layer(), (nn.Linear, nn.Embedding, Conv1D))]
    bad += [n for n, m in layers.items() if any(m.use_dora.values()) or any(getattr(m, "lora_bias", {}).values())]
    if bad:
        raise ValueError(f"Cannot merge the adapters of {bad[:4]}: plain LoRA on linear, Conv1D and embedding layers.")


def _adapter_keys(layer: nn.Module, *, prefix: str) -> dict[str, str]:
    """The checkpoint key of each tensor of the active adapters of ``layer`` (keys of its own state dict)."""
    active = set(layer.active_adapters)
    keys = [key.split(".") for key in layer.state_dict()]  # e.g. lora_A.default.weight, lora_embedding_B.default
    return {".".join(k): prefix + ".".join(k) for k in keys if k[0].startswith("lora_") and k[1] in active}


def _merged_item(item: _Item, layer: nn.Module, keys: dict[str, str], checkpoint: Any) -> _Item:
    missing = [key for key in keys.values() if key not in checkpoint.specs]
    if missing:
        raise ValueError(f"The checkpoint does not hold the adapter tensors {missing[:4]}: nothing to merge.")

    def load() -> torch.Tensor:
        base = item.load()
        # Give the meta layer this adapter's tensors for PEFT's delta, in fp32 like PEFT merges on the CPU, then
        # send it back to the meta device so no adapter stays in memory.
        adapters = {local: checkpoint.read(key).float() for local, key in keys.items()}
        layer.load_state_dict(adapters, strict=False, assign=True)
        try:
            with torch.no_grad():
                merged = base.float()
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                        merged = merged + layer.get_delta_weight(adapter)
        finally:
            layer.to("meta")
        return merged.to(item.spec.dtype)

    return _Item(item.name, item.spec, load)


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
# Writing


def _write_safetensors(path: Path, items: list[_Item]) -> None:
    """Write ``items`` in the safetensors format, one tensor in memory at a time.

    ``safetensors.torch.save_file`` needs every tensor of the file in memory at once (it has no incremental writer),
    so the format is written here: an 8-byte little-endian header length, a JSON header (dtype, shape and byte
    offsets of each tensor, padded with spaces to 8 bytes), then the raw bytes. Shapes and dtypes are known before any
    tensor is read. Tensors are ordered as safetensors orders them (wider dtypes first, then by name), which keeps
    each tensor aligned to its element size."""
    ordered = sorted(items, key=lambda i: (-i.spec.dtype.itemsize, i.name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in ordered:
        size = _nbytes(item.spec)
        header[item.name] = {
            "dtype": _SAFETENSORS_DTYPES[item.spec.dtype],
            "shape": list(item.spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for item in ordered:
            f.write(_raw_bytes(item))  # the tensor is freed before the next one is read


def _raw_bytes(item: _Item) -> memoryview:
    tensor = item.load()
    if tuple(tensor.shape) != item.spec.shape or tensor.dtype != item.spec.dtype:
        raise RuntimeError(f"{item.name}: read {tensor.dtype} {list(tensor.shape)}, expected {item.spec}")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _nbytes(spec: _Spec) -> int:
    numel = 1
    for size in spec.shape:
        numel *= size
    return numel * spec.dtype.itemsize


def _write_weights(directory: Path, items: list[_Item], *, max_shard_size: int | str, total_parameters: int) -> None:
    """``model.safetensors``, or shards and ``model.safetensors.index.json``, split as Transformers splits them."""
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {item.name: item for item in items}
    shapes = {i.name: torch.empty(i.spec.shape, dtype=i.spec.dtype, device="meta") for i in items}
    split = split_torch_state_dict_into_shards(
        shapes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        _write_safetensors(directory / filename, [by_name[n] for n in names])
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / "model.safetensors.index.json").write_text(text, encoding="utf-8")


def _write_configs(directory: Path, entry: dict[str, Any], *, dtype: torch.dtype) -> None:
    from transformers import GenerationConfig

    _config(entry, dtype=dtype).save_pretrained(directory)
    if entry.get("generation_config") is not None:
        GenerationConfig.from_dict(entry["generation_config"]).save_pretrained(directory)


def _write_adapter(directory: Path, peft_model: nn.Module, adapter: str, items: list[_Item]) -> None:
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
    _write_safetensors(target / "adapter_model.safetensors", items)


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
    path = checkpoint if remote.is_url(checkpoint) else Path(checkpoint)
    cast = _dtype(dtype)
    if not remote.is_url(path) and Path(out_dir).resolve() == path.resolve():
        raise ValueError(f"The output directory {out_dir} is the checkpoint itself: export to another directory.")
    source = _open_checkpoint(path, trust=trust_checkpoint)
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
        return _SafetensorsDirectory(Path(base))
    source = entry.get("source")
    if needed and source and Path(source).is_dir() and list(Path(source).glob("*.safetensors")):
        return _SafetensorsDirectory(Path(source))
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
    _write_weights(directory, items, max_shard_size=max_shard_size, total_parameters=model.num_parameters())


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
