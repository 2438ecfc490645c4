"""The safetensors format, written one tensor in memory at a time (:func:`write_safetensors`), and a model's weights
split into shards as Transformers splits them (:func:`write_weights`).

Written by hand because safetensors 0.8's ``serialize_file`` (and ``save_file`` over it) takes a pointer to every
tensor of the file at once, all alive for the whole call: no installed library writes one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: torch dtypes and their names in a safetensors header.
SAFETENSORS_DTYPES = {
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


@dataclass(frozen=True)
class Spec:
    """A tensor's shape and dtype, known before it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Item:
    """One tensor to write: its name, what it will be, and how to read it (called only when it is written)."""

    name: str
    spec: Spec
    load: Callable[[], torch.Tensor]


def write_safetensors(path: Path, *, items: list[Item]) -> None:
    """Write ``items`` in the safetensors format, one tensor in memory at a time.

    ``safetensors.torch.save_file`` needs every tensor of the file in memory at once (see the module docstring), so
    the format is written here: an 8-byte little-endian header length, a JSON header (dtype, shape and byte
    offsets of each tensor, padded with spaces to 8 bytes), then the raw bytes. Shapes and dtypes are known before any
    tensor is read. Tensors are ordered as safetensors orders them (wider dtypes first, then by name), which keeps
    each tensor aligned to its element size."""
    ordered = sorted(items, key=lambda i: (-i.spec.dtype.itemsize, i.name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in ordered:
        size = _nbytes(item.spec)
        header[item.name] = {
            "dtype": SAFETENSORS_DTYPES[item.spec.dtype],
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


def _raw_bytes(item: Item) -> memoryview:
    tensor = item.load()
    if tuple(tensor.shape) != item.spec.shape or tensor.dtype != item.spec.dtype:
        raise RuntimeError(f"{item.name}: read {tensor.dtype} {list(tensor.shape)}, expected {item.spec}")
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _nbytes(spec: Spec) -> int:
    numel = 1
    for size in spec.shape:
        numel *= size
    return numel * spec.dtype.itemsize


def write_weights(directory: Path, *, items: list[Item], max_shard_size: int | str, total_parameters: int) -> None:
    """``model.safetensors``, or shards and ``model.safetensors.index.json``, split as Transformers splits them."""
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {item.name: item for item in items}
    shapes = {i.name: torch.empty(i.spec.shape, dtype=i.spec.dtype, device="meta") for i in items}
    split = split_torch_state_dict_into_shards(
        shapes, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        write_safetensors(directory / filename, items=[by_name[n] for n in names])
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": total_parameters, **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (directory / "model.safetensors.index.json").write_text(text, encoding="utf-8")
