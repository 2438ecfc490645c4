"""Writes that survive a crash and never remove what this package did not write.

Every save goes to a hidden sibling (``.NAME.partial``) that is renamed over ``NAME`` only after every rank has
finished writing; what rank 0 writes alone goes through :func:`run_on_main_and_share_failure`, so a failure there
raises on every rank instead of leaving the others in a collective; directories are published file by file with
:func:`publish_directory`."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch.distributed as dist

from lightning_tp.checkpoint.format import CHECKPOINT_FILE
from lightning_tp.compat import distributed_is_initialized, get_default_store

T = TypeVar("T")


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


#: How long a rank waits in a collective save (``save_pretrained`` of a sharded model, ``save_merged``) for the other
#: ranks to call it too: Lightning's default process-group timeout, how long a collective would wait (a rank may do
#: long work of its own first, an upload, say). One called on rank 0 alone (under ``if trainer.is_global_zero:``)
#: fails after this at the latest, and usually at once: where another rank leaves a sign that it will not come (its
#: process exits, or it reaches one of the strategy's barriers instead). A refused save leaves the ranks' counts of
#: saves apart: the job cannot go on saving after it.
ARRIVAL_TIMEOUT = timedelta(minutes=30)
_ARRIVALS = "lightning_tp/arrivals"
_EXITED = "lightning_tp/exited"
_arrived = 0  # the collective saves this process has called: every rank calls the same ones in the same order
_watching_exit = False


def watch_for_exit() -> None:
    """Note in the job's store when this process exits, so that a rank waiting in :func:`arrive_together` for it
    fails at once instead of after :data:`ARRIVAL_TIMEOUT`. Every rank registers it when a model gets its collective
    saves; the store is taken now (the process group may be gone at exit)."""
    global _watching_exit
    if _watching_exit or not distributed_is_initialized():
        return
    _watching_exit = True
    store, rank = get_default_store(), dist.get_rank()

    def note_exit() -> None:
        try:
            store.set(f"{_EXITED}/{rank}", "1")
            store.add(_EXITED, 1)
        except Exception:  # noqa: BLE001 (the store's host may be gone: nothing is waiting then)
            pass

    atexit.register(note_exit)


def _refusal(what: str, arrived: int, world: int, reason: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is collective: every rank must call it (each holds only its shards, which the ranks gather "
        f"together; rank 0 writes alone), but {arrived} of {world} ranks called it: {reason}. Call it on every rank, "
        "not under `if trainer.is_global_zero:` or `if rank == 0:` (it writes from rank 0 only, whoever calls it), "
        "or export a saved checkpoint with `python -m lightning_tp.export`."
    )


def arrive_together(what: str) -> None:
    """Wait until every rank has called this collective save (``what`` names it), before its first collective: a
    save called on rank 0 alone would otherwise wait in an all-gather that no other rank joins (NCCL until its
    timeout; gloo fails once another rank exits, or pairs it with an unrelated collective). The ranks count
    themselves in the job's store; a rank that waits raises a clear error after :data:`ARRIVAL_TIMEOUT`, or at once
    when another rank's process has exited or that rank has reached a barrier of the strategy instead
    (:func:`refuse_waiting_saves`).

    Raises:
        RuntimeError: not every rank called it, naming ``what`` and the fix.
    """
    global _arrived
    if not distributed_is_initialized() or dist.get_world_size() == 1:
        return
    _arrived += 1
    store, world = get_default_store(), dist.get_world_size()
    key = f"{_ARRIVALS}/{_arrived}"
    store.add(key, 1)
    deadline = time.monotonic() + ARRIVAL_TIMEOUT.total_seconds()
    pause = 0.001
    while (arrived := int(store.add(key, 0))) < world:
        reason = None
        if int(store.add(_EXITED, 0)) > 0:
            reason = "another rank's process has exited"
        elif store.check([f"{key}/instead"]):
            reason = store.get(f"{key}/instead").decode()
        elif time.monotonic() > deadline:
            reason = f"the others did not within {ARRIVAL_TIMEOUT}"
        if reason is not None:
            raise _refusal(what, arrived, world, reason)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def refuse_waiting_saves(where: str) -> None:
    """Before a collective that every rank reaches (the strategy's ``barrier``): a rank waiting in a collective save
    that this rank has not called will never see this rank there, nor this rank it at the barrier. Tell it (it
    raises at once) and raise here too, instead of waiting in the barrier until the process group's timeout.

    Raises:
        RuntimeError: another rank waits in a collective save this rank did not call.
    """
    if not distributed_is_initialized() or dist.get_world_size() == 1:
        return
    store = get_default_store()
    key = f"{_ARRIVALS}/{_arrived + 1}"
    if not store.check([key]):
        return
    reason = f"rank {dist.get_rank()} reached {where} instead"
    store.set(f"{key}/instead", reason)
    raise _refusal(
        "A save (`save_pretrained` of a sharded model, `save_merged`)",
        int(store.add(key, 0)),
        dist.get_world_size(),
        reason,
    )


def on_every_rank(fn: Callable[[], T], *, what: str) -> T:
    """``fn()`` run on every rank, where each rank's part differs (its pipeline stages, its keys of a checkpoint): a
    failure on any rank raises on every rank, before the collectives that follow (the first failing rank's error: a
    ``ValueError`` as it was, else a ``RuntimeError`` naming ``what`` and the rank). Every rank must call it."""
    if not distributed_is_initialized():
        return fn()
    try:
        result, problem = fn(), None
    except Exception as error:  # noqa: BLE001 (shared with the other ranks, then raised on every rank)
        result, problem = None, (type(error).__name__, str(error))
    problems: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for rank, found in enumerate(problems):
        if found is not None:
            kind, message = found
            if kind == "ValueError":
                raise ValueError(message)
            raise RuntimeError(f"{what} failed on rank {rank}: {kind}: {message}")
    return result  # type: ignore[return-value]


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


def partial_path(path: Path) -> Path:
    """Where a save to ``path`` writes until every rank has finished."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.previous")


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
    for staging in (partial_path(path), previous_path(path)):
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
        remove_written(previous_path(path))
        return
    if not _is_ours(path):  # checked before the save started; the path may have changed since
        raise FileExistsError(f"Refusing to replace {path}: it was not written by a save of this package.")
    if staged.is_file() and (path.is_file() or path.is_symlink()):
        os.replace(staged, path)  # one atomic rename: no moment without a checkpoint
        return
    previous = previous_path(path)
    remove_written(previous)  # an older one, from a save interrupted earlier: `path` is whole
    os.replace(path, previous)
    os.replace(staged, path)
    remove_written(previous)
