"""What each rank would hold, computed for ``python -m lightning_tp.inspect`` (:mod:`lightning_tp.tools.inspect`) on a
meta model, no process group needed: the :class:`Report` of its plan as the strategy would resolve it, each planned
module's per-rank shape, what stays replicated, the sequence mixers split by heads and those kept whole, what context,
expert and pipeline parallelism do on each rank, the TP sizes that work, and per-rank bytes of parameters, gradients
and AdamW states.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_tp.compat import config_value
from lightning_tp.parallel.blocks import row_exchange
from lightning_tp.parallel.kv_heads import describe_layouts, kv_head_layout
from lightning_tp.plans.fallback_kinds import ATTENTION_KINDS
from lightning_tp.plans.heads import uneven_kv_problem
from lightning_tp.plans.mixers import attribute, config_heads, find_mixers, mixer_kind
from lightning_tp.plans.resolve import resolve_plan
from lightning_tp.plans.resolved import ResolvedPlan
from lightning_tp.plans.source import key_regex, model_plan, plan_source
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES, KV_HEAD_COUNT_ATTRIBUTES, facts, style_names

#: Styles that split an embedding's vocabulary (dim 0): a vocabulary the TP size does not divide gives uneven shards.
_VOCABULARY_STYLES = style_names(kind="embedding", weight_dim=0)


@dataclass
class MixerGroup:
    """Sequence mixers split by heads (:mod:`lightning_tp.plans.mixers`) that are alike: same kind, head counts and
    blocks (the layers of a hybrid model)."""

    names: list[str]
    kind: str
    description: str
    #: Size attribute (``"norm.n_groups"``: a child's) -> (whole, per rank).
    counts: dict[str, tuple[int, int]]
    #: Packed parameter (relative to the mixer) -> (whole block sizes, the rank's rows of each block).
    blocks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: Values of one mixer's packed parameters that a rank receives from the other TP ranks in each forward (the
    #: rows of its blocks they hold; the most any rank receives); the backward sends as many gradient values back.
    exchanged: int = 0


@dataclass
class Report:
    rows: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    replicated: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Whether ``memory`` was counted by the dry run (exact, the real ``parallelize``) rather than estimated from
    #: the plan's shapes (a refused layout, or inside a launched job).
    memory_counted: bool = False
    #: Where the plan comes from: ``"model"`` (its config's ``base_model_tp_plan``), ``"derived"`` (from its module
    #: structure), ``"none"``; ``" + tp_plan"`` when overrides were given.
    source: str = "none"
    #: Attention modules given ``local_heads`` (sequence mixers apart): (name, {attribute: (whole count, per-rank
    #: count)}).
    local_heads: list[tuple[str, dict[str, tuple[int, int]]]] = field(default_factory=list)
    #: Sequence mixers split by heads, alike ones grouped.
    mixers: list[MixerGroup] = field(default_factory=list)
    #: Sequence mixers the plan does not split by heads: (names, kind, why), alike ones grouped. A mixer kept whole
    #: trains: every TP rank computes all its heads, its projections as the model's plan places them.
    whole_mixers: list[tuple[list[str], str, str]] = field(default_factory=list)
    #: KV-head replication: the attention modules, what each rank computes, and the gathered K/V weight bytes.
    kv_replication: list[str] = field(default_factory=list)
    #: The model's parts (see :func:`model_parts`): (name, sharded parameters, parameters, elements, elements per
    #: rank under TP). A vision tower without plan entries: no sharded parameters, replicated over the TP group.
    parts: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    #: Context parallelism: what each rank holds of a sequence and what its attention exchanges.
    context_parallel: list[str] = field(default_factory=list)
    #: Expert parallelism: what each rank holds of the experts and what their all-to-alls carry.
    expert_parallel: list[str] = field(default_factory=list)
    #: The TP sizes up to :func:`tp_sizes`' limit that the plan accepts, and why the others fail (the first line of
    #: the plan's error, by size).
    working_tp_sizes: list[int] = field(default_factory=list)
    failing_tp_sizes: dict[int, str] = field(default_factory=dict)
    #: Of the working TP sizes, those at which sequence mixers stay whole: size -> their names.
    whole_mixer_sizes: dict[int, list[str]] = field(default_factory=dict)
    #: Pipeline parallelism: each pipeline rank's stages, what they hold and the elements per rank.
    pipeline: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


def local_shape(
    shape: tuple[int, ...], style: str, tp_size: int, *, is_bias: bool, dim: int | None = None
) -> tuple[int, ...]:
    """The largest per-rank shape of a parameter of ``shape`` under ``style`` (uneven splits give rank 0 the most).
    ``is_bias``: the parameter is named ``bias`` (a row-wise bias is added after the reduction: replicated).
    ``dim``: the split dim where the plan gives one (``ResolvedPlan.block_dims``), not the style's."""
    fact = facts(style)
    if dim is None:
        dim = fact.split_dim(len(shape), is_bias=is_bias) if fact is not None else None
    if dim is None:
        return shape
    out = list(shape)
    out[dim] = math.ceil(shape[dim] / tp_size)
    return tuple(out)


