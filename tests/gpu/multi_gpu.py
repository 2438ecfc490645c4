"""Multi-rank checks on CUDA GPUs with NCCL, run by hand where GPUs are (not part of the CPU suite):

    torchrun --standalone --nproc-per-node 2 tests/gpu/multi_gpu.py    # TP 2
    torchrun --standalone --nproc-per-node 4 tests/gpu/multi_gpu.py    # TP 2 x dp 2 (2-D, offload), TP 4, pp 2 x dp 2
    torchrun --standalone --nproc-per-node 8 tests/gpu/multi_gpu.py    # TP 2 x dp 4, TP 4 x dp 2, pp 2 x tp 2 x dp 2
    python tests/gpu/multi_gpu.py                                       # one GPU: one rank (NCCL refuses two
                                                                        # ranks on one GPU; gloo has no CUDA
                                                                        # reduce-scatter for FSDP2)
    torchrun --standalone --nproc-per-node 4 tests/gpu/multi_gpu.py --cpu   # the same on CPU/gloo (checks the
                                                                             # script itself; no offload; the suite
                                                                             # runs a few checks on 2 processes)

What it checks, each against a plain loop on one device (this rank's GPU) with the same model, data and seed: parity
of TP and 2-D training in fp32 (SGD), bf16-mixed, foreach AdamW with clipping, LoRA, sequence + loss parallelism,
gradient accumulation (``accumulate_grads`` both ways), FSDP2's CPU offload (also with a meta-built model initialised
after sharding; on pipeline stages, with a tied embedding); under offload the LightningModule's device,
``self.log(sync_dist=True)`` and a torchmetrics metric; a DCP checkpoint resumed mid-run, exported and saved with
``save_pretrained`` (also under offload), reloaded on one process; DTensor's RNG tracker made at setup (a
rank-conditional random DTensor op returns); and the ThroughputMonitor's figures on a 0.2B Llama. One JSON line per
check on rank 0, a summary at the end, and ``--out`` (default ``/tmp/lightning_tp_gpu``) gets ``results.json``. Exit
code 1 if a check failed. A few minutes on 2-8 GPUs; every collective times out after 3 minutes and every rank dumps
its stack after 15.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_tp import TensorParallelStrategy  # noqa: E402
from tests.helpers.cases import CASES, CHECKPOINT_ENV  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    build_causal_lm,
    pipeline_state,
    quiet_trainer,
    reference_run,
    tiny_config,
)
from tests.helpers.tolerances import (  # noqa: E402
    cross_entropy_scale,
    parity_tolerances,
    relative_distance,
    rounding_gap,
    sharded_roundings,
)
from tests.helpers.tripwire import worker_setup  # noqa: E402

TIMEOUT = timedelta(minutes=3)
RANK = int(os.environ.get("RANK", 0))
WORLD = int(os.environ.get("WORLD_SIZE", 1))
RESULTS: list[dict[str, Any]] = []
DEVICE_NAME = "cpu"

#: (case of tests/helpers/cases.py, strategy arguments added, what it needs), on every layout that has what it needs.
PARITY = [
    ("qwen3_sgd", {}, ()),
    ("qwen3_bf16_mixed", {}, ()),
    ("qwen3_adamw_foreach_clip", {}, ()),
    ("qwen3_sp_lp_adamw_clip", {}, ("tp",)),
    ("qwen3_lora", {}, ()),
    ("llama_accumulate", {}, ()),
    ("llama_accumulate_unsharded", {}, ("dp",)),
    ("qwen3_sgd", {"cpu_offload": True}, ("dp", "gpu")),
    ("qwen3_meta_init", {"cpu_offload": True}, ("dp", "gpu")),
]
#: Cases run on the pipeline layouts (pp 2 x dp 2 on 4 ranks, pp 2 x tp 2 x dp 2 on 8): FSDP2's CPU offload on each
#: stage, with a tied embedding (the two copies' gradients summed through the device) and AdamW with clipping.
PIPELINE_PARITY = [
    ("qwen3_sgd", {}),
    ("qwen3_sgd", {"cpu_offload": True}),
    ("tied_sgd", {"cpu_offload": True}),
    ("qwen3_adamw_foreach_clip", {"cpu_offload": True}),
    ("llama_accumulate", {"cpu_offload": True}),
]


def report(name: str, ok: bool, **values: Any) -> None:
    record = {"check": name, "ok": bool(ok), "device": DEVICE_NAME, **values}
    RESULTS.append(record)
    if RANK == 0:
        print(json.dumps(record, default=str), flush=True)


#: Substrings of the check names to run (``--only``); empty: all.
ONLY: list[str] = []


def run_check(name: str, check: Any, *args: Any) -> None:
    """One check; an exception is a failure (reported with its traceback), and every rank meets the others after."""
    if ONLY and not any(part in name for part in ONLY):
        return
    started = time.perf_counter()
    try:
        check(name, *args)
    except Exception:
        report(name, False, error=traceback.format_exc()[-3000:])
    if dist.is_initialized():
        dist.barrier()
    if RESULTS and RESULTS[-1]["check"] == name:
        RESULTS[-1]["seconds"] = round(time.perf_counter() - started, 1)


def device(args: argparse.Namespace) -> torch.device:
    return torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def trainer(args: argparse.Namespace, strategy: TensorParallelStrategy, **kwargs: Any) -> L.Trainer:
    return quiet_trainer(accelerator="cpu" if args.cpu else "gpu", devices=WORLD, strategy=strategy, **kwargs)


def strategy(layout: dict, **kwargs: Any) -> TensorParallelStrategy:
    return TensorParallelStrategy(**layout, timeout=TIMEOUT, throughput_monitor=False, **kwargs)


def probe(model: torch.nn.Module, dev: torch.device) -> torch.Tensor:
    """The logits of a fixed batch (every rank of a sharded model calls it)."""
    from tests.helpers.resume import PROBE

    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE.to(dev)).logits.detach().float().cpu()


def gaps(result: dict, ref: dict) -> dict[str, float]:
    losses = [abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)]
    norms = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["grad_norms"], ref["grad_norms"], strict=True)]
    state = [(result["state"][k] - v).abs().max().item() for k, v in ref["state"].items()]
    return {"loss": max(losses), "grad_norm_rel": max(norms), "state": max(state)}


def check_parity(name: str, layout: dict, case_name: str, extra: dict, args: argparse.Namespace) -> None:
    case = CASES[case_name]
    module = case.module()
    batches = case.batches()
    run = trainer(
        args,
        strategy(layout, **{**case.strategy_kwargs, **extra}),
        max_steps=len(batches) // case.accumulate,
        gradient_clip_val=case.clip,
        precision=case.precision,
        accumulate_grad_batches=case.accumulate,
    )
    run.fit(module, DataLoader(batches, batch_size=None))
    # Under a pipeline each rank holds its stages: every stage's tensors, gathered over the pipeline.
    state = pipeline_state(module.model, run.strategy.pp_group)
    result = {"losses": module.losses, "grad_norms": module.grad_norms, "state": state}
    ref = reference_run(
        case.module(reference=True),
        batches,
        clip=case.clip,
        accumulate=case.accumulate,
        precision=case.precision,
        device=device(args),
    )
    found = gaps(result, ref)  # also checks that both ran as many micro-batches
    if case.precision == "32-true":
        # The same computation up to the order of sums (AdamW divides by sqrt(v): tiny differences grow a little).
        adamw = case.optimizer == "adamw"
        limits = {"loss": 1e-5, "grad_norm_rel": 1e-4, "state": 1e-4 if adamw else 1e-5}
        ok = all(found[key] <= limits[key] for key in limits)
    else:
        found, limits = bf16_gaps(case, layout, batches, result, ref)
        ok = all(gap <= bound for key in limits for gap, bound in zip(found[key], limits[key], strict=True))
    report(name, ok, gaps=found, limits=limits, losses=module.losses)


def bf16_gaps(case: Any, layout: dict, batches: list, result: dict, ref: dict) -> tuple[dict, dict]:
    """The gaps of a bf16 run from one device's, per step, and their bounds: derived from bf16's unit roundoff and
    what the layout rounds differently (tests/helpers/tolerances.py), plus the fp32 check's limits (the fp32 parts of
    the step sum in another order too; all there is on one rank). ``state_rel``: the trained weights' distance from
    one device's, relative to one device's update."""
    module = case.module(reference=True)
    module.configure_model()
    initial = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    layers = module.model.config.num_hidden_layers
    tp = layout["tp_size"]
    dp = WORLD // tp
    steps = len(ref["losses"])
    bf16_weights = case.precision == "bf16-true"
    scale = cross_entropy_scale(module.model, batches, precision=case.precision, states=(ref["state"],))
    bounds = parity_tolerances(
        torch.bfloat16, layers, tp=tp, dp=dp, steps=steps, loss_scale=scale, bf16_weights=bf16_weights
    )
    update = {k: ref["state"][k] - initial[k] for k in initial}
    found = {
        "loss": [abs(a - b) for a, b in zip(result["losses"], ref["losses"], strict=True)],
        "grad_norm_rel": [abs(a - b) / b for a, b in zip(result["grad_norms"], ref["grad_norms"], strict=True)],
        "state_rel": [relative_distance(result["state"], ref["state"], update)],
    }
    roundings = steps * sharded_roundings(layers, tp=tp, dp=dp, bf16_weights=bf16_weights)
    limits = {
        "loss": [bound + 1e-5 for bound in bounds["loss"]],
        "grad_norm_rel": [bound + 1e-4 for bound in bounds["grad_norm_rel"]],
        "state_rel": [rounding_gap(torch.bfloat16, roundings) + 1e-5],
    }
    return found, limits


class _OffloadedModule(L.LightningModule):
    """What a user does on ``self.device`` under CPU offload: ``self.log(sync_dist=True)``, a torchmetrics metric,
    new tensors on ``self.device`` (NCCL takes no CPU tensors)."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.model: Any = None
        self.tokens = torchmetrics.SumMetric()
        self.seen: dict[str, str] = {}

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_causal_lm(tiny_config("qwen3"))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.tokens.update(torch.tensor(float(batch["input_ids"].numel()), device=self.device))
        self.log("tokens", self.tokens, batch_size=1)
        self.log("loss_synced", loss.detach(), sync_dist=True, batch_size=1)
        self.log("one", 1.0, sync_dist=True, reduce_fx="sum", batch_size=1)
        self.seen = {"device": str(self.device), "zeros": str(torch.zeros(1, device=self.device).device)}
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def check_offload_device(name: str, layout: dict, args: argparse.Namespace) -> None:
    from tests.helpers.models import lm_batches

    module = _OffloadedModule()
    run = trainer(args, strategy(layout, cpu_offload=True), max_steps=2)
    run.fit(module, DataLoader(lm_batches(2), batch_size=None))
    on_gpu = module.seen["device"].startswith("cuda") and module.seen["zeros"].startswith("cuda")
    one = float(run.callback_metrics["one"])  # summed over the data-parallel ranks (a TP group counts once)
    dp_size = run.strategy.dp_mesh.size()
    ok = on_gpu and one == dp_size and module.tokens.device.type == "cuda"
    report(name, ok, seen=module.seen, synced_sum=one, dp_size=dp_size, metric_device=str(module.tokens.device))


