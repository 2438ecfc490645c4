"""Step time, tokens/s, memory and collectives of lightning_tp against the alternatives, on one Llama-style model.

    python benchmarks/run.py --out benchmarks/results.json     # CPU/gloo: a few minutes on 2 cores
    python benchmarks/run.py --quick --out /tmp/bench.json     # tiny model, one round: a smoke run (< 2 min)

Writes the JSON and, next to it, the same name with ``.md`` (the markdown table, also printed). On a machine with
CUDA the runs use NCCL, bf16 (``bf16-true``) and a larger model; ``--device cpu`` keeps them on the CPU.

Runs (same model built from a config with the same seed, same token batches, AdamW(lr=1e-4), foreach default):

* ``single``: one process, Lightning ``Trainer`` (no strategy), one CPU thread (one "device");
* ``tp2``: ``Trainer(strategy=TensorParallelStrategy(tp_size=2))``, defaults (ThroughputMonitor on);
* ``hand_tp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``, the model
  parallelised by hand in ``configure_model`` with torch's ``ColwiseParallel``/``RowwiseParallel`` on every projection,
  the embedding and ``lm_head``; norms stay plain tensors (replicated);
* ``hand_tp2_prepared``: the same plan plus ``PrepareModuleInput`` on ``self_attn`` and ``mlp``, so that q/k/v (and
  gate/up) share one input DTensor: one all-reduce of the input gradient per sub-layer in backward instead of one per
  projection (Megatron's count). Not asked for by any user; it shows what the per-projection plans leave on the table;
* ``hf_native_tp2``: ``AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2))``
  and a plain PyTorch loop (no Lightning), the model saved with ``save_pretrained`` from the seeded build;
* ``tp2_sp``, ``tp2_loss_parallel``, ``tp2_sp_lp``: ``TensorParallelStrategy(tp_size=2, sequence_parallel=True)``,
  ``loss_parallel=True``, both; recorded as skipped while the strategy does not accept the keyword;
* ``tp2_no_monitor`` (only when named in ``--variants``): ``tp2`` with ``throughput_monitor=False``, to price the
  monitor the strategy adds by default;
* ``tp2_compile`` (only when named in ``--variants``): ``tp2`` with ``compile=True`` (each decoder layer compiled;
  the warm-up steps pay the compilation);
* ``tp2_dp2`` (only when named in ``--variants``): ``TensorParallelStrategy(tp_size=2)`` on 4 processes, so
  ``dp_shard 2 x tp 2`` (FSDP2 over the two TP groups); each data-parallel rank takes a whole batch, so a step holds
  twice the tokens. On 2 cores its 4 processes share 2 cores: its tokens/s can at best match ``tp2``'s.

Method. Each run is its own launch (``torchrun`` for 2 ranks, plain ``python`` for one), one thread per process on CPU
(``OMP_NUM_THREADS=1``: a core is a device; ``single`` uses one core, the TP runs two). Launches are interleaved in
``--rounds`` (round 1 in the order above, round 2 reversed, ...), since this machine is shared and noisy. In each
launch, after ``--warmup`` steps:

* step time: the wall clock between the starts of consecutive training steps (CUDA synchronised), so it holds the
  forward, backward, optimizer step, zero_grad and every per-step hook (Lightning's and the callbacks'); taken per
  step as the slowest rank. Lightning runs time it in a callback's ``on_train_batch_start``, the plain loop at the top
  of each iteration: the same points of the step. Reported: the median over ``--steps`` steps x rounds (the headline,
  tokens/s and "vs tp2"), the best round (the lowest of the per-round medians) and the fastest step. Contention from
  other processes only adds time and comes and goes over tens of seconds, about a launch: on a shared machine the
  best round is the steadiest comparison. Each step is also split into forward (with zero_grad), backward,
  optimizer and rest (hooks after the step, the loop, the next batch), each the median of the slowest rank;
* tokens/s: global tokens per step (batch x sequence x data-parallel ranks; every TP rank works on the same
  tokens) / median step time;
* memory per rank: on CPU the peak resident set (VmHWM, reset through ``/proc/self/clear_refs``) above the resident set
  once setup is done (model sharded, optimizer built, no state yet): gradients, AdamW states, activations and
  temporaries; on CUDA ``torch.cuda.max_memory_allocated`` above the allocated bytes at the same point;
* collectives: one more step (after the timed ones) under :class:`benchmarks.comm.CollectiveCounter`, a dispatch mode
  that intercepts DTensor's functional collectives and ``torch.distributed``'s c10d ops alike (as ``CommDebugMode``
  does; checked to agree with it), by phase (forward, backward, optimizer, after_step = hooks after the step) with
  bytes; also the number of ops dispatched on DTensors per step (each one pays DTensor's Python-side dispatch), and
  the time spent in collectives (each call and its wait, waiting for the slower rank included; the mean over the
  ranks). ``compute_time_s`` is the step time less that: the step's own work, the host's dispatch included (a lower
  bound under FSDP2, whose collectives would overlap compute: see :mod:`benchmarks.comm`);
* garbage collection: every Lightning run gets :class:`lightning_tp.GarbageCollection` (the strategy adds it by
  default; the others get it here), so that a full collection at a moment of its own on one rank, which stalls the
  other in its next collective, neither slows nor spares one run against another;
* theory: the collectives each plan implies for forward and backward (see :func:`theory`), next to the measured ones.

``--profile DIR`` adds one step under ``torch.profiler`` per run and writes the top operators of rank 0 there.
``--quick`` (a smoke run for CI) also runs the 2-rank runs one after the other in one launch (``--shared-launch``):
no start-up per run, but memory figures are then not per run, and the first run warms caches for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: name -> (processes, how it runs); in launch order.
VARIANTS = {
    "single": 1,
    "tp2": 2,
    "hand_tp2": 2,
    "hand_tp2_prepared": 2,
    "hf_native_tp2": 2,
    "tp2_sp": 2,
    "tp2_loss_parallel": 2,
    "tp2_sp_lp": 2,
    "tp2_no_monitor": 2,  # not run by default: tp2 without its ThroughputMonitor, to price the monitor
    "tp2_compile": 2,  # not run by default (its compilation takes longer than the quick run): tp2, compile=True
    "tp2_dp2": 4,  # not run by default: dp_shard 2 x tp 2 on 4 processes
}
#: Runs left out unless named: they price one option against ``tp2``.
OPTIONAL_VARIANTS = ("tp2_no_monitor", "tp2_compile", "tp2_dp2")
DEFAULT_VARIANTS = [name for name in VARIANTS if name not in OPTIONAL_VARIANTS]
#: Strategy keywords of the variants the strategy may not offer yet.
STRATEGY_OPTIONS = {
    "tp2": {},
    "tp2_sp": {"sequence_parallel": True},
    "tp2_loss_parallel": {"loss_parallel": True},
    "tp2_sp_lp": {"sequence_parallel": True, "loss_parallel": True},
    "tp2_no_monitor": {"throughput_monitor": False},
    "tp2_compile": {"compile": True},
    "tp2_dp2": {},
}
DEFAULTS = {
    "cpu": dict(hidden=256, layers=4, heads=8, vocab=4096, seq_len=256, batch_size=4, steps=8, warmup=2, rounds=2),
    "cuda": dict(
        hidden=2048, layers=8, heads=16, vocab=32000, seq_len=2048, batch_size=4, steps=20, warmup=5, rounds=2
    ),
    "quick": dict(hidden=64, layers=2, heads=4, vocab=256, seq_len=32, batch_size=2, steps=3, warmup=1, rounds=1),
}


# ---------------------------------------------------------------------------------------------- model and data


def model_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    intermediate = args.intermediate or 64 * round(2.75 * args.hidden / 64)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(args.heads // 2, 2),
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(model_config(args), dtype=torch.float32)


def batches(args: argparse.Namespace, count: int) -> list:
    """The same random token ids for every run, as ``{"input_ids", "labels"}`` dicts (the model shifts the labels)."""
    import torch

    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator) for _ in range(count)]
    return [{"input_ids": x, "labels": x} for x in ids]


def hand_parallelize(model, tp_mesh, *, prepared: bool) -> None:
    """What a careful user writes for ``ModelParallelStrategy``: torch's styles on every projection of the HF Llama
    model. HF's attention views q/k/v with ``(*input_shape, -1, head_dim)``, so the local head count needs no patch.
    Norms are left alone (plain replicated tensors)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
        if prepared:
            # One input DTensor per sub-layer: the projections' partial input gradients add up locally and are
            # all-reduced once, where each ColwiseParallel would all-reduce its own.
            plan[f"{prefix}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            )
            plan[f"{prefix}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    parallelize_module(model, tp_mesh, plan)


def theory(name: str, args: argparse.Namespace, element_size: int, tp: int = 2) -> dict | None:
    """Collectives per training step (forward, backward) each plan implies, with bytes (nccl-tests convention).

    ``A`` = one activation ``batch x seq x hidden``, ``G`` = the logits ``batch x seq x vocab``, ``L`` layers.

    TP without sequence parallelism, forward: the vocabulary-sharded embedding's partial sums (1 all-reduce of A), per
    layer the row-wise o_proj and down_proj (2 L all-reduces of A), ``lm_head`` column-wise gathering its output
    (1 all-gather of G). Backward: a column-wise layer's input gradient is a partial sum, all-reduced where its input
    DTensor was made. With Transformers' layers (``hf_native_tp2``) and a plain hand plan (``hand_tp2``) each of q, k,
    v, gate and up makes its own: 5 L all-reduces of A, plus ``lm_head`` (1). ``tp2`` (and ``hand_tp2_prepared``)
    make one input DTensor per attention and MLP: 2 L + 1 (Megatron's count).

    Sequence parallelism as ``TensorParallelStrategy`` does it: per layer 2 all-gathers (attention and MLP inputs) and
    2 reduce-scatters (o_proj, down_proj) each way. The embedding stays replicated (1 all-reduce of A forward) and the
    first layer cuts its input (its backward all-gathers); the final norm gathers its output (all-gather forward, a
    local slice backward), so ``lm_head`` is unchanged: it gathers the logits (G) and all-reduces its input gradient.
    The norms between the regions see one sequence shard each: 2 L + 1 all-reduces of their (hidden-sized) gradients.
    Loss parallelism replaces the gather of the logits by 2 all-reduces of per-token fp32 statistics (the row max; the
    sum of exponentials with the target logit).
    """
    L = args.layers
    A = args.batch_size * args.seq_len * args.hidden * element_size
    G = args.batch_size * args.seq_len * args.vocab * element_size
    S = args.batch_size * args.seq_len * 4  # loss statistics are fp32

    def kinds(**counts: tuple[int, int]) -> dict:
        return {k: {"count": c, "bytes": b} for k, (c, b) in sorted(counts.items()) if c}

    if name == "single":
        return {"forward": {}, "backward": {}}
    if name == "tp2_dp2":
        return None  # FSDP2's gathers and reduce-scatters on top of tp2's: not modelled here
    name = "tp2" if name in OPTIONAL_VARIANTS else name
    sp = name in ("tp2_sp", "tp2_sp_lp")
    lp = name in ("tp2_loss_parallel", "tp2_sp_lp")
    H = args.hidden * element_size
    logits = dict(all_reduce=(2, 3 * S)) if lp else dict(all_gather=(1, G))
    if sp:
        forward = kinds(all_reduce=(1, A), all_gather=(2 * L + 1, (2 * L + 1) * A), reduce_scatter=(2 * L, 2 * L * A))
        backward = kinds(
            all_gather=(2 * L + 1, (2 * L + 1) * A),
            reduce_scatter=(2 * L, 2 * L * A),
            all_reduce=(2 * L + 2, A + (2 * L + 1) * H),
        )
    else:
        forward = kinds(all_reduce=(2 * L + 1, (2 * L + 1) * A))
        per_layer = 5 if name in ("hand_tp2", "hf_native_tp2") else 2
        backward = kinds(all_reduce=(per_layer * L + 1, (per_layer * L + 1) * A))
    for kind, (count, size) in logits.items():
        entry = forward.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += count
        entry["bytes"] += size
    return {"forward": dict(sorted(forward.items())), "backward": backward}


# ---------------------------------------------------------------------------------------------- measuring in a rank


def status_kb(*keys: str) -> dict[str, int]:
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            values[key] = int(rest.split()[0])
    return values


class StepRecorder:
    """Timing, memory, collectives and (optionally) a profile, fed by ``step_start(i)`` at the top of each step and
    ``phase(name)`` inside it. Steps ``[warmup, warmup + steps)`` are timed, the next one counted, the next one
    profiled if asked; the last step only closes the window before it."""

    def __init__(self, warmup: int, steps: int, device, profile: bool) -> None:
        self.warmup, self.steps, self.device, self.profile = warmup, steps, device, profile
        self.times: list[float] = []
        self.phase_times: dict[str, list[float]] = {}
        self.losses: list[float] = []
        self._marks: list[tuple[str, float]] = []
        self.counter = None
        self.profiler = None
        self.profile_table = ""
        self._prev: float | None = None
        self._count_step = warmup + steps
        self._profile_step = self._count_step + 1 if profile else None

    @property
    def total_steps(self) -> int:
        return self._count_step + (2 if self.profile else 1) + 1

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def baseline(self) -> None:
        """Called once setup is done: memory is measured from here."""
        import torch

        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base_mb = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            from lightning_tp.runtime.monitor import reset_peak_rss

            reset_peak_rss()  # VmHWM back to the current resident set (the ThroughputMonitor's own reset)
            self._base_mb = status_kb("VmRSS")["VmRSS"] / 1024

    def memory(self) -> dict[str, float]:
        import torch

        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            from lightning_tp.runtime.monitor import peak_rss_mb

            peak = peak_rss_mb()
        return {"baseline_mb": self._base_mb, "peak_mb": peak, "peak_above_baseline_mb": peak - self._base_mb}

    def step_start(self, index: int) -> None:
        self._sync()
        now = time.perf_counter()
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profile_table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            self.profiler = None
        if self._prev is not None and self.warmup < index <= self.warmup + self.steps:
            self.times.append(now - self._prev)
            marks = [*self._marks, ("end", now)]
            for (name, start), (_, end) in zip(marks, marks[1:], strict=False):
                self.phase_times.setdefault(name, []).append(end - start)
        self._marks = []
        if index == self._count_step:
            from benchmarks.comm import CollectiveCounter

            self.counter = CollectiveCounter()
            self.counter.__enter__()
        elif self.counter is not None:
            self.finished_counter, self.counter = self.counter, None
        if index == self._profile_step:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        self._prev = time.perf_counter()  # the recorder's own work is not timed

    def phase(self, name: str) -> None:
        """Steps are split into forward (with zero_grad), backward, optimizer and after_step (the hooks after the
        step, the loop, fetching the next batch); each phase is timed, and its collectives are counted apart."""
        if self.counter is not None:
            self.counter.phase = name
        self._sync()
        self._marks.append((name, time.perf_counter()))

    def record(self) -> dict:
        counter = getattr(self, "finished_counter", None)
        return {
            "step_times_s": self.times,
            "phase_times_s": self.phase_times,
            "losses": self.losses,
            "memory": self.memory(),
            "collectives_by_phase": counter.by_phase() if counter else None,
            "collective_seconds_by_phase": dict(counter.seconds) if counter else None,
            "collective_events": counter.events if counter else None,
            "dtensor_ops_by_phase": dict(counter.dtensor_ops) if counter else None,
            "profile": self.profile_table,
        }


def lightning_probe(recorder: StepRecorder):
    import lightning as L

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            recorder.baseline()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            recorder.step_start(batch_idx)
            recorder.phase("forward")

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            recorder.phase("backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            recorder.phase("optimizer")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            recorder.phase("after_step")
            recorder.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, pl_module) -> None:
            recorder.step_start(recorder.total_steps)

    return Probe()


def optimizer_kwargs(model, device) -> dict:
    """AdamW's defaults, except on CUDA where the default ``foreach`` fails on a mix of DTensor and plain
    parameters (torch 2.13): those runs fall back to the for-loop, and say so."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return {"foreach": False} if device.type == "cuda" and len(kinds) > 1 else {}


def run_lightning(args: argparse.Namespace, recorder: StepRecorder, record: dict) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_tp import GarbageCollection

    variant = args.variant
    precision = "bf16-true" if args.device == "cuda" else "32-true"

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = build_model(args)
            if variant.startswith("hand_tp2"):
                hand_parallelize(
                    self.model, self.device_mesh["tensor_parallel"], prepared=variant == "hand_tp2_prepared"
                )

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            kwargs = optimizer_kwargs(self.model, self.device)
            record["optimizer"] = f"AdamW(lr=1e-4{', foreach=False' if kwargs else ''})"
            return torch.optim.AdamW(self.parameters(), lr=1e-4, **kwargs)

    if variant == "single":
        strategy, devices = "auto", 1
    elif variant.startswith("hand_tp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, devices = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2
    else:
        from lightning_tp import TensorParallelStrategy

        strategy, devices = TensorParallelStrategy(tp_size=2, **STRATEGY_OPTIONS[variant]), VARIANTS[variant]
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=recorder.total_steps,
        callbacks=[lightning_probe(recorder), GarbageCollection()],  # for every run alike (see the module docstring)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(LM(), DataLoader(batches(args, recorder.total_steps), batch_size=None))


def run_hf_native(args: argparse.Namespace, recorder: StepRecorder, record: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, distributed_config=DistributedConfig(tp_size=2), dtype=dtype
    )
    model.train()
    device = recorder.device
    kwargs = optimizer_kwargs(model, device)
    record["optimizer"] = f"AdamW(lr=1e-4{', foreach=False' if kwargs else ''})"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(args, recorder.total_steps)]
    import gc

    gc.collect()  # as GarbageCollection does for the Lightning runs (no collection in so few steps)
    gc.freeze()
    gc.disable()
    recorder.baseline()
    for index, batch in enumerate(data):
        recorder.step_start(index)
        recorder.phase("forward")
        loss = model(**batch).loss
        recorder.phase("backward")
        loss.backward()
        recorder.phase("optimizer")
        optimizer.step()
        optimizer.zero_grad()
        recorder.phase("after_step")
        recorder.losses.append(float(loss))
    recorder.step_start(len(data))
    gc.unfreeze()
    gc.enable()


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    for variant in args.variant.split(","):  # several only with --shared-launch
        args.variant = variant
        recorder = StepRecorder(args.warmup, args.steps, device, args.profile is not None)
        record: dict = {"variant": variant, "rank": int(os.environ.get("RANK", 0))}
        if variant == "hf_native_tp2":
            run_hf_native(args, recorder, record)
        else:
            run_lightning(args, recorder, record)
        record.update(recorder.record())
        Path(f"{args.result}.{variant}.rank{record['rank']}.json").write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------- the driver


def launch(args: argparse.Namespace, variants: list[str], result: Path, checkpoint: Path) -> dict[str, list[dict]]:
    """Run ``variants`` (one, or with ``--shared-launch`` several with the same number of ranks, one after the
    other in the same processes); return each one's per-rank records."""
    nprocs = VARIANTS[variants[0]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    forwarded = ["--variant", ",".join(variants), "--result", str(result), "--checkpoint", str(checkpoint)]
    for key in ("hidden", "intermediate", "layers", "heads", "vocab", "seq_len", "batch_size", "steps", "warmup"):
        if getattr(args, key) is not None:
            forwarded += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    forwarded += ["--device", args.device, "--seed", str(args.seed)]
    if args.profile is not None:
        forwarded += ["--profile", str(args.profile)]
    script = [str(Path(__file__).resolve()), *forwarded]
    cmd = (
        [sys.executable, *script]
        if nprocs == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", *script]
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{variants} failed:\n{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    elapsed = time.perf_counter() - started
    out = {}
    for variant in variants:
        out[variant] = [json.loads(Path(f"{result}.{variant}.rank{r}.json").read_text()) for r in range(nprocs)]
        for rec in out[variant]:
            rec["launch_s"] = elapsed
    return out


def launch_groups(names: list[str], shared: bool) -> list[list[str]]:
    """One launch per run; with ``shared``, one per number of ranks (Transformers' native TP last: it sets up the
    process group its own way)."""
    if not shared:
        return [[name] for name in names]
    groups: dict[int, list[str]] = {}
    for name in sorted(names, key=lambda n: n == "hf_native_tp2"):
        groups.setdefault(VARIANTS[name], []).append(name)
    return list(groups.values())


def skip_reason(variant: str) -> str | None:
    """Why the strategy cannot run this variant yet (its constructor rejects the keyword), or None."""
    options = STRATEGY_OPTIONS.get(variant)
    if not options:
        return None
    from lightning_tp import TensorParallelStrategy

    try:
        TensorParallelStrategy(tp_size=2, **options)
    except TypeError:
        missing = " and ".join(options)
        return f"TensorParallelStrategy has no {missing} option yet"
    return None


def summarise(name: str, rounds: list[list[dict]], args: argparse.Namespace, element_size: int) -> dict:
    from benchmarks.comm import merge

    # Per step, the slowest rank (ranks wait for each other in every collective anyway).
    def slowest(records: list[dict]) -> list[float]:
        return [max(step) for step in zip(*(rec["step_times_s"] for rec in records), strict=True)]

    times = [t for records in rounds for t in slowest(records)]
    phases = {}
    for phase in ("forward", "backward", "optimizer", "after_step"):
        per_step = [
            max(step)
            for records in rounds
            for step in zip(*(rec["phase_times_s"].get(phase, []) for rec in records), strict=True)
        ]
        phases[phase] = statistics.median(per_step) if per_step else None
    per_round = [statistics.median(slowest(records)) for records in rounds]
    median = statistics.median(times)
    quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [median, median, median]
    first = rounds[0]
    by_phase = first[0]["collectives_by_phase"]
    measured = {phase: by_phase.get(phase, {}) for phase in ("forward", "backward", "optimizer", "after_step")}
    stable = all(r[k]["collectives_by_phase"] == by_phase for r in rounds for k in range(len(r)))
    ranks_agree = all(rec["collectives_by_phase"] == by_phase for rec in first)
    # Data-parallel ranks: those past the TP group (2 ranks) each take a whole batch.
    data_parallel = max(1, len(first) // 2) if name != "single" else 1
    tokens = args.batch_size * args.seq_len * data_parallel
    # Time in collectives in the counted step, per rank (mean over the ranks), by phase.
    seconds = [rec.get("collective_seconds_by_phase") or {} for rec in first]
    collective_phases = {
        phase: statistics.mean(rank.get(phase, 0.0) for rank in seconds)
        for phase in ("forward", "backward", "optimizer", "after_step")
    }
    collective_time = sum(collective_phases.values())
    expected = theory(name, args, element_size)
    fwd_bwd = merge([measured["forward"], measured["backward"]])
    return {
        "name": name,
        "ranks": len(first),
        "step_time_s": median,
        "step_time_iqr_s": [quartiles[0], quartiles[2]],
        "step_time_per_round_s": per_round,
        "step_time_best_round_s": min(per_round),
        "step_time_min_s": min(times),
        "phase_time_s": phases,
        "tokens_per_s": tokens / median,
        "tokens_per_step": tokens,
        "collective_time_s": collective_time,
        "collective_time_by_phase_s": collective_phases,
        "compute_time_s": median - collective_time,
        "peak_mem_mb": [max(r[k]["memory"]["peak_above_baseline_mb"] for r in rounds) for k in range(len(first))],
        "baseline_mem_mb": [max(r[k]["memory"]["baseline_mb"] for r in rounds) for k in range(len(first))],
        "collectives": fwd_bwd,
        "collectives_by_phase": measured,
        "collectives_stable_over_rounds_and_ranks": stable and ranks_agree,
        "theory": expected,
        "theory_matches": (
            None
            if expected is None
            else all(
                {k: v["count"] for k, v in measured[p].items()} == {k: v["count"] for k, v in expected[p].items()}
                for p in ("forward", "backward")
            )
        ),
        "dtensor_ops_per_step": first[0]["dtensor_ops_by_phase"],
        "losses": first[0]["losses"],
        "optimizer": first[0].get("optimizer"),
        "launch_s": [r[0]["launch_s"] for r in rounds],
    }


def machine_info(device: str) -> dict:
    import lightning
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "threads_per_process": 1 if device == "cpu" else None,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (and .md)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 layers, few steps, one round")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated runs (default: all but {', '.join(OPTIONAL_VARIANTS)}), from {', '.join(VARIANTS)}",
    )
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 2.75 x hidden, rounded to 64")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per launch, after the warmup")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--rounds", type=int, help="interleaved launches of every run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None, help="profile one step per run; write tables here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument(
        "--shared-launch",
        action="store_true",
        help="run the 2-rank runs one after the other in one launch (default with --quick): saves the start-up "
        "of each launch, but memory figures are no longer per run",
    )
    # worker arguments
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant is not None:
        worker(args)
        return

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.shared_launch = args.shared_launch or args.quick
    defaults = DEFAULTS["quick" if args.quick else args.device]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown runs {sorted(unknown)}; choose from {list(VARIANTS)}")
    element_size = 2 if args.device == "cuda" else 4
    if args.device == "cuda" and torch.cuda.device_count() < max(VARIANTS[n] for n in names):
        raise SystemExit("The TP runs need 2 GPUs; this machine has fewer. Use --device cpu or --variants single.")
    skipped = {name: reason for name in names if (reason := skip_reason(name))}
    to_run = [name for name in names if name not in skipped]

    load_before = os.getloadavg()
    started = time.perf_counter()
    results: dict[str, list[list[dict]]] = {name: [] for name in to_run}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        checkpoint = tmp_path / "model"
        if "hf_native_tp2" in to_run:
            build_model(args).save_pretrained(checkpoint)
        groups = launch_groups(to_run, args.shared_launch)
        for round_index in range(args.rounds):
            for group in groups if round_index % 2 == 0 else groups[::-1]:
                print(f"round {round_index + 1}/{args.rounds}: {', '.join(group)}", file=sys.stderr, flush=True)
                for name, records in launch(args, group, tmp_path / f"round{round_index}", checkpoint).items():
                    results[name].append(records)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name, rounds in results.items():
            (args.profile / f"profile_{name}.txt").write_text(rounds[0][0]["profile"])

    runs = []
    for name in names:
        if name in skipped:
            runs.append({"name": name, "skipped": skipped[name]})
        else:
            runs.append(summarise(name, results[name], args, element_size))
    reference = next((r["losses"] for r in runs if "losses" in r), None)
    for run in runs:
        if "losses" in run:
            # Every run trains the same model on the same batches: the losses say each one computes the same thing.
            run["loss_max_abs_diff_vs_first"] = max(abs(a - b) for a, b in zip(run["losses"], reference, strict=True))
    config = {
        key: getattr(args, key)
        for key in ("hidden", "layers", "heads", "vocab", "seq_len", "batch_size", "steps", "warmup", "rounds", "seed")
    }
    config.update(
        intermediate=model_config(args).intermediate_size,
        kv_heads=model_config(args).num_key_value_heads,
        precision="bf16-true" if args.device == "cuda" else "32-true",
        quick=args.quick,
        shared_launch=args.shared_launch,
        tokens_per_step=args.batch_size * args.seq_len,
    )
    machine = machine_info(args.device)
    machine.update(load_average_before=load_before, load_average_after=os.getloadavg())
    machine["wall_s"] = time.perf_counter() - started
    report = {"machine": machine, "config": config, "runs": runs, "ratios": ratios(runs)}
    table = markdown(report)
    report["table"] = table
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")


def ratios(runs: list[dict]) -> dict:
    """Step-time ratios on the medians over every step, on each run's best round (the median of its least disturbed
    launch) and on the fastest steps. Contention from other processes only ever adds time, and on a shared machine it
    comes and goes over tens of seconds, a launch's length: the best round is then the steadiest comparison."""
    done = {r["name"]: r for r in runs if "skipped" not in r}
    out: dict = {}
    if "tp2" not in done:
        return out
    for stat, key in (("step_time_s", ""), ("step_time_best_round_s", "_best_round"), ("step_time_min_s", "_min")):
        base = done["tp2"][stat]
        out[f"step_time_vs_tp2{key}"] = {name: r[stat] / base for name, r in done.items()}
        for other in ("hand_tp2", "hand_tp2_prepared", "hf_native_tp2"):
            if other in done:
                out[f"tp2_over_{other}{key}"] = base / done[other][stat]
        if "single" in done:
            out[f"speedup_tp2_over_single{key}"] = done["single"][stat] / base
    return out


def _short(kinds: dict) -> str:
    if not kinds:
        return "-"
    names = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
    return ", ".join(f"{v['count']} {names.get(k, k)} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in kinds.items())


def markdown(report: dict) -> str:
    cfg, machine = report["config"], report["machine"]
    device = machine.get("gpu", f"{machine['cpus']} CPU cores, gloo, 1 thread per rank")
    lines = [
        f"Llama-style, hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads ({cfg['kv_heads']} KV), "
        f"vocab {cfg['vocab']}, batch {cfg['batch_size']} x {cfg['seq_len']} tokens, {cfg['precision']}, AdamW; "
        f"{device}; median of {cfg['steps']} steps x {cfg['rounds']} interleaved rounds after {cfg['warmup']} warmup; "
        "best round: the median of the run's least disturbed launch. "
        "Collectives per training step (one step counted, rank 0; forward / backward); theory in parentheses when it "
        "differs.",
        "",
        "| run | ranks | step time (ms) | best round (ms) | fastest step (ms) | fwd / bwd / opt / rest (ms) | "
        "tokens/s | vs tp2 | peak mem above setup / rank (MiB) | forward collectives | backward collectives | "
        "other collectives / step | DTensor ops / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    vs = report["ratios"].get("step_time_vs_tp2", {})
    for run in report["runs"]:
        if "skipped" in run:
            lines.append(f"| {run['name']} | - | skipped: {run['skipped']} | | | | | | | | | | |")
            continue
        measured, expected = run["collectives_by_phase"], run["theory"] or {}
        cells = []
        for phase in ("forward", "backward"):
            cell = _short(measured[phase])
            if expected and measured[phase] != expected.get(phase):
                cell += f" (theory: {_short(expected.get(phase, {}))})"
            cells.append(cell)
        other = _short(merge_phases(measured, ("optimizer", "after_step")))
        ops = sum((run["dtensor_ops_per_step"] or {}).values())
        ratio = f"{vs[run['name']]:.3f}" if run["name"] in vs else "-"
        split = " / ".join(
            f"{t * 1e3:.0f}" if t is not None else "-"
            for t in (run["phase_time_s"][p] for p in ("forward", "backward", "optimizer", "after_step"))
        )
        lines.append(
            f"| {run['name']} | {run['ranks']} | {run['step_time_s'] * 1e3:.1f} | "
            f"{run['step_time_best_round_s'] * 1e3:.1f} | {run['step_time_min_s'] * 1e3:.1f} | "
            f"{split} | {run['tokens_per_s']:.0f} | {ratio} | {max(run['peak_mem_mb']):.0f} | {cells[0]} | "
            f"{cells[1]} | {other} | {ops} |"
        )
    r = report["ratios"]
    notes = []
    for other in ("hand_tp2", "hand_tp2_prepared", "hf_native_tp2"):
        if f"tp2_over_{other}" in r:
            target = " (target <= 1.05)" if other == "hand_tp2" else ""
            notes.append(
                f"tp2 / {other} step time: {r[f'tp2_over_{other}']:.3f} median, "
                f"{r[f'tp2_over_{other}_best_round']:.3f} best round, {r[f'tp2_over_{other}_min']:.3f} fastest{target}"
            )
    if "speedup_tp2_over_single" in r:
        single = [r[f"speedup_tp2_over_single{key}"] for key in ("", "_best_round", "_min")]
        notes.append(f"single / tp2: {single[0]:.2f} median, {single[1]:.2f} best round, {single[2]:.2f} fastest")
    if notes:
        lines += ["", "; ".join(notes) + "."]
    return "\n".join(lines)


def merge_phases(measured: dict, phases) -> dict:
    from benchmarks.comm import merge

    return merge([measured.get(p, {}) for p in phases])


if __name__ == "__main__":
    main()
