"""Saving and loading a whole training state (model, optimizers, loops, random states), crash-safe and resharding,
at a local path or an fsspec URL: the bodies of the Trainer and Fabric strategies' ``save_checkpoint`` and
``load_checkpoint``. The building blocks (what may be replaced, publishing by rename, what may be unpickled) live in
:mod:`lightning_tp.checkpoint`, URLs in :mod:`lightning_tp.checkpoint.remote`.

A checkpoint is Lightning's: a distributed (DCP) directory whose tensors are the entries of ``state`` (``state_dict``
and ``optimizer_N`` for the Trainer), plus ``meta.pt`` with everything else; or one file written by rank 0.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_tp.checkpoint import remote
from lightning_tp.checkpoint.aliases import holds, parameter_aliases, renamed
from lightning_tp.checkpoint.dcp_layouts import dcp_layouts, misplaced_by_dcp, restore_layouts
from lightning_tp.checkpoint.format import META_FILENAME, MODELS_KEY, RNG_KEY, flat_optimizer_state
from lightning_tp.checkpoint.publish import (
    clear_partial,
    is_main,
    on_every_rank,
    partial_path,
    publish,
    remove_written,
    run_on_main_and_share_failure,
    save_target_refusal,
)
from lightning_tp.checkpoint.rng_state import gather_rng_states
from lightning_tp.checkpoint.stage_files import load_stage_file
from lightning_tp.checkpoint.trust import (
    UntrustedCheckpointError,
    index_reader,
    load_torch_file,
    safe_load_planner,
    unpickling_guard,
)
from lightning_tp.checkpoint.validation import (
    IncompleteCheckpointError,
    check_checkpoint,
    frozen_parameter_names,
    match_model_state,
    stored_entries,
)
from lightning_tp.compat import cutting_strided_shards, distributed_is_initialized
from lightning_tp.layout import ParallelLayout
from lightning_tp.parallel.pipeline import other_stages_modules
from lightning_tp.plans.discovery import describe_models

T = TypeVar("T")

#: The errors rank 0's look at a checkpoint raises again on every rank by their own type (others become ``OSError``).
_SHARED_ERRORS = (IncompleteCheckpointError, UntrustedCheckpointError, FileNotFoundError, ValueError)


def broadcast_from_main(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (the identity without a process group)."""
    if not distributed_is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def decide_on_main(decide: Callable[[], T], *, what: str | Path) -> T:
    """``decide()`` on rank 0 (one look at the file system or store, not one per rank), its result or its error on
    every rank: a failure on rank 0 alone must not leave the others in the next collective."""
    outcome: dict[str, Any] | None = None
    if is_main():
        try:
            outcome = {"value": decide()}
        except _SHARED_ERRORS as err:
            outcome = {"error": type(err).__name__, "message": str(err)}
        except Exception as err:  # the store: permissions, network
            outcome = {"error": "OSError", "message": f"Accessing {what} failed: {type(err).__name__}: {err}"}
    outcome = broadcast_from_main(outcome)
    assert outcome is not None
    if "error" in outcome:
        kinds = {error.__name__: error for error in _SHARED_ERRORS}
        raise kinds.get(outcome["error"], OSError)(outcome["message"])
    return outcome["value"]


def layout_sizes(layout: ParallelLayout) -> dict[str, int]:
    """The sizes a checkpoint records (``cp``, ``ep`` and ``pp`` only when above 1: checkpoints written before they
    existed compare equal)."""
    sizes = {"tp": layout.tp_size, "dp_shard": layout.dp_shard_size, "dp_replicate": layout.dp_replicate_size}
    if layout.cp_size > 1:
        sizes["cp"] = layout.cp_size
    if layout.ep_size > 1:
        sizes["ep"] = layout.ep_size
    if layout.pp_size > 1:
        sizes["pp"] = layout.pp_size
    return sizes


