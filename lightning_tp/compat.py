"""Every private name of torch, Lightning, Transformers and PEFT that lightning_tp uses, in one place: a new upstream
release that moves one breaks here, and ``.ci/run-latest`` runs the tests on the newest releases to find out.

Each entry says why it is used and which public alternative is missing. ``tests/unit/test_repo.py`` fails when another
module of the package imports a private name of those packages. Transformers and PEFT are imported where used (as
the package does elsewhere): importing this module costs nothing beyond torch and Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _load_checkpoint as load_checkpoint
from lightning.fabric.strategies.strategy import _BackwardSyncControl as BackwardSyncControl
from lightning.fabric.utilities.data import _set_sampler_epoch as set_sampler_epoch
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_ddp_if_available
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.throughput import _CUDA_FLOPS as CUDA_FLOPS
from torch import nn

if TYPE_CHECKING:
    import lightning as L
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "add_compile_callbacks",
    "CUDA_FLOPS",
    "BackwardSyncControl",
    "FSDP_MANAGED_ATTR",
    "all_gather_ddp_if_available",
    "assert_async",
    "attention_implementation",
    "install_dtensor_rng_tracker",
    "buffer_dict",
    "causal_lm_loss_function",
    "clear_received_sigterm",
    "cluster_environment",
    "compiled_graph_count",
    "compute_local_shape_and_global_offset",
    "config_value",
    "cuda_flash_attention_kernels",
    "distributed_is_initialized",
    "drop_always_called_hooks",
    "flatten_mesh",
    "foreach_mul_",
    "foreach_norm",
    "fsspec_reader_class",
    "fsspec_writer_class",
    "fused_attention_kernels",
    "get_default_store",
    "group_options",
    "hpc_save_path",
    "model_checkpoint_dirs_from_file_urls",
    "is_hf_initialized",
    "keys_to_ignore_on_save",
    "layer_configs",
    "load_checkpoint",
    "mark_hf_initialized",
    "no_split_modules",
    "optimizers_to_device",
    "parameter_dict",
    "register_attention_implementation",
    "remove_tied_weights_from_state_dict",
    "replace_sigterm_broadcast",
    "restore_sigterm_broadcast",
    "set_attention_implementation",
    "forget_loader_position",
    "forward_only_actions",
    "record_module_device",
    "set_device_mesh",
    "remove_transformers_grad_allreduce",
    "revert_weight_conversion",
    "set_sampler_epoch",
    "strategy_timeout",
    "sync_ddp_if_available",
    "torch_get_layout",
    "wrapped_initialize_weights",
]

# Lightning (imported above under public names):
# - `load_checkpoint`: ModelParallelStrategy's DCP loader, shared with its Fabric twin; no public function.
# - `set_sampler_epoch`: sets the epoch of a dataloader's sampler wherever Lightning keeps it; no public helper.
# - `all_gather_ddp_if_available`, `sync_ddp_if_available`: Lightning's gather/reduce on a group, what its own
#   strategies call; the public `Strategy.all_gather`/`reduce` are what we implement with them.
# - `optimizers_to_device`: moves optimizer states after a checkpoint load, as Lightning's strategies do.
# - `CUDA_FLOPS`: Lightning's table of dense peak FLOPs per GPU; `get_available_flops` does not know the H200.
# - `BackwardSyncControl`: the base of what `fabric.no_backward_sync` calls; Fabric's strategies set one, privately.


# ------------------------------------------------------------------------------------------------------------- torch


def distributed_is_initialized() -> bool:
    """Whether a default process group exists (the one spelling of it in the package). ``is_initialized`` exists only
    where torch was built with distributed support, hence ``is_available`` first (Lightning's private helper does the
    same)."""
    return dist.is_available() and dist.is_initialized()


def get_default_store() -> dist.Store:
    """The c10d store every process of the job shares (a rank waits there longer than a collective's timeout allows);
    torch has no public accessor."""
    return dist.distributed_c10d._get_default_store()


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: Any = None) -> DeviceMesh:
    """One 1-D mesh over several axes of ``mesh``: ``DeviceMesh._flatten``, what torchtitan uses; no public API yet."""
    return mesh._flatten(name, backend_override=backend_override)


def group_options(backend: str, timeout: timedelta) -> Any:
    """Backend options that carry ``timeout`` into the groups ``init_device_mesh`` and :func:`flatten_mesh` create:
    torch reads it from the private ``options._timeout``. NCCL insists on its own (public) options class; for the
    others the base class has no public constructor (``torch._C._distributed_c10d.Backend.Options``)."""
    if "nccl" in backend and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for the groups it builds itself
    else:
        from torch._C._distributed_c10d import Backend

        options = Backend.Options(backend, timeout)
    options._timeout = timeout
    return options


def compute_local_shape_and_global_offset(
    shape: torch.Size, mesh: DeviceMesh, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and offset in a DTensor of ``shape`` (torch's own chunking rule, uneven sizes too);
    DTensor exposes no public equivalent (``torch.distributed.tensor._utils``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as compute

    return compute(shape, mesh, placements)


def strided_shard(dim: int, split_factor: int) -> Any:
    """The placement of a tensor packed from ``split_factor`` blocks on ``dim``, each rank holding its slice of every
    block (torch's ``_StridedShard``, private; Transformers' ``packed_colwise`` uses it too)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether a placement is torch's private ``_StridedShard`` (see :func:`strided_shard`)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


@contextmanager
def cutting_strided_shards(misplaced: Callable[[Any], bool]) -> Iterator[None]:
    """Within the block, torch's ``_distribute_tensors`` (``set_model_state_dict``/``set_optimizer_state_dict`` with
    ``full_state_dict`` and ``broadcast_from_rank0``: Lightning's load of a full checkpoint file) cuts right what it
    cuts wrong. It cuts each rank's shard as the contiguous chunk at the offset
    ``compute_local_shape_and_global_offset`` gives, which for a DTensor where ``misplaced`` holds (a lone
    ``_StridedShard``; torch 2.13 to 2.15, whose function is the same) is neither that chunk nor the rank's blocks:
    rows of the whole are lost. Those are cut by ``distribute_tensor`` from the whole each rank holds (no
    communication); every other key as torch does. A patch of torch's module through
    :func:`lightning_tp.patches.patched`, undone on leaving the block; a nested block reuses the outer one's."""
    from torch.distributed import _state_dict_utils as utils
    from torch.distributed.tensor import distribute_tensor

    from lightning_tp import patches

    if patches.installed(utils, "_distribute_tensors") is not None:
        yield
        return
    original = utils._distribute_tensors

    def _distribute_tensors(local_state_dict: dict, keys: list, device: Any, pg: Any = None) -> None:
        rest = []
        for key in keys:
            entry = local_state_dict.get(key)
            if entry is None or torch.is_tensor(entry) or not misplaced(entry[0]):
                rest.append(key)
                continue
            local_state, whole = entry
            cut = distribute_tensor(whole, local_state.device_mesh, local_state.placements, src_data_rank=None)
            if local_state.is_meta:
                local_state_dict[key] = cut
            else:
                local_state.to_local().copy_(cut.to_local())
                local_state_dict[key] = local_state
        original(local_state_dict, rest, device, pg)

    with patches.patched(utils, "_distribute_tensors", _distribute_tensors):
        yield


def install_dtensor_rng_tracker(mesh: DeviceMesh) -> bool:
    """Create DTensor's random-number tracker for ``mesh`` now, without synchronising the generators (no collective),
    unless one exists or the device has none (CPU). Returns whether one exists afterwards. torch otherwise creates it
    at the first random DTensor op, with a broadcast of rank 0's CUDA state over the world group: that op then hangs
    if only some ranks run it, and it overwrites every rank's CUDA generator. The tracker is a private global."""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None and mesh.device_type != "cpu" and _random.is_rng_supported_mesh(mesh):
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)
    return _random._rng_tracker is not None


