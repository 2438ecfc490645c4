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

This module runs the pipeline. The split plan is in :mod:`lightning_tp.parallel.pipeline_plan`, the stages' modules
and stand-ins in :mod:`~lightning_tp.parallel.pipeline_stages`, a weight tied across stages in
:mod:`~lightning_tp.parallel.pipeline_tied` and the single-file gather in :mod:`~lightning_tp.parallel.pipeline_gather`.

May import: ``compat``, ``layout``, ``patches``, ``plans``, ``parallel.hooks``, ``parallel.router_loss``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_tp.compat import forward_only_actions
from lightning_tp.composition import refusal
from lightning_tp.parallel.hooks import RUNS_NO_PARAMETERS_ATTR
from lightning_tp.parallel.pipeline_plan import PipelinePlan, is_single_stage_schedule, schedule_class
from lightning_tp.parallel.pipeline_stages import (
    ITEMS_KWARG,
    LABELS_KWARG,
    ROUTER_TOTALS,
    TOKENS_KWARG,
    PipelineStageModule,
    keep_stages,
)
from lightning_tp.parallel.pipeline_tied import TiedAcrossStages, tied_across_stages
from lightning_tp.parallel.router_loss import (
    RouterTotals,
)
from lightning_tp.patches import install

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The attribute that holds a pipelined model's :class:`PipelineRunner`.
RUNNER_ATTR = "_lightning_tp_pipeline"

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
    ``None`` restores the model's own loss (``model.loss_function``).

    Args:
        model: a model parallelised with ``pp_size > 1`` (after the strategy's setup, e.g. in ``on_fit_start``).
        loss: ``loss(logits, labels, *, num_items_in_batch)``, or ``None`` for the model's own.

    Raises:
        ValueError: ``model`` is not pipelined, or a parallelism it runs with (context parallelism, the routers'
            load-balancing loss) needs the model's own loss.
    """
    runner = getattr(model, RUNNER_ATTR, None)
    if runner is None:
        raise ValueError(
            f"{type(model).__name__} is not pipelined: `set_pipeline_loss` applies to models parallelised with "
            "pp_size > 1 (call it after the strategy's setup, e.g. in `on_fit_start`)."
        )
    if loss is not None and runner.custom_loss_refusal is not None:
        raise refusal("pp+custom_loss", f"`set_pipeline_loss` with {runner.custom_loss_refusal}")
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
        #: What refuses a custom pipeline loss (rule ``pp+custom_loss``), in words, or ``None``.
        self.custom_loss_refusal = custom_loss_refusal
        self.stage_modules = stages
        self.custom_loss: PipelineLoss | None = None
        self._num_items: torch.Tensor | None = None
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()  # the most recently used last
        self._to_stash: dict[nn.Parameter, torch.Tensor] | None = None
        self._held: dict[nn.Parameter, torch.Tensor] = {}
        self.tied = tied

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
        kwargs[TOKENS_KWARG] = input_ids
        if self.custom_loss is None:  # the last stage's model computes the loss
            kwargs[LABELS_KWARG] = target
            kwargs[ITEMS_KWARG] = self._num_items.expand(rows)
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
        token = ROUTER_TOTALS.set(totals)
        try:
            if training:
                schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            else:
                with torch.no_grad():
                    schedule.eval(*args, target=target, losses=losses, **kwargs)
        finally:
            ROUTER_TOTALS.reset(token)
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
    (FSDP2 roots of their own under data parallelism). ``custom_loss_refusal``: what refuses
    :func:`set_pipeline_loss` for it (rule ``pp+custom_loss``: CP, loss parallelism), in words, if anything does.
    ``dp_mesh``: the data-parallel ranks whose tokens a router loss covers with this rank's."""
    if plan.router is not None and custom_loss_refusal is None:
        custom_loss_refusal = "`output_router_logits=True` (the model adds its routers' load-balancing loss)"
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
    "KEPT_SHAPES",
    "PipelineOutput",
    "PipelineRunner",
    "install_pipeline",
    "labelled_tokens",
    "modules_and_stages",
    "other_stages_modules",
    "pipeline_runner",
    "set_pipeline_loss",
    "stage_modules_of",
]
