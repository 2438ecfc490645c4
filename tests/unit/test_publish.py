"""Publishing and checking checkpoints, one process: the renames, links, and the errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_tp.checkpoint.publish import check_save_target, clear_partial, partial_path, publish, publish_directory
from lightning_tp.checkpoint.validation import IncompleteCheckpointError, check_checkpoint


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


# ---------------------------------------------------------------------------------------------------------------------
# Never replace or remove what this package did not write


def _user_directory(path: Path) -> Path:
    """A run directory: notes, a tokenizer folder."""
    (path / "tokenizer").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    return path


def _user_files_intact(path: Path) -> bool:
    return (path / "notes.txt").read_text() == "mine" and (path / "tokenizer" / "tokenizer.json").is_file()


def _checkpoint_directory(path: Path, tag: bytes) -> Path:
    path.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (path / name).write_bytes(tag)
    torch.save({"tag": tag}, path / "meta.pt")
    return path


def test_save_into_a_directory_that_is_not_a_checkpoint_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Issue 11, defect 1: the default distributed save moved the run directory aside and deleted it."""
    from lightning_tp import TensorParallelStrategy

    run = _user_directory(tmp_path / "run")
    with pytest.raises(IsADirectoryError, match=r"Cannot save a checkpoint to .*run: .*not a checkpoint.*notes\.txt"):
        TensorParallelStrategy().save_checkpoint({"state_dict": {}}, run)  # refused before any collective
    assert _user_files_intact(run) and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # and if a staged save reached publish anyway (the directory appeared meanwhile), nothing is removed
    _checkpoint_directory(partial_path(run), b"new")
    with pytest.raises(FileExistsError, match="not written by a save of this package"):
        publish(run)
    assert _user_files_intact(run)


def test_a_checkpoint_directory_holding_other_files_is_not_replaced(tmp_path: Path) -> None:
    path = _checkpoint_directory(tmp_path / "last.ckpt", b"old")
    (path / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="notes.txt"):
        check_save_target(path)