def check_resume_export(name: str, layout: dict, extra: dict, args: argparse.Namespace) -> None:
    """8 AdamW steps with a saved checkpoint after 6 (mid-epoch); resumed from it, steps 7-8 give the same losses;
    the final checkpoint exported and the model's ``save_pretrained`` both reload on one process with the sharded
    model's logits."""
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import export_checkpoint
    from tests.helpers.resume import ResumeModule, SaveAt

    out = args.out / name
    full = ResumeModule(stateful_data=_stateful())
    run = trainer(args, strategy(layout, **extra), max_steps=8, callbacks=[SaveAt(steps={6: out / "mid"})])
    run.fit(full)
    run.save_checkpoint(out / "final")
    full.model.save_pretrained(out / "pretrained")
    logits = probe(full.model, device(args))
    resumed = ResumeModule(stateful_data=_stateful())
    trainer(args, strategy(layout, **extra), max_steps=8).fit(resumed, ckpt_path=out / "mid")
    resume_gap = max(abs(resumed.losses[s] - full.losses[s]) for s in resumed.losses)
    values: dict[str, Any] = {"resume_gap": resume_gap, "resumed_steps": sorted(resumed.losses)}
    if RANK == 0:
        exported = export_checkpoint(out / "final", out / "exported")
        for label, directory in (("export", exported), ("save_pretrained", out / "pretrained")):
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device(args))
            values[f"{label}_logit_gap"] = (probe(model, device(args)) - logits).abs().max().item()
    shared = [values]
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    values = shared[0]
    ok = (
        resume_gap < 1e-5
        and sorted(resumed.losses) == [7, 8]
        and values["export_logit_gap"] < 1e-4
        and values["save_pretrained_logit_gap"] < 1e-4
    )
    report(name, ok, **values)


