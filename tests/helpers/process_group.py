"""A one-process gloo group for unit tests that need a real process group and mesh (no port: an in-memory store)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def one_rank_mesh() -> Iterator:
    """A one-process gloo group and its 1-D mesh, torn down on exit."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
