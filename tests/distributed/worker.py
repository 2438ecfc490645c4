"""Runs under torchrun: runs each named scenario (a parity case trained with TensorParallelStrategy, an error case, a
feature check) and writes what each rank saw to OUT_DIR/rank{R}.pt.

Usage: worker.py OUT_DIR [--tp-size N] SCENARIO [SCENARIO ...]

Scenarios live in :data:`SCENARIOS`: every parity case of ``tests.helpers.cases.CASES`` under its own name, every error
case of ``ERROR_CASES`` as ``error:<name>``, and the functions registered below with ``@SCENARIOS.register``. An
unknown name fails the launch at once, on every rank, before anything runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_tp
from lightning_tp import TensorParallelStrategy
from lightning_tp.compat import compiled_graph_count
from tests.helpers.cases import CASES, ERROR_CASES, ERROR_MODULE_KWARGS
from tests.helpers.inference import HeldShare
from tests.helpers.launch import SCENARIO_SECONDS
from tests.helpers.models import (
    PP_PROBE,
    PROBE,
    ParityModule,
    full_state,
    live_mib,
    lm_batches,
    pipeline_state,
    quiet_trainer,
    tied_embeddings,
)
from tests.helpers.scenarios import Scenarios
from tests.helpers.tripwire import tripwire_timeout, worker_setup

SCENARIOS = Scenarios("tests/distributed/worker.py")


@dataclass(frozen=True)
class Context:
    """What every scenario gets: the strategy's layout arguments, and a directory for what it writes."""

    layout: dict
    out: Path


def trainer(strategy: TensorParallelStrategy, **kwargs) -> L.Trainer:
    return quiet_trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, **kwargs)