def _stateful() -> bool:
    try:
        import torchdata  # noqa: F401
    except ImportError:
        return False
    return True


def check_rng(name: str, layout: dict, args: argparse.Namespace) -> None:
    """DTensor's RNG tracker exists after setup (made without a collective), and a random DTensor op on one rank only
    returns instead of waiting for the others in torch's lazy world broadcast."""
    from torch.distributed.tensor import _random

    from tests.helpers.models import ParityModule, lm_batches

    _random._rng_tracker = None  # an earlier check's setup made one: this setup must make its own
    module = ParityModule(lambda: build_causal_lm(tiny_config("qwen3")))
    trainer(args, strategy(layout), max_steps=1).fit(module, DataLoader(lm_batches(1), batch_size=None))
    tracker = _random._rng_tracker is not None
    weight = module.model.model.layers[0].self_attn.q_proj.weight
    started = time.perf_counter()
    if RANK == 0:
        state = None if args.cpu else torch.cuda.get_rng_state()
        with torch.no_grad():
            torch.nn.init.normal_(weight)  # rank 0's shard only
        if state is not None:
            torch.cuda.set_rng_state(state)  # the later checks start with every rank's generator alike
    seconds = time.perf_counter() - started
    ok = (tracker or args.cpu) and seconds < 30
    report(name, ok, tracker=tracker, rank0_only_op_s=round(seconds, 3))


