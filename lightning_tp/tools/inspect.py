"""``python -m lightning_tp.inspect MODEL --tp-size 4 [--cp-size 2] [--dp-shard-size 2] [--lora-r 16]``: will this
model shard, and what will each rank hold? Builds the model on the meta device from its config (no weights, no GPU,
no processes), resolves its plan as the strategy would, and prints each planned module with its per-rank shape, what
stays replicated, the sequence mixers split by heads (each rank's head counts and rows of each packed block) and
those kept whole, rules that matched nothing, divisibility problems with the sizes that would work, what context
parallelism exchanges, and per-rank memory for parameters, gradients and AdamW states. Exit code 0 when the layout is
valid, 1 with the reasons when not.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from lightning_tp.checkpoint.loading import model_from_config
from lightning_tp.parallel_options import CP_COMMS
from lightning_tp.tools.inspect_report import Report, inspect_model


def compact_names(names: list[str]) -> str:
    """Module paths that differ in one numeric component (the layers of a model) as one: ``model.layers.{0-2,5}.mixer``;
    others joined by commas."""
    if len(names) == 1:
        return names[0]
    parts = [name.split(".") for name in names]
    if len({len(p) for p in parts}) == 1:
        differ = [i for i in range(len(parts[0])) if len({p[i] for p in parts}) > 1]
        if len(differ) == 1 and all(p[differ[0]].isdigit() for p in parts):
            index = differ[0]
            numbers = sorted({int(p[index]) for p in parts})
            runs: list[list[int]] = []
            for n in numbers:
                if runs and n == runs[-1][-1] + 1:
                    runs[-1].append(n)
                else:
                    runs.append([n])
            spans = ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
            return ".".join([*parts[0][:index], f"{{{spans}}}", *parts[0][index + 1 :]])
    return ", ".join(names)


def collapse_repeated(entries: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...], int]]:
    """Parameters of the repeated layers as one line each: ``model.layers.*.input_layernorm.weight [8192] x 80``
    (the numeric path components as ``*``, those of one shape counted), in the order first met.

    Args:
        entries: (name, shape) of each parameter.

    Raises:
        Nothing.
    """
    counts: dict[tuple[str, tuple[int, ...]], int] = {}
    for name, shape in entries:
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        counts[(pattern, tuple(shape))] = counts.get((pattern, tuple(shape)), 0) + 1
    return [(pattern, shape, count) for (pattern, shape), count in counts.items()]


def build_meta_model(name_or_path: str, *, lora_r: int | None = None, lora_targets: str = "all-linear") -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path)
    with torch.device("meta"):
        model = model_from_config(config)
        if lora_r:
            from peft import LoraConfig, get_peft_model

            targets = lora_targets if lora_targets == "all-linear" else lora_targets.split(",")
            model = get_peft_model(model, LoraConfig(r=lora_r, target_modules=targets)).base_model.model
    return model


def format_report(
    report: Report, *, tp_size: int, dp_shard_size: int, cp_size: int = 1, ep_size: int = 1, pp_size: int = 1
) -> str:
    sources = {
        "model": "the model's own (its config's `base_model_tp_plan`)",
        "derived": "derived from the module structure (its config has no `base_model_tp_plan`; "
        "lightning_tp.plans.derived)",
        "none": "none of its own",
    }
    base, _, extra = report.source.partition(" + ")
    lines = [
        "Layout: "
        + (f"pp={pp_size} x " if pp_size > 1 else "")
        + f"tp={tp_size}"
        + (f" x cp={cp_size}" if cp_size > 1 else "")
        + f" x dp_shard={dp_shard_size}"
        + (f", ep={ep_size} for the experts" if ep_size > 1 else ""),
        f"Plan: {sources.get(base, base)}" + (", overridden by `tp_plan`" if extra else ""),
        "",
    ]
    if report.parts:
        lines.append("Parts (elements per TP rank):")
        for name, sharded, total, numel, per_rank in report.parts:
            if not total:  # every parameter of it is another part's (a tied lm_head)
                lines.append(f"  {name:<40} tied: its parameters are counted with the part that holds them")
                continue
            if not sharded:
                what = f"replicated over TP ({total} parameters, no plan entries)"
            else:
                what = f"sharded ({sharded} of {total} parameters by the plan)"
            lines.append(f"  {name:<40} {what:<52} {numel:>12,} -> {per_rank:,}")
        lines.append("")
    lines.append("Sharded parameters (per-rank shape):")
    for name, style, shape, local in report.rows:
        lines.append(f"  {name:<60} {style:<24} {list(shape)} -> {list(local)}")
    if report.local_heads:
        lines += ["", "Attention modules computing their rank's heads (local_heads; head counts whole -> per rank):"]
        for name, counts in report.local_heads:
            lines.append(f"  {name:<60} " + ", ".join(f"{a} {c} -> {p}" for a, (c, p) in counts.items()))
    lines += _format_mixers(report, tp_size)
    if report.kv_replication:
        lines += ["", *report.kv_replication]
    if report.context_parallel:
        lines += ["", f"Context parallelism (cp={cp_size}):", *(f"  {line}" for line in report.context_parallel)]
    if report.expert_parallel:
        lines += ["", f"Expert parallelism (ep={ep_size}):", *(f"  {line}" for line in report.expert_parallel)]
    if report.pipeline:
        lines += ["", f"Pipeline parallelism (pp={pp_size}):", *(f"  {line}" for line in report.pipeline)]
    if report.working_tp_sizes or report.failing_tp_sizes:
        top = max([*report.working_tp_sizes, *report.failing_tp_sizes])
        lines += [
            "",
            f"TP sizes this model's plan accepts (1 to {top}): "
            + (", ".join(map(str, report.working_tp_sizes)) or "none"),
        ]
        reasons: dict[str, list[int]] = {}
        for size, reason in report.failing_tp_sizes.items():
            reasons.setdefault(reason, []).append(size)
        for reason, sizes in reasons.items():
            lines.append(f"  not {', '.join(map(str, sizes))}: {reason}")
        whole: dict[tuple[str, ...], list[int]] = {}
        for size, names in report.whole_mixer_sizes.items():
            whole.setdefault(tuple(names), []).append(size)
        for names, sizes in whole.items():
            lines.append(
                f"  at {', '.join(map(str, sizes))}: {len(names)} sequence mixer(s) stay whole "
                f"({compact_names(list(names))}): every rank computes all their heads"
            )
    lines += ["", f"Replicated over TP ({len(report.replicated)} parameters):"]
    collapsed = collapse_repeated(report.replicated)
    lines += [f"  {name} {list(shape)}" + (f" x {count}" if count > 1 else "") for name, shape, count in collapsed[:40]]
    if len(collapsed) > 40:
        lines.append(f"  ... and {len(collapsed) - 40} more")
    if report.unmatched:
        lines += ["", "Rules of the model's plan that match nothing:"] + [f"  {key}" for key in report.unmatched]
    shards = f", FSDP2 over dp_shard x cp = {dp_shard_size * cp_size}" if cp_size > 1 else ""
    shards += ", the heaviest pipeline rank" if report.pipeline else ""
    lines += [
        "",
        f"Per-rank memory (MiB{shards}; "
        + (
            "counted by the dry run: the real parallelize on a fake process group, as `python -m lightning_tp.plan`):"
            if report.memory_counted
            else "estimated from the plan's shapes):"
        ),
        f"  {'':<6} {'parameters':>12} {'gradients':>12} {'AdamW states':>14}",
    ]
    for dtype, values in report.memory.items():
        lines.append(
            f"  {dtype:<6} {values['parameters'] / 2**20:>12.1f} {values['gradients'] / 2**20:>12.1f} "
            f"{values['adamw_states'] / 2**20:>14.1f}"
        )
    errors = [p for p in report.problems if not p.startswith("warning:")]
    warnings = [p for p in report.problems if p.startswith("warning:")]
    if warnings:
        lines += ["", *warnings]
    lines += ["", "Problems:" if errors else "The layout is valid."] + [f"  - {p}" for p in errors]
    return "\n".join(lines)


def _format_mixers(report: Report, tp_size: int) -> list[str]:
    lines = []
    if report.mixers:
        lines += ["", "Sequence mixers split by heads (each rank computes its own; sizes whole -> per rank):"]
        for group in report.mixers:
            count = f" ({len(group.names)} modules)" if len(group.names) > 1 else ""
            lines.append(f"  {compact_names(group.names)}{count}: {group.kind}, {group.description}")
            if group.counts:
                lines.append("    " + ", ".join(f"{a} {c} -> {p}" for a, (c, p) in group.counts.items()))
            width = max((len(p) for p in group.blocks), default=0)
            for param, (sizes, rows) in group.blocks.items():
                whole = [str(i + 1) for i, (size, row) in enumerate(zip(sizes, rows, strict=True)) if size == row]
                plural = "s" if len(whole) > 1 else ""
                note = f" (block{plural} {', '.join(whole)} whole on every rank)" if whole and tp_size > 1 else ""
                lines.append(f"    {param:<{width}}  blocks {list(sizes)} -> rank's rows {list(rows)}{note}")
            if group.blocks:
                lines += [
                    "    (stored as a plain split of dim 0, the shapes above; each forward exchanges the rows of every",
                    f"    block with one all-to-all, a rank receiving {group.exchanged:,} values per mixer from the "
                    "others; the backward sends their gradients back)",
                ]
    if report.whole_mixers:
        lines += ["", f"Sequence mixers not split by heads at tp_size={tp_size} (every rank computes all their heads):"]
        for names, kind, why in report.whole_mixers:
            count = f" ({len(names)} modules)" if len(names) > 1 else ""
            lines.append(f"  {compact_names(names)}{count}: {kind}: {why}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_tp.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local directory with config.json, or a hub id (needs the network)")
    parser.add_argument("--tp-size", type=int, required=True)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1, help="context-parallel ranks splitting each sequence")
    parser.add_argument(
        "--cp-comm", choices=CP_COMMS, default="all_gather", help="how context parallelism exchanges keys and values"
    )
    parser.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks splitting the experts")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline ranks, each holding some of the stages")
    parser.add_argument("--pp-stages-per-rank", type=int, default=1, help="stages per pipeline rank")
    parser.add_argument("--lora-r", type=int, default=None, help="add LoRA adapters of this rank")
    parser.add_argument("--lora-targets", default="all-linear", help="comma-separated module names, or all-linear")
    args = parser.parse_args(argv)
    model = build_meta_model(args.model, lora_r=args.lora_r, lora_targets=args.lora_targets)
    sizes = dict(tp_size=args.tp_size, dp_shard_size=args.dp_shard_size, cp_size=args.cp_size, ep_size=args.ep_size)
    report = inspect_model(
        model, **sizes, pp_size=args.pp_size, pp_stages_per_rank=args.pp_stages_per_rank, cp_comm=args.cp_comm
    )
    print(format_report(report, **sizes, pp_size=args.pp_size))
    return 0 if not [p for p in report.problems if not p.startswith("warning:")] else 1


if __name__ == "__main__":
    sys.exit(main())
