"""Pipeline parallelism: a Transformers causal LM cut into stages along its ``base_model_pp_plan``, run by torch's
schedules (``torch.distributed.pipelining``) inside the model's own ``forward``.

The split (its parts named by ``base_model_pp_plan``, or read from the model's structure where the config has none):
the first stage holds the input embedding, the last the final norm and the causal LM's head, and the
decoder layers are shared between the stages in order, balanced by parameters with the embedding and the head each
counted as one average layer (so the first and last stages get fewer layers, as torchtitan weighs them); or as the
user gives them (``pp_split``). Each rank keeps only its stages' modules, in place and under their own names: the
others are set to ``None`` in their parents, so state dicts, checkpoints (DCP reshards them across pipeline sizes) and
exports hold the original keys.

A stage runs the model's own forward, so that what its layers need from the whole model (rotary embeddings, causal
masks, position ids, per-layer-type masks) is computed on the stage, the way the model computes it. For the call, the
layers the stage does not hold are stood in for (:class:`_StandIn`: the layer's plain attributes, which the model's
loop may read; the one after the stage's last layer ends the forward and returns that layer's output), the stage's
first layer is given the activation received from the previous stage (:class:`_Receiver`), and a stage without the
embedding passes zeros as ``inputs_embeds`` of the right shape.

``model(**batch)`` on the pipelined model runs the whole schedule, forward and backward, over the batch's
micro-batches and returns the step's loss on every rank of the pipeline: the micro-batches' summed token losses
divided by the batch's labelled tokens, which is one process's loss of the whole batch, so a ``training_step``
returning ``model(**batch).loss`` is unchanged. Under ``torch.no_grad()`` or inference mode (Lightning's validation,
test and predict) a forward-only schedule runs; the module's ``.training`` flag decides nothing (a model loaded with
``from_pretrained`` is in eval mode and trains so, dropout off, as on one process).

The loss's ``backward()`` does one thing: Lightning zeroes the gradients between ``training_step`` and the backward
of its loss, so the gradients the schedule computed are taken off the parameters when it ends and given back (added to
``.grad``, times the loss's incoming gradient) by that backward; gradients the parameters held before the call are
set aside during it and put back after. ``model(...)`` takes ``input_ids``, ``labels``, ``attention_mask``,
``position_ids`` and ``use_cache`` only.

May import: ``compat``, ``layout``, ``patches``, ``plans``, ``parallel.hooks``, ``parallel.router_loss``.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_tp.compat import forward_only_actions
from lightning_tp.parallel.hooks import RUNS_NO_PARAMETERS_ATTR
from lightning_tp.parallel.router_loss import (
    PipelinedRouterLoss,
    RouterTotals,
    last_stage_router_loss,
    pipelined_router_loss,
    router_statistics,
)
from lightning_tp.patches import install

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The attribute that holds a pipelined model's :class:`PipelineRunner`.
RUNNER_ATTR = "_lightning_tp_pipeline"
#: The router statistics of the runner's call, set around its schedule where the model adds a router loss and
#: computes its own loss (read by the last stage).
_ROUTER_TOTALS: ContextVar[RouterTotals | None] = ContextVar("lightning_tp_router_totals", default=None)

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

#: The sets of stages (with their schedule) a pipelined model keeps, the most recently used: one per batch shape and
#: mode (training, evaluation), since torch's stages fix their receive buffers' shapes at their first step. A new
#: shape beyond them rebuilds (measured: its first step 1.2x a steady one, benchmarks/pipeline.py --rebuild) and
#: frees the least recently used set, whose buffers (``micro-batches x 2 x length x hidden`` per stage: about 1 GiB
#: for a 70B model at 4,096 tokens and 8 micro-batches in bf16) would otherwise stay for the rest of the run.
KEPT_SHAPES = 4

#: Keyword arguments of ``model(...)`` a pipelined model takes: split by micro-batch and given to every stage.
_BATCH_KWARGS = ("attention_mask", "position_ids")
#: Keyword arguments given to every stage's model forward as they are: ``use_cache`` decides whether packed documents
#: are told apart, as on one process (Transformers does only in a forward that makes no cache).
_PLAIN_KWARGS = ("use_cache",)
#: What the runner gives every stage besides them, split by micro-batch as well: the micro-batch's token ids (a stage
#: after the first sizes the model's inputs by the whole sequence, which it receives cut by sequence or context
#: parallelism), its labels and the batch's labelled tokens, one copy per row (the last stage's model computes the
#: loss).
_TOKENS, _LABELS, _ITEMS = "stage_input_ids", "labels", "num_items_in_batch"


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
        return (
            f"{type(model).__name__} has no `config.base_model_pp_plan` (Transformers' split of a causal LM into "
            "embeddings, decoder layers and norm) and its base model is not one embedding, one list of decoder layers "
            "and one final norm, so there are no stages to cut it into. Use pp_size=1"
        )
    base_name = base_model_name(model)
    base = getattr(model, base_name)
    if not isinstance(getattr(base, parts[1], None), nn.ModuleList):
        return (
            f"{type(model).__name__}'s pipeline plan names {list(parts)}, whose second entry is not a list of decoder "
            "layers. Use pp_size=1"
        )
    others = [
        name for name, child in base.named_children() if name not in parts and any(True for _ in child.parameters())
    ]
    if others:
        return (
            f"{type(model).__name__}.{base_name} holds parameters outside its pipeline plan ({others}), which no "
            "stage would compute. Use pp_size=1"
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


# ---------------------------------------------------------------------------------------------------------------------
# Keeping a rank's stages


def keep_stages(model: nn.Module, plan: PipelinePlan, stages: Sequence[int]) -> None:
    """Set every module that none of ``stages`` holds to ``None`` in its parent, so this rank keeps (and later
    shards, materialises and saves) only its stages' modules, under their own names."""
    held = {name for stage in stages for name in plan.modules_of(stage)}
    everything = {n for s in range(plan.num_stages) for n in plan.modules_of(s)}
    for name in sorted(everything - held):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, None)  # keeps the slot (and the other layers' indices), unlike `del`