# ---------------------------------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(
    checkpoint: dict[str, Any],
    path: str | Path,
    *,
    tensor_keys: list[str],
    root: nn.Module,
    layout: ParallelLayout | None,
    distributed: bool,
    write_file: Callable[[dict[str, Any], Any], None],
) -> None:
    """Write ``checkpoint`` to ``path`` so that a run killed during the save leaves the previous checkpoint whole.

    ``tensor_keys``: the entries of ``checkpoint`` that hold (sharded) state dicts, written by every rank with DCP
    when ``distributed``; the rest goes to ``meta.pt``. Otherwise ``write_file(checkpoint, target)`` writes one file
    on rank 0 (``layout``: ``None`` only before setup, where nothing but the refusal of a bad path can happen).
    Locally the save goes to ``.NAME.partial`` and is renamed to ``NAME`` once every rank has finished;
    at a URL it is committed by a marker (see :mod:`lightning_tp.checkpoint.remote`). Adds every rank's random states
    and what export needs to rebuild a Transformers directory (configs, PEFT settings). Every rank must call it.
    A ``file://`` URL is the local path it names (:func:`~lightning_tp.checkpoint.remote.local_path`)."""
    path = remote.local_path(path)
    local = not remote.is_url(path)
    # Rank 0 decides whether a local path may be replaced (never what this package did not write): every rank raises
    # the same error before anything is written, even where the ranks' file systems differ.
    if local:
        refusal = decide_on_main(lambda: save_target_refusal(Path(path)), what=path)
        if refusal is not None:
            raise refusal
    path = broadcast_from_main(path)
    if layout is None:
        raise RuntimeError("A checkpoint is saved once the layout is known: after the environment is set up.")
    checkpoint[RNG_KEY] = {  # gathered on every rank (a collective), written by rank 0
        "world_size": layout.world_size,
        "dp_size": layout.dp_size,
        "layout": layout_sizes(layout),
        "states": gather_rng_states(),
    }
    checkpoint[MODELS_KEY] = describe_models(root)
    tensors = {key: checkpoint.pop(key) for key in tensor_keys} if distributed else {}
    if local:
        _save_local(checkpoint, Path(path), tensors=tensors, distributed=distributed, write_file=write_file)
    else:
        _save_to_url(checkpoint, str(path), tensors=tensors, distributed=distributed, write_file=write_file)


def _save_local(
    checkpoint: dict[str, Any],
    path: Path,
    *,
    tensors: dict[str, Any],
    distributed: bool,
    write_file: Callable[[dict[str, Any], Any], None],
) -> None:
    from torch.distributed.checkpoint import save

    staged = partial_path(path)
    # The rank-0 steps run through `run_on_main_and_share_failure`: a failure there raises on every rank, and the
    # exchange it ends with keeps the ranks in step (nobody writes into a stale staging directory).
    run_on_main_and_share_failure(lambda: clear_partial(path), is_main=is_main())
    if distributed:
        save(dcp_layouts(tensors), checkpoint_id=staged)  # every rank writes its shards; DCP shares failures itself
        run_on_main_and_share_failure(lambda: torch.save(checkpoint, staged / META_FILENAME), is_main=is_main())
    else:
        run_on_main_and_share_failure(lambda: write_file(checkpoint, staged), is_main=is_main())
    run_on_main_and_share_failure(lambda: publish(path), is_main=is_main())


def _save_to_url(
    checkpoint: dict[str, Any],
    url: str,
    *,
    tensors: dict[str, Any],
    distributed: bool,
    write_file: Callable[[dict[str, Any], Any], None],
) -> None:
    """A fresh data directory committed by a marker written last, or one object moved into place (object stores have
    no atomic rename)."""
    from torch.distributed.checkpoint import save

    # Rank 0 looks at what is there and names where the ranks write; every rank raises the same error.
    plan = decide_on_main(lambda: remote.plan_save(url, directory=distributed), what=url)
    if plan.get("error"):
        raise ValueError(plan["error"])
    data = plan["data"]
    if distributed:
        save(dcp_layouts(tensors), storage_writer=remote.dcp_writer(data))  # every rank writes its shards
        run_on_main_and_share_failure(lambda: remote.write_meta(data, checkpoint), is_main=is_main())
        run_on_main_and_share_failure(lambda: remote.commit(url, data), is_main=is_main())
        return
    run_on_main_and_share_failure(lambda: write_file(checkpoint, data), is_main=is_main())
    run_on_main_and_share_failure(lambda: remote.publish_file(data, url), is_main=is_main())


