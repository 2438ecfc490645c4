"""Checkpoints are untrusted input: ``torch.load`` and DCP's readers rebuild only tensors, plain values and
:data:`SAFE_GLOBALS` unless the user opts in, and an object they refuse raises :class:`UntrustedCheckpointError` naming
the opt-in."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_tp.compat import torch_get_layout


class UntrustedCheckpointError(ValueError):
    """A checkpoint holds objects that only arbitrary code from the file can rebuild, and loading them was not
    allowed."""


#: Plain types Lightning checkpoints often hold in their hyper-parameters; rebuilding them runs no code of the file.
SAFE_GLOBALS = [pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath, argparse.Namespace]


def load_torch_file(path: Path | str, *, weights_only: bool, opt_in: str, mmap: bool = False) -> Any:
    """``torch.load`` onto the CPU (tensors saved from ``cuda:0`` would otherwise land on GPU 0 of every rank). With
    ``weights_only`` only tensors, plain values and :data:`SAFE_GLOBALS` are rebuilt; anything else raises
    :class:`UntrustedCheckpointError` saying what loading it risks and how to allow it (``opt_in``)."""
    with unpickling_guard(path, weights_only=weights_only, opt_in=opt_in):
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=weights_only)


@contextmanager
def unpickling_guard(path: Path | str | Any, *, weights_only: bool, opt_in: str) -> Iterator[None]:
    """Around a ``torch.load`` (or Lightning's loader) of ``path``: weights-only loads also rebuild
    :data:`SAFE_GLOBALS`, and an object they refuse raises :class:`UntrustedCheckpointError` naming the ``opt_in``."""
    if not weights_only:
        yield
        return
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            yield
        except pickle.UnpicklingError as err:
            raise UntrustedCheckpointError(untrusted_message(path, err, opt_in=opt_in)) from err


def safe_load_planner(*, weights_only: bool, opt_in: str) -> Any:
    """DCP's default load planner, but the non-tensor entries of the shard files (optimizer hyper-parameters such as
    ``param_groups``) are unpickled like ``meta.pt``: torch's planner loads them with ``weights_only=False``, so a
    crafted ``.distcp`` file would run code on every rank that resumes from it."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            label = f"the checkpoint entry {read_item.dest_index.fqn!r}"
            with unpickling_guard(label, weights_only=weights_only, opt_in=opt_in):
                plain = torch.load(value, map_location="cpu", weights_only=weights_only)
            # Handed on re-serialised: the parent's own (unrestricted) load then only sees what passed the guard.
            buffer = io.BytesIO()
            torch.save(plain, buffer)
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    return SafeLoadPlanner()


def untrusted_message(path: Path | str, err: Exception, *, opt_in: str) -> str:
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(err))
    what = f"an object of type {found.group(1)}" if found else "objects that are not tensors or plain values"
    return (
        f"{path} holds {what}. Loading it would run code the file names, which can do anything your user can "
        f"(a crafted checkpoint runs commands this way), so only tensors and plain values are loaded by default. If "
        f"you trust where the checkpoint comes from, {opt_in}."
    )


#: The classes a DCP index (``.metadata``) is made of: torch's own dataclasses and enums in these modules.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, rebuilding only what an index holds. DCP's own reader calls ``pickle.load`` on
    ``.metadata``: a crafted index runs code on every rank that opens the checkpoint (export, resume)."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if module in _DCP_MODULES + ("torch", "pathlib") else None
        if module in _DCP_MODULES and isinstance(found, type):
            if dataclasses.is_dataclass(found) or issubclass(found, enum.Enum):
                return found
        if module == "torch" and (found is torch.Size or isinstance(found, (torch.dtype, torch.memory_format))):
            return found
        if (module, name) == ("torch.serialization", "_get_layout"):  # looks a layout up by its name
            return torch_get_layout()
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "PureWindowsPath"):
            return found
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(
            f"The checkpoint index names {module}.{name}, which a DCP index does not hold: refused (unpickling it "
            "could run code the file names)."
        )


def _safe_reader_class(base: type) -> type:
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeIndexReader(base):
        """DCP's reader, reading ``.metadata`` with :class:`_IndexUnpickler` (as ``FileSystemReader.read_metadata``
        does otherwise, private ``_get_metadata_path`` included), and once (``load`` reads it on every call)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "_lightning_tp_metadata", None) is None:
                with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                    try:
                        metadata = _IndexUnpickler(f).load()
                    except pickle.UnpicklingError as err:
                        raise UntrustedCheckpointError(f"{self.path}: {err}") from err
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                self._lightning_tp_metadata = metadata
            self._lightning_tp_metadata.storage_meta.load_id = self.load_id
            return self._lightning_tp_metadata

    return SafeIndexReader


def index_reader(path: Path | str, *, base: type | None = None) -> Any:
    """A DCP storage reader for the checkpoint directory ``path`` that never runs code from its index. ``base``: the
    DCP reader class to extend (default ``FileSystemReader``; a URL's is fsspec's)."""
    if base is None:
        from torch.distributed.checkpoint import FileSystemReader as base
    return _safe_reader_class(base)(str(path))
