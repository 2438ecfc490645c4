"""The layouts of a number of GPUs for a model, each simulated (:func:`~lightning_tp.dryrun.engine.simulate_rank`),
refused with the strategy's own message where the strategy would refuse it, and ranked: those that fit first, then by
the bytes a rank sends in a step."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_tp.dryrun.agreement import check_agreement, representative_ranks
from lightning_tp.dryrun.engine import Memory, RankRun, Workload, simulate_rank
from lightning_tp.layout import ParallelLayout
from lightning_tp.parallel_options import ParallelOptions

#: The sizes a layout is made of, in the order they are printed.
SIZES = ("pp_size", "dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "ep_size")


@dataclass(frozen=True)
class Choices:
    """The sizes to try on each axis (``None``: the defaults of :func:`candidate_layouts`) and whether to try
    activation checkpointing (``None``: without, then with where without does not fit).

    Args:
        tp, pp, cp, ep, dp_replicate: a size to keep fixed, or ``None``.
        activation_checkpointing: fixed, or ``None``.
        gpus_per_node: the largest TP size tried (TP's collectives run in every layer: within a node).

    Raises:
        Nothing: checked where the layouts are made.
    """

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    dp_replicate: int | None = None
    activation_checkpointing: bool | None = None
    gpus_per_node: int = 8


def _divisors(n: int, *, at_most: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (at_most is None or d <= at_most)]


def candidate_layouts(gpus: int, choices: Choices, *, seq_len: int, experts: int = 0) -> list[ParallelLayout]:
    """The layouts of ``gpus`` ranks to try: TP sizes up to a node, pipelines of up to 8 stages, CP of 2 from 16k
    tokens and of 4 from 32k, EP sizes that divide the experts (a mixture-of-experts model only), one replica
    group (HSDP's replicas: fixed by the user). The user's fixed sizes replace the tries on their axes; a combination
    that does not multiply to ``gpus`` is not a layout of it and is left out.

    Args:
        gpus: the world size.
        choices: the fixed sizes.
        seq_len: tokens per row (CP is tried for long ones).
        experts: the routed experts of a mixture-of-experts model (0: dense; EP is not tried).

    Raises:
        ValueError: a fixed size that no layout of ``gpus`` has (named, with the divisors of ``gpus``).
    """
    for name in ("tp", "pp", "cp", "ep", "dp_replicate"):
        value = getattr(choices, name)
        if value is not None and (value < 1 or gpus % value):
            raise ValueError(
                f"--{name.replace('_', '-')} {value} does not divide {gpus} GPUs: use one of {_divisors(gpus)}."
            )
    tps = [choices.tp] if choices.tp else _divisors(gpus, at_most=choices.gpus_per_node)
    pps = [choices.pp] if choices.pp else [p for p in (1, 2, 4, 8) if gpus % p == 0]
    cps = [choices.cp] if choices.cp else [c for c in (1, 2, 4) if c == 1 or seq_len >= 8192 * c]
    eps = [choices.ep] if choices.ep else ([e for e in _divisors(experts, at_most=64)] if experts else [1])
    replicas = [choices.dp_replicate or 1]
    layouts = []
    for tp, pp, cp, ep, replicate in itertools.product(tps, pps, cps, eps, replicas):
        try:
            layout = ParallelLayout.resolve(
                gpus, tp_size=tp, pp_size=pp, cp_size=cp, ep_size=ep, dp_replicate_size=replicate
            )
        except ValueError:
            continue
        layouts.append(layout)
    return layouts


@dataclass(frozen=True)
class LayoutResult:
    """One layout's verdict: its ``layout`` and ``activation_checkpointing``, the strategy's ``refusal`` (its message;
    nothing else is then known), the :class:`Memory` of its fullest simulated rank, whether it ``fits`` the GPU's
    memory (``None``: only parameters, gradients and optimizer states are known, and they fit), the collectives of
    rank 0 in one step, ``traffic`` (the bytes rank 0 sends in one step, the ring's cost of each collective) and why
    the step was not traced (``not_traced``).

    Args:
        layout, activation_checkpointing, refusal, memory, fits, runs, not_traced: as above; ``failed``: why the
            simulation itself failed (a defect of the dry run, not of the layout).

    Raises:
        Nothing: a record.
    """

    layout: ParallelLayout
    activation_checkpointing: bool
    refusal: str | None = None
    memory: Memory | None = None
    fits: bool | None = None
    runs: tuple[RankRun, ...] = field(default=(), repr=False)
    not_traced: str | None = None
    failed: str | None = None

    @property
    def step_calls(self) -> list[Any]:
        return [call for call in (self.runs[0].calls if self.runs else ()) if call.phase != "setup"]

    @property
    def traffic(self) -> float:
        return sum(call.traffic() for call in self.step_calls)

    def per_axis(self) -> dict[str, tuple[int, float]]:
        """Collectives of one step on each axis: how many, and the bytes rank 0 sends."""
        out: dict[str, tuple[int, float]] = {}
        for call in self.step_calls:
            count, sent = out.get(call.axis, (0, 0.0))
            out[call.axis] = (count + 1, sent + call.traffic())
        return out

    def verdict(self, gpu_memory: int) -> str:
        if self.refusal is not None:
            return "refused: " + self.refusal.split(". ")[0].rstrip(".") + "."
        if self.failed is not None:
            return self.failed
        assert self.memory is not None
        share = f"{self.memory.total / 2**30:.1f} of {gpu_memory / 2**30:.0f} GiB"
        if self.fits is False:
            return f"does not fit: {share} at the peak"
        if self.fits is None:
            reason = self.not_traced or ""
            why = next((w for w in ("pipelined", "context-parallel") if w in reason), "the forward reads a value")
            return f"weights, gradients and optimizer states fit ({share}); activations not traced ({why})"
        return f"fits: {share} at the peak"


def evaluate(
    build_model: Callable[[], nn.Module],
    layout: ParallelLayout,
    *,
    options: ParallelOptions,
    workload: Workload,
    gpu_memory: int,
    ranks: Iterable[int] | None = None,
) -> LayoutResult:
    """Simulate ``ranks`` of ``layout`` and judge it against ``gpu_memory``.

    Args:
        build_model: builds the model (called on the meta device, once per simulated rank).
        layout: the sizes.
        options, workload: the strategy's options and the step's workload.
        gpu_memory: each GPU's bytes.
        ranks: the ranks to simulate (default: rank 0, and the first rank of each later pipeline stage).

    Raises:
        Nothing: a refusal or a failure of the simulation is the result's ``refusal`` or ``failed``.
    """
    if ranks is None:
        ranks = [stage * layout.stage_size for stage in range(layout.pp_size)]
    runs = []
    try:
        for rank in ranks:
            runs.append(simulate_rank(build_model, layout, rank, options=options, workload=workload))
    except ValueError as refused:  # the strategy's own check: what it would raise on the GPUs
        return LayoutResult(layout, options.activation_checkpointing, refusal=str(refused))
    except Exception as error:  # noqa: BLE001  (a failure of the simulation itself: said for this layout, not fatal)
        failed = f"the dry run failed ({type(error).__name__}: {error}); please report it"
        return LayoutResult(layout, options.activation_checkpointing, failed=failed)
    fullest = max(runs, key=lambda run: run.memory.total)
    traced = fullest.memory.peak is not None
    fits = fullest.memory.total <= gpu_memory
    return LayoutResult(
        layout,
        options.activation_checkpointing,
        memory=fullest.memory,
        fits=fits if traced or not fits else None,
        runs=tuple(runs),
        not_traced=runs[0].not_traced,
    )


def plan_layouts(
    build_model: Callable[[], nn.Module],
    gpus: int,
    *,
    gpu_memory: int,
    workload: Workload,
    choices: Choices | None = None,
    options: ParallelOptions | None = None,
    experts: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[LayoutResult]:
    """Every candidate layout of ``gpus`` GPUs (:func:`candidate_layouts`) simulated and ranked: refused last; then
    those that fit, those that may (pipelines: activations not traced), those that do not; each group by the bytes a
    rank sends in a step, then by peak memory. Activation checkpointing is tried where the layout does not fit
    without (unless ``choices`` fixes it).

    Args:
        build_model: builds the model (on the meta device).
        gpus: the world size.
        gpu_memory: each GPU's bytes.
        workload: the step's batch, sequence length, optimizer and clipping.
        choices: the fixed sizes and checkpointing.
        options: the strategy's other options (checkpointing is set per try).
        experts: the routed experts (0: dense).
        progress: called with each layout's description before it is simulated.

    Raises:
        ValueError: a fixed size that no layout of ``gpus`` has.
    """
    choices = choices or Choices()
    options = options or ParallelOptions()
    results = []
    for layout in candidate_layouts(gpus, choices, seq_len=workload.seq_len, experts=experts):
        tries = [choices.activation_checkpointing] if choices.activation_checkpointing is not None else [False, True]
        for checkpointing in tries:
            if progress:
                progress(f"{describe(layout)}{', activation checkpointing' if checkpointing else ''}")
            result = evaluate(
                build_model,
                layout,
                options=replace(options, activation_checkpointing=checkpointing),
                workload=workload,
                gpu_memory=gpu_memory,
            )
            results.append(result)
            if result.refusal is not None or result.failed is not None or result.fits is not False:
                break
    order = {True: 0, None: 1, False: 2}
    return sorted(
        results,
        key=lambda r: (r.memory is None, order[r.fits], r.traffic, r.memory.total if r.memory else 0),
    )


def check_hangs(
    build_model: Callable[[], nn.Module],
    layout: ParallelLayout,
    *,
    options: ParallelOptions,
    workload: Workload,
    ranks: Iterable[int] | None = None,
) -> int:
    """Simulate ``ranks`` of ``layout`` (default :func:`~lightning_tp.dryrun.agreement.representative_ranks`) and
    compare their collectives; return the number of groups compared.

    Args:
        build_model, layout, options, workload: as :func:`evaluate`'s.
        ranks: the ranks to simulate.

    Raises:
        CollectiveMismatch: two ranks of a group would issue different collectives (named).
        ValueError: the strategy refuses the layout (its message).
    """
    ranks = representative_ranks(layout) if ranks is None else list(ranks)
    runs = [simulate_rank(build_model, layout, rank, options=options, workload=workload) for rank in ranks]
    return check_agreement((run.rank, run.calls) for run in runs)


def describe(layout: ParallelLayout) -> str:
    """``tp 8 x dp_shard 8`` (the axes above size 1; EP after a comma, as it borrows the others' ranks)."""
    parts = [
        f"{name.removesuffix('_size')} {getattr(layout, name)}" for name in SIZES[:-1] if getattr(layout, name) > 1
    ]
    text = " x ".join(parts) or "1 GPU"
    return text + (f", ep {layout.ep_size}" if layout.ep_size > 1 else "")
