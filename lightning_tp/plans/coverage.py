"""How much of a model a resolved plan splits: the layer kinds whose matrices no rule splits (every TP rank holds
and computes them whole), with their share of the parameters, and the info line that names them."""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_tp.plans.resolved import ResolvedPlan, Style
from lightning_tp.plans.source import key_regex
from lightning_tp.plans.styles import facts


def kept_whole(module: nn.Module, plan: ResolvedPlan, *, leave: tuple[str, ...] = ()) -> dict[str, tuple[int, float]]:
    """The kinds of modules whose matrices no rule of ``plan`` splits (every TP rank holds and computes all of them):
    kind (the class of the nearest module above them that is not one of torch's building blocks) -> (matrices, share
    of the parameter elements), largest first. Norms and biases (1-D) are left out: they are whole by design; LoRA
    adapters too; and the experts of expert parallelism (``plan.experts``, or the ``leave`` keys of
    :func:`~lightning_tp.plans.resolve.resolve_plan`: split over the EP ranks)."""
    total = sum(p.numel() for p in module.parameters())
    kept: dict[str, list[int]] = {}
    splits = {name for name, style in plan.styles.items() if _split_style(style)}
    experts = tuple(f"{name}." for name in plan.experts)
    for name, param in module.named_parameters():
        owners = [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
        if param.ndim < 2 or name in splits or any(o in splits for o in owners) or ".lora_" in name:
            continue  # split, under a split module (a LoRA wrapper's base layer), or an adapter (small, by design)
        if (experts and name.startswith(experts)) or any(key_regex(k).fullmatch(o) for k in leave for o in owners):
            continue
        counts = kept.setdefault(_layer_kind(module, name), [0, 0])
        counts[0] += 1
        counts[1] += param.numel()
    ordered = sorted(kept.items(), key=lambda item: -item[1][1])
    return {kind: (k, n / total) for kind, (k, n) in ordered if total}


def report_whole_modules(module: nn.Module, plan: ResolvedPlan, *, leave: tuple[str, ...] = ()) -> None:
    """One info line naming the layer kinds TP keeps whole (:func:`kept_whole`) with 1% of the parameters or more."""
    listed = ", ".join(
        f"{kind} ({100 * share:.0f}% in {k} matrices)"
        for kind, (k, share) in kept_whole(module, plan, leave=leave).items()
        if share >= 0.01
    )
    if listed:
        rank_zero_info(f"{type(module).__name__}: TP keeps these whole on every rank (no rule splits them): {listed}.")


def _layer_kind(module: nn.Module, param: str) -> str:
    """The class of the nearest module above ``param`` that is not one of torch's building blocks (a mixer, an MLP,
    an attention), which names the layer kind better than its ``Linear``."""
    path = param.rpartition(".")[0]
    while True:
        owner = module.get_submodule(path) if path else module
        if not type(owner).__module__.startswith("torch.") or not path:
            return type(owner).__name__
        path = path.rpartition(".")[0]


def _split_style(style: Style | None) -> bool:
    """Whether a style splits the parameters it is given (a torch ParallelStyle is taken to)."""
    if style is None:
        return False
    fact = facts(style)
    return fact is None or fact.weight_dim is not None or fact.kind in ("module", "expert")


__all__ = [
    "kept_whole",
    "report_whole_modules",
]
