from datetime import timedelta

import pytest

from lightning_tp import ParallelLayout


@pytest.mark.parametrize(
    ("world", "kwargs", "expected"),
    [
        (4, {}, (4, 1, 1)),  # tp takes every rank
        (4, {"tp_size": 2}, (2, 2, 1)),  # the rest is FSDP
        (8, {"tp_size": 2, "dp_replicate_size": 2}, (2, 2, 2)),
        (8, {"dp_shard_size": 2, "dp_replicate_size": 2}, (2, 2, 2)),  # tp inferred
        (1, {}, (1, 1, 1)),
        (8, {"tp_size": 2, "cp_size": 2}, (2, 2, 1)),  # cp between the data-parallel axes and tp
        (8, {"cp_size": 4, "dp_shard_size": 1}, (2, 1, 1)),  # tp inferred from what cp and dp leave
    ],
)
def test_resolve_fills_in_sizes(world, kwargs, expected):
    layout = ParallelLayout.resolve(world, **kwargs)
    assert (layout.tp_size, layout.dp_shard_size, layout.dp_replicate_size) == expected
    assert layout.world_size == world
    assert layout.dp_size == world // layout.tp_size // layout.cp_size
    assert layout.fsdp_size == layout.dp_size * layout.cp_size
    assert layout.shard_size == layout.dp_shard_size * layout.cp_size


@pytest.mark.parametrize(
    ("world", "kwargs", "message"),
    [
        (6, {"tp_size": 4}, r"world size \(6\) is not divisible by tp_size=4.*\[1, 2, 3, 6\]"),
        (4, {"tp_size": 2, "dp_shard_size": 4}, r"1 \* 4 \* 1 \* 2 = 8, but the world size is 4"),
        (8, {"tp_size": 2, "cp_size": 3}, r"not divisible by tp_size \* cp_size=6"),
        (8, {"cp_size": 0}, r"`cp_size` must be a positive integer"),
        (16, {"tp_size": 2, "cp_size": 2, "dp_replicate_size": 3}, r"\(tp_size 2 \* cp_size 2\) = 4 ranks"),
        (4, {"dp_shard_size": 3}, r"not divisible by dp_replicate_size \* dp_shard_size"),
        (8, {"tp_size": 2, "dp_replicate_size": 3}, r"not divisible by dp_replicate_size=3"),
        (4, {"tp_size": 0}, r"`tp_size` must be a positive integer"),
        (4, {"tp_size": True}, r"`tp_size` must be a positive integer"),
        (4, {"dp_replicate_size": "2"}, r"`dp_replicate_size` must be a positive integer"),
    ],
)
def test_resolve_names_the_sizes_in_its_errors(world, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout.resolve(world, **kwargs)


def test_layout_is_frozen_and_validated():
    with pytest.raises(ValueError, match="dp_shard_size"):
        ParallelLayout(tp_size=2, dp_shard_size=0)
    layout = ParallelLayout(tp_size=2, dp_shard_size=2)
    with pytest.raises(AttributeError):
        layout.tp_size = 4  # type: ignore[misc]
    assert "tp=2" in str(layout)


def test_layout_names_cp_only_when_it_splits():
    assert "cp" not in str(ParallelLayout(tp_size=2, dp_shard_size=2))
    assert "x cp=2 x" in str(ParallelLayout(tp_size=2, cp_size=2))


def test_checkpoints_record_cp_only_when_it_splits():
    """A checkpoint written before the cp axis existed records the same sizes as one written without it."""
    from lightning_tp.checkpoint.state import layout_sizes

    assert layout_sizes(ParallelLayout(tp_size=2, dp_shard_size=2)) == {"tp": 2, "dp_shard": 2, "dp_replicate": 1}
    assert layout_sizes(ParallelLayout(tp_size=2, cp_size=2))["cp"] == 2


def test_meshes_are_built_once_per_world_group():
    """A second Trainer of the same layout (``fit`` then ``test``, a sweep) gets the first one's meshes: torch never
    frees a process group before the world group, so each mesh built anew would leak its groups' threads, sockets
    and, on NCCL, communicators. A new world group starts afresh."""
    import torch.distributed as dist

    from tests.helpers.process_group import one_rank_mesh

    layout = ParallelLayout(tp_size=1)
    with one_rank_mesh():
        first = layout.build_device_mesh("cpu")
        assert layout.build_device_mesh("cpu") == first and layout.build_device_mesh("cpu")[0] is first[0]
        other = layout.build_device_mesh("cpu", timeout=timedelta(seconds=30))
        assert other[0] is not first[0]  # another timeout: groups of its own
        groups = len(dist.distributed_c10d._world.pg_map)
        layout.build_device_mesh("cpu")
        assert len(dist.distributed_c10d._world.pg_map) == groups
    with one_rank_mesh():
        assert layout.build_device_mesh("cpu")[0] is not first[0]
