"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``memory://``, ...).

A local path is published by renames (:mod:`lightning_tp.checkpoint`), and so is a ``file://`` URL: it names that
local path (:func:`local_path`). An object store has no atomic rename of a directory, and a copy is neither atomic nor
cheap, so a checkpoint directory at a URL is laid out as::

    URL/.lightning_tp_complete     the commit marker: which data directory is the checkpoint, and its files
    URL/shards-<hex>/.metadata     DCP's index
    URL/shards-<hex>/__0_0.distcp  each rank's shards
    URL/shards-<hex>/meta.pt       the rest of Lightning's checkpoint dict

Every save writes a new ``shards-<hex>`` directory and commits it by writing the marker last (one object: a put is
atomic on object stores); only then are the files the previous marker listed removed. A save killed midway leaves
the previous checkpoint whole, and a directory without the marker reads as incomplete
(:class:`~lightning_tp.checkpoint.validation.IncompleteCheckpointError`). Nothing this package did not write is
removed: files already under ``URL`` stay.

A single-file checkpoint (``save_distributed_checkpoint=False``) is one object: written to ``.NAME.partial`` and moved
over ``NAME`` (a copy that becomes visible whole on object stores, a rename on a disk at a ``local://`` URL).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import uuid
import zipfile
from typing import Any

from lightning_tp.checkpoint.format import CHECKPOINT_FILE, COMMIT_MARKER, DCP_INDEX, META_FILENAME
from lightning_tp.checkpoint.publish import is_checkpoint_file
from lightning_tp.checkpoint.trust import index_reader
from lightning_tp.checkpoint.validation import IncompleteCheckpointError, check_shards
from lightning_tp.compat import fsspec_reader_class, fsspec_writer_class

_DATA_PREFIX = "shards-"
_DATA_DIRECTORY = re.compile(rf"{_DATA_PREFIX}[0-9a-f]{{16}}")


def is_url(path: Any) -> bool:
    """Whether ``path`` names a location by URL (``scheme://...``). ``pathlib.Path`` objects are local paths
    (``Path("s3://b/x")`` has already lost its second slash)."""
    return isinstance(path, str) and "://" in path


def local_path(path: Any) -> Any:
    """The local path a ``file://`` URL names (``file:///abs/dir`` is ``/abs/dir``); any other path or URL as it is.
    Saves, loads and removals take a ``file://`` URL as that path (published by renames), as Lightning takes it for a
    local path. fsspec's ``local://`` alias stays a URL: a checkpoint on disk written as on an object store (with the
    commit marker), which runs that path on several processes without a store. ``file://dir`` (two slashes) is
    refused: fsspec reads ``dir`` under the working directory, RFC 8089 a host named ``dir``, and Lightning's
    ``ModelCheckpoint`` ``/dir``."""
    if not is_url(path):
        return path
    from fsspec.utils import get_protocol

    if get_protocol(path) != "file":  # a chained URL (``simplecache::file://...``) stays a URL
        return path
    if not path.startswith("file:///"):
        raise ValueError(
            f"{path!r} names no absolute path: write file:///absolute/path (three slashes), or a plain path."
        )
    return _fs(path)[1]


def _fs(url: str) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def join(url: str, *names: str) -> str:
    return posixpath.join(url.rstrip("/"), *names)


def dcp_writer(url: str) -> Any:
    return fsspec_writer_class()(url)


def dcp_reader_class() -> type:
    return fsspec_reader_class()


def dcp_reader(url: str) -> Any:
    """fsspec's DCP reader, reading the index without running code from it (see ``checkpoint.index_reader``)."""
    return index_reader(url, base=dcp_reader_class())


def read_bytes(url: str) -> bytes:
    fs, path = _fs(url)
    return fs.cat_file(path)


def _read_marker(url: str) -> dict[str, Any] | None:
    fs, path = _fs(join(url, COMMIT_MARKER))
    if not fs.isfile(path):
        return None
    try:
        marker = json.loads(fs.cat_file(path))
        if not isinstance(marker, dict) or not _DATA_DIRECTORY.fullmatch(str(marker.get("data"))):
            raise ValueError("not a lightning_tp commit marker")
        # The marker steers what is removed: only files directly inside its own data directory.
        for file in marker.get("files", []):
            head, _, name = str(file).partition("/")
            if head != marker["data"] or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"it lists {file!r}, outside its data directory")
    except ValueError as err:  # json's errors are ValueErrors too
        where = join(url, COMMIT_MARKER)
        raise IncompleteCheckpointError(f"The commit marker {where} cannot be read ({err}).") from err
    return marker