def _fsdp_shape(shape: tuple[int, ...], dp_shard: int) -> tuple[int, ...]:
    if dp_shard == 1 or not shape:
        return shape
    return (math.ceil(shape[0] / dp_shard), *shape[1:])


def inspect_model(
    model: nn.Module,
    *,
    tp_size: int,
    dp_shard_size: int = 1,
    cp_size: int = 1,
    ep_size: int = 1,
    pp_size: int = 1,
    pp_stages_per_rank: int = 1,
    tp_plan: str | dict[str, Any] = "auto",
    cp_comm: str = "all_gather",
) -> Report:
    """The report for a (meta) model: no process group needed. FSDP2 shards over ``dp_shard_size x cp_size``; with
    ``ep_size > 1`` the experts go whole to the EP ranks, FSDP2 shards them over ``dp_shard x cp x tp / ep``; with
    ``pp_size > 1`` each pipeline rank holds its stages (the memory shown is the heaviest rank's); ``cp_comm``: how
    context parallelism exchanges keys and values (the strategies' option)."""
    from lightning_tp.parallel_options import CP_COMMS

    if cp_comm not in CP_COMMS:
        raise ValueError(f"`cp_comm` must be one of {', '.join(map(repr, CP_COMMS))}, got {cp_comm!r}.")
    report = Report()
    source = plan_source(model)[1]
    report.source = source + (" + tp_plan" if isinstance(tp_plan, dict) and tp_plan else "")
    leave: tuple[str, ...] = ()
    resolved = True
    try:
        from lightning_tp.parallel.expert_parallel import expert_modules_of

        leave = expert_modules_of(model) if ep_size > 1 else ()  # the experts are expert parallelism's to place
        plan = resolve_plan(model, tp_plan, tp_size=tp_size, leave=leave)
    except ValueError as err:
        report.problems.append(str(err))
        plan = _permissive_plan(model, tp_size)
        resolved = False
    try:
        from lightning_tp.parallel.lora import check_peft_supported, extend_plan_to_adapters, has_peft

        if has_peft(model):
            check_peft_supported(model)
            plan = extend_plan_to_adapters(model, plan)
    except ValueError as err:
        report.problems.append(str(err))
    efsdp = 1
    if ep_size > 1:
        from lightning_tp.layout import ParallelLayout
        from lightning_tp.parallel.expert_parallel import resolve_expert_plan

        try:
            layout = ParallelLayout(tp_size=tp_size, dp_shard_size=dp_shard_size, cp_size=cp_size, ep_size=ep_size)
            efsdp = layout.efsdp_size
            plan = resolve_expert_plan(model, plan, ep_size=ep_size)
        except ValueError as err:
            report.problems.append(str(err))
    report.problems += _uneven_splits(model, plan, tp_size)
    # The strategy's own refusal at setup (lightning_tp.stages.resolve_targets), the same message.
    shards = dp_shard_size * cp_size
    if (uneven := uneven_kv_problem(model, plan, tp_size, fsdp=shards > 1, shards=shards)) is not None:
        report.problems.append(f"{uneven}.")
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    report.unmatched = [key for key in model_plan(model) if not any(key_regex(key).fullmatch(n) for n in names)]
    modules = dict(model.named_modules())
    for name in plan.local_heads:
        if name not in plan.mixers:
            report.local_heads.append((name, _head_counts(modules[name], name, HEAD_COUNT_ATTRIBUTES, plan, tp_size)))
    report.mixers = _mixer_groups(model, plan, tp_size)
    if resolved:  # else the plan shown is the fallback's, which splits no mixer
        report.whole_mixers = _group_whole(_whole_mixers(model, plan, tp_size, tp_plan))
    report.kv_replication = _kv_replication(model, plan, tp_size)
    # Every style name, this package's own (GPT-2's Conv1D styles) too: the table knows what each splits.
    styles = {name: style for name, style in plan.styles.items() if isinstance(style, str)}
    counts = {"params": 0, "trainable": 0}
    per_param: dict[str, tuple[int, int]] = {}  # name -> (elements per rank, of them trainable)
    sharded_shapes: dict[str, tuple[int, ...]] = {}  # per rank under TP alone
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        style = styles.get(name)
        is_bias = name.rpartition(".")[2] == "bias"  # Transformers replicates a row-wise `bias` by its name
        if plan.experts.get(name) is not None:  # whole experts per EP rank, then FSDP2 over `efsdp`
            style, tp_local = plan.experts[name], (math.ceil(shape[0] / ep_size), *shape[1:])
            local = _fsdp_shape(tp_local, efsdp)
            report.rows.append((name, style, shape, local))
            counts["params"] += math.prod(local)
            counts["trainable"] += math.prod(local) if param.requires_grad else 0
            per_param[name] = (math.prod(local), math.prod(local) if param.requires_grad else 0)
            continue
        dim = plan.block_dims.get(name)
        tp_local = local_shape(shape, style, tp_size, is_bias=is_bias, dim=dim) if style else shape
        local = _fsdp_shape(tp_local, dp_shard_size * cp_size)
        if tp_local != shape:
            sharded_shapes[name] = tp_local
            report.rows.append((name, style, shape, local))
        else:
            report.replicated.append((name, local))
        numel = math.prod(local)
        counts["params"] += numel
        counts["trainable"] += numel if param.requires_grad else 0
        per_param[name] = (numel, numel if param.requires_grad else 0)
    if pp_size > 1:
        report.pipeline, heaviest = _pipeline(model, per_param, pp_size, pp_stages_per_rank, report.problems)
        counts = heaviest or counts
    report.parts = _parts(model, sharded_shapes)
    if cp_size > 1:
        report.context_parallel, problem = _context_parallel(model, tp_size=tp_size, cp_size=cp_size, cp_comm=cp_comm)
        if problem is not None:
            report.problems.append(f"cp_size={cp_size}: {problem}.")
    if ep_size > 1 and plan.experts:
        report.expert_parallel = _expert_parallel(model, plan, ep_size=ep_size, efsdp=efsdp, tp_size=tp_size)
    report.working_tp_sizes, report.failing_tp_sizes, report.whole_mixer_sizes = _tp_size_details(
        model, tp_plan=tp_plan, leave=leave
    )
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        report.memory[dtype] = {
            "parameters": counts["params"] * size,
            "gradients": counts["trainable"] * size,
            "adamw_states": counts["trainable"] * 2 * 4,  # exp_avg and exp_avg_sq, fp32 as usual
        }
    if report.valid:
        _count_by_dry_run(
            model,
            report,
            tp_size=tp_size,
            dp_shard_size=dp_shard_size,
            cp_size=cp_size,
            ep_size=ep_size,
            pp_size=pp_size,
            options={"tp_plan": tp_plan, "cp_comm": cp_comm, "pp_stages_per_rank": pp_stages_per_rank},
        )
    return report