class _StageDone(Exception):  # noqa: N818 (control flow, not an error)
    """Raised by the stand-in after a stage's last layer: carries that layer's output out of the model's forward."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def plain_attributes(layer: nn.Module) -> dict[str, Any]:
    """What the model's forward may read of a decoder layer besides calling it (Nemotron-H's loop reads
    ``layer.block_type``): its public attributes of plain types, kept for the layers a rank does not hold."""
    plain = (str, int, float, bool, type(None))
    return {k: v for k, v in vars(layer).items() if not k.startswith("_") and isinstance(v, plain)}


class _Placeholder:
    """What a layer before the stage's first one returns: the loop around the layers may take it as the hidden states,
    index it (``outputs[0]``) or unpack it (``hidden, weights = layer(...)``); it reaches no computation, since the
    stage's first layer takes the received activation instead (see :class:`_Receiver`)."""

    def __getitem__(self, index: int) -> Any:
        return self if index == 0 else None

    def __iter__(self) -> Any:
        return iter((self, None))


class _StandIn(nn.Module):
    """A layer this stage does not hold, for one call, with its plain attributes: before the stage's layers it returns
    a :class:`_Placeholder`; the one after them (``stop``) takes its input as the stage's output and ends the forward
    (:class:`_StageDone`), or where the model's own outputs are needed (``last``: the stage's last layer, recording
    its output) it and the later ones return what that layer returned, and the forward runs to its end.

    ``layer``: the layer it stands for where this rank holds it (another of its stages), never called: kept in the
    model's tree during the call, which then holds each of the rank's modules once, as outside it (Transformers
    installs its output-recording hooks, the routers' logits among them, by walking the tree at the first call that
    records)."""

    def __init__(
        self, attributes: dict[str, Any], *, stop: bool, last: _Receiver | None = None, layer: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.__dict__.update(attributes)
        self.stop, self.stood_for = stop, layer
        self.__dict__["last"] = last  # not a child: the layer is in the tree where it runs
        self.output: torch.Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stop:
            hidden = args[0] if args else kwargs["hidden_states"]
            if self.last is None:
                raise _StageDone(hidden)
            self.output = hidden
        if self.last is not None:
            return self.last.output
        return _Placeholder()


class _Skipped(nn.Module):
    """The final norm, for one call of a stage before the last that runs the model's forward to its end: its input
    unchanged. Holds the norm where this rank holds it (see :class:`_StandIn`'s ``layer``)."""

    def __init__(self, norm: nn.Module | None) -> None:
        super().__init__()
        self.stood_for = norm

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _Receiver(nn.Module):
    """The stage's first layer, for one call, given the activation received from the previous stage as its hidden
    states (``received``; ``None``: its own input); it returns what the layer returns, to the model's own loop
    (whatever form that takes), and keeps it (``output``)."""

    def __init__(self, layer: nn.Module, received: torch.Tensor | None) -> None:
        super().__init__()
        self.layer, self.received = layer, received
        self.output: Any = None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.layer, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.received is not None and args:
            args = (self.received, *args[1:])
        elif self.received is not None:
            kwargs = {**kwargs, "hidden_states": self.received}
        self.output = self.layer(*args, **kwargs)
        return self.output


class PipelineStageModule(nn.Module):
    """One stage of a pipelined model, the module torch's ``PipelineStage`` runs: ``forward(x, **batch_kwargs)``
    takes the stage's input (the micro-batch's ``input_ids`` on the first stage, the previous stage's activation on the
    others) and returns the next stage's input, or on the last stage the micro-batch's share of the loss as the
    model's forward computes it from ``labels`` (its loss function, with what sequence, context and loss parallelism
    installed there), or the logits without labels (a custom pipeline loss). Its parameters are the stage's own
    (registered here too, for FSDP2 and torch's stage); the model keeps them under their own names."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage: int) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not a child: the model's names stay its own
        self.stage, self.plan = stage, plan
        self.is_first, self.is_last = stage == 0, stage == plan.num_stages - 1
        self.parts = nn.ModuleDict(
            {name.replace(".", "__"): model.get_submodule(name) for name in plan.modules_of(stage)}
        )
        # Read while the model holds every layer (before `keep_stages`): the stand-ins of the others carry them.
        self.layer_attributes = [plain_attributes(layer) for layer in model.get_submodule(plan.layer_list)]

    def forward(self, x: torch.Tensor, *received: torch.Tensor, **kwargs: Any) -> Any:
        """``received``: the earlier stages' router statistics of the micro-batch, where the model adds a router loss
        (:attr:`PipelinePlan.router`); a stage before the last then returns its activation and the statistics with
        its own layers' added."""
        model, plan = self.model, self.plan
        tokens = kwargs.pop(_TOKENS, None)
        labels = kwargs.pop(_LABELS, None)
        items = kwargs.pop(_ITEMS, None)
        router_stats = received[0] if received else None
        # The routers' logits are an output of the model's forward: a stage before the last that adds them to the
        # statistics runs the forward to its end (the norm skipped), not stopping after its last layer.
        collect = plan.router is not None and not self.is_last
        layers = model.get_submodule(plan.layer_list)
        held = plan.layers[self.stage]
        # The layer list's slots (`None` for the layers other ranks hold), replaced for the call and put back after.
        saved = [layers[index] for index in range(len(layers))]
        receivers = {held.start: _Receiver(saved[held.start], x)} if not self.is_first else {}
        if collect:
            receivers.setdefault(held.stop - 1, _Receiver(saved[held.stop - 1], None))
        last = receivers[held.stop - 1] if collect else None
        stop = None
        for index in range(len(saved)):
            if index in receivers:
                layers[index] = receivers[index]
            elif index not in held:
                after = last if index >= held.stop else None
                attributes = self.layer_attributes[index]
                stand_in = _StandIn(attributes, stop=index == held.stop, last=after, layer=saved[index])
                stop = stand_in if index == held.stop else stop
                layers[index] = stand_in
        norm_parent, _, norm_name = plan.norm.rpartition(".")
        norm_owner = model.get_submodule(norm_parent) if collect else None
        norm = getattr(norm_owner, norm_name) if collect else None
        if collect:
            setattr(norm_owner, norm_name, _Skipped(norm))
        if self.is_first:
            inputs = {"input_ids": x}
        else:
            # Stand-in embeddings of the whole sequence (the received activation replaces them at the first layer):
            # the model computes masks and positions from them, and cuts them as it cut the first stage's.
            shape = x.shape if tokens is None else (*tokens.shape[:2], *x.shape[2:])
            inputs = {"inputs_embeds": torch.zeros(shape, dtype=x.dtype, device=x.device)}
        try:
            if self.is_last:
                # The causal LM's own forward (its class's: the instance's runs the pipeline) gives the logits, and
                # the loss, as one process computes them (scaling, soft-capping, the loss function's wrappers).
                if labels is None:  # a custom pipeline loss (refused where the model adds a router loss)
                    return type(model).forward(model, **inputs, **kwargs).logits
                loss_kwargs = {_LABELS: labels, _ITEMS: items[0] if items is not None else None}
                with self._router_loss(router_stats, labels):
                    # One element, not a scalar: torch's evaluation concatenates the micro-batches' outputs.
                    return type(model).forward(model, **inputs, **kwargs, **loss_kwargs).loss.reshape(1)
            base = model.get_submodule(plan.layer_list.rpartition(".")[0])
            outputs = base(**inputs, **kwargs)
        except _StageDone as done:
            return done.hidden
        finally:
            for index, layer in enumerate(saved):
                layers[index] = layer
            if collect:
                setattr(norm_owner, norm_name, norm)
        assert collect and stop is not None and plan.router is not None, f"stage {self.stage} ran past its last layer"
        hidden = stop.output
        assert hidden is not None, f"stage {self.stage}'s forward did not reach the layer after its last"
        router = plan.router
        mask = kwargs.get("attention_mask")
        stats = router_statistics(
            tuple(outputs.router_logits or ()), router.num_experts, router.top_k, mask, device=hidden.device
        )
        return hidden, stats if router_stats is None else stats + router_stats

    def _router_loss(self, received: torch.Tensor | None, labels: torch.Tensor) -> AbstractContextManager[None]:
        """Around the last stage's model forward: the router loss it adds is the whole batch's (see
        :class:`~lightning_tp.parallel.router_loss.RouterTotals`). The micro-batch is told by where its labels start
        in the batch's (torch cuts the batch into views; its shape inference's copy of the first micro-batch's labels
        shares their memory), which needs no read of the device. The runner put the labels on the stage's device
        already, so FSDP2's root, which moves a stage's inputs there, hands on the same views."""
        if self.plan.router is None:
            return nullcontext()
        totals = _ROUTER_TOTALS.get()
        assert totals is not None, "the last stage of a router loss run outside its runner's call"
        return last_stage_router_loss(self.model, received, totals, microbatch=labels.data_ptr())


# ---------------------------------------------------------------------------------------------------------------------
# Running the schedule inside `model(...)`


class PipelineOutput:
    """What a pipelined model returns: ``loss``, the same on every rank. The logits and other outputs exist only on
    the last stage, inside the schedule: reading them raises."""

    def __init__(self, loss: torch.Tensor | None) -> None:
        self.loss = loss

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"A pipelined model's output has no `{name}`: with pp_size > 1 the logits exist only on the last stage, "
            "inside the schedule, and `model(...)` returns the step's `loss` only. Compute what needs them in a "
            "pipeline loss (`lightning_tp.set_pipeline_loss(model, fn)`: fn(logits, labels, num_items) on the last "
            "stage), or export the model and run it with pp_size=1."
        )


