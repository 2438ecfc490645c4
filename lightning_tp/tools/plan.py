"""``python -m lightning_tp.plan --model meta-llama/Llama-3.1-70B --gpus 64 --gpu-memory 80GiB --seq 8192``: which
layouts of this many GPUs fit, what each GPU holds, and what each step sends, before renting the GPUs.

Reads only the model's ``config.json`` (a hub id downloads that file alone; a local directory or ``config.json``
works offline), builds the model on the meta device, and runs each layout's ranks through the real
:func:`lightning_tp.parallelize` on a fake process group of the real world size, then one training step on fake
tensors (:mod:`lightning_tp.dryrun`). Prints the layouts ranked (those that fit first, then by the bytes a rank sends
in a step), each with its per-GPU memory, its collectives per mesh axis, and the strategy's refusal where it would
refuse; then checks the best layout for hangs (every rank of every group issuing the same collectives). ``--json``
prints the same as a list of layouts.

Exit code 0 when a layout fits, 1 when none does, 2 when the hang check finds two ranks that disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from typing import Any

from lightning_tp.dryrun.agreement import CollectiveMismatch, representative_ranks
from lightning_tp.dryrun.engine import OPTIMIZERS, Workload
from lightning_tp.dryrun.layouts import SIZES, Choices, LayoutResult, check_hangs, describe, plan_layouts
from lightning_tp.parallel_options import SUPPORTED_PRECISIONS, ParallelOptions

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``141GB``, ``80`` (GiB) as bytes.

    Args:
        text: a number with a unit (``B``, ``KiB`` ... ``TiB``, ``KB``, ``MB``, ``GB``) or none (GiB).

    Raises:
        ValueError: not a number with one of the units (named).
    """
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r}: give a number with a unit ({', '.join(u for u in _UNITS if u)}).")
    return int(float(match.group(1)) * (_UNITS[unit] if unit else 2**30))


def load_config(name_or_path: str) -> Any:
    """The model's configuration: a local directory, a ``config.json`` or a hub id (only ``config.json`` is
    fetched).

    Args:
        name_or_path: as above.

    Raises:
        OSError: no configuration there (Transformers' message); ValueError: not a configuration it knows.
    """
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path)


def _model_builder(config: Any, precision: str) -> Any:
    """Builds the model (on the meta device, where the dry run calls it) in the dtype ``precision`` trains its
    parameters in: float32 for ``bf16-mixed`` and ``32-true`` (what AdamW's states then take too), whatever the
    config's ``torch_dtype`` says."""
    from lightning_tp.checkpoint.loading import model_from_config
    from lightning_tp.dryrun.engine import parameter_dtype

    return lambda: model_from_config(config).to(parameter_dtype(precision))


