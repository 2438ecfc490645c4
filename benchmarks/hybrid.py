"""A Qwen3.5-style hybrid (Gated DeltaNet linear attention and full attention, 3 : 1) at TP 2: this package's plan,
which splits the Gated DeltaNet mixers by heads, against Transformers' own plan for the model, which gathers the
mixers' projections so that every rank computes the whole recurrence, and against one process.

    python benchmarks/hybrid.py --out benchmarks/hybrid.json    # writes hybrid.json and hybrid.md; ~5 min on 2 cores
    python benchmarks/hybrid.py --quick --out /tmp/hybrid.json  # a small model, one round: a smoke run
    python benchmarks/hybrid.py --render --out benchmarks/hybrid.json  # only rewrite hybrid.md from the JSON

Runs (the same model built from a ``Qwen3_5TextConfig`` with the same seed, the same token batch, SGD(lr=1e-3)):

* ``single``: one process, the whole model, one thread (a core is a device);
* ``tp2``: ``lightning_tp.parallelize(model, tp_size=2)`` under ``torchrun --standalone --nproc-per-node 2`` (gloo),
  ``tp_plan="auto"``: the model's plan with the Gated DeltaNet mixers split by heads (``colwise_blocks`` for
  ``in_proj_qkv``, ``local_blocks`` for ``conv1d``/``A_log``/``dt_bias``, ``colwise`` for ``in_proj_z/b/a``,
  ``rowwise`` for ``out_proj``);
* ``tp2_hf_plan``: the same launch with ``tp_plan=dict(model.tp_plan)``, Transformers' plan given as the user's:
  a mixer a user key names is left as the plan says (``colwise_gather_output`` on its five projections, the
  recurrence whole on every rank).

Each launch checks the layout it got (the mixer's parameters' placements and its head counts) and fails if it is not
the one named. Launches are fresh processes (peak memory is per process), interleaved over ``--rounds`` (the order
reversed every other round: the machine is shared and its load comes and goes). In each launch:

* step time: forward, backward, ``optimizer.step()`` and ``zero_grad()``, the slowest rank, after ``--warmup``
  steps; the median over ``--steps`` steps per round; reported: the median of the rounds' medians and the best round,
  as ratios to one process; also the CPU time each rank's process used in the step (the busiest rank), which
  waiting for the other rank or for a core the machine's other jobs hold does not inflate. Garbage collection:
  automatic collection off, what setup left frozen, one collection between steps outside the timed window (as
  ``lightning_tp.GarbageCollection`` does every n steps), in every run;
* memory per rank: the peak resident set (VmHWM) during the steps, reset once setup is done (model sharded,
  optimizer built), absolute and above the resident set at that point (gradients, activations, temporaries), as
  ``benchmarks/run.py`` measures it; the parameter bytes each rank holds, exactly;
* collectives: one more step under :class:`benchmarks.comm.CollectiveCounter` (kind, count and bytes per rank as
  nccl-tests count them: all-reduce its input, all-gather its gathered output, reduce-scatter its unscattered input,
  all-to-all what the rank sends),
  by phase, against :func:`theory`, which derives them from the shapes;
* loss: every step's loss, against one process's at the same step (same batch, same updates).

No timed assertions: the figures are written down, not checked.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: name -> processes, in launch order.
VARIANTS = {"single": 1, "tp2": 2, "tp2_hf_plan": 2}
LABELS = {
    "single": "one process",
    "tp2": "TP 2, this package's plan (mixers split by heads)",
    "tp2_hf_plan": "TP 2, Transformers' plan (mixer projections gathered)",
}
#: Model sizes: the real Qwen3.5's head layout at hidden 1024 (linear attention 8 key / 16 value heads of 64, full
#: attention 8 query / 2 KV heads of 128), 3 linear-attention layers to 1 full-attention layer.
SIZES = {
    "default": dict(
        hidden=1024, intermediate=2816, layers=4, vocab=8192, linear_k_heads=8, linear_v_heads=16, linear_k_dim=64,
        linear_v_dim=64, heads=8, kv_heads=2, head_dim=128, seq=512, batch=2, steps=4, warmup=1, rounds=3,
    ),
    "quick": dict(
        hidden=256, intermediate=704, layers=4, vocab=1024, linear_k_heads=4, linear_v_heads=8, linear_k_dim=32,
        linear_v_dim=32, heads=4, kv_heads=2, head_dim=64, seq=64, batch=1, steps=2, warmup=1, rounds=1,
    ),
}  # fmt: skip
FP32 = 4


# ---------------------------------------------------------------------------------------------- model and layout


def layer_types(layers: int) -> list[str]:
    """Qwen3.5's pattern: every fourth layer full attention, the others linear attention."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


