"""TEMPORARY SHIM (branch fabric only): the announced ``parallelize`` API, borrowed from the Trainer strategy's setup
so that the Fabric strategy can be tested before the lead's pipeline lands on main. Replaced by main's module at the
merge; never merge this file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_tp.layout import DP_AXIS, DP_REPLICATE_AXIS, DP_SHARD_AXIS, TP_AXIS, ParallelLayout


@dataclass(frozen=True)
class ParallelOptions:
    tp_plan: Any = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_blocks: Any = None
    fsdp_param_dtype: Any = None
    precision: str = "32-true"


def parallelize(
    module: nn.Module,
    *,
    mesh: Any = None,
    tp_size: int | None = None,
    dp_shard_size: int | None = None,
    dp_replicate_size: int = 1,
    options: ParallelOptions | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    from lightning.pytorch.plugins.precision import Precision

    from lightning_tp.strategy import TensorParallelStrategy

    o = options or ParallelOptions()
    layout = ParallelLayout(
        tp_size=mesh[TP_AXIS].size(),
        dp_shard_size=mesh[DP_SHARD_AXIS].size(),
        dp_replicate_size=mesh[DP_REPLICATE_AXIS].size(),
    )
    s = TensorParallelStrategy(
        tp_plan=o.tp_plan,
        sequence_parallel=o.sequence_parallel,
        loss_parallel=o.loss_parallel,
        activation_checkpointing=o.activation_checkpointing,
        reshard_after_forward=o.reshard_after_forward,
        cpu_offload=o.cpu_offload,
        fsdp_blocks=o.fsdp_blocks,
        fsdp_param_dtype=o.fsdp_param_dtype,
    )
    s._layout = layout
    s._device_mesh = mesh
    s._dp_mesh = mesh[(DP_REPLICATE_AXIS, DP_SHARD_AXIS)]._flatten(DP_AXIS)
    root = nn.Module()
    root.add_module("model", module)
    s._lightning_module = root
    s.model = root
    s.parallel_devices = [device or torch.device("cpu")]
    plugin = Precision()
    plugin.precision = o.precision
    s.precision_plugin = plugin

    from lightning_tp.checkpoint import install_distributed_save_pretrained
    from lightning_tp.loading import materialize, materialize_modules
    from lightning_tp.lora import install_distributed_save, peft_models
    from lightning_tp.loss_parallel import install_loss_parallel
    from lightning_tp.plan import is_transformers_model
    from lightning_tp.tensor_parallel import apply_tensor_parallel, on_meta

    targets, extras = s._resolve_targets()
    s._take_rank_zero_values([m for m, _, p in targets if p is None] + extras)
    for m, plan, _ in targets:
        apply_tensor_parallel(m, s.tp_mesh, plan, device=s.root_device)
        if o.loss_parallel:
            install_loss_parallel(m)
    if o.activation_checkpointing:
        s._apply_activation_checkpointing(targets)
    if layout.dp_size > 1:
        s._apply_fsdp([m for m, _, _ in targets], extras)
    materialized = set()
    for m, plan, _ in targets:
        if on_meta(m) and is_transformers_model(m):
            materialize(m, s.root_device, tied=plan.tied)
            materialized.add(id(m))
    materialize_modules(root, s.root_device)
    for peft_model in peft_models(module):
        install_distributed_save(peft_model)
    for m, _, _ in targets:
        if is_transformers_model(m):
            install_distributed_save_pretrained(m)
    return module
