"""Every private name of torch, Lightning, Transformers and PEFT that lightning_tp uses, in one place (this package):
a new upstream release that moves one breaks here, and ``.ci/run-latest`` runs the tests on the newest releases to
find out.

Each entry says why it is used and which public alternative is missing. ``tests/unit/test_repo.py`` fails when another
module of the package imports a private name of those packages. Transformers and PEFT are imported where used (as
the package does elsewhere): importing this package costs nothing beyond torch and Lightning.

The entries live in one module per upstream package or concern, and every one of them is imported from here
(``from lightning_tp.compat import X``), whichever module holds it:

- :mod:`~lightning_tp.compat.torch_distributed`: process groups, device meshes, DTensor, pipelining schedules, DCP;
- :mod:`~lightning_tp.compat.torch_core`: fused ops, ``nn.Module``'s and tensors' private state, dynamo;
- :mod:`~lightning_tp.compat.torch_attention`: the fused attention kernels that return the log-sum-exp;
- :mod:`~lightning_tp.compat.transformers`: Transformers' internals;
- :mod:`~lightning_tp.compat.lightning`: Lightning's internals.
"""

from lightning_tp.compat.lightning import (
    CUDA_FLOPS,
    BackwardSyncControl,
    all_gather_ddp_if_available,
    clear_received_sigterm,
    cluster_environment,
    forget_loader_position,
    hpc_save_path,
    load_checkpoint,
    logs_this_step,
    model_checkpoint_dirs_from_file_urls,
    optimizers_to_device,
    record_module_device,
    replace_sigterm_broadcast,
    restore_sigterm_broadcast,
    set_device_mesh,
    set_sampler_epoch,
    strategy_timeout,
    sync_ddp_if_available,
)
from lightning_tp.compat.torch_attention import (
    cuda_flash_attention_kernels,
    fused_attention_kernels,
)
from lightning_tp.compat.torch_core import (
    add_compile_callbacks,
    assert_async,
    buffer_dict,
    compiled_graph_count,
    drop_always_called_hooks,
    foreach_mul_,
    foreach_norm,
    has_forward_pre_hook,
    is_view,
    module_slots,
    parameter_dict,
    remove_forward_hooks,
)
from lightning_tp.compat.torch_distributed import (
    compute_local_shape_and_global_offset,
    cutting_strided_shards,
    distributed_is_initialized,
    flatten_mesh,
    forward_only_actions,
    fsspec_reader_class,
    fsspec_writer_class,
    get_default_store,
    group_options,
    install_dtensor_rng_tracker,
    is_strided_shard,
    strided_shard,
    torch_get_layout,
)
from lightning_tp.compat.transformers import (
    FSDP_MANAGED_ATTR,
    attention_implementation,
    causal_lm_loss_function,
    config_value,
    decode_config_floats,
    is_hf_initialized,
    keys_to_ignore_on_save,
    layer_configs,
    mark_hf_initialized,
    no_split_modules,
    register_attention_implementation,
    remove_tied_weights_from_state_dict,
    remove_transformers_grad_allreduce,
    revert_weight_conversion,
    set_attention_implementation,
    set_loss_function,
    transformers_apply_expert_parallelism,
    uses_experts_interface,
    wrapped_initialize_weights,
)

__all__ = [
    "distributed_is_initialized",
    "get_default_store",
    "flatten_mesh",
    "group_options",
    "compute_local_shape_and_global_offset",
    "strided_shard",
    "is_strided_shard",
    "cutting_strided_shards",
    "install_dtensor_rng_tracker",
    "forward_only_actions",
    "fsspec_writer_class",
    "fsspec_reader_class",
    "torch_get_layout",
    "assert_async",
    "foreach_norm",
    "foreach_mul_",
    "parameter_dict",
    "module_slots",
    "buffer_dict",
    "drop_always_called_hooks",
    "has_forward_pre_hook",
    "remove_forward_hooks",
    "is_view",
    "add_compile_callbacks",
    "compiled_graph_count",
    "fused_attention_kernels",
    "cuda_flash_attention_kernels",
    "FSDP_MANAGED_ATTR",
    "is_hf_initialized",
    "mark_hf_initialized",
    "config_value",
    "layer_configs",
    "decode_config_floats",
    "no_split_modules",
    "keys_to_ignore_on_save",
    "remove_tied_weights_from_state_dict",
    "revert_weight_conversion",
    "remove_transformers_grad_allreduce",
    "transformers_apply_expert_parallelism",
    "uses_experts_interface",
    "attention_implementation",
    "set_attention_implementation",
    "set_loss_function",
    "register_attention_implementation",
    "causal_lm_loss_function",
    "wrapped_initialize_weights",
    "load_checkpoint",
    "BackwardSyncControl",
    "set_sampler_epoch",
    "all_gather_ddp_if_available",
    "sync_ddp_if_available",
    "optimizers_to_device",
    "CUDA_FLOPS",
    "clear_received_sigterm",
    "replace_sigterm_broadcast",
    "restore_sigterm_broadcast",
    "hpc_save_path",
    "model_checkpoint_dirs_from_file_urls",
    "cluster_environment",
    "set_device_mesh",
    "forget_loader_position",
    "record_module_device",
    "strategy_timeout",
    "logs_this_step",
]