def _count_by_dry_run(model: nn.Module, report: Report, *, options: dict[str, Any], **sizes: int) -> None:
    """The memory of a valid layout counted by the dry run (:mod:`lightning_tp.dryrun`), the same count as
    ``python -m lightning_tp.plan``: the real ``parallelize`` on a fake process group, rank 0 of each pipeline stage
    (the fullest shown), each rank's shards and AdamW's real states, in float32 and in bfloat16. A layout the
    strategy refuses where the checks above did not is a problem, with the strategy's message. Skipped, the
    estimate above kept (``memory_counted`` false), inside a launched job (the dry run needs its own world)."""
    import copy

    import torch

    from lightning_tp.compat import distributed_is_initialized
    from lightning_tp.dryrun.engine import Workload, simulate_rank
    from lightning_tp.layout import ParallelLayout
    from lightning_tp.parallel_options import ParallelOptions

    if distributed_is_initialized():
        return
    tp, dp, cp, ep, pp = (sizes[f"{axis}_size"] for axis in ("tp", "dp_shard", "cp", "ep", "pp"))
    layout = ParallelLayout.resolve(tp * dp * cp * pp, tp_size=tp, cp_size=cp, ep_size=ep, pp_size=pp)
    parallel_options = ParallelOptions(**options)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        runs = []
        for stage in range(pp):
            try:
                runs.append(
                    simulate_rank(
                        lambda dtype=dtype: copy.deepcopy(model).to(dtype),
                        layout,
                        stage * layout.stage_size,
                        options=parallel_options,
                        workload=Workload(optimizer="adamw"),
                        trace=False,
                    )
                )
            except ValueError as refused:
                report.problems.append(f"the strategy refuses this layout: {refused}")
                return
        fullest = max(runs, key=lambda run: run.memory.total).memory
        report.memory[name] = {
            "parameters": fullest.parameters,
            "gradients": fullest.gradients,
            "adamw_states": fullest.optimizer,
        }
    report.memory_counted = True