#: ``fn(logits, labels, *, num_items_in_batch)`` -> the micro-batch's share of the step's loss.
PipelineLoss = Callable[..., torch.Tensor]


def set_pipeline_loss(model: nn.Module, loss: PipelineLoss | None) -> None:
    """Replace the loss a pipelined ``model`` computes on its last stage: ``loss(logits, labels, *,
    num_items_in_batch)`` for one micro-batch, where ``num_items_in_batch`` is the number of labelled tokens in the
    whole batch (the micro-batches' results are summed, so return a sum divided by it for a mean over the batch).
    ``None`` restores the model's own loss (``model.loss_function``)."""
    runner = getattr(model, RUNNER_ATTR, None)
    if runner is None:
        raise ValueError(
            f"{type(model).__name__} is not pipelined: `set_pipeline_loss` applies to models parallelised with "
            "pp_size > 1 (call it after the strategy's setup, e.g. in `on_fit_start`)."
        )
    if loss is not None and runner.custom_loss_refusal is not None:
        raise ValueError(
            f"`set_pipeline_loss` gives the loss the whole micro-batch's logits, but {runner.custom_loss_refusal}. "
            "Use the model's own loss (its `loss_function`, which those wrap), or drop that parallelism."
        )
    runner.custom_loss = loss


class PipelineRunner:
    """Builds the stages and schedules of one pipelined model (once per micro-batch shape and mode: torch's stages
    fix their buffers' shapes at the first step) and runs them."""

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        *,
        pp_mesh: DeviceMesh,
        device: torch.device,
        stages: list[nn.Module],
        tied: TiedAcrossStages | None = None,
        custom_loss_refusal: str | None = None,
        dp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.model, self.plan, self.pp_mesh, self.device = model, plan, pp_mesh, device
        #: The data-parallel ranks whose tokens a router loss covers with this rank's (``None``: this rank's alone).
        self.dp_mesh = dp_mesh
        #: Why a custom pipeline loss cannot be given the logits (the end of a sentence), or ``None``.
        self.custom_loss_refusal = custom_loss_refusal
        self.stage_modules = stages
        self.custom_loss: PipelineLoss | None = None
        self._num_items: torch.Tensor | None = None
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()  # the most recently used last
        self._to_stash: dict[nn.Parameter, torch.Tensor] | None = None
        self._held: dict[nn.Parameter, torch.Tensor] = {}
        self.tied = tied
        if tied is not None:
            _TIED_RUNNERS.add(self)

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """torch's ``loss_fn``: the last stage's output is the loss its model computed, or the logits for a custom
        pipeline loss."""
        if self.custom_loss is not None:
            return self.custom_loss(output, labels, num_items_in_batch=self._num_items)
        return output.sum()  # its one element, as a new tensor (torch's split backward detaches it in place)

    def _schedule(self, key: tuple, *, training: bool) -> Any:
        if key in self._schedules:
            self._schedules.move_to_end(key)
        else:
            from torch.distributed.pipelining import PipelineStage

            while len(self._schedules) >= KEPT_SHAPES:
                self._schedules.popitem(last=False)  # every rank alike: the keys are the batch's shapes and mode

            # A V-shaped schedule evaluates with ZBV's order, forwards only (DualPipeV's overlapped actions pair each
            # forward with a backward; torch runs the backward actions of either in `eval()`).
            name = "ZBVZeroBubble" if self.plan.v_shaped and not training else self.plan.schedule
            cls = schedule_class(name)
            group = self.pp_mesh.get_group()
            stages = [
                PipelineStage(module, module.stage, self.plan.num_stages, self.device, group=group)
                for module in self.stage_modules
            ]
            # The loss is a sum over micro-batches, each divided by the batch's labelled tokens: no scaling after.
            kwargs = dict(n_microbatches=self.plan.microbatches, loss_fn=self._loss, scale_grads=False)
            schedule = cls(stages[0], **kwargs) if is_single_stage_schedule(cls) else cls(stages, **kwargs)
            if self.plan.v_shaped and not training:
                forward_only_actions(schedule)
            self._schedules[key] = schedule
        return self._schedules[key]

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor | None, **kwargs: Any) -> PipelineOutput:
        rows = input_ids.shape[0]
        if rows % self.plan.microbatches:
            raise ValueError(
                f"The batch has {rows} rows, not divisible by pp_microbatches={self.plan.microbatches}: each "
                "micro-batch of the pipeline takes the same number of rows. Use a batch size divisible by it."
            )
        length = input_ids.shape[-1]
        if self.plan.pad_to_multiple_of is not None:
            length = -(-length // self.plan.pad_to_multiple_of) * self.plan.pad_to_multiple_of
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            # Every data-parallel replica runs the same shape, the longest: a replica meeting a new shape alone would
            # build stages, whose shape inference runs a forward through FSDP2's all-gathers that the others do not
            # join. One small all-reduce per step, decided from the layout.
            longest = torch.tensor([length], device=self.device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.dp_mesh.get_group())
            length = int(longest.item())
        if length != input_ids.shape[-1]:
            input_ids, labels, kwargs = pad_batch(
                input_ids,
                labels,
                kwargs,
                length=length,
                pad_token_id=getattr(self.model.config, "pad_token_id", None) or 0,
                with_mask=self.plan.router is not None,
            )
        # Train or evaluate as Lightning does: by the grad mode (validation, test and predict run under `no_grad` or
        # inference mode), the same on every stage, never by `.training` (a model from `from_pretrained` is in eval
        # mode, and Lightning keeps a submodule's mode: it trains in eval mode, dropout off, as on one process).
        training = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        if labels is None:
            raise ValueError(
                "A pipelined model computes its loss on the last stage and returns only that: pass `labels`. For "
                "predictions, export the model (`lightning_tp.export`) and run it with pp_size=1."
            )
        self._num_items = labelled_tokens(labels).to(self.device)
        # Contiguous, so each micro-batch's labels start at their own address (a router loss tells them apart so).
        target = labels.to(self.device).contiguous()
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        input_ids = input_ids.to(self.device)
        kwargs[_TOKENS] = input_ids
        if self.custom_loss is None:  # the last stage's model computes the loss
            kwargs[_LABELS] = target
            kwargs[_ITEMS] = self._num_items.expand(rows)
        described = ((k, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items())
        shapes = (tuple(input_ids.shape), tuple(sorted(described)))
        key = (*shapes, training, torch.is_inference_mode_enabled())
        schedule = self._schedule(key, training=training)
        losses: list[torch.Tensor] = []
        first = any(m.is_first for m in self.stage_modules)
        last = any(m.is_last for m in self.stage_modules)
        args = (input_ids,) if first else ()
        totals = None
        if self.plan.router is not None and self.custom_loss is None and last:
            group = self.dp_mesh.get_group() if self.dp_mesh is not None else None
            size = self.dp_mesh.size() if self.dp_mesh is not None else 1
            totals = RouterTotals(self.plan.router, microbatches=self.plan.microbatches, group=group, size=size)
        token = _ROUTER_TOTALS.set(totals)
        try:
            if training:
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            else:
                with torch.no_grad():
                    schedule.eval(*args, target=target, losses=losses, **kwargs)
        finally:
            _ROUTER_TOTALS.reset(token)
        total = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else None
        value = torch.zeros((), device=self.device) if total is None else total.to(self.device)
        if totals is not None:  # the whole batch's router loss, counted once (each micro-batch's added nothing)
            value = value + totals.loss().to(value.device)
        # The loss lives on the last stage: every rank of the pipeline gets it (a sum, the others adding zeros).
        dist.all_reduce(value, group=self.pp_mesh.get_group())
        if not training:
            return PipelineOutput(value)
        self._to_stash = stash = {}
        return PipelineOutput(_StashedGradients.apply(value.requires_grad_(True), stash))

    def tied_parameter(self) -> nn.Parameter | None:
        """This rank's copy of an embedding tied to the head across stages: the first stage's embedding weight, or
        the last stage's head weight; ``None`` on the other ranks, or where one rank holds both stages (one tensor)."""
        tied = self.tied
        if tied is None:
            return None
        rank = self.pp_mesh.get_local_rank()
        if rank == tied.first_rank:
            return self.model.get_submodule(tied.embedding).weight
        if rank == tied.last_rank:
            return self.model.get_submodule(tied.head).weight
        return None

    def _exchange(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` sent to the other holder of the tied weight, and its copy received (point to point: the ranks
        between them take no part), on ``local``'s device. Through the pipeline's device: under FSDP2's CPU offload
        the shards and their gradients live in host memory, and NCCL sends device tensors only."""
        tied, group = self.tied, self.pp_mesh.get_group()
        assert tied is not None
        mine = self.pp_mesh.get_local_rank()
        other = dist.get_global_rank(group, tied.last_rank if mine == tied.first_rank else tied.first_rank)
        sent = local.detach().to(self.device).contiguous()
        received = torch.empty_like(sent)
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, sent, other, group), dist.P2POp(dist.irecv, received, other, group)]
        ):
            work.wait()
        return received.to(local.device)

    def sync_tied_weights(self) -> None:
        """The last stage's copy of the tied weight takes the first stage's values (once the weights are
        materialised and sharded: a meta-built model's two copies were initialised apart)."""
        tied = self.tied_parameter()
        if tied is None:
            return
        local = _local(tied.data)
        received = self._exchange(local)
        if self.pp_mesh.get_local_rank() == self.tied.last_rank:
            with torch.no_grad():
                local.copy_(received)

    def _stage_parameters(self) -> list[nn.Parameter]:
        """This rank's stages' parameters, each once (a V placement's first and last stage share a tied weight)."""
        unique: dict[int, nn.Parameter] = {}
        for module in self.stage_modules:
            for param in module.parameters():
                unique.setdefault(id(param), param)
        return list(unique.values())

    def hold_gradients(self) -> None:
        """Take the gradients the parameters hold already (an earlier micro-batch's of an accumulation, or a step's
        that Lightning has not zeroed yet) off them before the schedule runs, so that it computes this call's alone.
        A forward pre-hook of the model, before this package's other hooks (see :meth:`stash_gradients`)."""
        self._held = {}
        for param in self._stage_parameters():
            if param.grad is not None:
                self._held[param], param.grad = param.grad, None

    def stash_gradients(self) -> None:
        """Move the gradients the schedule computed into the stash of the loss it returned, and give the parameters
        back those :meth:`hold_gradients` took: Lightning zeroes the gradients between ``training_step`` and the
        backward of its loss, and that backward adds the stash to them. A forward hook of the model, run once its
        call has ended: during it, hooks of this package may show the layers views of their parameters (see
        ``run_on_parameter_views``), not the parameters."""
        stash, self._to_stash = self._to_stash, None
        held, self._held = self._held, {}
        tied = self.tied_parameter()
        if stash is not None and tied is not None and tied.requires_grad:
            # The embedding's gradient from the first stage and the head's from the last, summed on both: one
            # process's gradient of the one tensor (Megatron's embedding group). Here, once the parameters are the
            # layers' again (during the call the layers may read views of them).
            with torch.no_grad():
                grad = tied.grad if tied.grad is not None else torch.zeros_like(tied)
                local = _local(grad)
                local += self._exchange(local)
                tied.grad = grad
        for param in self._stage_parameters():
            if stash is not None and param.grad is not None:
                stash[param] = param.grad
            param.grad = held.get(param, param.grad if stash is None else None)


class _StashedGradients(torch.autograd.Function):
    """The step's loss; its backward adds the gradients the schedule computed (and stashed), times the loss's
    incoming gradient, to the parameters' (``.grad``, as a backward would accumulate them), so that
    ``loss.backward()`` behaves as without a pipeline: after Lightning's ``zero_grad``, under gradient accumulation,
    in ``manual_backward``."""

    @staticmethod
    def forward(ctx, loss, stash):  # type: ignore[override]
        ctx.stash = stash
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        stash, ctx.stash = ctx.stash, {}
        with torch.no_grad():
            for param, value in stash.items():
                # The loss may have been scaled on its way (Lightning divides it by `accumulate_grad_batches`). The
                # gradient is where the parameter is (host memory under CPU offload), the loss on the device.
                scaled = value if bool(grad == 1) else value * grad.to(device=value.device, dtype=value.dtype)
                param.grad = scaled if param.grad is None else param.grad + scaled
        return None, None


@dataclass(frozen=True)
class TiedAcrossStages:
    """An input embedding tied to the output head (``tie_word_embeddings``) whose stages two ranks of the pipeline hold:
    each keeps a copy (the first stage's embedding, the last stage's head), and the two stay equal (their gradients
    summed after each step's backward, their values synchronised once at setup)."""

    embedding: str  # the input embedding's path in the model
    head: str  # the output head's path in the model
    first_rank: int  # the pipeline rank holding the first stage
    last_rank: int  # the pipeline rank holding the last stage


#: The runners of pipelines whose last stage holds a copy of a weight tied across stages (held weakly; a parameter
#: cannot be: `Module.to` swaps a parameter's tensor, which a weak reference to it forbids).
_TIED_RUNNERS: weakref.WeakSet[PipelineRunner] = weakref.WeakSet()


def counted_on_another_stage(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is the last stage's copy of a weight tied across stages, whose gradient the first
    stage's copy holds as well (a norm over the pipeline counts it once). Found through the runners, at the call: the
    copy is whatever parameter the head holds now (sharding replaces it)."""
    return any(
        runner.tied is not None
        and runner.pp_mesh.get_local_rank() == runner.tied.last_rank
        and runner.tied_parameter() is parameter
        for runner in list(_TIED_RUNNERS)
    )


def tied_head(model: nn.Module, plan: PipelinePlan) -> str | None:
    """The path of ``model``'s output head whose weight is its input embedding's (``tie_word_embeddings``), read while
    it holds every module; ``None`` if untied."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None
    embedding = model.get_submodule(plan.embedding)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is not getattr(embedding, "weight", None):
        return None
    return next(name for name, module in model.named_modules() if module is head)


def tied_across_stages(model: nn.Module, plan: PipelinePlan, *, pp_size: int) -> TiedAcrossStages | None:
    """The embedding tied to the head of ``model`` (read while it holds every module), if the first and last stages
    are on two ranks; ``None`` otherwise."""
    head_path = tied_head(model, plan)
    if head_path is None:
        return None
    owners = generate_owners(pp_size, plan.num_stages, v_shaped=plan.v_shaped)
    first, last = owners[0], owners[plan.num_stages - 1]
    if first == last:
        return None
    return TiedAcrossStages(plan.embedding, head_path, first, last)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def pad_batch(
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    kwargs: dict[str, Any],
    *,
    length: int,
    pad_token_id: int,
    with_mask: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """The batch padded at the end to ``length`` (``pp_pad_to_multiple_of``; the longest of the data-parallel
    replicas' under pp): input ids with ``pad_token_id``, labels with -100, a 2-D attention mask with zeros,
    position ids counting on. A causal model's real tokens never attend to later positions, and ignored labels add
    nothing to the loss or to the labelled tokens it is divided by: the loss is the unpadded batch's. ``with_mask``:
    give the padding an attention mask (ones on the real tokens) where the batch has none, so that a router's
    statistics leave it out.

    Raises:
        ValueError: an attention mask that is not ``(rows, length)``.
    """
    extra = length - input_ids.shape[-1]
    assert extra >= 0, f"padding a batch of length {input_ids.shape[-1]} to {length}"
    if not extra:
        return input_ids, labels, kwargs
    kwargs = dict(kwargs)
    mask = kwargs.get("attention_mask")
    if mask is None and with_mask:
        mask = torch.ones_like(input_ids)
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError(
                f"`pp_pad_to_multiple_of` pads a (rows, length) attention mask; got one of shape {tuple(mask.shape)}. "
                "Pad the batch yourself, or drop pp_pad_to_multiple_of."
            )
        kwargs["attention_mask"] = F.pad(mask, (0, extra), value=0)
    positions = kwargs.get("position_ids")
    if positions is not None:
        steps = torch.arange(1, extra + 1, device=positions.device, dtype=positions.dtype)
        kwargs["position_ids"] = torch.cat([positions, positions[..., -1:] + steps], dim=-1)
    input_ids = F.pad(input_ids, (0, extra), value=pad_token_id)
    if labels is not None:
        labels = F.pad(labels, (0, extra), value=-100)
    return input_ids, labels, kwargs


def labelled_tokens(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """The tokens a causal LM's loss counts in ``labels``: those whose next-token label is not ``ignore_index``
    (Transformers' ``ForCausalLMLoss`` shifts the labels by one)."""
    return (labels[..., 1:] != ignore_index).sum()


def pipelined_forward(runner: PipelineRunner) -> Callable[..., PipelineOutput]:
    """The forward a pipelined model gets: ``model(input_ids=..., labels=..., attention_mask=..., position_ids=...)``
    runs the schedule."""

    def forward(input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        taken = (*_BATCH_KWARGS, *_PLAIN_KWARGS)
        other = sorted(k for k, v in kwargs.items() if k not in taken and v is not None)
        if input_ids is None or other:
            given = other if input_ids is not None else ["input_ids (missing)", *other]
            raise ValueError(
                f"A pipelined model takes `input_ids`, `labels` and {', '.join(taken)}; got {given}. Pass those only, "
                "or use pp_size=1."
            )
        batch = {k: v for k, v in kwargs.items() if v is not None}
        return runner.run(input_ids, labels, **batch)

    return forward


def install_pipeline(
    model: nn.Module,
    plan: PipelinePlan,
    *,
    pp_mesh: DeviceMesh,
    device: torch.device,
    custom_loss_refusal: str | None = None,
    dp_mesh: DeviceMesh | None = None,
) -> list[PipelineStageModule]:
    """Keep this rank's stages of ``model`` and make ``model(...)`` run the schedule; returns the stage modules
    (FSDP2 roots of their own under data parallelism). ``custom_loss_refusal``: why :func:`set_pipeline_loss` is
    refused for it (the end of a sentence), if it is. ``dp_mesh``: the data-parallel ranks whose tokens a router loss
    covers with this rank's."""
    if plan.router is not None and custom_loss_refusal is None:
        custom_loss_refusal = (
            "the model's loss adds its routers' load-balancing loss over the whole batch, which a loss of the logits "
            "would drop (set `config.output_router_logits=False` to train without it)"
        )
    stages = plan.stages_of(pp_mesh.get_local_rank(), pp_mesh.size())
    modules = [PipelineStageModule(model, plan, stage) for stage in stages]
    tied = tied_across_stages(model, plan, pp_size=pp_mesh.size())  # while the model holds both ends
    keep_stages(model, plan, stages)
    runner = PipelineRunner(
        model,
        plan,
        pp_mesh=pp_mesh,
        device=device,
        stages=modules,
        tied=tied,
        custom_loss_refusal=custom_loss_refusal,
        dp_mesh=dp_mesh,
    )
    setattr(model, RUNNER_ATTR, runner)
    setattr(model, RUNS_NO_PARAMETERS_ATTR, True)  # its call runs the schedule; the stages call the modules
    # The instance's forward: `training_step`'s `model(**batch)` runs the pipeline; the stages call the class's. A
    # replacement, not hooks: the model's own forward must not run on a rank that holds only its stages.
    install(model, "forward", pipelined_forward(runner), owner=model)
    # The pre-hook runs before the parameter-view hooks later stages register; the hook after the call runs once their
    # restore has run, since `run_on_parameter_views` prepends it (see `hold_gradients`, `stash_gradients`).
    model.register_forward_pre_hook(lambda *_: runner.hold_gradients())
    model.register_forward_hook(lambda *_: runner.stash_gradients(), always_call=True)
    refuse_generate(model)
    return modules


def other_stages_modules(root: nn.Module) -> tuple[str, ...]:
    """The paths (in ``root``) of the modules that other ranks of this rank's pipelines hold: a checkpoint of the whole
    model holds their weights, which this rank neither has nor loads."""
    paths = []
    for path, module in root.named_modules():
        runner = getattr(module, RUNNER_ATTR, None)
        if runner is None:
            continue
        held = {name for stage in runner.stage_modules for name in runner.plan.modules_of(stage.stage)}
        every = {name for stage in range(runner.plan.num_stages) for name in runner.plan.modules_of(stage)}
        paths += [f"{path}.{name}" if path else name for name in sorted(every - held)]
    return tuple(paths)


def pipeline_runner(module: nn.Module) -> PipelineRunner | None:
    """The runner of the pipelined Transformers model in ``module`` (the model itself, or a PEFT model around it)."""
    for inner in module.modules():
        runner = getattr(inner, RUNNER_ATTR, None)
        if runner is not None:
            return runner
    return None


def gather_stages(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Under pipeline parallelism, every stage's entries of ``state`` (each rank's whole tensors of its own stages),
    merged on the first rank of each pipeline (rank 0 among them), ``{}`` on the others; without it, ``state``. Every
    rank must call it.

    Streamed: the ranks first share what they hold (names, shapes, dtypes: plain values), then each tensor goes to the
    first rank point to point, one at a time, through the pipeline's device (NCCL sends device tensors), and lands on
    its CPU. A tensor held under several names (a tied weight) is sent once and kept as one object."""
    runner = pipeline_runner(module)
    if runner is None:
        return state
    # Ranks in the group's own numbering, in which the sends below address the first rank.
    group = runner.pp_mesh.get_group()
    mine, size = dist.get_rank(group), dist.get_world_size(group)
    names: dict[int, list[str]] = {}
    for name, value in state.items():
        assert isinstance(value, torch.Tensor), f"gather_stages of a non-tensor entry {name!r}"
        names.setdefault(id(value), []).append(name)
    listing = [
        (keys, tuple(state[keys[0]].shape), str(state[keys[0]].dtype).removeprefix("torch.")) for keys in names.values()
    ]
    listings: list[Any] = [None] * size
    dist.all_gather_object(listings, listing, group=group)
    merged = dict(state) if mine == 0 else {}
    first = dist.get_global_rank(group, 0)
    for rank in range(1, size):
        if mine not in (0, rank):
            continue
        for keys, shape, dtype in listings[rank]:
            if mine == rank:
                dist.send(state[keys[0]].detach().to(runner.device).contiguous(), dst=first, group=group)
                continue
            received = torch.empty(shape, dtype=getattr(torch, dtype), device=runner.device)
            dist.recv(received, src=dist.get_global_rank(group, rank), group=group)
            received = received.cpu()
            for key in keys:
                merged[key] = received
    return merged


def modules_and_stages(module: nn.Module) -> list[nn.Module]:
    """``module.modules()`` and the pipeline stage modules of the models in it: the stages (FSDP2 roots under data
    parallelism) are not children of the model they run."""
    found = list(module.modules())
    seen = {id(m) for m in found}
    for inner in list(found):
        runner = getattr(inner, RUNNER_ATTR, None)
        for stage in runner.stage_modules if runner is not None else ():
            found += [m for m in stage.modules() if id(m) not in seen]
            seen |= {id(m) for m in stage.modules()}
    return found


def stage_modules_of(model: nn.Module) -> list[PipelineStageModule]:
    runner = getattr(model, RUNNER_ATTR, None)
    return list(runner.stage_modules) if runner is not None else []


def refuse_generate(model: nn.Module) -> None:
    """``generate`` on a pipelined model raises, saying what to do instead."""

    def generate(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"`generate` is not supported on a pipelined {type(model).__name__} (pp_size > 1): each rank holds only "
            "its stages. Export the model (`lightning_tp.export` or `save_pretrained`) and generate with pp_size=1."
        )

    install(model, "generate", generate, owner=model)


__all__ = [
    "PipelineOutput",
    "PipelinePlan",
    "PipelineStageModule",
    "balanced_split",
    "install_pipeline",
    "gather_stages",
    "labelled_tokens",
    "modules_and_stages",
    "other_stages_modules",
    "pipeline_runner",
    "pipeline_problem",
    "resolve_pipeline_plan",
    "set_pipeline_loss",
    "stage_modules_of",
]
