"""Runs under torchrun: trains, saves, kills and resumes the checkpoint cases; writes what each rank saw to
OUT_DIR/{LABEL}_rank{R}.pt (one dict: what every scenario returned, merged).

Usage: checkpoint_worker.py OUT_DIR --label LABEL [--from CHECKPOINT] [--truncated CHECKPOINT] SCENARIO [...]
(a SCENARIO written ``NAME@CHECKPOINT`` resumes that checkpoint; its results are kept under that key)

Scenarios (registered in :data:`SCENARIOS`), by launch: on 2 processes ``dropout`` (exact resume mid-epoch, URLs
on disk), ``full`` (single-file checkpoints), ``final`` (a final save, a save into a run directory, save_pretrained),
``from_single`` (1 -> TP 2), ``lora`` (frozen weights left out), ``tied`` (tied saves), ``vlm`` (LLaVA: resume,
export), ``cp`` (cp 2 -> TP 2, 1 -> cp 2), ``pp`` (pp 2 -> pp 2, TP 2; TP 2 -> pp 2) and ``mixers:KIND`` (a
family whose mixers TP 2 splits by heads: exact resume, save_pretrained); ``crash`` (2 processes: a save killed
midway; the launch fails on purpose); ``one`` (1 process: TP 2 -> 1, cp 2 -> 1, pp 2 -> 1; ``one:KIND``: TP 2 -> 1
for those families); ``2d`` (4 processes: TP 2 -> 2-D, and a
truncated checkpoint), ``tp4`` and ``cp_2d`` (TP 2 -> cp 2 x tp 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_tp import TensorParallelStrategy
from tests.helpers.cases import CHECKPOINT_ENV
from tests.helpers.models import quiet_trainer
from tests.helpers.resume import MIXER_KINDS, STEPS, ResumeModule, SaveAt, probe_logits
from tests.helpers.scenarios import Scenarios
from tests.helpers.tripwire import worker_setup

SCENARIOS = Scenarios("tests/distributed/checkpoint_worker.py")


@dataclass(frozen=True)
class Context:
    out: Path
    #: The checkpoint to resume from (``--from``), and a truncated copy of one (``--truncated``).
    source: Path | None
    truncated: Path | None
    #: The one-process checkpoint of the tiny Qwen3-MoE (``--from-moe``).
    source_moe: Path | None = None


def fit(
    module: ResumeModule,
    *,
    ckpt_path: Path | str | None = None,
    callbacks=(),
    limit_train_batches: int | float = 1.0,
    **strategy_kwargs: Any,
) -> L.Trainer:
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=TensorParallelStrategy(throughput_monitor=False, **strategy_kwargs),
        max_steps=STEPS,
        callbacks=list(callbacks),
        limit_train_batches=limit_train_batches,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def resumed_losses(path: Path | str, **kwargs: Any) -> dict[int, float]:
    module = ResumeModule(**{k: kwargs.pop(k) for k in ("dropout", "lora", "stateful_data", "kind") if k in kwargs})
    fit(module, ckpt_path=path, **kwargs)
    return module.losses


@SCENARIOS.register("dropout")
def dropout(ctx: Context) -> dict[str, Any]:
    """Exact resume mid-epoch with dropout (the random states and the data position matter), and from a save after an
    epoch's last batch (where Lightning goes on with the next epoch, which must start at its first batch, in its own
    order: on one device torchdata's loader skips that epoch). The same run also saves
    at a ``local://`` URL, through fsspec and the commit marker as an object store would, twice (the second save
    replaces the first). (A ``file://`` URL is the local path it names, published by renames.)"""
    out, results = ctx.out, {}
    module = ResumeModule(dropout=0.1)
    url = f"local://{out / 'url_mid'}"
    mid = SaveAt(steps={4: out / "dropout_last_batch", 6: out / "dropout_mid"})  # 4: epoch 0's last batch
    fit(module, callbacks=[mid, SaveAt(steps={4: url, 6: url})])
    results["dropout"] = {
        "reference": module.losses,
        "mid": resumed_losses(out / "dropout_mid", dropout=0.1),
        "last_batch": resumed_losses(out / "dropout_last_batch", dropout=0.1),
    }
    # Epochs of 3 batches (`limit_train_batches=3`), saved after epoch 0's last: the next epoch again.
    limited = ResumeModule(dropout=0.1)
    fit(limited, limit_train_batches=3, callbacks=[SaveAt(steps={3: out / "dropout_limited"})])
    results["dropout"]["limited_reference"] = limited.losses
    results["dropout"]["limited"] = resumed_losses(out / "dropout_limited", dropout=0.1, limit_train_batches=3)
    results["url"] = resumed_losses(url, dropout=0.1)
    return results


@SCENARIOS.register("full")
def full(ctx: Context) -> dict[str, Any]:
    """A single-file checkpoint (mid-run, at a URL, and at the end, with the model's logits for export)."""
    out, results = ctx.out, {}
    module = ResumeModule()
    url = f"local://{out / 'url_full.ckpt'}"
    callbacks = [SaveAt(steps={5: out / "full_mid.ckpt"}), SaveAt(steps={5: url})]
    trainer = fit(module, save_distributed_checkpoint=False, callbacks=callbacks)
    results["full"] = {
        "reference": module.losses,
        "mid": resumed_losses(out / "full_mid.ckpt", save_distributed_checkpoint=False),
        "url": resumed_losses(url, save_distributed_checkpoint=False),
    }
    trainer.save_checkpoint(out / "final_full.ckpt")
    results["final_full_logits"] = probe_logits(module.model)
    return results


@SCENARIOS.register("final")
def final(ctx: Context) -> dict[str, Any]:
    """The final sharded checkpoint (also at a URL) with the model's logits, for export; a save into a run directory;
    save_pretrained of the sharded model."""
    out, results = ctx.out, {}
    module = ResumeModule()
    trainer = fit(module)
    trainer.save_checkpoint(out / "final")
    results["save_into_run_dir"] = save_into_run_dir(trainer, out / "run_dir")
    trainer.save_checkpoint(f"local://{out / 'url_final'}")  # for export from a URL
    module.model.save_pretrained(out / "pretrained")  # on every rank of the sharded model
    results["final_logits"] = probe_logits(module.model)
    return results


@SCENARIOS.register("from_single")
def from_single(ctx: Context) -> dict[str, Any]:
    """One process -> TP 2: a checkpoint a plain single-device Trainer wrote (``--from``)."""
    assert ctx.source is not None, "from_single needs --from"
    return {"from_single": resumed_losses(ctx.source, stateful_data=False)}


@SCENARIOS.register("lora")
def lora(ctx: Context) -> dict[str, Any]:
    """LoRA, frozen base weights left out of the checkpoints: exact resume, and logits for export."""
    out, results = ctx.out, {}
    module = ResumeModule(lora=True)
    trainer = fit(module, save_frozen_weights=False, callbacks=[SaveAt(steps={6: out / "lora_mid"})])
    results["lora"] = {
        "reference": module.losses,
        "mid": resumed_losses(out / "lora_mid", lora=True, save_frozen_weights=False),
    }
    trainer.save_checkpoint(out / "lora_final")
    results["lora_logits"] = probe_logits(module.model)
    return results


@SCENARIOS.register("vlm")
def vlm(ctx: Context) -> dict[str, Any]:
    """A vision-language model (LLaVA: replicated vision tower, sharded language model): exact resume mid-run from
    a sharded checkpoint, and the final checkpoint with the model's logits on an image batch, for export."""
    from functools import partial

    from torchdata.stateful_dataloader import StatefulDataLoader

    from tests.helpers.models import ParityModule, build_vlm, vlm_batches

    out = ctx.out

    def run(ckpt_path: Path | None = None, callbacks=()) -> tuple[ParityModule, L.Trainer]:
        module = ParityModule(partial(build_vlm, "llava"))
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=int(os.environ["LOCAL_WORLD_SIZE"]),
            strategy=TensorParallelStrategy(throughput_monitor=False),
            max_steps=4,
            callbacks=list(callbacks),
        )
        trainer.fit(module, StatefulDataLoader(vlm_batches("llava", 4), batch_size=None), ckpt_path=ckpt_path)
        return module, trainer

    module, trainer = run(callbacks=[SaveAt(steps={2: out / "vlm_mid"})])
    trainer.save_checkpoint(out / "vlm_final")
    module.model.eval()
    with torch.no_grad():
        logits = module.model(**vlm_batches("llava", 1)[0]).logits.detach().cpu().clone()
    resumed, _ = run(out / "vlm_mid")
    return {"vlm": {"reference": module.losses, "resumed": resumed.losses, "logits": logits}}