def remove_checkpoint(path: str | Path) -> None:
    """Remove a checkpoint this package wrote (``ModelCheckpoint`` keeping its top k): only what a save wrote (a
    link, not its target; at a URL, what its commit marker lists); anything else is kept, with a warning. Rank 0
    only; never raises (no collective follows that would let the others learn of it)."""
    if not is_main():
        return
    path = remote.local_path(path)
    if not remote.is_url(path):
        try:
            remove_written(Path(path))
        except FileExistsError as err:
            rank_zero_warn(f"{err} It is kept.")
        return
    try:
        kept = remote.remove_checkpoint(str(path))
    except Exception as err:
        rank_zero_warn(f"Removing the checkpoint {path} failed ({type(err).__name__}: {err}); training goes on")
        return
    for url in kept:
        rank_zero_warn(
            f"{url} was not removed: it is neither a torch.save archive nor a directory with a commit marker "
            f"({remote.COMMIT_MARKER}), so lightning_tp did not write it (or not completely)."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    weights_only: bool,
    strict: bool,
    opt_in: str,
    optimizer_states_from_list: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint written on any layout (DCP reshards) into ``modules`` and ``optimizers`` (by their keys in
    the checkpoint; ``model`` is the module the optimizers' parameters belong to), after checking on every rank that
    it is whole and holds what they need. Returns the rest of the checkpoint (``meta.pt``).

    Only tensors and plain values are unpickled unless ``weights_only=False``: a checkpoint is untrusted input, and
    unpickling other objects runs code it names (``opt_in`` says how a user passes it). Every rank must call it."""
    common = dict(modules=modules, optimizers=optimizers, weights_only=weights_only, strict=strict, opt_in=opt_in)
    load_directory = partial(_load_distributed, model=model, **common)
    load_file = partial(_load_file, optimizer_states_from_list=optimizer_states_from_list, **common)
    path = remote.local_path(broadcast_from_main(path))  # a `file://` URL is the local path it names
    if remote.is_url(path):
        # Checked on rank 0 before any collective of the load; every rank raises the same error.
        kind, data = decide_on_main(lambda: remote.resolve(str(path)), what=path)
        if kind == "directory":
            return load_directory(data)
        # A full file: each rank reads its own local copy (torch.load memory-maps it, as for a local file).
        with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
            local = Path(tmp) / "checkpoint.ckpt"
            remote.download(str(path), local)
            return load_file(local, shown=str(path))
    path = Path(path)
    check_checkpoint(path)  # on every rank, before any collective of the load: every rank raises the same error
    return load_file(path, shown=str(path)) if path.is_file() else load_directory(path)


def _load_file(
    path: Path,
    *,
    shown: str,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    weights_only: bool,
    strict: bool,
    opt_in: str,
    optimizer_states_from_list: bool,
) -> dict[str, Any]:
    from lightning_tp.compat import load_checkpoint as load_full_checkpoint

    # torch's full-state loader misplaces what DCP misplaces (see `dcp_layouts`); those tensors are cut right, within
    # this load only.
    with cutting_strided_shards(misplaced_by_dcp):
        if any(other_stages_modules(module) for module in modules.values()):
            # A pipeline: every rank reads the file and takes its own stages' entries (rank 0's broadcast, which torch's
            # full-state loader runs, cannot serve ranks holding different stages).
            with unpickling_guard(shown, weights_only=weights_only, opt_in=opt_in):
                checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
            ((module_key, module),) = modules.items()
            return load_stage_file(
                checkpoint,
                module_key=module_key,
                module=module,
                optimizers=optimizers,
                strict=strict,
                optimizer_states_from_list=optimizer_states_from_list,
                shown=shown,
            )
        # Refused objects raise the same error on every rank, before any collective.
        with unpickling_guard(shown, weights_only=weights_only, opt_in=opt_in):
            metadata = load_full_checkpoint(
                path=path,
                state={**modules, **optimizers},
                strict=strict,
                optimizer_states_from_list=optimizer_states_from_list,
                weights_only=weights_only,
            )
        return metadata


def _load_distributed(
    path: Path | str,
    *,
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    weights_only: bool,
    strict: bool,
    opt_in: str,
) -> dict[str, Any]:
    """DCP's load, with each module's entries checked against the checkpoint's index first (names and shapes, with
    clear errors) and frozen weights the checkpoint left out skipped."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # Unpickled first, on every rank, before any collective: a refused meta.pt raises the same error everywhere.
    url = path if remote.is_url(path) else None
    meta = io.BytesIO(remote.read_bytes(remote.join(url, META_FILENAME))) if url else Path(path) / META_FILENAME
    metadata = load_torch_file(meta, weights_only=weights_only, opt_in=opt_in)
    reader = remote.dcp_reader(url) if url else index_reader(path)  # neither runs code from the index
    stored = stored_entries(path, reader=reader)
    planner = safe_load_planner(weights_only=weights_only, opt_in=opt_in)  # nor from the shard files
    missing_optimizers = [key for key in optimizers if not any(name.startswith(f"{key}.") for name in stored)]
    if missing_optimizers:
        written = sorted({name.split(".", 1)[0] for name in stored})
        raise ValueError(
            f"The checkpoint {path} holds no optimizer state for {missing_optimizers} (its entries start with "
            f"{written}): it was written with fewer optimizers than this run has."
        )
    for key, module in modules.items():
        template = get_model_state_dict(module)
        elsewhere = other_stages_modules(module)
        check = partial(
            match_model_state,
            template,
            stored,
            frozen=frozen_parameter_names(list(template), module),
            strict=strict,
            path=path,
            prefix=f"{key}.",
            elsewhere=elsewhere,
        )
        # Each stage checks its own keys: one rank's problem is raised on every rank, before DCP's collectives.
        names = on_every_rank(check, what=f"Checking {path}") if elsewhere else check()
        wanted = {name: template[name] for name in names}
        state = {key: dcp_layouts(wanted)}
        load(state, checkpoint_id=path, storage_reader=reader, planner=planner)
        module.load_state_dict(restore_layouts(state[key], wanted), strict=False)  # completeness was checked above
    saved_pp = metadata.get(RNG_KEY, {}).get("layout", {}).get("pp", 1)
    flat = flat_optimizer_state(saved_pp)
    aliases = parameter_aliases(model)
    for key, optimizer in optimizers.items():
        # Read under the names the checkpoint was written with (a tensor with several names under its canonical one,
        # see `checkpoint.aliases`), handed to torch under the names it asked for.
        asked = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
        wanted = renamed(asked, aliases)
        back = {canonical: alias for alias, canonical in aliases.items() if holds(asked, alias)}
        state = {key: dcp_layouts(wanted)}
        load(state, checkpoint_id=path, storage_reader=reader, planner=planner)
        set_optimizer_state_dict(
            model,
            optimizer,
            optim_state_dict=renamed(restore_layouts(state[key], wanted), back),
            options=StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=flat),
        )
    return metadata


def pop_rng_entry(
    metadata: dict[str, Any], *, layout: ParallelLayout, restore: bool
) -> tuple[list[dict[str, Any]] | None, int | None]:
    """Take this package's entries out of a loaded checkpoint's metadata. Returns every rank's random states when they
    can be restored (``restore`` and the same layout; else a warning), and the data-parallel size it was written with
    when that differs from ``layout``'s (the data position then means nothing)."""
    metadata.pop(MODELS_KEY, None)
    rng = metadata.pop(RNG_KEY, None)
    if rng is None:
        return None, None
    saved_dp = rng.get("dp_size", layout.dp_size)
    other_dp = saved_dp if saved_dp != layout.dp_size else None
    if not restore:
        return None, other_dp
    if rng.get("layout") == layout_sizes(layout):
        return rng["states"], other_dp
    rank_zero_warn(
        f"The checkpoint was written on another layout ({rng.get('layout')}, this run: {layout_sizes(layout)}): the "
        "random states (dropout masks) are not restored; the weights, optimizer and loops are."
    )
    return None, other_dp
