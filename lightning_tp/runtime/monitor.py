"""Throughput and memory while training: tokens/s (per data-parallel replica and global), step time, peak memory per
rank and, on GPU, MFU. Added by ``TensorParallelStrategy`` unless ``throughput_monitor=False``.

The ranks of a TP group work on the same tokens, so the global figure sums over the data-parallel group only (the
strategy's ``reduce`` default), never over the world.

Measured over windows of optimizer steps that end where the loggers write (``log_every_n_steps``) and at the first
step, so that the steps in between pay nothing: no collective, no CUDA synchronisation (tokens are summed on the
device). At a window's end: one synchronisation, one reduce over the data-parallel group; the memory peak is reset for
the next window, so a peak is the window's own (setup and earlier windows left out; a checkpoint saved at a window's
end, or a validation inside one, is in the next or that window's peak). Where Linux does not let the resident set's
peak be reset (``/proc/self/clear_refs``), a CPU peak is the process's since it started.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_tp.compat import CUDA_FLOPS, logs_this_step
from lightning_tp.parallel.pipeline_tied import counted_on_another_stage
from lightning_tp.state import parallel_state


class ThroughputMonitor(L.Callback):
    """Logs ``tokens_per_sec`` (global, shown in the progress bar), ``tokens_per_sec_per_replica`` (this
    data-parallel replica, i.e. its TP group), ``tokens_per_sec_per_device`` (global / world size), ``step_time_s``
    (the window's mean), ``peak_memory_mb`` (the window's peak: CUDA allocator on GPU, resident set on CPU) and, on
    GPU, ``mfu``, where the loggers write (see the module's docstring).

    Tokens are counted from the batch's ``attention_mask`` when there is one, else from ``input_ids``; batches without
    either are skipped. FLOPs per token for MFU are ``6 x trainable-or-not parameters`` (forward and backward of the
    matmuls, attention's quadratic term left out), against the device's peak from Lightning's table for the dtype the
    matmuls run in (:func:`matmul_dtype`: under ``32-true`` the fp32 peak at torch's default matmul precision
    ``"highest"``, the TF32 peak once ``torch.set_float32_matmul_precision("high")`` or ``"medium"`` allows TF32).

    Raises:
        Nothing of its own: a batch without ``attention_mask`` or ``input_ids`` is skipped.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._steps = 0
        self._tokens: int | torch.Tensor = 0
        self._flops_per_token: float | None = None
        self._peak_flops: float | None = None
        self._paused: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = None
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return
        from lightning.fabric.utilities.throughput import get_available_flops

        params = model_numel(pl_module, pp_group=getattr(trainer.strategy, "pp_group", None), device=device)
        dtype = matmul_dtype(str(trainer.precision))
        self._flops_per_token = 6.0 * params
        self._peak_flops = get_available_flops(device, dtype) or _h200_flops(device, dtype)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            self._open_window(trainer.strategy.root_device)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tokens = _count_tokens(batch)
        if self._start is None or tokens is None:
            return
        self._tokens = self._tokens + tokens
        if not ends_optimizer_step(trainer, batch_idx):
            return
        self._steps += 1
        if not _reports_this_step(trainer):  # every rank joins the reduce below or none does
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak_mb = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            peak_mb = peak_rss_mb()
        elapsed = time.perf_counter() - self._start
        per_replica = float(self._tokens) / elapsed
        # Summed over the data-parallel ranks (each a different share of the batch) by the strategy's reduce: the
        # ranks of a TP group work on the same tokens and are not counted twice.
        total = float(trainer.strategy.reduce(torch.tensor(per_replica, device=device), reduce_op="sum"))
        per_device = total / trainer.world_size
        metrics = {
            "tokens_per_sec_per_replica": per_replica,
            "tokens_per_sec_per_device": per_device,
            "step_time_s": elapsed / self._steps,
            "peak_memory_mb": peak_mb,
        }
        if self._flops_per_token and self._peak_flops:
            metrics["mfu"] = per_device * self._flops_per_token / self._peak_flops
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("tokens_per_sec", total, on_step=True, on_epoch=False, prog_bar=True, batch_size=1)
        self._open_window(device)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused = time.perf_counter()  # validation inside a window is not training time

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        paused, self._paused = self._paused, None
        if self._start is not None and paused is not None:
            self._start += time.perf_counter() - paused

    def _open_window(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            reset_peak_rss()
        self._start, self._steps, self._tokens = time.perf_counter(), 0, 0


def ends_optimizer_step(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether ``batch_idx`` is the last micro-batch of an optimizer step (gradient accumulation)."""
    return (batch_idx + 1) % max(1, trainer.accumulate_grad_batches) == 0


def _reports_this_step(trainer: L.Trainer) -> bool:
    """At the first optimizer step and where the loggers write (``log_every_n_steps``): decided from the step count
    alone, so on every rank alike."""
    return trainer.global_step == 1 or logs_this_step(trainer)


def matmul_dtype(precision: str) -> torch.dtype | str:
    """The dtype the matmuls of a Trainer ``precision`` run in, as Lightning's FLOPs table names it: bf16 under
    ``bf16-mixed`` (its weights are fp32), and for fp32 TF32 (``"tfloat32"``) unless the float32 matmul precision is
    ``"highest"`` (where an fp32 peak, 7x lower on an H100, would give an MFU 7x too high)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32 if torch.get_float32_matmul_precision() == "highest" else "tfloat32"


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_rss() -> None:
    """Resets the peak resident set (VmHWM) to the current one, where Linux allows it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """The peak resident set since the last reset (VmHWM), else since the process started."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _count_tokens(batch: Any) -> int | torch.Tensor | None:
    """The batch's tokens: a device tensor when counted from a mask (read on the host at a window's end only)."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return mask.sum()
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return None


def model_numel(module: torch.nn.Module, *, pp_group: Any | None = None, device: torch.device | None = None) -> int:
    """The parameters of the whole model ``module`` trains, counted whole: TP and FSDP shards of one replica add up to
    the model (a DTensor's ``numel`` is its global size), and under pipeline parallelism (``pp_group``, which every
    rank of it must pass) the other stages' parameters, which other ranks hold, are added (one sum over the group, on
    ``device``: the group's backend's), an embedding tied to the head across stages counted once, as one process's
    ``parameters()`` counts it."""
    if pp_group is None:
        return sum(p.numel() for p in module.parameters())
    elsewhere = counted_on_another_stage(parallel_state(module))
    count = sum(p.numel() for p in module.parameters() if id(p) not in elsewhere)
    total = torch.tensor(count, dtype=torch.int64, device=device)
    dist.all_reduce(total, group=pp_group)
    return int(total.item())


def _h200_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Lightning 2.6 knows the H200 only by names with "SXM1"/"NVL1" (and quotes sparse figures for it); CUDA reports
    a plain "NVIDIA H200" (seen here), which then gets no MFU. The H200 has the H100 SXM's compute: take its dense
    figures."""
    if "h200" not in torch.cuda.get_device_name(device).lower():
        return None
    return CUDA_FLOPS["h100 sxm"].get(dtype)


class ExpertLoadMonitor(L.Callback):
    """Logs how evenly a mixture-of-experts model's routers spread the tokens under expert parallelism (added by
    ``TensorParallelStrategy`` with ``ep_size > 1`` unless ``throughput_monitor=False``):
    ``moe/expert_load_max_over_mean`` (the busiest expert's tokens over the mean, at the worst layer: 1.0 is perfect
    balance) and ``moe/ep_rank_load_max_over_mean`` (the same for the tokens each EP rank's experts receive: the rank
    that sets the pace of the all-to-alls), over the last micro-batch of the whole batch (every data-parallel and CP
    rank's tokens, every pipeline stage's layers). At the first optimizer step and wherever the loggers write
    (``log_every_n_steps``): an all-gather of the layers' names and one all-reduce of ``layers x experts`` counts
    then, on every rank (a pipeline stage without experts too). :func:`lightning_tp.expert_load` gives the raw
    counts of this rank's tokens.

    Raises:
        Nothing of its own: a model without expert parallelism logs nothing.
    """

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        import torch.distributed as dist

        from lightning_tp.compat import distributed_is_initialized
        from lightning_tp.parallel.expert_parallel import expert_load

        if not ends_optimizer_step(trainer, batch_idx) or not _reports_this_step(trainer):
            return
        loads = expert_load(pl_module)
        sizes = {name: load.numel() for name, load in loads.items()}
        if distributed_is_initialized():
            # Every rank takes part, whatever its stages hold: under pipeline parallelism a rank holds its stages'
            # experts modules only (none on a stage of dense layers), so the layers' names and sizes are gathered
            # first and each rank lays out the same tensor, its zeros where another stage counts.
            gathered: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, sizes)
            for other in gathered:
                sizes.update(other)
        if not sizes:
            return
        names = sorted(sizes)  # the same order on every rank
        device = trainer.strategy.root_device
        flat = torch.cat(
            [
                loads[n].to(device) if n in loads else torch.zeros(sizes[n], dtype=torch.float32, device=device)
                for n in names
            ]
        )
        if distributed_is_initialized():
            # Over every rank: the ranks of a TP group count the same tokens, which scales each layer's counts
            # alike and leaves the ratios as they are; CP ranks, data-parallel ranks and the stages count their own.
            dist.all_reduce(flat)
        ep_size = getattr(getattr(trainer.strategy, "layout", None), "ep_size", 1)
        worst = {"expert_load": 0.0, "ep_rank_load": 0.0}
        for counts in flat.float().split([sizes[name] for name in names]):
            per_rank = counts.reshape(ep_size, -1).sum(dim=-1)
            for metric, values in (("expert_load", counts), ("ep_rank_load", per_rank)):
                ratio = float(values.max() / values.mean().clamp_min(1e-12))
                worst[metric] = max(worst[metric], ratio)
        for metric, value in worst.items():
            pl_module.log(f"moe/{metric}_max_over_mean", value, on_step=True, on_epoch=False, batch_size=1)