@SCENARIOS.register("cp")
def context_parallel(ctx: Context) -> dict[str, Any]:
    """Context parallelism across layouts: cp 2 trains and checkpoints at the end of epoch 0, and the checkpoint
    resumes on TP 2 (cp 1); the one-process checkpoint (``--from``) resumes on cp 2."""
    assert ctx.source is not None, "cp needs --from (the one-process checkpoint)"
    out = ctx.out
    module = ResumeModule(stateful_data=False)
    fit(module, cp_size=2, tp_size=1, callbacks=[SaveAt(epochs={0: out / "cp2_epoch0"})])
    return {
        "cp_uninterrupted": module.losses,
        "cp_logits": probe_logits(module.model),  # a forward without labels: the whole sequence's logits
        "cp_to_tp2": resumed_losses(out / "cp2_epoch0", stateful_data=False),
        "single_to_cp": resumed_losses(ctx.source, cp_size=2, tp_size=1, stateful_data=False),
    }


@SCENARIOS.register("pp")
def pipeline_parallel(ctx: Context) -> dict[str, Any]:
    """Pipeline parallelism across layouts: pp 2 (one decoder layer per stage) trains and checkpoints at the end of
    epoch 0, distributed and as one file; each resumes on pp 2 and on TP 2 (pp 1), the distributed one also on one
    process (``one@``); a TP 2 run's epoch-0 checkpoint and one process's file (``--from``) resume on pp 2."""
    assert ctx.source is not None, "pp needs --from (a single-file checkpoint)"
    out = ctx.out
    module = ResumeModule(stateful_data=False)
    saves = SaveAt(epochs={0: out / "pp2_epoch0"})
    fit(module, pp_size=2, tp_size=1, callbacks=[saves])
    as_file = ResumeModule(stateful_data=False)
    single_file = {"save_distributed_checkpoint": False}
    fit(as_file, pp_size=2, tp_size=1, callbacks=[SaveAt(epochs={0: out / "pp2_epoch0.ckpt"})], **single_file)
    fit(ResumeModule(stateful_data=False), callbacks=[SaveAt(epochs={0: out / "tp2_epoch0"})])
    pp = {"pp_size": 2, "tp_size": 1, "stateful_data": False}
    return {
        "pp_uninterrupted": module.losses,
        "pp_file_uninterrupted": as_file.losses,
        "pp_to_pp": resumed_losses(out / "pp2_epoch0", **pp),
        "pp_to_tp2": resumed_losses(out / "pp2_epoch0", stateful_data=False),
        "tp2_to_pp": resumed_losses(out / "tp2_epoch0", **pp),
        "file_pp_to_pp": resumed_losses(out / "pp2_epoch0.ckpt", **pp, **single_file),
        "file_pp_to_tp2": resumed_losses(out / "pp2_epoch0.ckpt", stateful_data=False),
        "file_single_to_pp": resumed_losses(ctx.source, **pp),
    }