def forward_only_actions(schedule: Any) -> None:
    """Keep only the forward actions (and their sends, receives and FSDP2 unshards/reshards) of each rank's list in
    a V-shaped schedule (``ZBVZeroBubble``, ``DualPipeV``). Why: its ``eval()`` still runs the backward actions (torch
    2.13 to 2.15): on 2.13 one of them, handing an input gradient to the adjacent stage on the same rank, asserts that
    the stage has a backward; on 2.15 the ranks block in a receive until the process group's timeout (measured without
    this rewrite: gloo, 120 s). Its action lists (``pipeline_order_with_comms``) and their kinds are private; no public
    forward-only mode of these schedules works.

    torch 2.15 retires each send by an explicit ``WAIT_SEND_F``/``WAIT_SEND_B`` action (placed after the backward
    that proves the peer received it) and fails a step that leaves one unwaited ("Pipeline sends have no matching
    wait"): the forward sends' waits are kept, where torch put them. torch 2.13 and 2.14 have no such kind (they wait
    on every send at the end of the step). Dropping actions from every rank's list never deadlocks a list that did not:
    each kept action waits only on kept actions of other ranks, in the same order as before."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    kept = {Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.UNSHARD, Kind.RESHARD}
    if hasattr(Kind, "WAIT_SEND_F"):  # torch >= 2.15
        kept.add(Kind.WAIT_SEND_F)
    for rank, actions in schedule.pipeline_order_with_comms.items():
        schedule.pipeline_order_with_comms[rank] = [a for a in actions if a is not None and a.computation_type in kept]


def assert_async(condition: torch.Tensor, message: str) -> None:
    """A device-side assert (no host sync on GPU), as torch's own losses check their targets; no public spelling."""
    torch._assert_async(condition, message)