def _experts_of(config: Any) -> int:
    """The routed experts of a mixture-of-experts config (0 for a dense model), read from the config's usual keys."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _as_json(result: LayoutResult, gpu_memory: int) -> dict[str, Any]:
    memory = result.memory
    return {
        "sizes": {name.removesuffix("_size"): getattr(result.layout, name) for name in SIZES},
        "activation_checkpointing": result.activation_checkpointing,
        "fits": result.fits,
        "refusal": result.refusal,
        "verdict": result.verdict(gpu_memory),
        "memory": None
        if memory is None
        else {
            "parameters": memory.parameters,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "activations": memory.activations,
            "transient": memory.transient,
            "peak": memory.peak,
        },
        "not_traced": result.not_traced,
        "traffic_bytes": result.traffic,
        "collectives": {axis: {"count": n, "bytes": sent} for axis, (n, sent) in result.per_axis().items()},
        "calls": [
            {"kind": c.kind, "axis": c.axis, "dtype": c.dtype, "shapes": c.shapes, "phase": c.phase, "where": c.where}
            for c in result.step_calls
        ],
    }


def _format_table(results: list[LayoutResult], gpu_memory: int) -> str:
    head = ("#", "layout", "AC", "params", "grads", "optim", "activ.", "transient", "peak", "sent/step", "verdict")
    rows = []
    for i, r in enumerate(results, 1):
        m = r.memory
        rows.append(
            (
                str(i),
                describe(r.layout),
                "yes" if r.activation_checkpointing else "no",
                *(
                    [_gib(m.parameters), _gib(m.gradients), _gib(m.optimizer), _gib(m.activations), _gib(m.transient)]
                    if m
                    else ["-"] * 5
                ),
                _gib(m.peak) if m else "-",
                _gib(r.traffic) if m else "-",
                r.verdict(gpu_memory),
            )
        )
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in [head, *rows]
    ]
    return "\n".join(lines)


def _format_collectives(result: LayoutResult) -> str:
    kinds: dict[str, dict[str, int]] = {}
    for call in result.step_calls:
        kinds.setdefault(call.axis, {}).setdefault(call.kind, 0)
        kinds[call.axis][call.kind] += 1
    lines = []
    for axis, (count, sent) in sorted(result.per_axis().items(), key=lambda item: -item[1][1]):
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds[axis].items()))
        lines.append(f"  {axis}: {count} collectives ({detail}), {sent / 2**30:.2f} GiB sent by rank 0")
    return "\n".join(lines) or "  none"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_tp.plan",
        description="Which layouts of N GPUs fit this model, with per-GPU memory and collectives (a dry run).",
    )
    parser.add_argument("--model", required=True, help="a hub id, a local directory or a config.json")
    parser.add_argument("--gpus", type=int, required=True, help="the number of GPUs (the world size)")
    parser.add_argument("--gpu-memory", default="80GiB", help="each GPU's memory (default 80GiB)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--batch", type=int, default=1, help="rows per data-parallel rank in a step (default 1)")
    parser.add_argument("--precision", default="bf16-mixed", choices=SUPPORTED_PRECISIONS)
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipped to (0: none)")
    for axis in ("tp", "pp", "cp", "ep", "dp-replicate"):
        parser.add_argument(f"--{axis}", type=int, default=None, help=f"keep the {axis} size fixed")
    parser.add_argument(
        "--activation-checkpointing", choices=("on", "off"), default=None, help="fixed (default: tried where needed)"
    )
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--loss-parallel", action="store_true")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="the largest TP size tried (default 8)")
    parser.add_argument("--top", type=int, default=0, help="print only the first N layouts (default all)")
    parser.add_argument("--no-hang-check", action="store_true", help="skip the best layout's hang check")
    parser.add_argument("--json", action="store_true", help="print the layouts as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command: ``argv`` as on the command line (default ``sys.argv[1:]``); returns the exit code (0 a layout
    fits or may, 1 none does or the input is wrong, 2 a hang was found).

    Args:
        argv: the arguments (see ``--help``).

    Raises:
        SystemExit: ``--help`` or arguments argparse refuses.
    """
    args = _parser().parse_args(argv)
    try:
        gpu_memory = parse_bytes(args.gpu_memory)
        workload = Workload(batch_size=args.batch, seq_len=args.seq, optimizer=args.optimizer, clip=args.clip or None)
        options = ParallelOptions(
            precision=args.precision, sequence_parallel=args.sequence_parallel, loss_parallel=args.loss_parallel
        )
        checkpointing = None if args.activation_checkpointing is None else args.activation_checkpointing == "on"
        choices = Choices(
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            ep=args.ep,
            dp_replicate=args.dp_replicate,
            activation_checkpointing=checkpointing,
            gpus_per_node=args.gpus_per_node,
        )
        config = load_config(args.model)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    build = _model_builder(config, args.precision)
    start = time.perf_counter()
    progress = None if args.json else (lambda text: print(f"  simulating {text} ...", file=sys.stderr, flush=True))
    try:
        results = plan_layouts(
            build,
            args.gpus,
            gpu_memory=gpu_memory,
            workload=workload,
            choices=choices,
            options=options,
            experts=_experts_of(config),
            progress=progress,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    shown = results[: args.top] if args.top else results
    # A layout known to fit; else one whose weights fit and whose step could not be traced (pipelines, CP, MoE).
    best = next((r for r in results if r.fits), None) or next((r for r in results if r.fits is None and r.memory), None)
    hang: str | None = None
    unchecked: str | None = None
    groups = 0
    if best is not None and not args.no_hang_check:
        ranks = representative_ranks(best.layout)
        if progress:
            progress(f"the hang check of {describe(best.layout)}: ranks {ranks}")
        best_options = replace(options, activation_checkpointing=best.activation_checkpointing)
        try:
            groups = check_hangs(build, best.layout, options=best_options, workload=workload, ranks=ranks)
        except CollectiveMismatch as mismatch:
            hang = str(mismatch)
        except ValueError as error:  # a representative rank the strategy refuses (an uneven shard, say)
            unchecked = f"not checked: a rank was refused ({error})"
    if args.json:
        checked = "skipped" if args.no_hang_check or best is None else unchecked or f"{groups} groups agree"
        report = {"layouts": [_as_json(r, gpu_memory) for r in shown], "hang": hang, "hang_check": checked}
        print(json.dumps(report, indent=1))
    else:
        name = getattr(config, "model_type", "model")
        print(
            f"{args.model} ({name}) on {args.gpus} GPUs of {gpu_memory / 2**30:.0f} GiB: {args.batch} x {args.seq} "
            f"tokens per data-parallel rank, {args.precision}, {args.optimizer}; GiB per GPU, "
            f"{time.perf_counter() - start:.0f} s"
        )
        print()
        print(_format_table(shown, gpu_memory))
        if best is not None:
            print()
            print(f"Collectives of the best layout ({describe(best.layout)}) in one step:")
            print(_format_collectives(best))
            if hang is not None or unchecked is not None:
                print(f"\nHang check: {hang or unchecked}")
            elif not args.no_hang_check:
                only = " (its step is not traced: the setup's collectives only)" if best.not_traced else ""
                print(
                    f"\nHang check: ranks {representative_ranks(best.layout)} simulated{only}; the collectives of "
                    f"{groups} group{'s' if groups != 1 else ''} agree."
                )
    if hang is not None:
        return 2
    return 0 if best is not None else 1