def check_monitor(name: str, layout: dict, args: argparse.Namespace) -> None:
    """The ThroughputMonitor on a 0.2B Llama in bf16-mixed: tokens/s, step time, peak memory, MFU (no parity)."""
    from transformers import LlamaConfig

    from lightning_tp import ThroughputMonitor
    from tests.helpers.models import ParityModule

    small = args.cpu
    config = LlamaConfig(
        hidden_size=256 if small else 1024,
        intermediate_size=704 if small else 2816,
        num_hidden_layers=2 if small else 12,
        num_attention_heads=8 if small else 16,
        num_key_value_heads=4 if small else 8,
        vocab_size=4096 if small else 32000,
        max_position_embeddings=1024,
    )
    seq, rows = (128, 4) if small else (1024, 8)
    generator = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": ids, "labels": ids}
        for ids in (torch.randint(0, config.vocab_size, (rows, seq), generator=generator) for _ in range(30))
    ]
    module = ParityModule(lambda: build_causal_lm(config), optimizer="adamw", lr=1e-4)
    run = trainer(
        args,
        strategy(layout),
        max_steps=len(batches),
        precision="bf16-mixed",
        log_every_n_steps=10,
        callbacks=[ThroughputMonitor()],
    )
    run.fit(module, DataLoader(batches, batch_size=None))
    figures = {k: float(v) for k, v in run.callback_metrics.items() if k in _MONITOR_KEYS}
    ok = figures.get("tokens_per_sec", 0) > 0 and (args.cpu or 0 < figures.get("mfu", 0) < 1)
    report(name, ok, figures=figures, layout=layout, tokens_per_step=rows * seq)