def foreach_norm(tensors: list[torch.Tensor], norm_type: float, *, dtype: torch.dtype) -> list[torch.Tensor]:
    """One norm per tensor in one fused kernel, what ``torch.nn.utils.clip_grad_norm_`` runs itself; the public
    ``get_total_norm`` reduces them to one number, and we combine norms of several meshes ourselves."""
    return torch._foreach_norm(tensors, norm_type, dtype=dtype)


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """In-place scaling of many tensors in one kernel (``clip_grad_norm_``'s own step); no public spelling."""
    torch._foreach_mul_(tensors, scalar)


def fsspec_writer_class() -> type:
    """DCP's fsspec writer: public from torch 2.15 (``torch.distributed.checkpoint.FsspecWriter``); torch 2.13 and 2.14
    have only the private ``_fsspec_filesystem`` module, which 2.15 deprecates with a warning at its import."""
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "FsspecWriter"):  # torch >= 2.15
        return dcp.FsspecWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def fsspec_reader_class() -> type:
    """DCP's fsspec reader, public or private as :func:`fsspec_writer_class` says."""
    import torch.distributed.checkpoint as dcp

    if hasattr(dcp, "FsspecReader"):  # torch >= 2.15
        return dcp.FsspecReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def torch_get_layout() -> Callable[[str], Any]:
    """What a DCP index pickles to name a tensor layout (``torch.serialization._get_layout``): the safe unpickler
    must hand back this very function."""
    return torch.serialization._get_layout


def parameter_dict(module: nn.Module) -> dict[str, Any]:
    """``module._parameters``: name -> parameter held by the module itself. Assigning into it swaps a tensor in
    without ``register_parameter``'s type check (a plain-tensor view in forward) and without hooks; nn.Module has no
    public setter that does."""
    return module._parameters


def module_slots(module: nn.Module) -> list[str]:
    """The names of ``module``'s child slots in registration order, empty ones (``None``) included:
    ``named_children()`` skips those, and a pipeline rank keeps the other stages' modules as ``None`` in their slots,
    whose order still says where a module comes in the whole model."""
    return list(module._modules)


def buffer_dict(module: nn.Module) -> dict[str, Any]:
    """``module._buffers``, for the same reason as :func:`parameter_dict`."""
    return module._buffers


def drop_always_called_hooks(module: nn.Module) -> int:
    """Make ``module``'s forward hooks registered with ``always_call=True`` ordinary ones (run after a forward that
    returns, not after one that raises), emptying its private ``_forward_hooks_always_called``; returns how many.

    Why: dynamo (torch 2.13 to 2.15) guards a compiled module's graph on ``hook_id in
    self._forward_hooks_always_called`` for every submodule with such a hook (``Module._call_impl``), and hook ids are
    one counter for the whole process, so the decoder layers, which share one code object, fail each other's guards:
    one recompilation per layer, and the layers past ``torch._dynamo.config.recompile_limit`` run uncompiled. Inside a
    compiled layer the flag buys nothing: the hooks' mutations (a parameter swapped for its local tensor and put back)
    are side effects dynamo applies after its graph has run, so a graph that raises leaves none behind. No public way
    to unset it: ``RemovableHandle`` removes the hook itself."""
    always_called = module._forward_hooks_always_called
    count = len(always_called)
    always_called.clear()
    return count