def test_a_file_that_is_not_a_checkpoint_is_not_replaced_by_a_directory(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    path.write_text("my notes")
    with pytest.raises(FileExistsError, match="a file that is not a checkpoint"):
        check_save_target(path)
    _checkpoint_directory(partial_path(path), b"new")
    with pytest.raises(FileExistsError):
        publish(path)
    assert path.read_text() == "my notes"


def test_staging_paths_someone_else_made_are_not_removed(tmp_path: Path) -> None:
    for name in ("partial", "previous"):
        path = tmp_path / name / "last.ckpt"
        staging = tmp_path / name / f".last.ckpt.{name}"
        _user_directory(staging)
        with pytest.raises(FileExistsError, match=rf"{staging.name} exists and was not written by a save"):
            check_save_target(path)
        _checkpoint_directory(path, b"old")
        if name == "partial":
            with pytest.raises(FileExistsError, match="Refusing to remove"):
                clear_partial(path)
        else:
            _checkpoint_directory(partial_path(path), b"new")
            with pytest.raises(FileExistsError, match="Refusing to remove"):
                publish(path)
            assert torch.load(path / "meta.pt")["tag"] == b"old"
        assert _user_files_intact(staging)


def test_what_this_package_wrote_is_replaced(tmp_path: Path) -> None:
    """A checkpoint directory by a directory or a file, a file checkpoint by a directory, leftovers of a crash."""
    path = _checkpoint_directory(tmp_path / "last.ckpt", b"old")
    check_save_target(path)
    _checkpoint_directory(partial_path(path), b"new")
    publish(path)
    assert torch.load(path / "meta.pt")["tag"] == b"new"
    torch.save({"tag": b"file"}, partial_path(path))
    check_save_target(path)
    publish(path)
    assert path.is_file() and torch.load(path)["tag"] == b"file"
    _checkpoint_directory(partial_path(path), b"dir")
    publish(path)
    assert torch.load(path / "meta.pt")["tag"] == b"dir"
    # a save killed while writing left a staging directory with some shards, or a file cut short: both are ours
    _checkpoint_directory(partial_path(path), b"cut")
    (partial_path(path) / ".metadata").rename(partial_path(path) / ".metadata.tmp")  # DCP's name while writing it
    clear_partial(path)
    partial_path(path).write_bytes(b"PK\x03\x04cut")
    clear_partial(path)
    # killed between the two renames: the previous checkpoint is whole, and removed once a new one is in place
    path.rename(tmp_path / ".last.ckpt.previous")
    _checkpoint_directory(partial_path(path), b"after")
    check_save_target(path)
    publish(path)
    assert torch.load(path / "meta.pt")["tag"] == b"after"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_link_is_replaced_and_its_target_kept_whatever_it_is(tmp_path: Path) -> None:
    """ModelCheckpoint(save_last="link"): `last.ckpt` links to a checkpoint, or to anything a user pointed it at."""
    for kind in ("file", "directory"):
        target = _user_directory(tmp_path / f"{kind}_target")
        path = tmp_path / f"{kind}_last.ckpt"
        path.symlink_to(target)
        check_save_target(path)
        if kind == "file":
            torch.save({"tag": b"new"}, partial_path(path))
        else:
            _checkpoint_directory(partial_path(path), b"new")
        publish(path)
        assert not path.is_symlink() and _user_files_intact(target)


def test_publish_directory_refuses_a_file_before_writing(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("mine")
    with pytest.raises(NotADirectoryError, match="is a file"):
        with publish_directory(tmp_path / "out") as tmp:
            raise AssertionError(f"nothing may be written ({tmp})")
    assert (tmp_path / "out").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_model_checkpoint_removes_only_what_was_written(tmp_path: Path) -> None:
    """`ModelCheckpoint` drops checkpoints it no longer keeps through `strategy.remove_checkpoint` (Lightning's own
    removes the path recursively, whatever it holds)."""
    from lightning_tp import TensorParallelStrategy

    strategy = TensorParallelStrategy()
    written = _checkpoint_directory(tmp_path / "epoch=0.ckpt", b"old")
    strategy.remove_checkpoint(written)
    assert not written.exists()
    run = _user_directory(tmp_path / "epoch=1.ckpt")  # a user's files under the name of a checkpoint
    with pytest.warns(UserWarning, match=r"Refusing to remove .*epoch=1\.ckpt.*kept"):
        strategy.remove_checkpoint(run)
    assert _user_files_intact(run)
    link = tmp_path / "last.ckpt"
    link.symlink_to(run)
    strategy.remove_checkpoint(link)
    assert not link.is_symlink() and _user_files_intact(run)


@pytest.fixture
def two_rank_store():
    """A process group of 2 of which this process is rank 0, over an in-memory store, as the collective saves' arrival
    check sees it (the fake backend runs no collective; the check uses the store alone)."""
    import torch.distributed as dist

    from lightning_tp.compat import get_default_store

    dist.init_process_group("fake", rank=0, world_size=2, store=dist.HashStore())
    try:
        yield get_default_store()
    finally:
        dist.destroy_process_group()


def test_a_save_the_other_ranks_do_not_call_fails_after_a_bounded_wait(two_rank_store, monkeypatch) -> None:
    """Rank 0 alone in `save_pretrained` (under `if trainer.is_global_zero:`): a clear error once the wait is over,
    instead of an all-gather that NCCL waits in until its timeout."""
    from datetime import timedelta

    from lightning_tp.checkpoint import publish

    monkeypatch.setattr(publish, "ARRIVAL_TIMEOUT", timedelta(seconds=0.2))
    with pytest.raises(RuntimeError, match=r"every rank must call it .* 1 of 2 ranks called it: the others did not"):
        publish.arrive_together("`save_pretrained`")


def test_a_rank_at_a_barrier_releases_a_rank_waiting_in_a_save(two_rank_store, monkeypatch) -> None:
    """The other side: rank 1 reaches the strategy's barrier while rank 0 waits in a save rank 1 skipped. Rank 1
    raises there and leaves the reason for rank 0, which raises at once (long before its timeout)."""
    import time

    from lightning_tp.checkpoint import publish

    waiting = f"{publish._ARRIVALS}/{publish._arrived + 1}"
    publish.refuse_waiting_saves("the strategy's barrier")  # nobody waits: nothing happens
    two_rank_store.add(waiting, 1)  # rank 1's view: rank 0 arrived at a save this process has not called
    with pytest.raises(RuntimeError, match=r"1 of 2 ranks called it: rank 0 reached the strategy's barrier instead"):
        publish.refuse_waiting_saves("the strategy's barrier")
    two_rank_store.add(waiting, -1)  # rank 0's view now: it arrives at that save and finds the reason
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="reached the strategy's barrier instead"):
        publish.arrive_together("`save_pretrained`")
    assert time.monotonic() - start < publish.ARRIVAL_TIMEOUT.total_seconds() / 10


def test_a_rank_whose_process_exited_releases_a_rank_waiting_in_a_save(two_rank_store) -> None:
    from lightning_tp.checkpoint import publish

    two_rank_store.add(publish._EXITED, 1)  # what the other rank's exit hook leaves
    with pytest.raises(RuntimeError, match="another rank's process has exited"):
        publish.arrive_together("`save_merged`")
