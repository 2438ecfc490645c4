"""The pipeline's split plan: which stage holds which modules of a Transformers causal LM, on which rank, run by
which of torch's schedules; read from ``base_model_pp_plan`` (or the model's structure) and ``pp_split``, checked
before anything moves. Pure data and arithmetic: :mod:`lightning_tp.parallel.pipeline` runs the plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_tp.composition import problem
from lightning_tp.parallel.router_loss import (
    PipelinedRouterLoss,
    pipelined_router_loss,
)

if TYPE_CHECKING:
    pass


#: The default schedule by stages per rank: 1F1B for one (the least activation memory of torch's single-stage
#: schedules), its interleaved form for more (a bubble ``V`` times smaller).
DEFAULT_SCHEDULES = {1: "1F1B", 2: "Interleaved1F1B"}

#: Schedules that split the backward into an input-gradient pass and a later weight-gradient pass, which fills the
#: bubble (zero-bubble pipelining).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
#: Schedules whose stages run down the ranks and back up ("V": with 2 stages per rank, rank r holds stages r and
#: 2p-1-r, so the first and the last stage are on rank 0); the others place stage s on rank s % p ("loop").
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
#: Schedules that run every forward of the last stage before its first backward (all forwards, then all backwards):
#: the ones under which a loss over the whole batch (the routers' load-balancing loss, a product of two means over its
#: tokens) has its gradient when the first micro-batch's backward needs it.
FORWARDS_FIRST_SCHEDULES = ("GPipe", "LoopedBFS")
#: The schedules ``pp_schedule`` may name.
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", *SPLIT_BACKWARD_SCHEDULES)


def schedule_class(name: str) -> type:
    """torch's schedule class of ``name`` (case-insensitive, one of :data:`SCHEDULES`)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    if not isinstance(name, str) or name.lower() not in (n.lower() for n in SCHEDULES):
        raise ValueError(f"`pp_schedule={name!r}` is not one of {list(SCHEDULES)}: unknown schedule name.")
    return get_schedule_class(name)


def is_single_stage_schedule(cls: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return issubclass(cls, PipelineScheduleSingle)


@dataclass(frozen=True)
class PipelinePlan:
    """How a model is cut: ``layers[s]`` are the decoder-layer indices of stage ``s``; the paths name the embedding,
    the layer list and the final norm inside the model (from ``base_model_pp_plan``) and the head's modules (the
    causal LM's own children that hold parameters, e.g. ``lm_head``)."""

    layers: tuple[range, ...]
    embedding: str
    layer_list: str
    norm: str
    head: tuple[str, ...]
    schedule: str
    microbatches: int
    stages_per_rank: int
    #: The routers' load-balancing loss the model adds, whose statistics each stage adds to and passes on beside its
    #: activation; ``None`` where it adds none.
    router: PipelinedRouterLoss | None = None
    #: Each batch's sequence length padded up to a multiple of this (``pp_pad_to_multiple_of``), or ``None``.
    pad_to_multiple_of: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.layers)

    @property
    def v_shaped(self) -> bool:
        """Whether the stages go down the ranks and back up (see :data:`V_SCHEDULES`)."""
        return self.schedule in V_SCHEDULES

    def stages_of(self, pp_rank: int, pp_size: int) -> tuple[int, ...]:
        """The stage indices rank ``pp_rank`` holds, in order (as torch's schedule places them)."""
        owners = generate_owners(pp_size, self.num_stages, v_shaped=self.v_shaped)
        return tuple(stage for stage, rank in enumerate(owners) if rank == pp_rank)

    def modules_of(self, stage: int) -> list[str]:
        """The paths of the modules stage ``stage`` holds."""
        names = [f"{self.layer_list}.{i}" for i in self.layers[stage]]
        if stage == 0:
            names.insert(0, self.embedding)
        if stage == self.num_stages - 1:
            names += [self.norm, *self.head]
        return names


def base_model_name(model: nn.Module) -> str | None:
    """The name of the causal LM's child that is its decoder (``base_model_prefix``, or the child that
    ``get_decoder()`` returns, or the one holding the input embedding: Llama 4's prefix names a composite model's
    part), or ``None``."""
    prefix = getattr(model, "base_model_prefix", None)
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    found = next((name for name, child in model.named_children() if child is decoder), None)
    if found is None and hasattr(model, "get_input_embeddings"):  # the child holding the input embedding
        embedding = model.get_input_embeddings()
        found = next((n for n, c in model.named_children() if any(m is embedding for m in c.modules())), None)
    return found