def build(args: argparse.Namespace):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        layer_types=layer_types(args.layers),
        linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads,
        linear_key_head_dim=args.linear_k_dim,
        linear_value_head_dim=args.linear_v_dim,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    import torch

    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).to(torch.float32)


def check_layout(model, variant: str, args: argparse.Namespace) -> dict:
    """The layout of the first linear-attention mixer, checked against the one ``variant`` names (raises if not)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mixer = model.model.layers[layer_types(args.layers).index("linear_attention")].linear_attn
    facts = {"num_v_heads": mixer.num_v_heads, "num_k_heads": mixer.num_k_heads}
    for name, param in mixer.named_parameters():
        if isinstance(param, DTensor):
            facts[name] = {"placements": str(param.placements), "local_shape": list(param.to_local().shape)}
        else:
            facts[name] = {"placements": "plain tensor", "local_shape": list(param.shape)}
    if variant == "single":
        return facts
    qkv, conv, out = mixer.in_proj_qkv.weight, mixer.conv1d.weight, mixer.out_proj.weight
    qkv_rows = 2 * args.linear_k_heads * args.linear_k_dim + args.linear_v_heads * args.linear_v_dim
    # Both plans store in_proj_qkv as a row split (Shard(0), half the rows per rank); they differ in what is computed.
    expected = {
        "in_proj_qkv Shard(0), half the rows": isinstance(qkv, DTensor)
        and qkv.placements == (Shard(0),)
        and qkv.to_local().shape[0] == qkv_rows // 2,
    }
    if variant == "tp2":  # split by heads: half the heads per rank, conv channels split, out_proj row-wise
        expected["mixer holds half the value heads"] = mixer.num_v_heads == args.linear_v_heads // 2
        expected["conv1d Shard(0)"] = isinstance(conv, DTensor) and conv.placements == (Shard(0),)
        expected["out_proj Shard(1) (rowwise)"] = isinstance(out, DTensor) and out.placements == (Shard(1),)
    else:  # gathered: every head on every rank, conv whole, out_proj column-wise with its output gathered
        expected["mixer holds every value head"] = mixer.num_v_heads == args.linear_v_heads
        expected["conv1d whole (Replicate)"] = isinstance(conv, DTensor) and conv.placements == (Replicate(),)
        expected["out_proj Shard(0) (colwise_gather_output)"] = isinstance(out, DTensor) and out.placements == (
            Shard(0),
        )
    wrong = [check for check, ok in expected.items() if not ok]
    if wrong:
        raise SystemExit(f"{variant}: the mixer's layout is not the one this run measures: {wrong}; got {facts}")
    facts["checks"] = list(expected)
    return facts


# ---------------------------------------------------------------------------------------------- one launch


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.comm import CollectiveCounter
    from benchmarks.memory import local_bytes
    from lightning_tp.runtime.monitor import peak_rss_mb, reset_peak_rss

    torch.set_num_threads(1)
    variant = args.variant
    distributed = VARIANTS[variant] > 1
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank() if distributed else 0
    started = time.perf_counter()
    model = build(args)
    if distributed:
        import lightning_tp

        plan = "auto" if variant == "tp2" else dict(model.tp_plan)
        model = lightning_tp.parallelize(model, tp_size=2, options=lightning_tp.ParallelOptions(tp_plan=plan))
    layout = check_layout(model, variant, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    losses: list[float] = []

    def step() -> None:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    def barrier() -> None:
        if distributed:
            dist.barrier()

    gc.collect()
    gc.freeze()
    gc.disable()
    barrier()
    setup_s = time.perf_counter() - started
    reset_peak_rss()  # VmHWM back to the current resident set: memory is measured from here
    baseline_mb = _rss_mb()
    times, cpu_times = [], []
    for index in range(args.warmup + args.steps):
        gc.collect()
        barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        # Wall time and the CPU time the rank's process used (its threads; waiting for the other rank or for a
        # core the machine's other jobs hold costs none): the slowest rank of each.
        elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64)
        if distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if index >= args.warmup:
            times.append(elapsed[0].item())
            cpu_times.append(elapsed[1].item())
    gc.collect()
    barrier()
    counter = CollectiveCounter()
    with counter:
        loss = model(**batch).loss
        loss.backward()
        counter.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
    peak_mb = peak_rss_mb()
    record = {
        "variant": variant,
        "rank": rank,
        "step_times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "setup_s": setup_s,
        "memory": {"baseline_mb": baseline_mb, "peak_mb": peak_mb, "peak_above_baseline_mb": peak_mb - baseline_mb},
        "param_bytes": local_bytes(model.parameters()),
        "collectives_by_phase": counter.by_phase(),
        "collective_seconds_by_phase": dict(counter.seconds),
        "collective_events": counter.events,
        "dtensor_ops_by_phase": dict(counter.dtensor_ops),
        "layout": layout,
    }
    Path(args.result).with_suffix(f".rank{rank}.json").write_text(json.dumps(record))
    if distributed:
        dist.destroy_process_group()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def launch(variant: str, args: argparse.Namespace, workdir: Path, round_index: int) -> list[dict]:
    nprocs = VARIANTS[variant]
    result = workdir / f"{variant}.round{round_index}"
    script = [str(Path(__file__).resolve()), "--variant", variant, "--result", str(result)]
    script += [f"--{key}={getattr(args, key)}" for key in SIZES["default"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = (
        [sys.executable, *script]
        if nprocs == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}", *script]
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    records = [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in range(nprocs)]
    for record in records:
        record["launch_s"] = time.perf_counter() - started
    return records


# ---------------------------------------------------------------------------------------------- theory


def theory(variant: str, args: argparse.Namespace) -> dict:
    """The collectives of one training step per rank at TP 2, derived from the shapes: ``{"by_phase": {phase: {kind:
    {count, bytes}}}, "items": [(phase, kind, what, count, bytes each)]}``. Bytes as :mod:`benchmarks.comm` counts
    them (all-reduce: the tensor reduced; all-gather: the gathered tensor; reduce-scatter: the unscattered tensor).

    Common to both plans (the model's own rules): the vocabulary-sharded embedding's output and every row-wise
    projection's output (full attention's ``o_proj``, each MLP's ``down_proj``) are all-reduced in the forward, the
    column-wise ``lm_head``'s logits all-gathered; in the backward each column-wise projection all-reduces the
    gradient of its (replicated) input, one per projection (``q/k/v``, ``gate/up``, ``lm_head``; this stack keeps
    Transformers' per-projection layers, see the notes), and ``q_norm``/``k_norm`` (``replicated_with_grad_allreduce``)
    their weight gradients. The rest (norms, residuals, the embedding's and the projections' weight gradients) needs
    nothing: every rank holds the same replicated values or its own shard.
    """
    if variant == "single":
        return {"by_phase": {}, "items": []}
    tokens, hidden, vocab = args.batch * args.seq, args.hidden, args.vocab
    types = layer_types(args.layers)
    linear, full = types.count("linear_attention"), types.count("full_attention")
    key_dim, value_dim = args.linear_k_heads * args.linear_k_dim, args.linear_v_heads * args.linear_v_dim
    qkv_out = 2 * key_dim + value_dim  # in_proj_qkv's rows: [q | k | v]
    conv_kernel = 4  # Qwen3_5TextConfig's linear_conv_kernel_dim
    act = tokens * hidden * FP32  # one [tokens, hidden] fp32 activation
    items: list[tuple[str, str, str, int, int]] = [
        ("forward", "all_reduce", "embedding output (vocabulary-sharded embedding)", 1, act),
        ("forward", "all_reduce", "o_proj output (full attention)", full, act),
        ("forward", "all_reduce", "down_proj output (MLP)", args.layers, act),
        ("forward", "all_gather", "lm_head logits [tokens, vocab]", 1, tokens * vocab * FP32),
        ("backward", "all_reduce", "lm_head input gradient", 1, act),
        ("backward", "all_reduce", "q/k/v_proj input gradients (full attention)", 3 * full, act),
        ("backward", "all_reduce", "q_norm/k_norm weight gradients", 2 * full, args.head_dim * FP32),
        ("backward", "all_reduce", "gate/up_proj input gradients (MLP)", 2 * args.layers, act),
    ]
    if variant == "tp2":
        qkv_weight = qkv_out * hidden * FP32
        conv_weight = qkv_out * conv_kernel * FP32
        # The packed weights' rows go where they are computed (one all-to-all each, counted by what a rank sends:
        # its shard, half of the weight at TP 2, its own rows included), their gradients back the same way.
        items += [
            ("forward", "all_to_all", "in_proj_qkv weight rows (colwise_blocks: the rank's rows of q, k and v)",
             linear, qkv_weight // 2),
            ("forward", "all_to_all", "conv1d weight rows (local_blocks over q, k, v channels)", linear,
             conv_weight // 2),
            ("forward", "all_reduce", "out_proj output (rowwise)", linear, act),
            ("backward", "all_to_all", "in_proj_qkv weight gradient rows, sent back", linear, qkv_weight // 2),
            ("backward", "all_to_all", "conv1d weight gradient rows, sent back", linear, conv_weight // 2),
            ("backward", "all_reduce", "in_proj_qkv/z/b/a input gradients", 4 * linear, act),
            ("backward", "all_reduce", "gated norm weight gradient (shared by the heads)", linear,
             args.linear_v_dim * FP32),
        ]  # fmt: skip
    else:
        items += [
            ("forward", "all_gather", "in_proj_qkv output [tokens, 2 key_dim + value_dim]", linear,
             tokens * qkv_out * FP32),
            ("forward", "all_gather", "in_proj_z output [tokens, value_dim]", linear, tokens * value_dim * FP32),
            ("forward", "all_gather", "in_proj_b and in_proj_a outputs [tokens, value heads]", 2 * linear,
             tokens * args.linear_v_heads * FP32),
            ("forward", "all_gather", "out_proj output (colwise_gather_output)", linear, act),
            ("backward", "all_reduce", "in_proj_qkv/z/b/a and out_proj input gradients", 5 * linear, act),
        ]  # fmt: skip
    by_phase: dict[str, dict[str, dict[str, int]]] = {}
    for phase, kind, _, count, size in items:
        if count == 0:
            continue
        record = by_phase.setdefault(phase, {}).setdefault(kind, {"count": 0, "bytes": 0})
        record["count"] += count
        record["bytes"] += count * size
    order = {"forward": 0, "backward": 1}
    items = sorted((item for item in items if item[3]), key=lambda item: order[item[0]])  # stable within a phase
    return {"by_phase": by_phase, "items": [list(item) for item in items]}


# ---------------------------------------------------------------------------------------------- report


def summarise(variant: str, rounds: list[list[dict]], args: argparse.Namespace) -> dict:
    from benchmarks.comm import merge

    per_round = [statistics.median(records[0]["step_times_s"]) for records in rounds]  # slowest rank, per step
    first = rounds[0]
    by_phase = first[0]["collectives_by_phase"]
    expected = theory(variant, args)
    measured_total = merge(by_phase.values())
    expected_total = merge(expected["by_phase"].values())
    return {
        "name": variant,
        "label": LABELS[variant],
        "ranks": len(first),
        "step_time_s": statistics.median(per_round),
        "step_time_best_round_s": min(per_round),
        "step_time_per_round_s": per_round,
        "step_times_s": [records[0]["step_times_s"] for records in rounds],
        "cpu_s": statistics.median(t for records in rounds for t in records[0]["cpu_times_s"]),
        "cpu_times_s": [records[0]["cpu_times_s"] for records in rounds],
        "peak_rss_mb_per_rank": [max(r[k]["memory"]["peak_mb"] for r in rounds) for k in range(len(first))],
        "peak_above_setup_mb_per_rank": [
            max(r[k]["memory"]["peak_above_baseline_mb"] for r in rounds) for k in range(len(first))
        ],
        "setup_rss_mb_per_rank": [max(r[k]["memory"]["baseline_mb"] for r in rounds) for k in range(len(first))],
        "param_bytes_per_rank": [rec["param_bytes"] for rec in first],
        "collectives_by_phase": by_phase,
        "collectives": measured_total,
        "collectives_stable_over_rounds_and_ranks": all(
            rec["collectives_by_phase"] == by_phase for records in rounds for rec in records
        ),
        "collective_seconds_by_phase": [rec["collective_seconds_by_phase"] for rec in first],
        "collective_events_rank0": first[0]["collective_events"],
        "dtensor_ops_by_phase": first[0]["dtensor_ops_by_phase"],
        "theory": expected,
        "theory_total": expected_total,
        "theory_matches": {
            phase: by_phase.get(phase, {}) == expected["by_phase"].get(phase, {})
            for phase in ("forward", "backward", "optimizer")
        },
        "losses": first[0]["losses"],
        "layout": first[0]["layout"],
        "setup_s": [r[0]["setup_s"] for r in rounds],
        "launch_s": [r[0]["launch_s"] for r in rounds],
    }


def mib(size: float) -> str:
    return f"{size / 2**20:.2f} MiB"


def kinds_cell(kinds: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
    return ", ".join(f"{v['count']} {short.get(k, k)} {mib(v['bytes'])}" for k, v in sorted(kinds.items())) or "none"


def markdown(report: dict, args: argparse.Namespace) -> str:
    runs = report["runs"]
    single = runs["single"]
    machine = report["machine"]
    tokens = args.batch * args.seq
    lines = [
        "# Qwen3.5-style hybrid at TP 2: heads split against Transformers' gathered plan",
        "",
        f"Command: `python benchmarks/hybrid.py{' --quick' if args.quick else ''} --out {args.out}` "
        f"({report['wall_s'] / 60:.1f} min). Machine: {machine['cpus']}-core CPU shared with other jobs, gloo, one "
        f"thread per process (a core is a device: one process uses 1 core, TP 2 uses 2), torch {machine['torch']}, "
        f"transformers {machine['transformers']}. Relative figures only; no GPU figures.",
        "",
        f"Model: `Qwen3_5ForCausalLM` from a `Qwen3_5TextConfig` (no download), hidden {args.hidden}, {args.layers} "
        f"layers ({', '.join(layer_types(args.layers))}), linear attention {args.linear_k_heads} key / "
        f"{args.linear_v_heads} value heads of {args.linear_k_dim}/{args.linear_v_dim}, full attention "
        f"{args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, MLP {args.intermediate}, vocabulary "
        f"{args.vocab}, untied, fp32; {args.batch} x {args.seq} tokens per step, SGD. The Gated DeltaNet runs "
        "Transformers' PyTorch fallbacks (no `flash-linear-attention`, no `causal-conv1d` on CPU).",
        "",
        "| run | step time (ms) | / one process (best round) | CPU s / step, busiest rank | / one process | peak RSS "
        "/ rank (MiB) | / one process | peak above setup / rank (MiB) | / one process | params / rank | bytes moved / "
        "step / rank: measured | theory | max loss diff vs one process |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        peak, above = max(run["peak_rss_mb_per_rank"]), max(run["peak_above_setup_mb_per_rank"])
        params = max(run["param_bytes_per_rank"])
        peak_single, above_single = single["peak_rss_mb_per_rank"][0], single["peak_above_setup_mb_per_rank"][0]
        measured = sum(v["bytes"] for v in run["collectives"].values())
        expected = sum(v["bytes"] for v in run["theory_total"].values())
        loss = "-" if name == "single" else f"{run['max_loss_diff_vs_single']:.1e}"
        lines.append(
            f"| {name}: {run['label']} | {run['step_time_s'] * 1e3:.0f} | "
            f"{run['step_time_s'] / single['step_time_s']:.2f} "
            f"({run['step_time_best_round_s'] / single['step_time_best_round_s']:.2f}) | "
            f"{run['cpu_s']:.2f} | {run['cpu_s'] / single['cpu_s']:.2f} | "
            f"{' / '.join(f'{v:.0f}' for v in run['peak_rss_mb_per_rank'])} | {peak / peak_single:.2f} | "
            f"{' / '.join(f'{v:.0f}' for v in run['peak_above_setup_mb_per_rank'])} | {above / above_single:.2f} | "
            f"{mib(params)} ({params / single['param_bytes_per_rank'][0]:.2f}) | "
            f"{'-' if name == 'single' else mib(measured)} | {'-' if name == 'single' else mib(expected)} | {loss} |"
        )  # fmt: skip
    lines += [
        "",
        f"Step time: the median over {args.rounds} interleaved rounds of the median of {args.steps} steps after "
        f"{args.warmup} warm-up step(s) (forward, backward, SGD step, zero_grad; the slowest rank); per round: "
        + "; ".join(
            f"{name} {', '.join(f'{t * 1e3:.0f}' for t in run['step_time_per_round_s'])} ms"
            for name, run in runs.items()
        )
        + ". CPU s: the CPU time the process used in a step (its threads: one intra-op thread and gloo's), the "
        "busiest rank, the median over every timed step: waiting for the other rank or for a core held by the "
        "machine's other jobs costs none, so it is steadier than the wall clock here; TP 2 at 0.50 would be perfect "
        "division of the work. Peak RSS: the resident set's peak (VmHWM) during the steps, the largest of the "
        "rounds, per rank; above setup: less the resident set once the model was sharded and the optimizer built "
        "(gradients, activations and temporaries: the runtime, about the same in every process, is left out). "
        "Params: the bytes of parameters each rank holds (gradients the same again). Loss: every step's loss against "
        "one process's at the same step (the same batch every step, so after the first step it also checks the "
        "updates).",
        "",
        "## Bytes moved per step and rank, against the theory",
        "",
        f"Counted by `benchmarks/comm.py` over one more step; bytes as nccl-tests count them (all-reduce: the tensor "
        f"reduced, all-gather: the gathered tensor, reduce-scatter: the unscattered tensor; a ring moves 2(n-1)/n = 1x "
        f"of an all-reduce's and (n-1)/n = 0.5x of the others' per rank at n = 2). T = {tokens} tokens, H = "
        f"{args.hidden}, fp32; an activation [T, H] is {mib(tokens * args.hidden * FP32)}.",
        "",
        "| run | phase | measured | theory | equal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        if name == "single":
            continue
        for phase in ("forward", "backward", "optimizer"):
            got, want = run["collectives_by_phase"].get(phase, {}), run["theory"]["by_phase"].get(phase, {})
            if got or want:
                lines.append(
                    f"| {name} | {phase} | {kinds_cell(got)} | {kinds_cell(want)} | "
                    f"{'yes' if run['theory_matches'][phase] else '**no**'} |"
                )
    for name in ("tp2", "tp2_hf_plan"):
        run = runs[name]
        lines += ["", f"Theory for `{name}` ({run['label']}), per step and rank:", ""]
        lines += ["| phase | collective | what | count | bytes each | bytes |", "| --- | --- | --- | --- | --- | --- |"]
        for phase, kind, what, count, size in run["theory"]["items"]:
            lines.append(f"| {phase} | {kind} | {what} | {count} | {mib(size)} | {mib(count * size)} |")
    lines += ["", "## Notes", "", *notes(report, args)]
    return "\n".join(lines) + "\n"


def notes(report: dict, args: argparse.Namespace) -> list[str]:
    runs = report["runs"]
    tokens = args.batch * args.seq
    linear = layer_types(args.layers).count("linear_attention")
    key_dim, value_dim = args.linear_k_heads * args.linear_k_dim, args.linear_v_heads * args.linear_v_dim
    qkv_out = 2 * key_dim + value_dim
    # Per linear-attention layer, what differs. Both pay five [T, H] all-reduces (split: out_proj's output in the
    # forward and the input gradients of in_proj_qkv/z/b/a; gathered: the input gradients of all five projections).
    # Split by heads also exchanges the in_proj_qkv and conv1d weights' rows and sends their gradients back (per
    # step, whatever the tokens: half of each weight each way at TP 2, as counted); the gathered plan all-gathers the
    # five projections' outputs (per token).
    weight_bytes = qkv_out * (args.hidden + 4) * FP32
    gathered_per_token = (qkv_out + value_dim + 2 * args.linear_v_heads + args.hidden) * FP32
    crossover = weight_bytes / gathered_per_token
    bytes_of = {name: sum(v["bytes"] for v in run["collectives"].values()) for name, run in runs.items()}
    ar_bwd = {
        name: sum(1 for phase, kind, size, *_ in run["collective_events_rank0"] if phase == "backward" and kind ==
                  "all_reduce" and size == tokens * args.hidden * FP32)
        for name, run in runs.items() if name != "single"
    }  # fmt: skip
    regions = 1 + 2 * args.layers  # lm_head, and one per mixer/attention and MLP: Megatron's count

    def ratio(key: str) -> float:
        return runs["tp2"][key] / runs["tp2_hf_plan"][key]

    def above(name: str) -> float:
        return max(runs[name]["peak_above_setup_mb_per_rank"])

    def coll(name: str) -> float:
        seconds = runs[name]["collective_seconds_by_phase"]
        return statistics.mean(sum(rank.values()) for rank in seconds)

    all_equal = all(all(run["theory_matches"].values()) for name, run in runs.items() if name != "single")
    return [
        f"- **Theory**: the measured collectives {'equal' if all_equal else '**differ from**'} the theory in "
        "count and bytes, phase by phase, for both TP runs"
        + ("." if all_equal else " (see the table above).")
        + " The optimizer step moves nothing (SGD on each rank's shards).",
        f"- **Bytes**: at {tokens} tokens per step this package's plan moves {mib(bytes_of['tp2'])} per rank and "
        f"step, Transformers' plan {mib(bytes_of['tp2_hf_plan'])} ({bytes_of['tp2'] / bytes_of['tp2_hf_plan']:.2f}x). "
        f"Splitting by heads moves weights, not activations: per linear-attention layer the `in_proj_qkv` weight "
        f"({mib(qkv_out * args.hidden * FP32)}) and the `conv1d` weight have their rows exchanged in the forward "
        f"(each rank sends its shard) and their gradients sent back, {mib(weight_bytes)} per layer whatever the "
        "batch, where the gathered plan "
        f"all-gathers the projections' outputs, {gathered_per_token} bytes per token and layer "
        f"(({qkv_out} + {value_dim} + 2 x {args.linear_v_heads} + {args.hidden}) x 4); the [T, H] all-reduces are "
        f"five per layer in both. The two are equal at about {crossover:.0f} tokens per step (a ring at n = 2 moves "
        f"half of both sides: the same crossover); above it, as in training batches of thousands of tokens, "
        f"splitting by heads moves less, the gap growing with the tokens ({linear} linear-attention layers here).",
        "- **Compute**: with Transformers' plan every rank runs the whole recurrence (the causal conv and the chunked "
        "gated delta rule over all value heads) and holds its activations; split by heads each rank runs half the "
        "heads. Both runs compute half of every projection.",
        f"- **Time and memory, this package's plan against Transformers'**: step time {ratio('step_time_s'):.2f}x "
        f"(median), {ratio('step_time_best_round_s'):.2f}x (best rounds), CPU time per step {ratio('cpu_s'):.2f}x; "
        f"peak above setup per rank {above('tp2') / above('tp2_hf_plan'):.2f}x "
        f"({above('tp2'):.0f} against {above('tp2_hf_plan'):.0f} MiB). Time in collectives in the counted step "
        f"(each call and its wait, the mean of the ranks): {coll('tp2'):.2f} s against {coll('tp2_hf_plan'):.2f} s, "
        "so most of the difference is the recurrence each rank computes and keeps for the backward, not the bytes "
        "moved (equal here). Neither reaches 0.50 of one process; on the dense models of `scaling.py` the rest is "
        "the replicated norms and residuals, the full-vocabulary loss on every rank and DTensor's host dispatch, and "
        "here two processes share two cores with other jobs (not profiled for this model).",
        f"- **Backward all-reduces of [T, H]**: {ar_bwd['tp2']} (this package's plan) and {ar_bwd['tp2_hf_plan']} "
        f"(Transformers') per step, one per column-wise projection. On dense models the package rewrites each "
        f"attention and MLP to take one replicated input DTensor (2 per layer, Megatron's count: {regions} here, "
        f"with one per mixer), but `rewrite_dense_layers` skips a whole layer stack as soon as one layer has a style "
        "it does not rewrite (`colwise_blocks`, `local_blocks`, `colwise_gather_output`), so on this hybrid even the "
        f"MLPs and the full-attention layer keep the per-projection all-reduces: {ar_bwd['tp2'] - regions} of "
        f"{mib(tokens * args.hidden * FP32)} each per step that a region-per-sub-layer rewrite would save.",
    ]


def machine_info() -> dict:
    import platform

    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
        "backend": "gloo",
        "threads_per_process": 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (and .md next to it)")
    parser.add_argument("--quick", action="store_true", help="a small model, one round: a smoke run")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    for key in SIZES["default"]:
        parser.add_argument(f"--{key}", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the JSON at --out; run nothing")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # worker
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in SIZES["quick" if args.quick else "default"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.variant is not None:
        worker(args)
        return
    if args.render:
        report = json.loads(args.out.read_text())
        for key, value in report["config"].items():
            setattr(args, key, value)
        args.out.with_suffix(".md").write_text(markdown(report, args))
        return
    names = [name for name in args.variants.split(",") if name]
    if "single" not in names or any(name not in VARIANTS for name in names):
        raise SystemExit(f"--variants must include single and name only {', '.join(VARIANTS)}, got {names}")
    started = time.perf_counter()
    rounds: dict[str, list[list[dict]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for name in names[:: 1 if round_index % 2 == 0 else -1]:
                rounds[name].append(launch(name, args, Path(tmp), round_index))
                median_ms = statistics.median(rounds[name][-1][0]["step_times_s"]) * 1e3
                print(f"round {round_index + 1}/{args.rounds} {name}: {median_ms:.0f} ms/step", flush=True)
    runs = {name: summarise(name, rounds[name], args) for name in names}
    reference = runs["single"]["losses"]
    for name, run in runs.items():
        diffs = [abs(a - b) for a, b in zip(run["losses"], reference, strict=True)]
        run["max_loss_diff_vs_single"] = max(diffs)
        run["first_loss"] = run["losses"][0]
        print(f"{name}: first loss {run['losses'][0]:.6f}, last {run['losses'][-1]:.6f}, "
              f"max |loss - one process's| over {len(diffs)} steps {max(diffs):.2e}")  # fmt: skip
    report = {
        "config": {key: getattr(args, key) for key in SIZES["default"]} | {"layer_types": layer_types(args.layers)},
        "machine": machine_info(),
        "wall_s": time.perf_counter() - started,
        "summary": {
            name: {
                "step_time_vs_single": run["step_time_s"] / runs["single"]["step_time_s"],
                "step_time_vs_single_best_round": run["step_time_best_round_s"]
                / runs["single"]["step_time_best_round_s"],
                "cpu_time_per_step_vs_single": run["cpu_s"] / runs["single"]["cpu_s"],
                "peak_rss_per_rank_vs_single": max(run["peak_rss_mb_per_rank"])
                / runs["single"]["peak_rss_mb_per_rank"][0],
                "peak_above_setup_per_rank_vs_single": max(run["peak_above_setup_mb_per_rank"])
                / runs["single"]["peak_above_setup_mb_per_rank"][0],
                "bytes_per_step_per_rank": sum(v["bytes"] for v in run["collectives"].values()),
                "theory_bytes_per_step_per_rank": sum(v["bytes"] for v in run["theory_total"].values()),
                "theory_matches": all(run["theory_matches"].values()),
                "max_loss_diff_vs_single": run["max_loss_diff_vs_single"],
            }
            for name, run in runs.items()
        },
        "runs": runs,
    }
    print(json.dumps(report["summary"], indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        if set(names) == set(VARIANTS):
            text = markdown(report, args)
            args.out.with_suffix(".md").write_text(text)
            print(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
