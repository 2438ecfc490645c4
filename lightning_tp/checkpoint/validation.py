"""Clear errors before a load starts: a checkpoint that is absent, incomplete or written for another model is named,
from its index and file sizes alone (no collective), on every rank alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_tp.checkpoint.format import COMMIT_MARKER, DCP_INDEX, META_FILENAME, MODEL_KEY
from lightning_tp.checkpoint.publish import partial_path, previous_path
from lightning_tp.checkpoint.trust import UntrustedCheckpointError, index_reader


class IncompleteCheckpointError(ValueError):
    """A checkpoint is missing files or holds fewer bytes than its index says."""


def check_checkpoint(path: Path) -> None:
    """Raise a clear error if the checkpoint at ``path`` is absent or incomplete. Reads only the index and file sizes:
    run it on every rank before any collective of the load, so that every rank raises the same error."""
    if not path.exists():
        hint = ""
        if previous_path(path).exists():
            hint = (
                f" A save was replacing it when the run stopped; the previous checkpoint is whole at "
                f"{previous_path(path)}: rename it to {path.name} to resume from it."
            )
        elif partial_path(path).exists():
            hint = f" Only an unfinished save ({partial_path(path)}) is there; it cannot be loaded."
        raise FileNotFoundError(f"No checkpoint at {path}.{hint}")
    if path.is_file():
        _check_file(path)
        return
    missing = [name for name in (DCP_INDEX, META_FILENAME) if not (path / name).is_file()]
    if missing and (path / COMMIT_MARKER).is_file():
        raise ValueError(
            f"{path} holds a checkpoint in the layout written at URLs (its commit marker {COMMIT_MARKER}; a file:// "
            f"URL wrote it before lightning_tp took file:// as a local path): load it as local://{path.resolve()}."
        )
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
    elsewhere: tuple[str, ...] = (),
) -> list[str]:
    """The model keys to load from ``stored``. Frozen parameters the checkpoint left out (``save_frozen_weights=False``)
    are skipped: they come from where the model was loaded. A missing trainable key, a key the model lacks (with
    ``strict``; except those of the modules in ``elsewhere``, which other stages of a pipeline hold) or a shape that
    differs raises, naming the keys."""
    missing = [k for k in template if prefix + k not in stored and k not in frozen]
    if missing:
        raise ValueError(
            f"The checkpoint {path} has no entry for {len(missing)} weight(s) of this model, e.g. {missing[:3]}. "
            "It was written for another model (or another PEFT configuration)."
        )
    if strict:
        model_keys = {prefix + k for k in template}
        other_stages = tuple(f"{prefix}{module}." for module in elsewhere)
        extra = [
            k[len(prefix) :]
            for k in stored
            if k.startswith(prefix) and k not in model_keys and not k.startswith(other_stages)
        ]
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