_MONITOR_KEYS = ("tokens_per_sec", "tokens_per_sec_per_device", "step_time_s", "peak_memory_mb", "mfu")


def layouts() -> list[tuple[str, dict, set[str]]]:
    """The layouts this world size allows, each with what it has ("tp", "dp", "gpu" added by the caller)."""
    if WORLD == 1:
        return [("one_rank", {"tp_size": 1}, set())]
    found = []
    for tp in (2, 4):
        if tp <= WORLD and WORLD % tp == 0:
            has = {"tp"} | ({"dp"} if WORLD > tp else set())
            found.append((f"tp{tp}" + (f"_dp{WORLD // tp}" if WORLD > tp else ""), {"tp_size": tp}, has))
    return found


def pipeline_layouts() -> list[tuple[str, dict]]:
    """pp 2 with data parallelism on each stage (and TP 2 where there are 8 ranks)."""
    if WORLD < 4 or WORLD % 4:
        return []
    tp = 2 if WORLD >= 8 else 1
    return [(f"pp2_tp{tp}_dp{WORLD // 2 // tp}", {"tp_size": tp, "pp_size": 2})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (checks the script itself)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/lightning_tp_gpu"))
    parser.add_argument("--skip-monitor", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated parts of the check names to run (default: all)")
    args = parser.parse_args()
    ONLY.extend(part for part in args.only.split(",") if part)
    if args.cpu:  # under the suite: its short process-group timeout (a hang fails in a minute, every stack dumped)
        global TIMEOUT
        TIMEOUT = worker_setup()
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(15 * 60, exit=True)  # a hang ends with every rank's stack
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: pass --cpu to run the checks on CPU with gloo.")
    # The tiny checkpoint the resume check loads, written by every rank into its own directory (same seed, same bytes).
    checkpoints = args.out / f"checkpoints_rank{RANK}"
    build_causal_lm(tiny_config("qwen3")).save_pretrained(checkpoints / "qwen3")
    os.environ[CHECKPOINT_ENV] = str(checkpoints)
    global DEVICE_NAME
    DEVICE_NAME = "cpu" if args.cpu else torch.cuda.get_device_name()
    env = {
        "torch": torch.__version__,
        "device": DEVICE_NAME,
        "world_size": WORLD,
        "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
    }
    report("env", True, **env)
    for label, layout, has in layouts():
        has = has | (set() if args.cpu else {"gpu"})
        for case_name, extra, needs in PARITY:
            if set(needs) <= has:
                suffix = "_offload" if extra.get("cpu_offload") else ""
                run_check(f"{label}:{case_name}{suffix}", check_parity, layout, case_name, extra, args)
        run_check(f"{label}:rng", check_rng, layout, args)
        run_check(f"{label}:resume_export", check_resume_export, layout, {}, args)
        if {"dp", "gpu"} <= has:
            run_check(f"{label}:offload_device", check_offload_device, layout, args)
            run_check(f"{label}:resume_export_offload", check_resume_export, layout, {"cpu_offload": True}, args)
    for label, layout in pipeline_layouts():
        for case_name, extra in PIPELINE_PARITY:
            suffix = "_offload" if extra.get("cpu_offload") else ""
            if not (args.cpu and extra.get("cpu_offload")):
                run_check(f"{label}:{case_name}{suffix}", check_parity, layout, case_name, extra, args)
    if not args.skip_monitor:
        run_check("monitor", check_monitor, layouts()[0][1], args)
    failed = [r["check"] for r in RESULTS if not r["ok"]]
    if RANK == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"env": env, "results": RESULTS}, indent=1, default=str))
        print(json.dumps({"summary": f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed", "failed": failed}))
    faulthandler.cancel_dump_traceback_later()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
