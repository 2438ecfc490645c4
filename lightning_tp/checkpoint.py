"""Checkpoints that survive a crash and load on any layout.

torch's distributed checkpointing (DCP) already reshards on load: each tensor is stored with its global shape and
every rank reads the slices its own layout needs, so a checkpoint written with TP 2 loads on one process, on TP 4 or
on 2-D. What DCP and Lightning leave to us:

- **Crash safety.** Both write in place: a run killed mid-save leaves a directory (or file) that looks like a
  checkpoint and is not. Here every save goes to a hidden sibling (``.NAME.partial``) that is renamed over ``NAME``
  only after every rank has finished writing.
- **Clear errors.** Loading a checkpoint whose ``.metadata``, ``meta.pt`` or shard files are missing or short fails
  deep in torch with a shape or unpickling error, on some ranks only. :func:`check_checkpoint` reads the index on
  every rank (no collective) and names what is missing.
- **Writes from one rank.** What rank 0 writes alone (``meta.pt``, a Transformers directory) goes through
  :func:`run_on_main_and_share_failure`, so a failure there raises on every rank instead of leaving the others in a
  collective; directories are published file by file with :func:`publish_directory`.
- **Random states.** Lightning does not checkpoint them; dropout after a resume would draw different masks. Each
  rank's states are gathered into the checkpoint and restored on the same layout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from lightning_tp.compat import distributed_is_initialized, get_default_store, torch_get_layout
from lightning_tp.gather import whole_tensor

#: Lightning's name for the file with everything that is not a model or optimizer tensor.
META_FILENAME = "meta.pt"
#: DCP's index of a checkpoint directory.
DCP_INDEX = ".metadata"
#: The entries this strategy adds to Lightning's checkpoint dict.
MODELS_KEY = "lightning_tp"
RNG_KEY = "lightning_tp_rng"
#: Lightning's key of the model's tensors in the checkpoint dict (a DCP directory's entries are ``state_dict.NAME``).
MODEL_KEY = "state_dict"


def is_main() -> bool:
    """Whether this process is rank 0 (or the only one)."""
    return not distributed_is_initialized() or dist.get_rank() == 0


#: How long the other ranks wait for a write of the main rank: far longer than a process-group timeout, since a
#: healthy write of a large file (a full checkpoint, a merged model) can take many minutes; a main rank that dies
#: ends the job sooner (its launcher stops the others).
MAIN_WRITE_TIMEOUT = timedelta(hours=2)
_calls = 0  # numbers the store keys of each call: every rank makes the same calls in the same order


def run_on_main_and_share_failure(fn: Any, *, is_main: bool) -> None:
    """Run ``fn`` on the main rank; every rank then learns whether it failed and raises with it. A failed write on
    rank 0 (a full disk, say) must not leave the other ranks waiting in a barrier.

    The others wait in the c10d store, not in a collective: a collective gives up after the process group's timeout
    (the strategy's ``timeout``), and a healthy write longer than that would kill the job. The store waits up to
    :data:`MAIN_WRITE_TIMEOUT`."""
    global _calls
    if not distributed_is_initialized():
        if is_main:
            fn()
        return
    # Which ranks write: agreed first (a small, quick collective), so that none waits for a result never coming.
    flags: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(flags, bool(is_main))
    writers = [rank for rank, flag in enumerate(flags) if flag]
    _calls += 1
    # The default store is shared by every process of the job.
    store = get_default_store()
    prefix = f"lightning_tp/run_on_main/{_calls}"
    if is_main:
        error = ""
        try:
            fn()
        except Exception as err:  # shared below, then raised on every rank
            error = f"{type(err).__name__}: {err}"
        store.set(f"{prefix}/{dist.get_rank()}", "1" + error)  # "1" + the error, "" when it worked
    keys = [f"{prefix}/{rank}" for rank in writers]
    if keys:
        store.wait(keys, MAIN_WRITE_TIMEOUT)
    for rank, key in zip(writers, keys, strict=True):
        error = store.get(key).decode()[1:]
        if error:
            raise RuntimeError(f"Writing failed on rank {rank}: {error}")


@contextmanager
def publish_directory(directory: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary sibling of ``directory`` to write into; on success each written file is renamed into
    ``directory`` (an atomic replace per file), so no reader sees a half-written file, and files already there that
    this write does not produce (a tokenizer, logs) are kept. On failure the temporary directory is removed and
    ``directory`` is left as it was. A file at ``directory`` is refused before anything is written."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a directory to write into: choose another path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield str(tmp)
        target.mkdir(exist_ok=True)
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            destination = target / file.relative_to(tmp)
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, destination)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # made by mkdtemp above: ours, whatever it holds


class IncompleteCheckpointError(ValueError):
    """A checkpoint is missing files or holds fewer bytes than its index says."""


def partial_path(path: Path) -> Path:
    """Where a save to ``path`` writes until every rank has finished."""
    return path.with_name(f".{path.name}.partial")


def _previous_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


#: The files of a checkpoint directory: DCP's index (global or per rank, and the temporary name it is written under)
#: and shards, Lightning's ``META_FILENAME``. A directory holding only these (or nothing) is one this package may
#: replace or remove; anything else in it is someone else's. Also what a URL's data directory may hold (`remote`).
CHECKPOINT_FILE = re.compile(rf"(__\d+)?{re.escape(DCP_INDEX)}(\.tmp)?|{re.escape(META_FILENAME)}|__\d+_\d+\.distcp")
#: How every torch.save archive (Lightning's single-file checkpoints) begins: a zip file.
_ZIP_MAGIC = b"PK\x03\x04"


def _foreign_entries(directory: Path) -> list[str]:
    """What ``directory`` holds that no save of this package writes (sub-directories included)."""
    return sorted(
        entry.name for entry in directory.iterdir() if entry.is_dir() or not CHECKPOINT_FILE.fullmatch(entry.name)
    )


def _is_ours(path: Path) -> bool:
    """Whether ``path`` is something a save of this package may replace or remove: a link (replaced, never followed:
    ModelCheckpoint's ``save_last="link"``), a checkpoint directory (see ``CHECKPOINT_FILE``), or an empty file or
    torch.save archive (a single-file checkpoint, whole or cut short)."""
    if path.is_symlink():
        return True
    if path.is_dir():
        return not _foreign_entries(path)
    if path.is_file():
        with open(path, "rb") as f:
            return is_checkpoint_file(f)
    return not path.exists()


def is_checkpoint_file(f: BinaryIO) -> bool:
    """Whether the open file ``f`` is one a save of this package may replace or remove: empty, or a torch.save
    archive (whole or cut short)."""
    return f.read(len(_ZIP_MAGIC)) in (b"", _ZIP_MAGIC)


def save_target_refusal(path: Path) -> OSError | None:
    """Why a save to ``path`` must not start, or ``None``: it would replace or remove what this package did not
    write: a directory with other files (a run directory, a tokenizer), a file that is not a checkpoint, or a
    ``.NAME.partial`` / ``.NAME.previous`` someone else made. Reads the file system only."""
    if path.is_symlink():
        return None  # the link is replaced, its target kept
    if path.is_dir() and not _is_ours(path):
        foreign = _foreign_entries(path)
        return IsADirectoryError(
            f"Cannot save a checkpoint to {path}: it is a directory that is not a checkpoint (it holds "
            f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}), and saving replaces the path as a whole. "
            f"Save to a new path, e.g. {path / 'last.ckpt'}."
        )
    if path.exists() and not _is_ours(path):
        return FileExistsError(
            f"Cannot save a checkpoint to {path}: a file that is not a checkpoint is there, and saving would replace "
            "it. Save to a new path, or move the file away."
        )
    for staging in (partial_path(path), _previous_path(path)):
        if not _is_ours(staging):
            return FileExistsError(
                f"Cannot save a checkpoint to {path}: {staging} exists and was not written by a save of this package "
                "(it holds other files); saving would remove it. Move it away."
            )
    return None


def check_save_target(path: Path) -> None:
    """Raise :func:`save_target_refusal`'s error, if any."""
    refusal = save_target_refusal(path)
    if refusal is not None:
        raise refusal


def remove_written(path: Path) -> None:
    """Remove ``path`` if it is ours to remove (see :func:`_is_ours`); else raise, removing nothing."""
    if not _is_ours(path):
        raise FileExistsError(f"Refusing to remove {path}: it was not written by a save of this package.")
    if path.is_symlink() or path.is_file():  # a link (ModelCheckpoint's `save_last="link"`) is removed, not followed
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def clear_partial(path: Path) -> None:
    """Remove what an interrupted save to ``path`` left behind (main rank only, before the save starts)."""
    remove_written(partial_path(path))


def publish(path: Path) -> None:
    """Make the finished ``.NAME.partial`` the checkpoint at ``path`` (main rank only, after every rank wrote).

    A file replaces a file (or a link) in one atomic rename. A directory takes two: the old checkpoint moves aside,
    the new one takes its name; the old one is deleted last. A crash between those renames leaves ``.NAME.previous``
    whole, and :func:`check_checkpoint` points to it (``ckpt_path="last"`` does not look there: resume from it by
    name). Only what a save of this package wrote (or a link) is ever moved aside or removed."""
    staged = partial_path(path)
    if not (path.exists() or path.is_symlink()):
        os.replace(staged, path)  # nothing to replace; a `.NAME.previous` left by a crash is removed once replaced
        remove_written(_previous_path(path))
        return
    if not _is_ours(path):  # checked before the save started; the path may have changed since
        raise FileExistsError(f"Refusing to replace {path}: it was not written by a save of this package.")
    if staged.is_file() and (path.is_file() or path.is_symlink()):
        os.replace(staged, path)  # one atomic rename: no moment without a checkpoint
        return
    previous = _previous_path(path)
    remove_written(previous)  # an older one, from a save interrupted earlier: `path` is whole
    os.replace(path, previous)
    os.replace(staged, path)
    remove_written(previous)


# ---------------------------------------------------------------------------------------------------- untrusted input


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


def check_checkpoint(path: Path) -> None:
    """Raise a clear error if the checkpoint at ``path`` is absent or incomplete. Reads only the index and file sizes:
    run it on every rank before any collective of the load, so that every rank raises the same error."""
    if not path.exists():
        hint = ""
        if _previous_path(path).exists():
            hint = (
                f" A save was replacing it when the run stopped; the previous checkpoint is whole at "
                f"{_previous_path(path)}: rename it to {path.name} to resume from it."
            )
        elif partial_path(path).exists():
            hint = f" Only an unfinished save ({partial_path(path)}) is there; it cannot be loaded."
        raise FileNotFoundError(f"No checkpoint at {path}.{hint}")
    if path.is_file():
        _check_file(path)
        return
    missing = [name for name in (DCP_INDEX, META_FILENAME) if not (path / name).is_file()]
    if missing:
        raise IncompleteCheckpointError(
            f"The checkpoint directory {path} is incomplete: {', '.join(missing)} missing. A save that did not "
            "finish, or a copy that was cut short; resume from an earlier checkpoint."
        )
    check_shards(index_reader(path), path, size_of=lambda name: _size(path / name))


def _size(file: Path) -> int | None:
    return file.stat().st_size if file.is_file() else None


def check_shards(reader: Any, where: Path | str, *, size_of: Callable[[str], int | None]) -> None:
    """Raise :class:`IncompleteCheckpointError` if a shard file the index of ``reader`` names is missing or shorter
    than the index needs. ``size_of(name)``: the size of the file ``name`` of the checkpoint, ``None`` if absent (a
    local directory's, or a URL's)."""
    try:
        metadata = reader.read_metadata()
    except UntrustedCheckpointError:
        raise
    except Exception as err:
        index = f"{str(where).rstrip('/')}/{DCP_INDEX}"
        raise IncompleteCheckpointError(f"The index {index} cannot be read ({err}).") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        actual = size_of(name)
        if actual is None:
            problems.append(f"{name} is missing")
        elif actual < size:
            problems.append(f"{name} holds {actual} bytes, the index needs {size}")
    if problems:
        raise IncompleteCheckpointError(
            f"The checkpoint directory {where} is incomplete: {'; '.join(problems[:5])}"
            f"{' ...' if len(problems) > 5 else ''}. Resume from an earlier checkpoint."
        )


def _check_file(path: Path) -> None:
    import zipfile

    if not zipfile.is_zipfile(path):
        raise IncompleteCheckpointError(
            f"The checkpoint file {path} ({path.stat().st_size} bytes) is not a complete torch.save archive: it was "
            "cut short or is not a checkpoint. Resume from an earlier checkpoint."
        )


def stored_entries(path: Path, *, reader: Any | None = None) -> dict[str, torch.Size | None]:
    """Every entry of a DCP checkpoint directory by its flattened key (``state_dict.<name>``), with the global shape
    of tensors (``None`` for other values). ``reader``: a DCP storage reader to use instead (a URL's)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = (reader or index_reader(path)).read_metadata()
    return {
        key: value.size if isinstance(value, TensorStorageMetadata) else None
        for key, value in metadata.state_dict_metadata.items()
    }


def match_model_state(
    template: Mapping[str, Any],
    stored: Mapping[str, torch.Size | None],
    *,
    frozen: set[str],
    strict: bool,
    path: Path,
    prefix: str = f"{MODEL_KEY}.",
) -> list[str]:
    """The model keys to load from ``stored``. Frozen parameters the checkpoint left out (``save_frozen_weights=False``)
    are skipped: they come from where the model was loaded. A missing trainable key, a key the model lacks (with
    ``strict``) or a shape that differs raises, naming the keys."""
    missing = [k for k in template if prefix + k not in stored and k not in frozen]
    if missing:
        raise ValueError(
            f"The checkpoint {path} has no entry for {len(missing)} weight(s) of this model, e.g. {missing[:3]}. "
            "It was written for another model (or another PEFT configuration)."
        )
    if strict:
        model_keys = {prefix + k for k in template}
        extra = [k[len(prefix) :] for k in stored if k.startswith(prefix) and k not in model_keys]
        if extra:
            raise ValueError(
                f"The checkpoint {path} holds {len(extra)} weight(s) this model does not have, e.g. {extra[:3]}. Load "
                "the model it was written for, or set `LightningModule.strict_loading = False`."
            )
    wrong = []
    for key, value in template.items():
        shape = stored.get(prefix + key)
        if shape is not None and hasattr(value, "shape") and tuple(shape) != tuple(value.shape):
            wrong.append(f"{key}: checkpoint {tuple(shape)}, model {tuple(value.shape)}")
    if wrong:
        raise ValueError(f"The checkpoint {path} was written for a model of other sizes: {'; '.join(wrong[:3])}.")
    return [k for k in template if prefix + k in stored]


def frozen_parameter_names(state_dict_names: list[str], module: nn.Module) -> set[str]:
    """The state-dict names of ``module``'s parameters that do not train."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    # The state dict may name a parameter through a wrapper (activation checkpointing); compare without it.
    return {name for name in state_dict_names if name.replace("_checkpoint_wrapped_module.", "") in frozen}


# ---------------------------------------------------------------------------------------------------- random states


def rng_state() -> dict[str, Any]:
    """This rank's random states, as tensors and plain values (loadable with ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: another node may have fewer GPUs
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's random states, on every rank (a collective: call it on all ranks)."""
    state = rng_state()
    if not distributed_is_initialized():
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


# ---------------------------------------------------------------------------------------------------- save_pretrained


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
        # `keep_vars`: tied weights (`lm_head.weight` of a tied model) come as one object under two names. Gathered
        # once and kept as one tensor, so that Transformers sees the shared storage and writes only its own keys.
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) not in gathered:
                gathered[id(tensor)] = whole_tensor(tensor, keep=is_main)  # a collective, on every rank
            if is_main:
                state[name] = gathered[id(tensor)]
        return state

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
    """Replace ``model.save_pretrained`` (on this instance, once) by a collective one: every rank calls it, every rank
    runs ``gather(is_main)`` (the state dict to write, whole, needed on the main rank only), the main rank writes it
    with the original method into a temporary directory renamed into place once complete, and a failure there raises
    on every rank. ``is_main_process`` picks the writing rank (default: rank 0).

    A caller's own ``state_dict``: ``given_state="call_through"`` hands the call to the original method as it is (no
    collective: the caller may be on one rank only); ``"publish"`` writes it from the main rank as above, without
    ``gather``. ``defaults``: keyword arguments for the original method unless the caller passes them."""
    if getattr(model, "_lightning_tp_save", False):
        return
    original = model.save_pretrained

    def save_pretrained(save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        state = kwargs.pop("state_dict", None)
        if state is not None and given_state == "call_through":
            return original(save_directory, *args, state_dict=state, **kwargs)
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

    model.save_pretrained = save_pretrained
    model._lightning_tp_save = True