def pipeline_parts(model: nn.Module) -> tuple[str, str, str] | None:
    """The names, in the base model, of the input embedding, the list of decoder layers and the final norm: the keys
    of ``config.base_model_pp_plan``, or where the config has none, read from the structure (the child that
    ``get_input_embeddings`` returns, the one ``ModuleList``, and the one other child holding parameters: Llama 4 and
    Nemotron-H ship no plan). ``None`` when neither gives them."""
    base_name = base_model_name(model)
    if base_name is None:
        return None
    base = getattr(model, base_name)
    pp_plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if pp_plan:
        names = tuple(pp_plan)
        return names if len(names) == 3 else None  # type: ignore[return-value]
    children = {name: child for name, child in base.named_children() if any(True for _ in child.parameters())}
    lists = [name for name, child in children.items() if isinstance(child, nn.ModuleList)]
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    embeddings = [name for name, child in children.items() if child is embedding]
    rest = [name for name in children if name not in lists and name not in embeddings]
    if len(lists) != 1 or len(embeddings) != 1 or len(rest) != 1:
        return None
    return embeddings[0], lists[0], rest[0]


def pipeline_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot be pipelined (the end of a sentence), or ``None``."""
    parts = pipeline_parts(model)
    if parts is None:
        return problem(
            "pp+no_plan",
            f"{type(model).__name__} has no `config.base_model_pp_plan` (Transformers' split of a causal LM into "
            "embeddings, decoder layers and norm) and its base model is not one embedding, one list of decoder layers "
            "and one final norm",
        )
    base_name = base_model_name(model)
    base = getattr(model, base_name)
    if not isinstance(getattr(base, parts[1], None), nn.ModuleList):
        return problem(
            "pp+plan_not_layers",
            f"{type(model).__name__}'s pipeline plan names {list(parts)}, whose second entry is not a list of "
            "decoder layers",
        )
    others = [
        name for name, child in base.named_children() if name not in parts and any(True for _ in child.parameters())
    ]
    if others:
        return problem(
            "pp+parameters_outside_plan",
            f"{type(model).__name__}.{base_name} holds parameters outside its pipeline plan ({others})",
        )
    return None


def resolve_pipeline_plan(
    model: nn.Module,
    *,
    pp_size: int,
    schedule: str | None,
    microbatches: int | None,
    stages_per_rank: int,
    split: Sequence[int] | None,
    pad_to_multiple_of: int | None = None,
) -> PipelinePlan:
    """The stages of ``model`` (which passed :func:`pipeline_problem`), checked before anything moves."""
    if pad_to_multiple_of is not None and (
        not isinstance(pad_to_multiple_of, int) or isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1
    ):
        raise ValueError(f"`pp_pad_to_multiple_of` must be a positive integer or None, got {pad_to_multiple_of!r}.")
    base_name = base_model_name(model)
    base = getattr(model, base_name)
    parts = pipeline_parts(model)
    assert parts is not None, "resolve_pipeline_plan of a model pipeline_problem refuses"
    embedding, layer_list, norm = parts
    layers: nn.ModuleList = getattr(base, layer_list)
    name = schedule or DEFAULT_SCHEDULES.get(stages_per_rank, "Interleaved1F1B")
    cls = schedule_class(name)
    single = is_single_stage_schedule(cls)
    if single and stages_per_rank != 1:
        raise ValueError(
            f"`pp_schedule={name!r}` runs one stage per rank, but pp_stages_per_rank={stages_per_rank}. Use an "
            "interleaved schedule (Interleaved1F1B, LoopedBFS) or pp_stages_per_rank=1."
        )
    num_stages = pp_size * stages_per_rank
    microbatches = num_stages if microbatches is None else microbatches
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"`pp_microbatches` must be a positive integer or None, got {microbatches!r}.")
    short = cls.__name__.removeprefix("Schedule")
    v_shaped = short in V_SCHEDULES
    if v_shaped and stages_per_rank != 2:
        raise ValueError(
            f"`pp_schedule={name!r}` places exactly 2 stages on each rank (down the ranks and back up), but "
            f"pp_stages_per_rank={stages_per_rank}. Use pp_stages_per_rank=2."
        )
    if short == "DualPipeV" and microbatches < num_stages:
        raise ValueError(
            f"`pp_schedule='DualPipeV'` needs at least as many micro-batches as stages ({num_stages}), got "
            f"pp_microbatches={microbatches}. Use more micro-batches."
        )
    if cls.__name__ == "Schedule1F1B" and microbatches < num_stages:
        raise ValueError(
            f"`pp_schedule='1F1B'` needs at least as many micro-batches as stages ({num_stages}), got "
            f"pp_microbatches={microbatches}. Use more micro-batches, or GPipe."
        )
    if not single and microbatches % pp_size:
        raise ValueError(
            f"`pp_schedule={name!r}` with {stages_per_rank} stages per rank needs a number of micro-batches divisible "
            f"by pp_size={pp_size}, got pp_microbatches={microbatches}."
        )
    router = pipelined_router_loss(model)
    if router is not None and short not in FORWARDS_FIRST_SCHEDULES:
        raise ValueError(
            f"{type(model).__name__} adds its routers' load-balancing loss (`output_router_logits=True`), "
            "num_experts x sum_e f_e P_e with f_e and P_e means over the whole batch, so the gradient of each "
            "micro-batch's router probabilities is num_experts x f_e / tokens and needs every micro-batch's routing; "
            f"`pp_schedule={name!r}` runs the first micro-batch's backward before the last one's forward. Use a "
            f"schedule that runs every forward first ({', '.join(map(repr, FORWARDS_FIRST_SCHEDULES))}), or set "
            "`config.output_router_logits=False`."
        )
    count = len(layers)
    if count < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {count} decoder layers, fewer than its {num_stages} pipeline stages "
            f"(pp_size={pp_size} x pp_stages_per_rank={stages_per_rank}). Use fewer stages."
        )
    if split is not None:
        split = list(split)
        if len(split) != num_stages or sum(split) != count or min(split) < 1:
            raise ValueError(
                f"`pp_split={split}` must give each of the {num_stages} stages at least one decoder layer and add up "
                f"to the model's {count} layers."
            )
        sizes = split
    else:
        per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        sizes = balanced_split(per_layer, num_stages, owners=generate_owners(pp_size, num_stages, v_shaped=v_shaped))
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    head = tuple(
        name for name, child in model.named_children() if name != base_name and any(True for _ in child.parameters())
    )
    return PipelinePlan(
        layers=tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True)),
        embedding=f"{base_name}.{embedding}",
        layer_list=f"{base_name}.{layer_list}",
        norm=f"{base_name}.{norm}",
        head=head,
        schedule=short,
        microbatches=microbatches,
        stages_per_rank=stages_per_rank,
        router=router,
        pad_to_multiple_of=pad_to_multiple_of,
    )


def generate_owners(pp_size: int, num_stages: int, *, v_shaped: bool) -> list[int]:
    """The pipeline rank holding each stage: stage ``s`` on rank ``s % p`` ("loop"), or down the ranks and back up
    ("V", 2 stages per rank)."""
    if v_shaped:
        return [s if s < pp_size else num_stages - 1 - s for s in range(num_stages)]
    return [s % pp_size for s in range(num_stages)]


def balanced_split(per_layer: Sequence[int], num_stages: int, *, owners: Sequence[int] | None = None) -> list[int]:
    """Layers per stage, contiguous, at least one each, minimising the heaviest stage, where the first and the last
    stage also carry one average layer's weight (the embedding, and the norm and head): torchtitan's default weights.
    Ties go to the earlier cut. ``owners`` (the rank of each stage): where a rank holds several stages, the cuts are
    then moved one layer at a time while that lowers the heaviest rank's load (a V-shaped placement puts the first and
    the last stage, with the embedding and the head, on one rank)."""
    count = len(per_layer)
    average = sum(per_layer) / count
    prefix = [0.0]
    for value in per_layer:
        prefix.append(prefix[-1] + value)

    def load(stage: int, start: int, end: int) -> float:
        extra = (average if stage == 0 else 0.0) + (average if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: the least possible heaviest load of stages s.. over layers i..
    inf = math.inf
    best = [[inf] * (count + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[num_stages][count] = 0.0
    for stage in range(num_stages - 1, -1, -1):
        for start in range(count - 1, -1, -1):
            for end in range(start + 1, count - (num_stages - stage - 1) + 1):
                value = max(load(stage, start, end), best[stage + 1][end])
                if value < best[stage][start] - 1e-9:
                    best[stage][start], cut[stage][start] = value, end
    sizes, start = [], 0
    for stage in range(num_stages):
        end = cut[stage][start]
        sizes.append(end - start)
        start = end
    if owners is None or len(set(owners)) == num_stages:
        return sizes

    def cost(sizes: list[int]) -> tuple[float, float]:
        """The heaviest rank's load, then the heaviest stage's."""
        starts = [sum(sizes[:s]) for s in range(num_stages)]
        stages = [load(s, starts[s], starts[s] + sizes[s]) for s in range(num_stages)]
        ranks: dict[int, float] = {}
        for stage, rank in enumerate(owners):
            ranks[rank] = ranks.get(rank, 0.0) + stages[stage]
        return max(ranks.values()), max(stages)

    best_cost = cost(sizes)
    improved = True
    while improved:
        improved = False
        for boundary in range(num_stages - 1):  # move one layer across the cut after stage `boundary`
            for step in (1, -1):
                moved = list(sizes)
                moved[boundary] += step
                moved[boundary + 1] -= step
                if min(moved) < 1:
                    continue
                if (value := cost(moved)) < best_cost:
                    sizes, best_cost, improved = moved, value, True
    return sizes


__all__ = [
    "DEFAULT_SCHEDULES",
    "FORWARDS_FIRST_SCHEDULES",
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "V_SCHEDULES",
    "PipelinePlan",
    "balanced_split",
    "generate_owners",
    "pipeline_problem",
    "resolve_pipeline_plan",
    "schedule_class",
]