def _pipeline(
    model: nn.Module, per_param: dict[str, tuple[int, int]], pp_size: int, stages_per_rank: int, problems: list[str]
) -> tuple[list[str], dict[str, int] | None]:
    """Each pipeline rank's stages (their layers and what else they hold) and elements per rank, and the heaviest
    rank's counts; a model that cannot be pipelined adds its problem instead."""
    from lightning_tp.parallel.pipeline_plan import pipeline_problem, resolve_pipeline_plan

    if (problem := pipeline_problem(model)) is not None:
        problems.append(f"pp_size={pp_size}: {problem}.")
        return [], None
    try:
        plan = resolve_pipeline_plan(
            model, pp_size=pp_size, schedule=None, microbatches=None, stages_per_rank=stages_per_rank, split=None
        )
    except ValueError as err:
        problems.append(str(err))
        return [], None
    base_names = {plan.embedding: "embedding", plan.norm: "norm", **{name: name for name in plan.head}}
    total = sum(numel for numel, _ in per_param.values())
    lines = [f"schedule {plan.schedule}, {plan.microbatches} micro-batches by default, {plan.num_stages} stages"]
    heaviest: dict[str, int] | None = None
    for rank in range(pp_size):
        stages = plan.stages_of(rank, pp_size)
        held = tuple(f"{name}." for stage in stages for name in plan.modules_of(stage))
        numel = sum(n for name, (n, _) in per_param.items() if name.startswith(held))
        trainable = sum(t for name, (_, t) in per_param.items() if name.startswith(held))
        parts = []
        for stage in stages:
            layers = plan.layers[stage]
            extra = [base_names[name] for name in plan.modules_of(stage) if name in base_names]
            parts.append(f"stage {stage}: layers {layers.start}-{layers.stop - 1}" + "".join(f" + {e}" for e in extra))
        share = f"{numel / total:.0%}" if total else "-"
        lines.append(f"pp rank {rank}: {'; '.join(parts)}: {numel:,} elements per rank ({share} of this layout's)")
        if heaviest is None or numel > heaviest["params"]:
            heaviest = {"params": numel, "trainable": trainable}
    return lines, heaviest