@SCENARIOS.register("tied_resume")
def tied_resume(ctx: Context) -> dict[str, Any]:
    """A model with tied embeddings (one tensor under two names) resumed mid-run on TP 2; pp 2 (the tensor's copies on
    the first and the last stage) checkpoints at the end of epoch 0, resumed on pp 2 and on TP 2 (pp 1), and TP 2's
    epoch-0 checkpoint on pp 2."""
    out = ctx.out
    module = ResumeModule(kind="tied")  # a stateful loader: the resume mid-epoch continues where the save was
    fit(module, callbacks=[SaveAt(steps={6: out / "tied_mid"})])
    fit(ResumeModule(kind="tied", stateful_data=False), callbacks=[SaveAt(epochs={0: out / "tied_tp2_epoch0"})])
    pipelined = ResumeModule(kind="tied", stateful_data=False)
    saves = SaveAt(epochs={0: out / "tied_pp2_epoch0"})
    fit(pipelined, pp_size=2, tp_size=1, callbacks=[saves])
    pp = {"pp_size": 2, "tp_size": 1}
    # As one file: the tensor's state written once, under the embedding's name, as one process writes it.
    as_file = ResumeModule(kind="tied", stateful_data=False)
    file_save = SaveAt(epochs={0: out / "tied_pp2_epoch0.ckpt"})
    fit(as_file, **pp, save_distributed_checkpoint=False, callbacks=[file_save])
    tied_file = out / "tied_pp2_epoch0.ckpt"
    return {
        "tied_resume": {
            "uninterrupted": module.losses,
            "pp_uninterrupted": pipelined.losses,
            "mid": resumed_losses(out / "tied_mid", kind="tied"),
            "pp_to_pp": resumed_losses(out / "tied_pp2_epoch0", kind="tied", stateful_data=False, **pp),
            "pp_to_tp2": resumed_losses(out / "tied_pp2_epoch0", kind="tied", stateful_data=False),
            "tp2_to_pp": resumed_losses(out / "tied_tp2_epoch0", kind="tied", stateful_data=False, **pp),
            "file_pp_to_pp": resumed_losses(tied_file, kind="tied", stateful_data=False, **pp),
            "file_pp_to_tp2": resumed_losses(tied_file, kind="tied", stateful_data=False),
        }
    }


