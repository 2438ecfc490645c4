"""Random numbers across the ranks of a sharded model, apart from initialisation (see
:mod:`lightning_tp.parallel.random_init`).

- DTensor's random ops (``torch.nn.init.*_`` or dropout on a DTensor) draw each shard from its own offset of one
  stream, so that sharded results equal one process's. torch creates that tracker lazily, at the first such op, with a
  broadcast over the world group (a hang if only some ranks run it). :func:`prepare_dtensor_random` creates it at
  setup, on every rank, without that collective: every rank's generator is left as the user seeded it (the same seed
  on every rank, as Lightning's ``seed_everything`` gives, is what DTensor's ops need).
- Dropout on plain tensors (what a Transformers layer's own ``dropout`` sees: its rank's heads, or under sequence or
  context parallelism its rank's tokens) draws from each rank's generator, which is the same on the ranks of a TP or
  CP group. Where dropout applies to replicated activations that is what keeps the replicas equal; where it applies
  to a rank's own heads or tokens, the shards get the same mask where one process would draw independent ones.
  :func:`warn_repeated_dropout` says so (Megatron keeps a second, per-TP-rank generator for those regions, which
  needs to know each dropout's region; the models this package trains have dropout off by default).
"""

from __future__ import annotations

import hashlib
import re
import warnings

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_tp.compat import install_dtensor_rng_tracker
from lightning_tp.layout import TP_AXIS, ParallelLayout

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def prepare_dtensor_random(mesh: DeviceMesh) -> bool:
    """See the module's docstring; every rank calls it. Whether DTensor's tracker exists after. The generator states
    of the mesh's device are then compared within each TP group (one all-gather of a digest; the TP ranks read the
    same batches, so their generators stay alike through training where they started alike): dropout on the
    activations a TP group holds in common needs them equal, and so do DTensor's random ops (torch's lazy tracker
    would have overwritten them with rank 0's). Other ranks may differ (data-parallel ranks seeded apart)."""
    exists = install_dtensor_rng_tracker(mesh)
    if TP_AXIS not in (mesh.mesh_dim_names or ()) or mesh[TP_AXIS].size() == 1:
        return exists
    tp_mesh = mesh[TP_AXIS]
    cpu = mesh.device_type == "cpu"
    state = torch.get_rng_state() if cpu else torch.get_device_module(mesh.device_type).get_rng_state()
    digests: list[str | None] = [None] * tp_mesh.size()
    digest = hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest()
    dist.all_gather_object(digests, digest, group=tp_mesh.get_group())
    if len(set(digests)) > 1 and tp_mesh.get_local_rank() == 0:  # said once per TP group that differs
        warnings.warn(
            f"The {mesh.device_type} random generators of the ranks of a TP group differ (seeded per rank?): dropout "
            "on the activations they hold in common would draw different masks on each, and DTensor's random ops "
            "(`torch.nn.init` on a sharded weight) would give replicas that differ. Seed every rank the same "
            "(`L.seed_everything(seed)`) before training.",
            stacklevel=2,
        )
    return exists


def active_dropout(root: nn.Module) -> list[str]:
    """Where ``root`` drops out, by module path (layer indices as ``*``): ``nn.Dropout`` modules with ``p > 0``, and
    float attributes named ``*dropout*`` above 0 (the rate a Transformers attention passes to its attention function,
    ``self.attention_dropout``)."""
    found: dict[str, None] = {}
    for name, module in root.named_modules():
        path = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)
        if isinstance(module, _DROPOUT) and module.p > 0:
            found[f"{path} (p={module.p})"] = None
        for key, value in vars(module).items():
            if "dropout" in key and isinstance(value, float) and value > 0:
                found[f"{path}.{key}={value}" if path else f"{key}={value}"] = None
    return list(found)


def warn_repeated_dropout(root: nn.Module, layout: ParallelLayout) -> None:
    """Warn, naming them, where dropout is on and TP or CP ranks split the activations it may apply to."""
    if layout.tp_size * layout.cp_size == 1:
        return
    found = active_dropout(root)
    if found:
        rank_zero_warn(
            f"Dropout is on ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}) and the ranks of a TP or CP "
            f"group ({layout}) share one random state: where dropout applies to a rank's own heads or tokens, every "
            "rank draws the same mask for its shard, where one process would draw independent ones. Training stays "
            "unbiased but not equal to one process's; set these rates to 0 (as most fine-tuning recipes do) for "
            "parity."
        )