def add_compile_callbacks(start: Callable[[], None], end: Callable[[], None]) -> Callable[[], None]:
    """Call ``start`` when torch.compile (dynamo) begins compiling in this process and ``end`` when it is done (the
    outermost compilation: nested ones do not call them again); returns what removes them. torch runs them on the
    compiling thread (``torch._dynamo.callback.callback_handler``, which passes a ``CallbackArgs`` dropped here); no
    public registration."""
    from torch._dynamo.callback import callback_handler

    def on_start(*_args: Any) -> None:
        start()

    def on_end(*_args: Any) -> None:
        end()

    callback_handler.register_start_callback(on_start)
    callback_handler.register_end_callback(on_end)

    def remove() -> None:
        callback_handler.remove_start_callback(on_start)
        callback_handler.remove_end_callback(on_end)

    return remove


def compiled_graph_count() -> int:
    """The graphs dynamo has built in this process so far (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``;
    ``torch.compiler.reset()`` does not clear it): a recompilation builds one more. torch has no public count."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ------------------------------------------------------------------------------------------------------ Transformers

#: Transformers' mark of a model it sharded with FSDP2 itself (``transformers/distributed/fsdp.py``): ``generate``
#: then defaults to ``synced_gpus=True`` when the world has more than one rank. No public switch.
FSDP_MANAGED_ATTR = "_is_fsdp_managed_module"

#: Transformers' mark of a tensor its weight initialisation must leave alone (loaded from a checkpoint).
_HF_INITIALIZED_ATTR = "_is_hf_initialized"


def is_hf_initialized(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _HF_INITIALIZED_ATTR, False)


def mark_hf_initialized(tensor: torch.Tensor) -> None:
    """Make Transformers' ``initialize_weights`` skip ``tensor``, as its own loading does; no public API."""
    setattr(tensor, _HF_INITIALIZED_ATTR, True)


def config_value(config: Any, name: str, *, default: Any = None) -> Any:
    """``config.<name>``, or ``default`` where the config has no single value: a heterogeneous config (values per
    layer, ``per_layer_config``) raises Transformers' ``AmbiguousGlobalPerLayerAttributeError`` on a global read of
    a per-layer attribute (Dots 3's head counts); its opt-in flag is internal."""
    try:
        return getattr(config, name, default)
    except RuntimeError as err:
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":  # its module path is internal
            raise
        return default


def layer_configs(config: Any) -> list[Any]:
    """The per-layer configs of a heterogeneous config (``per_layer_config``), else ``[config]``."""
    if not getattr(config, "is_heterogeneous", False):
        return [config]
    return list(config.per_layer_config)