# ---------------------------------------------------------------------------------------------------- saving


def plan_save(url: str, *, directory: bool) -> dict[str, Any]:
    """What a save to ``url`` will write (main rank, before any rank writes): ``{"error": ...}`` for a location that
    cannot take this kind of checkpoint, else ``{"data": URL}``, where the ranks write (a fresh directory for a
    distributed checkpoint, the staging object for a single file)."""
    fs, path = _fs(url)
    if directory:
        if fs.isfile(path):
            return {
                "error": f"The checkpoint URL {url} is a file, and `save_distributed_checkpoint=True` writes a "
                "directory: remove the file or choose another name."
            }
        return {"data": join(url, f"{_DATA_PREFIX}{uuid.uuid4().hex[:16]}")}
    if fs.isdir(path):
        return {
            "error": f"The checkpoint URL {url} is a directory, and `save_distributed_checkpoint=False` writes one "
            "file: choose another name."
        }
    if fs.isfile(path) and not _is_checkpoint_object(fs, path):
        return {
            "error": f"The checkpoint URL {url} holds a file that is not a checkpoint (no torch.save archive): it is "
            "not replaced. Remove it or choose another name."
        }
    return {"data": partial_url(url)}


def _is_checkpoint_object(fs: Any, path: str) -> bool:
    with fs.open(path, "rb") as f:
        return is_checkpoint_file(f)  # as for local paths


def partial_url(url: str) -> str:
    head, name = posixpath.split(url.rstrip("/"))
    return posixpath.join(head, f".{name}.partial")


def write_meta(data_url: str, checkpoint: dict[str, Any]) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    fs, path = _fs(join(data_url, META_FILENAME))
    fs.pipe_file(path, buffer.getvalue())


def _stored_files(data_url: str) -> list[str]:
    """The files of the DCP checkpoint at ``data_url``, as its index names them."""
    metadata = dcp_reader(data_url).read_metadata()
    shards = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return [DCP_INDEX, META_FILENAME, *sorted(shards)]


def commit(url: str, data_url: str) -> None:
    """Make the finished ``data_url`` the checkpoint at ``url`` (main rank, after every rank wrote): write the marker,
    then remove the files of the checkpoint it replaces."""
    fs, root = _fs(url)
    try:
        previous = _read_marker(url)
    except IncompleteCheckpointError:
        previous = None  # unreadable: nothing of it is removed
    data = posixpath.basename(data_url.rstrip("/"))
    marker = {"format": 1, "data": data, "files": [posixpath.join(data, f) for f in _stored_files(data_url)]}
    staged = posixpath.join(root, f"{COMMIT_MARKER}.tmp")
    fs.pipe_file(staged, json.dumps(marker).encode())
    fs.mv(staged, posixpath.join(root, COMMIT_MARKER))  # a rename on disks; one object replaced whole on stores
    if previous is not None and previous["data"] != data:
        _remove_listed(fs, root, previous)
    _remove_unfinished(fs, root, keep=data)