def tp_sizes(
    model: nn.Module, *, tp_plan: str | dict[str, Any] = "auto", leave: tuple[str, ...] = ()
) -> tuple[list[int], dict[int, str]]:
    """The TP sizes from 1 to ``max(8, query heads)`` whose plan resolves on ``model`` (head counts, replication of
    the KV heads, styles; ``leave``: modules another parallelism places, as in :func:`resolve_plan`), and for each
    size that fails the reason: the first sentence of the plan's error."""
    working, failing, _ = _tp_size_details(model, tp_plan=tp_plan, leave=leave)
    return working, failing


def _tp_size_details(
    model: nn.Module, *, tp_plan: str | dict[str, Any], leave: tuple[str, ...]
) -> tuple[list[int], dict[int, str], dict[int, list[str]]]:
    """:func:`tp_sizes`, and for each working size the sequence mixers that stay whole at it."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config_value(config, "num_attention_heads")
    limit = max(8, heads if isinstance(heads, int) else 0)
    working, failing, whole = [], {}, {}
    for size in range(1, min(limit, 128) + 1):
        try:
            with _quiet():
                plan = resolve_plan(model, tp_plan, tp_size=size, leave=leave)
        except ValueError as err:
            first = re.split(r"\.\s+(?=[A-Z`])", str(err))[0].split(": ", 1)[-1]
            failing[size] = first.replace(f"tp_size={size}", "tp_size").rstrip(".")
        else:
            working.append(size)
            if names := [
                name for name, _, why in _whole_mixers(model, plan, size, tp_plan) if why != _PLACED_BY_TP_PLAN
            ]:
                whole[size] = names
    return working, failing, whole


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without the info lines of plan resolution (the mixers kept whole at each TP size tried), warnings kept."""
    from lightning_utilities.core import rank_zero

    log = getattr(rank_zero, "log", None) or logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


#: Why a mixer the user's ``tp_plan`` places itself is not split by heads.
_PLACED_BY_TP_PLAN = "placed by the `tp_plan` given (its rules name it or something inside it)"


