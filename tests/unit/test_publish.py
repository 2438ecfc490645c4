"""Publishing and checking checkpoints, one process: the renames, links, and the errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_tp.checkpoint import IncompleteCheckpointError, check_checkpoint, partial_path, publish


def test_a_file_replaces_a_file_in_one_rename(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"step": 1}, path)
    torch.save({"step": 2}, partial_path(path))
    publish(path)
    assert torch.load(path)["step"] == 2 and not partial_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_directory_replaces_a_link_without_following_it(tmp_path: Path) -> None:
    """ModelCheckpoint(save_last="link") leaves `last.ckpt` a link to a top-k checkpoint, which must survive."""
    target = tmp_path / "epoch=0.ckpt"
    target.mkdir()
    (target / "meta.pt").write_bytes(b"kept")
    path = tmp_path / "last.ckpt"
    path.symlink_to(target)
    partial_path(path).mkdir()
    (partial_path(path) / "meta.pt").write_bytes(b"new")
    publish(path)
    assert not path.is_symlink() and (path / "meta.pt").read_bytes() == b"new"
    assert (target / "meta.pt").read_bytes() == b"kept"


def test_an_interrupted_publish_points_to_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    previous = tmp_path / ".last.ckpt.previous"
    previous.mkdir()
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint is whole at .*\.last\.ckpt\.previous"):
        check_checkpoint(path)


def test_a_directory_without_its_index_is_incomplete(tmp_path: Path) -> None:
    (tmp_path / "meta.pt").write_bytes(b"")
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata missing"):
        check_checkpoint(tmp_path)
