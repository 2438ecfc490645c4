"""Checkpoints of ``TensorParallelStrategy``, and Transformers directories, read one tensor at a time: a
distributed checkpoint directory (:class:`DcpCheckpoint`), a single-file checkpoint (:class:`FileCheckpoint`),
safetensors files (:class:`SafetensorsDirectory`); :func:`open_checkpoint` picks the reader of a path or URL.

Each reader has ``specs`` (name -> :class:`~lightning_tp.checkpoint.safetensors.Spec`, known before any tensor is read)
and ``read(name)``; the checkpoint readers also have ``meta``, the rest of Lightning's checkpoint dict.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_tp.checkpoint import remote
from lightning_tp.checkpoint.format import DCP_INDEX, META_FILENAME, MODEL_KEY
from lightning_tp.checkpoint.safetensors import SAFETENSORS_DTYPES, Spec
from lightning_tp.checkpoint.trust import UntrustedCheckpointError, index_reader, load_torch_file

_DCP_PREFIX = f"{MODEL_KEY}."


class DcpCheckpoint:
    """A distributed checkpoint directory: each tensor is read alone, whatever the layout it was saved with."""

    def __init__(self, path: Path | str, *, trust: bool):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # Never runs code from the index; reads it once. A URL's data directory (checked by `remote.resolve`) reads
        # through fsspec.
        self.reader = remote.dcp_reader(path) if remote.is_url(path) else index_reader(path)
        items = self.reader.read_metadata().state_dict_metadata.items()
        self.specs = {
            key.removeprefix(_DCP_PREFIX): Spec(tuple(md.size), md.properties.dtype)
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


class FileCheckpoint:
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
        self.specs = {k: Spec(tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.state[key]


class SafetensorsDirectory:
    """Base weights from a Transformers directory (``--base``), read one tensor at a time."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"--base {path}: no *.safetensors files there (a Transformers model directory is needed).")
        self.files: dict[str, Path] = {}
        self.specs: dict[str, Spec] = {}
        dtypes = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    self.files[key] = file
                    self.specs[key] = Spec(tuple(part.get_shape()), dtypes[part.get_dtype()])

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


def open_checkpoint(path: Path | str, *, trust: bool) -> DcpCheckpoint | FileCheckpoint:
    if remote.is_url(path):
        kind, data = remote.resolve(path)  # a directory without its commit marker is incomplete
        return DcpCheckpoint(data, trust=trust) if kind == "directory" else FileCheckpoint(data, trust=trust)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if path.is_dir():
        if not (path / DCP_INDEX).is_file():
            raise ValueError(
                f"{path} is a directory but not a distributed checkpoint (no {DCP_INDEX} file): pass the directory "
                "Lightning's ModelCheckpoint wrote, or a single-file checkpoint."
            )
        return DcpCheckpoint(path, trust=trust)
    return FileCheckpoint(path, trust=trust)