def _head_counts(
    module: nn.Module, name: str, attributes: tuple[str, ...], plan: ResolvedPlan, tp_size: int
) -> dict[str, tuple[int, int]]:
    """The integer size attributes of the head-split module ``name`` (``"norm.n_groups"``: a child's), whole and per
    rank: divided by the TP size, but the KV heads of KV-head replication (the most any rank computes)."""
    counts = {}
    for path in attributes:
        count = attribute(module, path)
        if not isinstance(count, int) or isinstance(count, bool):
            continue
        if name in plan.kv_replicated and path.rpartition(".")[2] in KV_HEAD_COUNT_ATTRIBUTES:
            query_heads, kv_heads = plan.kv_replicated[name]
            layouts = (kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=r) for r in range(tp_size))
            counts[path] = (count, max(layout.local_kv_heads for layout in layouts))
        else:
            counts[path] = (count, count // tp_size)
    return counts


def _mixer_groups(model: nn.Module, plan: ResolvedPlan, tp_size: int) -> list[MixerGroup]:
    """The plan's sequence mixers with their head counts and packed blocks per rank, alike ones grouped."""
    params = dict(model.named_parameters())
    groups: dict[tuple, MixerGroup] = {}
    for name, split in plan.mixers.items():
        mixer = model.get_submodule(name)
        kind = mixer_kind(mixer)
        counts = _head_counts(mixer, name, split.kind.attributes, plan, tp_size)
        if not counts and kind is not None and kind.heads:
            # A mixer that reshapes by -1 (Doge's): the counts its split is checked on, read where they live.
            counts = _head_counts(mixer, name, kind.heads, plan, tp_size)
        if not counts and kind in ATTENTION_KINDS:
            # Plain attention reshaping by -1 keeps no head count: its heads are its config's, split like q/k/v.
            config = getattr(mixer, "config", None)
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            heads = config_heads(mixer)
            kv_heads = config_value(config, "num_key_value_heads") or heads
            if isinstance(heads, int) and isinstance(kv_heads, int):
                kv_local = kv_heads // tp_size
                if name in plan.kv_replicated:
                    kv_local = max(
                        kv_head_layout(*plan.kv_replicated[name], tp_size=tp_size, rank=r).local_kv_heads
                        for r in range(tp_size)
                    )
                counts = {
                    "num_attention_heads (config)": (heads, heads // tp_size),
                    "num_key_value_heads (config)": (kv_heads, kv_local),
                }
        blocks, exchanged = {}, 0
        for param, sizes in plan.blocks.items():
            if not param.startswith(f"{name}."):
                continue
            whole = plan.whole_blocks.get(param, ())
            rows = tuple(size if i in whole else size // tp_size for i, size in enumerate(sizes))
            blocks[param.removeprefix(f"{name}.")] = (sizes, rows)
            owner, _, leaf = param.rpartition(".")
            held = params.get(param, params.get(f"{owner}.base_layer.{leaf}"))  # a LoRA wrapper's base layer
            if held is not None and tp_size > 1:
                received = max(
                    row_exchange(sizes, tp_size=tp_size, rank=r, whole=whole).received for r in range(tp_size)
                )
                exchanged += received * held.numel() // held.shape[0]
        kind_name = kind.name if kind is not None else "?"
        description = kind.description if kind is not None else type(mixer).__name__
        key = (kind_name, tuple(counts.items()), tuple(blocks.items()), exchanged)
        if key in groups:
            groups[key].names.append(name)
        else:
            groups[key] = MixerGroup([name], kind_name, description, counts, blocks, exchanged)
    return list(groups.values())


def _whole_mixers(
    model: nn.Module, plan: ResolvedPlan, tp_size: int, tp_plan: str | dict[str, Any] = "auto"
) -> list[tuple[str, str, str]]:
    """The sequence mixers of ``model`` that ``plan`` (resolved at ``tp_size`` with ``tp_plan``) does not split by
    heads: (name, kind, why), as :func:`lightning_tp.plans.resolve.resolve_plan` decides. Attention that the model's
    own rules split is no such mixer; at TP size 1 nothing is split."""
    if tp_size == 1:
        return []
    overrides = list(tp_plan) if isinstance(tp_plan, dict) else []
    found = []
    for name, kind in find_mixers(model).items():
        if name in plan.mixers:
            continue
        if name in plan.whole_mixers:
            found.append((name, kind.name, plan.whole_mixers[name]))
            continue
        mixer = model.get_submodule(name)
        paths = [
            name,
            *(f"{name}.{inner}" for inner, _ in [*mixer.named_modules(), *mixer.named_parameters()] if inner),
        ]
        if _matches(overrides, paths):
            found.append((name, kind.name, _PLACED_BY_TP_PLAN))
        # Otherwise attention (or an MLP) the model's own rules split, or a tower left whole: listed with the others.
    return found


def _matches(keys: list[str], paths: list[str]) -> bool:
    return any(key_regex(key).fullmatch(path) for key in keys for path in paths)


def _group_whole(found: list[tuple[str, str, str]]) -> list[tuple[list[str], str, str]]:
    groups: dict[tuple[str, str], list[str]] = {}
    for name, kind, why in found:
        groups.setdefault((kind, why), []).append(name)
    return [(names, kind, why) for (kind, why), names in groups.items()]


def _expert_parallel(model: nn.Module, plan: ResolvedPlan, *, ep_size: int, efsdp: int, tp_size: int) -> list[str]:
    """What each rank holds of the experts, and what the two all-to-alls of each MoE layer carry."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    hidden, top_k = getattr(config, "hidden_size", None), getattr(config, "num_experts_per_tok", None)
    layers = plan.expert_modules
    count = getattr(model.get_submodule(layers[0]), "num_experts", 0)
    params = dict(model.named_parameters())
    whole = sum(params[n].numel() for n in plan.experts if n in params)
    lines = [
        f"{len(layers)} experts modules ({layers[0]}, ...) of {count} experts each: each rank of an EP group holds "
        f"{count // ep_size} whole experts per layer; FSDP2 shards them over the {efsdp} rank(s) holding the same "
        f"ones (efsdp = dp_shard x cp x tp / ep). Expert weights per rank: {whole // (ep_size * efsdp):,} of "
        f"{whole:,} values (1/{ep_size * efsdp}).",
    ]
    if isinstance(hidden, int) and isinstance(top_k, int):
        lines.append(
            f"Per MoE layer and step, each routed (token, expert) pair travels as {hidden} values there and back in "
            f"the forward (2 all-to-alls), and its gradient in the backward (2 more): {4 * hidden * top_k:,} values "
            f"per token of the TP group's batch ({top_k} experts per token), of which ~{(ep_size - 1) / ep_size:.0%} "
            f"leave the rank (uniform routing); the ranks of a TP group send {1}/{tp_size} of the tokens each."
        )
    return lines


def _kv_replication(model: nn.Module, plan: ResolvedPlan, tp_size: int) -> list[str]:
    """What KV-head replication does on each rank, and what it costs (see :mod:`lightning_tp.parallel.kv_heads`), for
    each group of attention modules with the same head counts (layers may differ)."""
    params = dict(model.named_parameters())
    groups: dict[tuple[int, int], list[str]] = {}
    for attention, counts in plan.kv_replicated.items():
        groups.setdefault(counts, []).append(attention)
    lines = []
    for (query_heads, kv_heads), attentions in groups.items():
        kv_weights = [
            params[name]
            for name, style in plan.styles.items()
            if style == "colwise_kv_heads"
            and name in params
            and name.endswith(".weight")
            and any(name.startswith(f"{a}.") for a in attentions)
        ]
        gathered = sum(w.numel() for w in kv_weights) // len(attentions)  # one module's K and V (and adapters')
        size = kv_weights[0].element_size() if kv_weights else 4
        most = max(
            kv_head_layout(query_heads, kv_heads, tp_size=tp_size, rank=r).local_kv_heads for r in range(tp_size)
        )
        lines += [
            f"{kv_heads} KV heads for {query_heads} query heads, not divisible by tp_size={tp_size}: the KV heads are "
            f"replicated in {len(attentions)} attention modules ({attentions[0]}, ...). K/V weights stay split like "
            f"'colwise' (1/{tp_size} per rank); each rank computes the KV heads its query heads read:",
            *(f"  {line}" for line in describe_layouts(query_heads, kv_heads, tp_size=tp_size)),
            f"Cost per attention module and step: its K/V weights gathered for the forward ({gathered:,} values, "
            f"{gathered * size / 2**20:.2f} MiB at {size} bytes each) and their gradient reduce-scattered; K/V "
            f"activations of up to {most} head(s) per rank instead of {kv_heads / tp_size:g}.",
        ]
    return lines


def _context_parallel(
    model: nn.Module, *, tp_size: int, cp_size: int, cp_comm: str = "all_gather"
) -> tuple[list[str], str | None]:
    """What a rank holds of each sequence with ``cp_size`` ranks splitting it (the split's own functions, at 8,192
    tokens), how ``cp_comm`` exchanges keys and values (its rule of the composition table) and the bytes it moves;
    and why the model cannot be split, if it cannot (the strategy's own check)."""
    from lightning_tp.composition import BY_KEY
    from lightning_tp.parallel.cp_checks import context_parallel_problem
    from lightning_tp.parallel.cp_split import padded_length, piece_starts

    problem = context_parallel_problem(model)
    config = model.config.get_text_config() if hasattr(model, "config") else None
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads") or heads
    layers = getattr(config, "num_hidden_layers", None)
    length = padded_length(8192, 2 * cp_size)
    piece = length // (2 * cp_size)
    held = ", ".join(
        f"rank {r}: " + " + ".join(f"[{s:,}, {s + piece:,})" for s in piece_starts(length, cp_size, r))
        for r in range(min(cp_size, 4))
    )
    lines = [
        f"Each sequence is split into {2 * cp_size} pieces; each rank holds 2 of them (one from the front, its mirror "
        f"from the back), 1/{cp_size} of the tokens and of the activations (lengths are padded to a multiple of "
        f"{2 * cp_size}, times tp_size under sequence parallelism). Of {length:,} tokens, {held}"
        + (", ..." if cp_size > 4 else "")
        + ".",
        f"cp_comm={cp_comm!r}: {BY_KEY[f'cp+{cp_comm}'].reason}",
    ]
    if isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(layers, int):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        local_kv = max(kv_head_layout(heads, kv_heads, tp_size=tp_size, rank=r).local_kv_heads for r in range(tp_size))
        per_token = 2 * local_kv * head_dim  # keys and values, per layer
        lines.append(
            f"Each of the {layers} attention layers receives {per_token:,} values per token of the sequence "
            f"({local_kv} KV head(s) x {head_dim} x K and V per TP rank), {(cp_size - 1) / cp_size:.0%} of them from "
            f"other ranks, and sends their gradients back in the backward. Per 1,024 tokens and layer, bf16: "
            f"{per_token * 1024 * 2 / 2**20:.2f} MiB received."
        )
    return lines, problem


def model_parts(model: nn.Module) -> list[str]:
    """The parts a report summarises, those holding parameters: the children of the model's base model (a
    vision-language model's vision tower, projector and language model; a causal LM's embedding, layers and norm),
    then the model's other children (``lm_head``)."""
    base = getattr(model, "base_model", model)
    prefix = next((f"{n}." for n, m in model.named_modules() if m is base and n), "")
    parts = [f"{prefix}{n}" for n, _ in base.named_children()]
    if base is not model:
        parts += [n for n, child in model.named_children() if child is not base]
    return [p for p in parts if any(True for _ in model.get_submodule(p).parameters())]


def _parts(model: nn.Module, tp_local: dict[str, tuple[int, ...]]) -> list[tuple[str, int, int, int, int]]:
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    out = []
    for part in model_parts(model):
        inside = [n for n in shapes if n.startswith(f"{part}.")]
        numel = sum(math.prod(shapes[n]) for n in inside)
        per_rank = sum(math.prod(tp_local.get(n, shapes[n])) for n in inside)
        out.append((part, sum(n in tp_local for n in inside), len(inside), numel, per_rank))
    return out


def _permissive_plan(model: nn.Module, tp_size: int) -> ResolvedPlan:
    """The plan without the checks that failed, so the rest of the report can still be shown."""
    try:
        return resolve_plan(model, "auto", tp_size=1)
    except ValueError:
        return ResolvedPlan()


def _uneven_splits(model: nn.Module, plan: ResolvedPlan, tp_size: int) -> list[str]:
    """Vocabulary (embedding, lm_head) sizes the TP size does not divide: they work, with uneven shards, but pad."""
    notes = []
    params = dict(model.named_parameters())
    for name, style in plan.styles.items():
        if style in _VOCABULARY_STYLES and name in params and params[name].shape[0] % tp_size:
            vocab = params[name].shape[0]
            notes.append(
                f"warning: {name} has a vocabulary of {vocab}, not divisible by tp_size={tp_size}: shards are uneven "
                f"(pad the vocabulary to a multiple of {tp_size}, e.g. {math.ceil(vocab / tp_size) * tp_size})."
            )
    return notes


__all__ = ["MixerGroup", "Report", "inspect_model", "local_shape", "model_parts", "tp_sizes"]