@SCENARIOS.register("cp_2d")
def context_parallel_2d(ctx: Context) -> dict[str, Any]:
    """A TP 2 checkpoint (``--from``) resumed on cp 2 x tp 2."""
    return {"cp_tp2": resumed_losses(ctx.source, cp_size=2, tp_size=2, stateful_data=False)}


@SCENARIOS.register("tied")
def tied_saves(ctx: Context) -> dict[str, Any]:
    save_tied(ctx.out)
    return {}


def save_into_run_dir(trainer: L.Trainer, run_dir: Path) -> str | None:
    """A save into a directory that is not a checkpoint (rank 0 sees a file there): every rank raises the same error
    and nothing is removed (issue 11, defect 1); the ranks stay in step for what follows."""
    run_dir.mkdir(exist_ok=True)
    if dist.get_rank() == 0:
        (run_dir / "notes.txt").write_text("mine")
    try:
        trainer.save_checkpoint(run_dir)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def save_tied(out: Path) -> None:
    """A model with tied embeddings, sharded over TP 2 as the strategy shards it, saved with `save_pretrained` on
    every rank, and the same model with LoRA saved merged (`save_merged`), with Transformers' own save of the merged
    model on one process as the reference: `lm_head.weight` shares the embedding's shards and must not be written
    (issue 11, defect 3)."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lightning_tp import save_merged
    from lightning_tp.checkpoint.hf_saves import install_distributed_save_pretrained
    from lightning_tp.parallel.lora import extend_plan_to_adapters
    from lightning_tp.parallel.tensor_parallel import apply_tensor_parallel
    from lightning_tp.plans.resolve import resolve_plan

    def tied(lora: bool) -> Any:
        model = AutoModelForCausalLM.from_pretrained(Path(os.environ[CHECKPOINT_ENV]) / "tied", dtype=torch.float32)
        if lora:
            torch.manual_seed(3)
            config = LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
            return get_peft_model(model, config)
        return model

    mesh = init_device_mesh("cpu", (2,))
    for lora in (False, True):
        model = tied(lora)
        base = model.get_base_model() if lora else model
        plan = resolve_plan(base, "auto", tp_size=2)
        apply_tensor_parallel(base, mesh, extend_plan_to_adapters(base, plan) if lora else plan)
        assert base.lm_head.weight is base.model.embed_tokens.weight, "the test needs the tie kept through sharding"
        if lora:
            save_merged(model, out / "tied_merged")
        else:
            install_distributed_save_pretrained(model)
            model.save_pretrained(out / "tied_pretrained")
    if dist.get_rank() == 0:
        tied(True).merge_and_unload().save_pretrained(out / "tied_merged_reference")
    dist.barrier()


class KillDuringSave(L.Callback):
    """On the second save, rank 1 dies after writing its shards: the checkpoint being replaced must survive."""

    def __init__(self) -> None:
        self.saves = 0

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        self.saves += 1
        if self.saves == 2 and trainer.global_rank == 1:
            from torch.distributed.checkpoint import FileSystemWriter

            original = FileSystemWriter.write_data

            def write_then_die(self, *a: Any, **k: Any) -> Any:
                original(self, *a, **k).wait()
                os._exit(17)

            FileSystemWriter.write_data = write_then_die


@SCENARIOS.register("crash")
def crash(ctx: Context) -> dict[str, Any]:
    module = ResumeModule(stateful_data=False)
    out = ctx.out
    fit(module, callbacks=[SaveAt(steps={6: out / "last"}, epochs={0: out / "last"}), KillDuringSave()])
    raise AssertionError("the run was meant to be killed during its second save")


@SCENARIOS.register("compiled")
def compiled(ctx: Context) -> dict[str, Any]:
    """torch.compile per decoder layer (TP 2): trained compiled and checkpointed at the end of epoch 0, resumed
    uncompiled; the one-process checkpoint (``--from``) resumed compiled. The checkpoint's names are the model's."""
    assert ctx.source is not None, "compiled needs --from (the one-process checkpoint)"
    from torch.distributed.checkpoint import FileSystemReader

    out = ctx.out
    module = ResumeModule(stateful_data=False)
    # `aot_eager`: the checkpoint's names and a resume across compiled and not are the same with any backend, and a
    # cold inductor compile of another model's layers would cost the suite 20 s (the 2-D compile case checks
    # inductor).
    compile_args = {"backend": "aot_eager"}
    fit(module, compile=compile_args, callbacks=[SaveAt(epochs={0: out / "compiled_epoch0"})])
    names = list(FileSystemReader(str(out / "compiled_epoch0")).read_metadata().state_dict_metadata)
    return {
        "compiled_uninterrupted": module.losses,
        "compiled_to_plain": resumed_losses(out / "compiled_epoch0", stateful_data=False),
        "single_to_compiled": resumed_losses(ctx.source, compile=compile_args, stateful_data=False),
        "compiled_names": names,
    }


@SCENARIOS.register("ep")
def ep(ctx: Context) -> dict[str, Any]:
    """Expert parallelism across layouts, on the tiny Qwen3-MoE: ep 2 (over the TP group) trains and checkpoints at
    the end of epoch 0, and the checkpoint resumes on ep 2 and with the experts split TP-wise (ep 1); the one-process
    checkpoint (``--from-moe``) resumes on ep 2 over the TP group and on ep 2 over the data-parallel ranks (tp 1)."""
    assert ctx.source_moe is not None, "ep needs --from-moe (the one-process checkpoint)"
    out, moe = ctx.out, {"kind": "qwen3_moe", "stateful_data": False}
    module = ResumeModule(**moe)
    fit(module, ep_size=2, callbacks=[SaveAt(epochs={0: out / "ep2_epoch0"})])
    return {
        "ep_uninterrupted": module.losses,
        "ep_to_tp2": resumed_losses(out / "ep2_epoch0", **moe),
        "ep_to_ep": resumed_losses(out / "ep2_epoch0", ep_size=2, **moe),
        "tp2_moe": _saved_and_resumed_on_tp2(out, moe),
        "single_to_tp2_moe": resumed_losses(ctx.source_moe, **moe),
        "single_to_ep": resumed_losses(ctx.source_moe, ep_size=2, **moe),
        "single_to_ep_dp": resumed_losses(ctx.source_moe, ep_size=2, tp_size=1, **moe),
        "dp_rank": dist.get_rank(),
    }


def _saved_and_resumed_on_tp2(out: Path, moe: dict[str, Any]) -> dict[int, float]:
    """The experts split TP-wise (ep 1): a sharded checkpoint written and resumed on that layout (the packed gate/up
    weights and their AdamW states are `_StridedShard`s)."""
    module = ResumeModule(**moe)
    fit(module, callbacks=[SaveAt(epochs={0: out / "moe_tp2_epoch0"})])
    return resumed_losses(out / "moe_tp2_epoch0", **moe)


@SCENARIOS.register("one_moe")
def one_moe(ctx: Context) -> dict[str, Any]:
    """An ep 2 checkpoint of the tiny Qwen3-MoE -> 1 process."""
    return {"resumed": resumed_losses(ctx.source, kind="qwen3_moe", stateful_data=False)}


@SCENARIOS.register("one")
def one(ctx: Context) -> dict[str, Any]:
    """TP 2 -> 1 process."""
    return {"resumed": resumed_losses(ctx.source, stateful_data=False)}


def head_split_mixers(ctx: Context, kind: str) -> dict[str, Any]:
    """A family whose mixers TP 2 splits by heads (:data:`MIXER_KINDS`), trained on TP 2: a sharded checkpoint
    mid-epoch 1 (step 6), resumed on TP 2 here and on one process by ``one:KIND``; a final one and save_pretrained on
    every rank, with the model's logits (for export and for the resumed runs' weights) and the placements, local and
    global shapes of each DTensor parameter."""
    from torch.distributed.tensor import DTensor

    out = ctx.out
    module = ResumeModule(kind=kind)
    trainer = fit(module, callbacks=[SaveAt(steps={6: out / f"{kind}_mid"})])
    trainer.save_checkpoint(out / f"{kind}_final")
    module.model.save_pretrained(out / f"{kind}_pretrained")  # on every rank of the sharded model
    sharded = {
        name: (str(param.placements), tuple(param.to_local().shape), tuple(param.shape))
        for name, param in module.model.named_parameters()
        if isinstance(param, DTensor)
    }
    logits = probe_logits(module.model)
    resumed = ResumeModule(kind=kind)
    fit(resumed, ckpt_path=out / f"{kind}_mid")
    return {
        f"mixers:{kind}": {
            "reference": module.losses,
            "logits": logits,
            "sharded": sharded,
            "resumed": resumed.losses,
            "resumed_logits": probe_logits(resumed.model),
        }
    }


def one_kind(ctx: Context, kind: str) -> dict[str, Any]:
    """A TP 2 checkpoint of ``kind`` (``--from``, or ``one:KIND@CHECKPOINT``) -> 1 process: the resumed losses and the
    final model's logits."""
    module = ResumeModule(kind=kind)
    fit(module, ckpt_path=ctx.source)
    return {"resumed": module.losses, "logits": probe_logits(module.model)}