def _remove_unfinished(fs: Any, root: str, *, keep: str) -> None:
    """Remove the data directories that saves killed before their commit left under ``root``: named as this package
    names them and holding only the files DCP and this package write there (anything else keeps the directory)."""
    for entry in fs.ls(root, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if name == keep or not _DATA_DIRECTORY.fullmatch(name) or not fs.isdir(entry):
            continue
        files = fs.find(entry)
        if all(CHECKPOINT_FILE.fullmatch(posixpath.relpath(f, entry)) for f in files):
            for file in files:
                fs.rm_file(file)
            try:
                if fs.isdir(entry):
                    fs.rmdir(entry)
            except (OSError, NotImplementedError):
                pass


def publish_file(staged_url: str, url: str) -> None:
    fs, staged = _fs(staged_url)
    fs.mv(staged, _fs(url)[1])


def _remove_listed(fs: Any, root: str, marker: dict[str, Any]) -> None:
    """Remove the files ``marker`` lists, then their data directory if that left it empty."""
    for name in marker.get("files", []):
        file = posixpath.join(root, name)
        if fs.isfile(file):
            fs.rm_file(file)
    data = posixpath.join(root, marker["data"])
    try:
        if fs.isdir(data) and not fs.ls(data, detail=False):
            fs.rmdir(data)
    except (OSError, NotImplementedError):  # object stores have no directories to remove
        pass


def remove_checkpoint(url: str) -> list[str]:
    """Remove the checkpoint at ``url`` that this package wrote; return what was left alone, for a warning.

    A directory loses its marker first (so a reader never sees a half-removed checkpoint as whole), then the files the
    marker listed, then itself if nothing else is in it. A directory without a marker is left as it is."""
    fs, root = _fs(url)
    if fs.isfile(root):
        if not _is_checkpoint_object(fs, root):
            return [url]
        fs.rm_file(root)
        return []
    if not fs.isdir(root):
        return []
    try:
        marker = _read_marker(url)
    except IncompleteCheckpointError:
        marker = None
    if marker is None:
        return [url]
    fs.rm_file(posixpath.join(root, COMMIT_MARKER))
    _remove_listed(fs, root, marker)
    try:
        if not fs.ls(root, detail=False):
            fs.rmdir(root)
    except (OSError, NotImplementedError):
        pass
    return []


# ---------------------------------------------------------------------------------------------------- loading


def resolve(url: str) -> tuple[str, str]:
    """``("file", url)`` or ``("directory", data_url)`` for the checkpoint at ``url``, after checking that it is whole
    (reads only the marker, the index and sizes: run it on every rank before any collective of the load)."""
    fs, root = _fs(url)
    if fs.isfile(root):
        with fs.open(root, "rb") as f:
            whole = zipfile.is_zipfile(f)
        if not whole:
            raise IncompleteCheckpointError(
                f"The checkpoint file {url} is not a complete torch.save archive: it was cut short or is not a "
                "checkpoint. Resume from an earlier checkpoint."
            )
        return "file", url
    if not fs.isdir(root):
        hint = ""
        if fs.exists(_fs(partial_url(url))[1]):
            hint = f" Only an unfinished save ({partial_url(url)}) is there; it cannot be loaded."
        raise FileNotFoundError(f"No checkpoint at {url}.{hint}")
    marker = _read_marker(url)
    if marker is None:
        raise IncompleteCheckpointError(
            f"The checkpoint directory {url} has no commit marker ({COMMIT_MARKER}): a save that did not finish, or "
            "a directory lightning_tp did not write. Resume from an earlier checkpoint."
        )
    data_url = join(url, marker["data"])
    data = posixpath.join(root, marker["data"])
    missing = [name for name in (DCP_INDEX, META_FILENAME) if not fs.isfile(posixpath.join(data, name))]
    if missing:
        raise IncompleteCheckpointError(
            f"The checkpoint directory {data_url} is incomplete: {'; '.join(f'{name} is missing' for name in missing)}"
            ". Resume from an earlier checkpoint."
        )

    def size_of(name: str) -> int | None:
        file = posixpath.join(data, name)
        return fs.size(file) if fs.isfile(file) else None

    check_shards(dcp_reader(data_url), data_url, size_of=size_of)
    return "directory", data_url


def download(url: str, local: str | os.PathLike) -> None:
    fs, path = _fs(url)
    fs.get_file(path, os.fspath(local))