class ReduceScatterCounter:
    """Counts FSDP2's gradient reduce-scatters and the bytes its parameter all-gathers receive (the collectives
    still run: this only counts)."""

    def __init__(self) -> None:
        self.calls = 0
        self.all_gather_bytes = 0
        self.fsdp_all_reduces = 0  # HSDP's gradient all-reduces across the replicas (FSDP2's own calls only)
        self._original = dist.reduce_scatter_single
        self._all_gather = dist.all_gather_single

    def __enter__(self) -> ReduceScatterCounter:
        def counting(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        def gathering(output, *args, **kwargs):
            self.all_gather_bytes += output.numel() * output.element_size()
            return self._all_gather(output, *args, **kwargs)

        counter = self

        class FsdpDist:  # what FSDP2's collectives module sees as `dist`: all-reduces counted, the rest as is
            def __getattr__(self, name):
                return getattr(dist, name)

            def all_reduce(self, *args, **kwargs):
                counter.fsdp_all_reduces += 1
                return dist.all_reduce(*args, **kwargs)

        dist.reduce_scatter_single = counting
        dist.all_gather_single = gathering
        _fsdp_collectives.dist = FsdpDist()  # only FSDP2's own calls (a global patch would reach compiled code)
        return self

    def __exit__(self, *exc) -> None:
        dist.reduce_scatter_single = self._original
        dist.all_gather_single = self._all_gather
        _fsdp_collectives.dist = dist


class LongRun(HeldShare):
    """What a long run does beside training: its live memory after every validation, the share of the parameters
    the rank holds at every batch's start (:class:`~tests.helpers.inference.HeldShare`), a checkpoint halfway and the
    model exported on every rank at the end (rank 0 writes)."""

    def __init__(self, directory: Path, *, steps: int) -> None:
        super().__init__()
        self.directory, self.steps = directory, steps
        self.live: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.live.append(live_mib())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.steps // 2:
            trainer.save_checkpoint(self.directory / "checkpoint")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.model.save_pretrained(self.directory / "export")


def run_case(ctx: Context, name: str) -> dict:
    """A parity case: trained sharded; the test trains it on one process and compares."""
    layout, out = ctx.layout, ctx.out
    case = CASES[name]
    module = case.module()
    batches = case.batches()
    strategy = TensorParallelStrategy(**{**layout, **case.strategy_kwargs})
    long_run = {}
    if case.val_every is not None:  # validation every `val_every` steps, a checkpoint halfway, an export at the end
        long_run = {
            "val_check_interval": case.val_every,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "callbacks": [LongRun(out / name, steps=len(batches) // case.accumulate)],
        }
    t = trainer(
        strategy,
        max_steps=len(batches) // case.accumulate,
        gradient_clip_val=case.clip,
        precision=case.precision,
        accumulate_grad_batches=case.accumulate,
        **long_run,
    )
    initial: dict = {}
    if "meta" in name:  # the weights and buffers as loaded or initialised, before any step

        class Snapshot(L.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                initial.update(full_state(pl_module.model))
                initial.update({f"buffer:{k}": v.detach().cpu().clone() for k, v in pl_module.model.named_buffers()})

        t.callbacks.append(Snapshot())
    infos: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: infos.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # Lightning's rank_zero_info
    rank_zero_log.addHandler(handler)
    try:
        graphs_before = compiled_graph_count()  # the graphs torch.compile built (`compile=True` cases)
        with ReduceScatterCounter() as counter, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            val = DataLoader(case.val_batches(), batch_size=None) if case.val_batches is not None else None
            t.fit(module, DataLoader(batches, batch_size=None), val)
        # The layers compiled in place, the graphs torch.compile built in this process so far (a later case may reuse
        # an earlier one's) and those this case built.
        compiled = {
            "layers": sum(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()),
            "graphs_so_far": compiled_graph_count(),
            "graphs": compiled_graph_count() - graphs_before,
        }
    finally:
        rank_zero_log.removeHandler(handler)
    model = module.model
    adapter = {}
    # Saved the PEFT way on every rank; logits of the sharded model to compare a reload with. Not under a pipeline (its
    # own test saves), nor for the compiled case: its no-grad forward would compile every layer again, unread.
    if "lora" in name and "_pp" not in name and "compile" not in name:
        model.save_pretrained(out / f"{name}_adapter")
        lightning_tp.save_merged(model, out / f"{name}_merged")
        model.eval()
        with torch.no_grad():
            adapter["logits"] = model(input_ids=PROBE).logits.detach().cpu().clone()
        adapter["dir"] = str(out / f"{name}_adapter")
        adapter["merged"] = str(out / f"{name}_merged")
    result = {
        "adapter": adapter,
        "initial_state": initial,
        "reduce_scatters": counter.calls,
        "fsdp_all_reduces": counter.fsdp_all_reduces,
        "compiled": compiled,
        "all_gather_bytes": counter.all_gather_bytes,
        "optimizer_steps": t.global_step,
        "fsdp_groups": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "fsdp_units": sorted(name for name, m in module.named_modules() if isinstance(m, FSDPModule)),
        "infos": infos,
        "warnings": [str(w.message) for w in caught],
        "tied": tied_embeddings(model),
        "losses": module.losses,
        "grad_norms": module.grad_norms,
        "state": pipeline_state(module.model, strategy.pp_group),
        "sampler": strategy.distributed_sampler_kwargs,
        "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
        "placements": {
            n: [str(x) for x in p.placements] for n, p in model.named_parameters() if isinstance(p, DTensor)
        },
        "mesh_axes": sorted({p.device_mesh.mesh_dim_names for p in model.parameters() if isinstance(p, DTensor)}),
        "num_params": len(list(module.parameters())),
        "grad_layouts": module.grad_layouts,
        "trainable": sum(p.requires_grad for p in module.parameters()),
        "optimizer_states": len(t.optimizers[0].state),
        "frozen_with_grad": sum(p.grad is not None for p in module.parameters() if not p.requires_grad),
    }
    result["split"] = split = {}
    if long_run:
        callback = long_run["callbacks"][0]
        split.update(
            val_losses=module.val_losses, live_mib=callback.live, held=callback.shares, directory=str(out / name)
        )
    if re.search(r"_cp\d", name) and "_pp2" not in name:
        # The logits of a forward without labels (gathered over the CP group), and the token counts; a pipeline
        # returns its loss only.
        model.eval()
        with torch.no_grad():
            split["logits"] = model(input_ids=PROBE).logits.detach().cpu().clone()
        split["throughput"] = {
            k: float(v) for k, v in t.callback_metrics.items() if k.startswith(("tokens_per_sec", "step_time"))
        }
    if "_pp2" in name:  # the stages each rank holds, its parameters, and a forward-only loss of the trained model
        from lightning_tp.parallel.pipeline import stage_modules_of

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        split["stages"] = [stage.stage for stage in stage_modules_of(base)]
        split["held"] = sorted(
            n for n, _ in model.named_parameters(remove_duplicate=False)
        )  # a tied weight by both names
        # What MFU counts: the whole model's parameters, the other stages' added over the pipeline.
        from lightning_tp.runtime.monitor import model_numel

        split["model_numel"] = model_numel(model, pp_group=strategy.pp_group, device=torch.device("cpu"))
        # The stages the pipeline keeps after training, and those of its stages still in memory (garbage included:
        # automatic collection is off while training).
        from torch.distributed.pipelining import PipelineStage

        from lightning_tp.parallel.pipeline import pipeline_runner

        runner = pipeline_runner(model)
        split["kept_shapes"] = len(runner._schedules)
        owned = {id(m) for m in runner.stage_modules}
        split["live_stages"] = sum(type(o) is PipelineStage and id(o.submod) in owned for o in gc.get_objects())
        model.save_pretrained(out / f"{name}_pretrained")  # every stage's weights (a LoRA model's: its adapters)
        split["pretrained"] = str(out / f"{name}_pretrained")
        if "lora" in name:  # every stage's adapters merged into its base weights, gathered on rank 0
            lightning_tp.save_merged(model, out / f"{name}_merged")
            split["merged"] = str(out / f"{name}_merged")
        # `Trainer.validate` (inference mode: a forward-only schedule, through FSDP2 under data parallelism), every
        # rank given the whole probe batch.
        t.validate(module, DataLoader([{"input_ids": PP_PROBE, "labels": PP_PROBE}], batch_size=None), verbose=False)
        split["eval_loss"] = module.val_losses[-1]
    if "_ep" in name:  # what each rank holds of the experts, their last load, the model exported on every rank
        split["expert_numel"] = sum(
            p.to_local().numel() for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n
        )
        split["expert_placements"] = sorted(
            {
                (p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)))
                for n, p in model.named_parameters()
                if ".experts." in n
            }
        )
        split["expert_load"] = {k: v.cpu() for k, v in lightning_tp.expert_load(model).items()}
        split["logged"] = {k: float(v) for k, v in t.callback_metrics.items() if k.startswith("moe/")}
        if "lora" not in name:
            model.save_pretrained(out / f"{name}_export")
            split["export"] = str(out / f"{name}_export")
    return result


for _name in CASES:
    SCENARIOS.add(_name, partial(run_case, name=_name))


@SCENARIOS.register("features")
def run_features(ctx: Context) -> dict:
    """Validation with generate, predict, logging and metrics on an untrained model, then the same after fit (the
    second `setup` meets a model sharded already), then bf16 precisions."""
    layout = ctx.layout
    from tests.helpers.models import FeatureModule, build_causal_lm, lm_batches, tiny_config

    batches = lm_batches(2)
    build = partial(build_causal_lm, tiny_config("qwen3"))
    module = FeatureModule(build)
    strategy = TensorParallelStrategy(**layout)
    t = trainer(strategy, max_steps=2, use_distributed_sampler=True, num_sanity_val_steps=0)
    metrics = t.validate(module, DataLoader(batches, batch_size=None))[0]
    out = {"generated": [g.clone() for g in module.generated], "validate": metrics, "logged": dict(module.logged)}
    out["predict"] = t.predict(module, DataLoader(batches, batch_size=None))
    out["dp_rank"] = strategy.dp_mesh.get_local_rank()
    q_proj = module.model.model.layers[0].self_attn.q_proj.weight
    out["q_proj_local_shape"] = tuple(q_proj.to_local().shape)
    # Same batch on every rank of the TP group with Lightning's own distributed sampler.
    seen: list[torch.Tensor] = []
    module.on_train_batch_start = lambda batch, idx: seen.append(batch["input_ids"].sum())  # type: ignore[assignment]
    t.fit(module, DataLoader(batches * 2, batch_size=None))
    sums = torch.stack(seen).float()
    gathered = [torch.zeros_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    out["batch_sums"] = [g.tolist() for g in gathered]
    out["throughput"] = {
        k: float(v) for k, v in t.callback_metrics.items() if k.startswith(("tokens_per_sec", "step_time", "peak_mem"))
    }
    out["q_proj_local_shape_after_fit"] = tuple(module.model.model.layers[0].self_attn.q_proj.weight.to_local().shape)
    out["decisions"] = module.logged["decisions"]
    for precision in ("bf16-mixed", "bf16-true"):
        m = ParityModule(build)
        trainer(TensorParallelStrategy(**layout), max_steps=2, precision=precision).fit(
            m, DataLoader(batches, batch_size=None)
        )
        out[precision] = {
            "losses": m.losses,
            "grad_norms": m.grad_norms,
            "dtype": str(next(m.model.parameters()).dtype),
        }
    return out


@SCENARIOS.register("vlm_generate")
def run_vlm_generate(ctx: Context) -> dict:
    """Greedy generation from an image batch by VLMs sharded with `parallelize` (Gemma 3 plain, Qwen2.5-VL with
    sequence and loss parallelism: the prompt splits, the decoding steps of 1 run unsplit)."""
    from tests.helpers.models import build_vlm, vlm_prompt

    if not dist.is_initialized():  # selected alone (`-k`): no Trainer scenario has started the process group
        from lightning_tp.strategies.shared import destroy_process_groups_at_exit

        dist.init_process_group("gloo", timeout=tripwire_timeout())
        destroy_process_groups_at_exit()
    out = {}
    for kind, options in (("gemma3", {}), ("qwen2_5_vl", {"sequence_parallel": True, "loss_parallel": True})):
        model = lightning_tp.parallelize(
            build_vlm(kind), tp_size=ctx.layout["tp_size"] or 2, options=lightning_tp.ParallelOptions(**options)
        )
        with torch.no_grad():
            out[kind] = model.eval().generate(**vlm_prompt(kind), max_new_tokens=3, do_sample=False).tolist()
    return out


@SCENARIOS.register("save_failure")
def run_save_failure(ctx: Context) -> dict:
    """Saving into a path rank 0 cannot write: every rank raises, none waits in a barrier."""
    from tests.helpers.cases import _lora

    module = ParityModule(partial(_lora, "qwen3"))
    trainer(TensorParallelStrategy(), max_steps=1).fit(module, DataLoader(lm_batches(1), batch_size=None))
    try:
        module.model.save_pretrained("/dev/null/adapter")
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "no error"}


@SCENARIOS.register("whole_tensors")
def run_whole_tensors(ctx: Context) -> dict:
    """`lightning_tp.parallel.gather.whole_tensor` (the gather of save_pretrained, the adapter save, save_merged) in
    slices of a third of each tensor against `full_tensor()`: every parameter of a model sharded as the strategy shards
    it (TP, and FSDP2's strided shards in 2-D), and uneven and fully split layouts; kept on rank 0 only."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_tp.parallel.gather import whole_tensor
    from tests.helpers.models import build_causal_lm, tiny_config

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=tripwire_timeout())
    world = dist.get_world_size()
    tp_size = ctx.layout["tp_size"] or world
    model = lightning_tp.parallelize(build_causal_lm(tiny_config("qwen3")), tp_size=tp_size)
    tensors = dict(model.state_dict())
    mesh = next(t for t in tensors.values() if isinstance(t, DTensor)).device_mesh
    generator = torch.Generator().manual_seed(0)
    for shape in [(7, 5), (5, 7, 3), (9,)]:  # uneven shards on every axis; no unsplit dimension at the end
        whole = torch.randn(shape, generator=generator)
        layouts = [[Shard(0)] * mesh.ndim, [Replicate()] * mesh.ndim]
        if whole.ndim > 1:  # each mesh axis splits another dimension (on a 2-D mesh a (7, 5) tensor has none free)
            layouts.append([Shard(axis + 2 - mesh.ndim) for axis in range(mesh.ndim)])
        for placements in layouts:
            tensors[f"{shape}:{placements}"] = distribute_tensor(whole, mesh, placements)
    keep = dist.get_rank() == 0
    differ, kept = [], 0
    for name, tensor in tensors.items():
        # About 3 slices each (a few bytes for the small layouts): more would only add collectives.
        gathered = whole_tensor(tensor, keep=keep, chunk_bytes=max(4, tensor.numel() * tensor.element_size() // 3))
        expected = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if gathered is not None:
            kept += 1
            if gathered.device.type != "cpu" or not torch.equal(gathered, expected.detach().cpu()):
                differ.append(name)
    return {
        "differ": differ,
        "kept": kept,
        "count": len(tensors),
        "placements": sorted({str(t.placements) for t in tensors.values() if isinstance(t, DTensor)}),
    }


@SCENARIOS.register("collectives")
def run_collectives(ctx: Context) -> dict:
    """Collectives of one training step's forward and backward, by kind (``benchmarks/comm.py``'s counter: DTensor's
    functional collectives and ``torch.distributed``'s calls alike; torch's CommDebugMode also tracks modules, and
    fails on a module called twice, as Transformers 5.25's shared rotary function module is), without and with
    sequence parallelism, on the 2-layer model."""
    layout = ctx.layout
    from benchmarks.comm import CollectiveCounter
    from tests.helpers.models import build_causal_lm, tiny_config

    class Count(L.Callback):
        def on_train_batch_start(self, *args) -> None:
            self.mode = CollectiveCounter()
            self.mode.__enter__()

        def on_after_backward(self, *args) -> None:
            self.mode.__exit__(None, None, None)
            self.counts = {kind: value["count"] for kind, value in self.mode.totals().items()}
            self.by_phase = self.mode.by_phase()

    out = {}
    build = partial(build_causal_lm, tiny_config("qwen3"))
    for name, kwargs in {
        "plain": {},
        "sequence_parallel": {"sequence_parallel": True},
        "sp_lp": {"sequence_parallel": True, "loss_parallel": True},
        # A Gated DeltaNet layer's packed [q | k | v] projection and conv, with their bytes.
        "packed_mixer": {},
    }.items():
        counter = Count()
        module = ParityModule(partial(build_causal_lm, tiny_config("qwen3_5")) if name == "packed_mixer" else build)
        trainer(TensorParallelStrategy(**layout, **kwargs), max_steps=1, callbacks=[counter]).fit(
            module, DataLoader(lm_batches(1), batch_size=None)
        )
        out[name] = counter.by_phase if name == "packed_mixer" else counter.counts
        if kwargs:  # greedy generation (odd prompt length, decoding steps of 1) against the same weights, whole
            plain = build()
            plain.load_state_dict(full_state(module.model))
            module.model.eval()
            prompt = torch.arange(5).reshape(1, 5) + 3
            with torch.no_grad():
                sharded = module.model.generate(prompt, max_new_tokens=4, do_sample=False)
                whole = plain.eval().generate(prompt, max_new_tokens=4, do_sample=False)
                ids = torch.arange(8).reshape(1, 8) + 3  # split: the last 3 positions of the whole sequence
                kept = module.model(input_ids=ids, logits_to_keep=3).logits
                kept_whole = plain(input_ids=ids, logits_to_keep=3).logits
            out[f"{name}_generate"] = {"sharded": sharded.tolist(), "whole": whole.tolist()}
            same_shape = kept.shape == kept_whole.shape
            out[f"{name}_logits_to_keep"] = (kept - kept_whole).abs().max().item() if same_shape else None
    return out


@SCENARIOS.register("sp_odd_on_one_group")
def run_sequence_parallel_odd_on_one_group(ctx: Context) -> dict:
    """Sequence parallelism in 2-D where only data-parallel rank 1 gets a length tp_size does not divide: its TP group
    pads its sequence, the other does not, and every rank trains on (no rank needs another's length: nothing to
    agree, nothing to wait for)."""
    layout = ctx.layout
    import time
    from datetime import timedelta

    from tests.helpers.models import build_causal_lm, tiny_config

    class OddOnOneGroup(ParityModule):
        def compute_loss(self, batch: dict) -> torch.Tensor:
            if self.trainer.strategy.dp_mesh.get_local_rank() == 1:
                batch = {k: v[:, :15] for k, v in batch.items()}
            return super().compute_loss(batch)

    module = OddOnOneGroup(partial(build_causal_lm, tiny_config("qwen3")))
    strategy = TensorParallelStrategy(**layout, sequence_parallel=True, timeout=timedelta(seconds=60))
    t = trainer(strategy, max_steps=2)
    start = time.monotonic()
    try:
        t.fit(module, DataLoader(lm_batches(2), batch_size=None))
        return {"type": None, "message": "no error", "seconds": time.monotonic() - start}
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}


@SCENARIOS.register("cp_rows_differ")
def run_cp_rows_differ(ctx: Context) -> dict:
    """Context parallelism where the two ranks of the CP group get different rows (a loader split over every rank):
    every rank raises the same clear error in the first forward, none waits in the key/value exchange."""
    import time
    from datetime import timedelta

    from tests.helpers.models import build_causal_lm, tiny_config

    class OtherRowsOnRankOne(ParityModule):
        def compute_loss(self, batch: dict) -> torch.Tensor:
            if self.trainer.strategy.cp_mesh.get_local_rank() == 1:
                batch = {k: v.flip(0) for k, v in batch.items()}
            return super().compute_loss(batch)

    module = OtherRowsOnRankOne(partial(build_causal_lm, tiny_config("qwen3")))
    strategy = TensorParallelStrategy(tp_size=1, cp_size=2, timeout=timedelta(seconds=60))
    start = time.monotonic()
    try:
        trainer(strategy, max_steps=1).fit(module, DataLoader(lm_batches(1), batch_size=None))
        return {"type": None, "message": "no error", "seconds": time.monotonic() - start}
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}


@SCENARIOS.register("group_timeouts")
def run_group_timeouts(ctx: Context) -> dict:
    """The timeout of each group of a mesh built for a 7 s strategy timeout."""
    layout = ctx.layout
    from datetime import timedelta

    from lightning_tp import ParallelLayout

    if not dist.is_initialized():  # selected alone (`-k`), no Trainer scenario has started the process group
        from lightning_tp.strategies.shared import destroy_process_groups_at_exit

        dist.init_process_group("gloo", timeout=tripwire_timeout())
        destroy_process_groups_at_exit()  # as the strategy does for a group it created

    sizes = ParallelLayout.resolve(dist.get_world_size(), tp_size=layout["tp_size"])
    mesh, dp_mesh = sizes.build_device_mesh("cpu", timeout=timedelta(seconds=7))
    groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    groups["dp"] = dp_mesh.get_group()
    if dist.get_world_size() == 4:
        cp_layout = ParallelLayout.resolve(4, tp_size=2, cp_size=2)
        cp_mesh, _ = cp_layout.build_device_mesh("cpu", timeout=timedelta(seconds=7))
        groups["dp_shard_cp"] = cp_mesh["dp_shard_cp"].get_group()
    return {
        name: (group._get_backend(torch.device("cpu")).options._timeout.total_seconds(), group.size())
        for name, group in groups.items()
    }


@SCENARIOS.register("loss_parallel_checks")
def run_loss_parallel(ctx: Context) -> dict:
    """vocab_parallel_cross_entropy and a vocabulary-sharded lm_head against torch (tests/distributed/
    loss_parallel_checks.py): one record per check."""
    from tests.distributed.loss_parallel_checks import run_loss_parallel_checks

    return {"checks": run_loss_parallel_checks()}


@SCENARIOS.register("stream_weights")
def run_stream_weights(ctx: Context) -> dict:
    """lightning_tp.stream_weights against save_pretrained and save_merged, its peak memory, its targets, a consumer's
    tp parts and a failing rank (tests/distributed/stream_checks.py): TP 2, dp 2 x tp 2, and pp 2 on 8 ranks."""
    from tests.distributed.stream_checks import run_stream_checks

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=tripwire_timeout())
    world = dist.get_world_size()
    pp_size = 2 if world == 8 else 1
    return run_stream_checks(ctx.out, tp_size=ctx.layout["tp_size"] or world, pp_size=pp_size)


def run_error(ctx: Context, name: str) -> dict:
    build, kwargs, _ = ERROR_CASES[name]
    module = ParityModule(build, **ERROR_MODULE_KWARGS.get(name, {}))
    try:
        trainer(TensorParallelStrategy(**kwargs), max_steps=1).fit(
            module, DataLoader([{"x": torch.zeros(2, 32), "y": torch.zeros(2, dtype=torch.long)}], batch_size=None)
        )
    except Exception as err:  # recorded per rank; the test checks every rank raised
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": "no error"}


for _name in ERROR_CASES:
    SCENARIOS.add(f"error:{_name}", partial(run_error, name=_name))


def main() -> None:
    worker_setup()  # a hang fails within the short timeout, with every stack
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tp-size", type=int, default=None)
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args()
    SCENARIOS.check(args.scenarios)  # an unknown name: the same ValueError on every rank, before any collective
    ctx = Context(layout={"tp_size": args.tp_size}, out=args.out)
    rank = int(os.environ["RANK"])
    results = {}
    for name in args.scenarios:
        start = time.perf_counter()
        try:
            results[name] = SCENARIOS.run(name, ctx)
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
            # Printed as well: if another rank then hangs in the barrier below, this is the launch's only trace of it.
            print(f"[rank{rank}] {name} crashed:\n{results[name]['crash']}", file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()  # every rank reached the end of the case: none is left hanging
        if rank == 0:  # read by tests/helpers/launch.py: the slowest scenarios close the run's summary
            print(f"{SCENARIO_SECONDS} {time.perf_counter() - start:.2f} {name}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(results, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