for _kind in MIXER_KINDS:
    SCENARIOS.add(f"mixers:{_kind}", functools.partial(head_split_mixers, kind=_kind))
    SCENARIOS.add(f"one:{_kind}", functools.partial(one_kind, kind=_kind))


@SCENARIOS.register("2d")
def two_d(ctx: Context) -> dict[str, Any]:
    """TP 2 -> 2-D, and a truncated checkpoint that must fail on every rank."""
    results: dict[str, Any] = {"resumed": resumed_losses(ctx.source, tp_size=2, stateful_data=False)}
    try:
        resumed_losses(ctx.truncated, tp_size=2, stateful_data=False)
        results["truncated"] = {"type": None}
    except Exception as err:  # every rank must raise it, none hang
        results["truncated"] = {"type": type(err).__name__, "message": str(err)}
    results["dp_rank"] = dist.get_rank() // 2
    return results


@SCENARIOS.register("pp_2d_file")
def pp_2d_file(ctx: Context) -> dict[str, Any]:
    """pp 2 x dp 2 (FSDP2 on each stage: its weights and optimizer states sharded, gathered whole for the file) saves
    one file at the end of epoch 0, resumed on pp 2 x dp 2 and on dp 2 x tp 2."""
    path = ctx.out / "pp2_dp2_epoch0.ckpt"
    pp = {"pp_size": 2, "tp_size": 1, "stateful_data": False}
    module = ResumeModule(stateful_data=False)
    fit(
        module,
        **{k: v for k, v in pp.items() if k != "stateful_data"},
        save_distributed_checkpoint=False,
        callbacks=[SaveAt(epochs={0: path})],
    )
    return {
        "pp_file_uninterrupted": module.losses,
        "pp_file_resumed": resumed_losses(path, **pp),
        "pp_file_to_2d": resumed_losses(path, tp_size=2, stateful_data=False),
        "pp_dp_rank": dist.get_rank() % 2,  # pp outermost: ranks 0 and 1 hold the first stage
        "dp_rank_2d": dist.get_rank() // 2,
    }


