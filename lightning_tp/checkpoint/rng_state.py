"""Random states in checkpoints: Lightning does not save them, so dropout after a resume would draw other masks.
Each rank's states are gathered into the checkpoint and restored on the same layout."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from lightning_tp.compat import distributed_is_initialized


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