def decode_config_floats(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict as ``to_json_string`` wrote it, with infinity and NaN (written ``{"__float__": "Infinity"}``)
    back as floats (Nemotron-H's ``time_step_limit``): Transformers' private decoder of its own encoding."""
    from transformers import PreTrainedConfig

    return PreTrainedConfig._decode_special_floats(values)


def no_split_modules(module: nn.Module) -> Iterable[str]:
    """The class names Transformers keeps whole when splitting a model (``_no_split_modules``, a class attribute):
    our default FSDP2 units. No public accessor."""
    return getattr(module, "_no_split_modules", None) or ()


def keys_to_ignore_on_save(model: nn.Module) -> Iterable[str]:
    """The state-dict names ``save_pretrained`` leaves out (``_keys_to_ignore_on_save``); no public accessor."""
    return getattr(model, "_keys_to_ignore_on_save", None) or ()


def remove_tied_weights_from_state_dict(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``save_pretrained``'s own de-duplication of tied weights (``transformers.modeling_utils``, not exported)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict as remove

    return remove(state, model)


def revert_weight_conversion(model: nn.Module, state: dict[str, Any]) -> dict[str, Any] | None:
    """``save_pretrained``'s renaming back to a checkpoint's original layout (``transformers.core_model_loading``, not
    exported), or ``None`` where Transformers has none."""
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:  # pragma: no cover - older Transformers
        return None
    return revert(model, state)


def remove_transformers_grad_allreduce(module: nn.Module) -> None:
    """Undo Transformers' ``replicated_with_grad_allreduce`` layer on a module that ``from_pretrained`` sharded: 5.24
    replaces the instance's ``forward``, 5.25 registers a forward pre-hook (a local function of
    ``ReplicatedWithGradAllReduce.install_forward``) that hooks each parameter's gradient with an all-reduce of a plain
    tensor. This package sums that gradient itself, on the replicated DTensor it makes of the parameter."""
    module.__dict__.pop("forward", None)
    hooks = module._forward_pre_hooks
    for key, hook in list(hooks.items()):
        if "ReplicatedWithGradAllReduce." in getattr(hook, "__qualname__", ""):
            del hooks[key]


def remove_forward_hooks(module: nn.Module, marker: str) -> int:
    """Remove the forward hooks of ``module`` whose function carries the attribute ``marker`` (hooks this package
    registered, found again without keeping their handles anywhere: torch's public handles are per registration,
    the hooks themselves live in the module's private ``_forward_hooks``); returns how many."""
    hooks = module._forward_hooks
    marked = [key for key, hook in hooks.items() if getattr(hook, marker, False)]
    for key in marked:
        del hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    return len(marked)


def transformers_apply_expert_parallelism() -> Callable[..., Any]:
    """Transformers' expert parallelism (``grouped_gemm`` weights, ``ep_dispatch_experts`` all-to-all dispatch) on a
    built model: internal, like its TP."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    return apply_expert_parallelism


def logs_this_step(trainer: Any) -> bool:
    """Whether the Trainer's loggers write this training step's metrics (``log_every_n_steps``), as Lightning decides
    it (``_logger_connector.should_update_logs``, private)."""
    return bool(trainer._logger_connector.should_update_logs)


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another (``Tensor._is_view``: no public spelling)."""
    return tensor._is_view()


def uses_experts_interface(experts: Any) -> bool:
    """Whether an experts module goes through Transformers' experts interface (``@use_experts_implementation``, which
    sets ``_is_expert_parallel``): its expert-parallel dispatch relies on it to skip the expert ids of other ranks."""
    return hasattr(experts, "_is_expert_parallel")


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a Transformers config selects (``config._attn_implementation``: the models read
    it at every forward; ``attn_implementation`` is only the constructor's argument)."""
    return config._attn_implementation


def set_attention_implementation(config: Any, name: str) -> None:
    """Select an implementation registered with ``AttentionInterface.register`` for one model's config, without the
    checks of ``PreTrainedModel.set_attn_implementation`` (which loads kernels and refuses names it does not ship);
    the config's setter passes it on to the sub-configs."""
    config._attn_implementation = name


def fused_attention_kernels(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[Callable, Callable, bool] | None:
    """torch's fused attention kernels that return the log-sum-exp of each query's scores, which blockwise
    attention (:mod:`lightning_tp.parallel.blockwise`) merges partial results with, for ``device`` and ``dtype``:
    ``(forward, backward, takes_mask)``, or ``None``. SDPA, the public entry, returns the outputs only; the public
    kernels that return the log-sum-exp (``flex_attention(return_lse=True)``, ``torch.nn.attention.varlen``) take
    their backward through autograd from each call's own outputs, where the tiles recompute each call's gradient from
    the merged outputs and log-sum-exp (``O(L)`` kept per layer), and ``varlen`` runs on CUDA only.

    - CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype, an additive mask of
      the query's dtype, grouped-query attention).
    - CUDA, fp16/bf16, compute capability 8.0 or later: ``aten._scaled_dot_product_flash_attention`` and its backward
      (no mask: masked calls take the explicit path; head dims of at most 256, a multiple of 8), built by
      :func:`cuda_flash_attention_kernels`.

    ``forward(q, k, v, *, is_causal, bias, scale) -> (out, lse)`` and ``backward(grad, q, k, v, out, lse, *,
    is_causal, bias, scale) -> (dq, dk, dv)`` on ``(batch, heads, length, head_dim)`` tensors; ``lse`` fp32
    ``(batch, heads, queries)``; ``is_causal`` aligns the causal mask to the first key (the calls' are square).
    Present, with these signatures, in torch 2.13 to 2.15 (the declared range). Each call makes a new pair: a
    backward belongs to the pair whose forward ran (the CUDA backward takes arguments from it)."""
    if device.type == "cpu":
        forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

        def cpu_forward(q, k, v, *, is_causal, bias, scale):
            return forward_op(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)

        def cpu_backward(grad, q, k, v, out, lse, *, is_causal, bias, scale):
            return backward_op(grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale)

        return cpu_forward, cpu_backward, True
    flash = head_dim <= 256 and head_dim % 8 == 0  # what the CUDA kernel takes unpadded (SDPA pads the others)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash:
        if torch.cuda.get_device_capability(device) < (8, 0):  # flash attention 2 needs Ampere or later
            return None
        return cuda_flash_attention_kernels()
    return None


def cuda_flash_attention_kernels() -> tuple[Callable, Callable, bool]:
    """CUDA's flash attention (``aten._scaled_dot_product_flash_attention`` and its backward) as
    :func:`fused_attention_kernels` returns it, without dropout, the key heads repeated to the query heads; on any
    device the ops have a kernel for (the meta device's check the calls in the CPU suite).

    The backward's arguments are what torch's own callers pass, the autograd formula of the forward and the ring
    attention of ``torch.distributed.tensor.experimental._context_parallel._attention`` (which passes one forward's
    outputs to every step of its backward): the forward's ``cum_seq_q``/``cum_seq_k`` (undefined, ``None``: ATen takes
    its variable-length path whenever ``cum_seq_q`` is defined, where FlashAttention-2 requires int32 offsets of the
    rows), ``max_q``/``max_k`` (the call's lengths), and its philox seed and offset (read under dropout only; this
    pair runs none, so the latest forward's are every backward's, as torch's ring attention passes them)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
    rng: list[Any] = []  # the latest forward's (philox_seed, philox_offset)

    def repeat(q, k):
        groups = q.shape[1] // k.shape[1]
        return groups, (lambda t: t.repeat_interleave(groups, dim=1) if groups > 1 else t)

    def cuda_forward(q, k, v, *, is_causal, bias, scale):
        assert bias is None, "the CUDA flash kernel takes no mask"
        _, expand = repeat(q, k)
        out, lse, _cum_q, _cum_k, _max_q, _max_k, seed, offset, _debug = flash(
            q, expand(k), expand(v), 0.0, is_causal, False, scale=scale
        )
        rng[:] = (seed, offset)
        return out, lse

    def cuda_backward(grad, q, k, v, out, lse, *, is_causal, bias, scale):
        assert bias is None, "the CUDA flash kernel takes no mask"
        assert rng, "the backward of a pair whose forward has not run"
        groups, expand = repeat(q, k)
        grad, q, out, lse = (t.contiguous() for t in (grad, q, out, lse))
        dq, dk, dv = flash_backward(
            grad,
            q,
            expand(k).contiguous(),
            expand(v).contiguous(),
            out,
            lse,
            None,  # cum_seq_q: the dense path
            None,  # cum_seq_k
            q.shape[2],  # max_q: the forward's (the query's length)
            k.shape[2],  # max_k
            0.0,
            is_causal,
            *rng,
            scale=scale,
        )
        if groups > 1:
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (v.shape[1], groups)).sum(2)
        return dq, dk, dv

    return cuda_forward, cuda_backward, False


def register_attention_implementation(
    name: str, *, attention: Callable[..., Any], mask: Callable[..., Any], owner: object
) -> None:
    """Register ``attention`` and ``mask`` under ``name`` in Transformers' attention and mask interfaces, for
    ``owner``: a strategy's teardown gives them up (:func:`lightning_tp.patches.undo_owned`), and the last owner's
    removes them. Transformers' ``register`` (public) has no counterpart that removes an entry, so the entries of the
    registries' class-level mappings (``_global_mapping``, private) are set and removed through
    :func:`lightning_tp.patches.install_entry`. Registering the same functions again for another owner shares them.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from lightning_tp import patches

    for interface, function in ((AttentionInterface, attention), (AttentionMaskInterface, mask)):
        mapping = interface._global_mapping
        existing = patches.installed_entry(interface, mapping, name)
        if existing is not None and existing.value is function:
            existing.add_owner(owner)
        else:
            if existing is not None:
                existing.undo()
            patches.install_entry(interface, mapping, name, function, owner=owner)


def causal_lm_loss_function() -> Callable[..., Any]:
    """Transformers' ``ForCausalLMLoss``, what ``PreTrainedModel.loss_function`` resolves to for causal LMs; its
    module (``transformers.loss.loss_utils``) is not exported."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


@contextmanager
def wrapped_initialize_weights(
    models: Iterable[nn.Module], wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """Inside the block, each of ``models`` (Transformers models) runs ``wrap(original)`` as its private
    ``_initialize_weights(module)``, the per-module step of the public ``initialize_weights``; there is no public hook
    around it. Instances that carry their own already are left alone; every wrapper is removed on exit."""
    attr = "_initialize_weights"
    wrapped = []
    try:
        for model in models:
            if attr not in model.__dict__:
                setattr(model, attr, wrap(getattr(model, attr)))
                wrapped.append(model)
        yield
    finally:
        for model in wrapped:
            delattr(model, attr)


# --------------------------------------------------------------------------------------------------------- Lightning


def clear_received_sigterm(trainer: L.Trainer) -> None:
    """Reset the Trainer's SIGTERM flag: ``trainer.received_sigterm`` has no public setter."""
    trainer._signal_connector.received_sigterm = False


def replace_sigterm_broadcast(loop: Any, broadcast: Callable[[], None]) -> None:
    """Replace the epoch loop's per-batch broadcast of the SIGTERM flag (``_broadcast_sigterm_tensor``, private);
    undo with :func:`restore_sigterm_broadcast`."""
    loop._broadcast_sigterm_tensor = broadcast


def restore_sigterm_broadcast(loop: Any) -> None:
    loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def hpc_save_path(trainer: L.Trainer) -> str:
    """Lightning's name for the next HPC checkpoint (``hpc_ckpt_{max + 1}.ckpt``, which ``ckpt_path="hpc"`` resolves
    to the newest of); only its private checkpoint connector knows the rule."""
    return trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)


def model_checkpoint_dirs_from_file_urls(callbacks: Iterable[Any]) -> None:
    """Point each ``ModelCheckpoint`` built with ``dirpath="file:///abs/dir"`` at ``/abs/dir`` (call it before the
    callbacks' ``setup``). Why: Lightning 2.6.6's ``ModelCheckpoint.__init__`` (its private ``__init_ckpt_dir``) takes
    ``os.path.realpath`` of every local-protocol dirpath, a ``file://`` URL included, so the URL already reads
    ``<cwd>/file:/abs/dir`` when any hook of a strategy runs, and checkpoints would land under the working directory.
    The URL is recovered from that shape only where its realpath gives exactly this dirpath (a relative dirpath that
    starts with a directory named ``file:`` reads the same, and is taken as the URL too)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    mangled_head = os.path.join(os.path.realpath(os.getcwd()), "file:")
    for callback in callbacks:
        dirpath = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
        if not isinstance(dirpath, str) or not dirpath.startswith(mangled_head + os.sep):
            continue
        local = dirpath[len(mangled_head) :]  # "/abs/dir"
        if os.path.realpath(os.path.expanduser(f"file://{local}")) == dirpath:  # what __init_ckpt_dir does
            callback.dirpath = local


def cluster_environment(trainer: L.Trainer) -> Any:
    """The Trainer's cluster environment where Lightning's signal handling reads it (a single-device strategy has no
    ``cluster_environment`` attribute of its own)."""
    return trainer._accelerator_connector.cluster_environment


def set_device_mesh(module: L.LightningModule, mesh: DeviceMesh) -> None:
    """Give a LightningModule its ``device_mesh`` (a read-only property over the private ``_device_mesh``, which
    Lightning's own ModelParallelStrategy sets)."""
    module._device_mesh = mesh


def forget_loader_position(trainer: L.Trainer) -> None:
    """Drop the data loaders' positions a resumed fit loop was about to restore (its private
    ``_combined_loader_states_to_load``): the epoch starts from its first batch."""
    trainer.fit_loop._combined_loader_states_to_load = []


def record_module_device(module: nn.Module, device: torch.device) -> None:
    """Record ``device`` as a Lightning module's own (``self.device``) without moving its parameters, as
    ``module.to(device)`` would have recorded it (Lightning's ``_DeviceDtypeModuleMixin`` keeps it in the private
    ``_device``). Other modules are left alone."""
    from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device


def strategy_timeout(strategy: Any) -> timedelta | None:
    """The process-group ``timeout`` a Lightning strategy was built with (kept in the private ``_timeout``)."""
    return getattr(strategy, "_timeout", None)