@SCENARIOS.register("tp4")
def tp4(ctx: Context) -> dict[str, Any]:
    """KV-head replication: TP 4 over the tiny Qwen3's 4 query and 2 KV heads. Trains (checkpoint at the end of epoch
    0, save_pretrained at the end), then resumes that checkpoint on 2-D (dp 2 x tp 2, KV heads split as usual)."""
    out = ctx.out
    module = ResumeModule(stateful_data=False)
    fit(module, tp_size=4, callbacks=[SaveAt(epochs={0: out / "tp4_epoch0"})])
    module.model.save_pretrained(out / "tp4_pretrained")
    results = {"uninterrupted": module.losses, "tp4_logits": probe_logits(module.model)}
    results["tp4_kv_heads"] = [
        (m.num_key_value_groups, tuple(m.k_proj.weight.to_local().shape))
        for m in module.model.modules()
        if type(m).__name__.endswith("Attention")
    ][:1]
    results["resumed_2d"] = resumed_losses(out / "tp4_epoch0", tp_size=2, stateful_data=False)
    results["dp_rank_2d"] = dist.get_rank() // 2
    return results


def main() -> None:
    worker_setup()  # a hang fails within the short timeout, with every stack
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--label", required=True, help="the results file: OUT/{label}_rank{R}.pt")
    parser.add_argument("--from", dest="source", type=Path)
    parser.add_argument("--truncated", type=Path)
    parser.add_argument("--from-moe", dest="source_moe", type=Path)
    args = parser.parse_args()
    # `NAME@CHECKPOINT`: scenario NAME resuming CHECKPOINT (instead of --from), its results under that key, so that one
    # launch resumes several checkpoints.
    SCENARIOS.check([name.split("@")[0] for name in args.scenarios])  # an unknown name: before anything runs
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out=args.out, source=args.source, truncated=args.truncated, source_moe=args.source_moe)
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    try:
        for name in args.scenarios:
            if "@" in name:
                scenario, source = name.split("@", 1)
                results[name] = SCENARIOS.run(scenario, dataclasses.replace(ctx, source=Path(source)))
            else:
                results.update(SCENARIOS.run(name, ctx))
    except Exception:  # recorded and shown by the test (the ranks may be out of step: nothing else runs)
        results = {"crash": traceback.format_exc()}
    torch.save(results, args.out / f"{args.label}_rank{rank}.pt")


if __name__ == "__main__":
    main()
