"""An input embedding tied to the output head across pipeline stages: the first stage holds the embedding, the last
the head, each rank a copy that stays equal to the other (their gradients summed after each step's backward, their
values synchronised once at setup), and a gradient norm counts it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_tp.parallel.pipeline_plan import PipelinePlan, generate_owners


@dataclass(frozen=True)
class TiedAcrossStages:
    """An input embedding tied to the output head (``tie_word_embeddings``) whose stages two ranks of the pipeline hold:
    each keeps a copy (the first stage's embedding, the last stage's head), and the two stay equal (their gradients
    summed after each step's backward, their values synchronised once at setup)."""

    embedding: str  # the input embedding's path in the model
    head: str  # the output head's path in the model
    first_rank: int  # the pipeline rank holding the first stage
    last_rank: int  # the pipeline rank holding the last stage


def counted_on_another_stage(state: Any | None) -> set[int]:
    """The ids of this rank's parameters that are the last stage's copy of a weight tied across stages, whose
    gradient the first stage's copy holds as well (a norm or a count over the pipeline takes it once): found through
    the pipeline runners of ``state`` (a :class:`lightning_tp.ParallelState`; ``None``: none). Found at the call: the
    copy is whatever parameter the head holds now (sharding replaces it)."""
    runners = state.pipelines if state is not None else ()
    return {
        id(parameter)
        for runner in runners
        if runner.tied is not None
        and runner.pp_mesh.get_local_rank() == runner.tied.last_rank
        and (parameter := runner.tied_parameter()) is not None
    }


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


__all__ = [
    "TiedAcrossStages",
    "counted_on_another_stage",
    "tied_across_stages",
    "tied_head",
]
