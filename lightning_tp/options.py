"""The strategies' constructor arguments, each defined once in :data:`OPTIONS`: name, type, default, which strategies
take it, and what it means.

The constructors of the Trainer's and Fabric's ``TensorParallelStrategy`` keep explicit signatures (LightningCLI and
jsonargparse read them); everything else follows from this table or is checked against it by
tests/unit/test_options.py: both constructors' names, order, types and defaults; their docstrings' ``Args:``
(assembled by :func:`document`); the ``ValueError`` with which Fabric's strategy refuses a Trainer-only argument
(:data:`TRAINER_ONLY`); the defaults of ``StrategyOptions`` and ``ParallelOptions``; the table of docs/arguments.md.
Adding an option: write its :class:`Option` here, then run tests/unit/test_options.py, which names each place that
must agree.

The lowest layer with ``compat`` and ``layout``: imports nothing of the package.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

__all__ = ["DEFAULTS", "OPTIONS", "TRAINER_ONLY", "Option", "document", "options_of"]

_T = TypeVar("_T", bound=type)


@dataclass(frozen=True)
class Option:
    """One constructor argument of the strategies."""

    name: str
    #: The annotation as the constructors write it (compared after parsing, so quotes and spaces do not matter).
    type: str
    default: Any
    #: What it means: the ``Args:`` entry of the strategies' docstrings (reStructuredText, one paragraph).
    doc: str
    #: ``None``: both strategies take it. Otherwise a Trainer-only argument, and why Fabric's strategy refuses it and
    #: what to do there instead (the end of a sentence: "`name` is an argument of the Trainer's ...: <this>. Drop it.").
    trainer_only: str | None = None


OPTIONS: tuple[Option, ...] = (
    Option(
        "tp_size",
        "int | None",
        None,
        "Ranks per tensor-parallel group. ``None`` takes every rank the data-parallel and CP sizes leave. The only "
        "argument that may be passed by position.",
    ),
    Option(
        "tp_plan",
        'Literal["auto"] | dict[str, Any]',
        "auto",
        '``"auto"`` (each Transformers model\'s own plan), or a dict of overrides in ``DistributedConfig.tp_plan`` '
        'form (``{"model.layers.*.mlp.down_proj": "rowwise"}``, paths relative to the Transformers model), or for a '
        "module that is not a Transformers model, a dict of path (relative to the LightningModule, or to the module "
        "given to Fabric) to a style name or a torch ``ParallelStyle``.",
    ),
    Option(
        "dp_shard_size",
        "int | None",
        None,
        "Ranks per FSDP2 shard group. ``None`` takes what ``tp_size`` and ``dp_replicate_size`` leave.",
    ),
    Option(
        "dp_replicate_size",
        "int",
        1,
        "Number of replicas of the FSDP2 groups (HSDP: shard within a group, e.g. a node, and replicate across "
        "groups).",
    ),
    Option(
        "cp_size",
        "int",
        1,
        "Ranks per context-parallel group: each splits every sequence of the rows its ranks all read (axis ``cp``, "
        "between the data-parallel axes and ``tp``; 1/cp of the activations per rank). Attention exchanges keys and "
        "values; ``model(input_ids=..., labels=...).loss`` is the loss of the whole sequence, and the logits and "
        "hidden states of such a forward are this rank's tokens (a forward without labels gathers the logits of the "
        "whole sequence). FSDP2 shards over ``dp_shard x cp``. Attention runs by tiles, skipping what no query sees "
        "(another packed document, keys beyond a window). Text causal LMs; see "
        ":mod:`lightning_tp.parallel.context_parallel`.",
    ),
    Option(
        "cp_comm",
        'Literal["all_gather", "ring"]',
        "all_gather",
        'How context parallelism exchanges keys and values: ``"all_gather"`` (one collective per layer; the '
        'backward reduce-scatters their gradients) or ``"ring"`` (point to point, each rank\'s passed around the '
        "group while the tiles of the ones held compute: one layer never holds the whole sequence's keys and "
        "values, for lengths where they do not fit). Ignored with ``cp_size=1``.",
    ),
    Option(
        "ep_size",
        "int",
        1,
        "Ranks per expert-parallel group (1: none). Each holds ``1/ep`` of every mixture-of-experts layer's experts, "
        "whole, and tokens travel to their experts by all-to-all (the model's own ``ep_plan``; the TP plan leaves the "
        "experts whole). The ranks are borrowed from ``dp_shard x cp x tp``: a multiple of ``tp_size`` that divides "
        "it. FSDP2 shards each rank's experts over the ranks holding the same ones (``dp_shard x cp x tp / ep``). "
        "Dropless, as on one process; see :mod:`lightning_tp.parallel.expert_parallel`.",
    ),
    Option(
        "parallelism_config",
        "Any | None",
        None,
        "An ``accelerate.ParallelismConfig`` to take ``tp_size``, ``dp_shard_size``, ``dp_replicate_size`` and "
        "``cp_size`` from, instead of passing them.",
    ),
    Option(
        "pp_size",
        "int",
        1,
        "Ranks per pipeline (axis ``pp``, outermost): each holds some of the model's stages, cut along its "
        "``base_model_pp_plan`` (the embedding on the first, the norm and head on the last, the decoder layers "
        "balanced by parameters between them). Every rank of a pipeline reads the same rows; ``model(**batch).loss`` "
        "runs the schedule over the batch's micro-batches, backward included, and returns one process's loss of the "
        "batch. Transformers causal LMs, tied embeddings included; with TP, sequence and loss parallelism, FSDP2, "
        "HSDP, ``cp_size`` and ``ep_size`` inside each stage.",
    ),
    Option(
        "pp_schedule",
        "str | None",
        None,
        "torch's pipeline schedule by name: ``1F1B``, ``GPipe``, ``Interleaved1F1B``, ``LoopedBFS``, or the "
        "zero-bubble ``InterleavedZeroBubble``, ``ZBVZeroBubble`` and ``DualPipeV`` (the last two place 2 stages per "
        "rank in a V: rank ``r`` holds stages ``r`` and ``2p - 1 - r``). ``None``: ``1F1B`` with one stage per rank, "
        "``Interleaved1F1B`` with more. A model that adds its routers' load-balancing loss trains with ``GPipe`` or "
        "``LoopedBFS``, which run every forward first (that loss's gradient needs the whole batch's routing).",
    ),
    Option(
        "pp_microbatches",
        "int | None",
        None,
        "Micro-batches each batch is cut into by the pipeline (the batch size must divide by it). ``None``: the "
        "number of stages. More micro-batches, a smaller bubble: ``(p - 1) / (m + p - 1)`` of a step for 1F1B.",
    ),
    Option(
        "pp_stages_per_rank",
        "int",
        1,
        "Stages each pipeline rank holds (``V``): 2 or more for the interleaved schedules, exactly 2 for "
        "``ZBVZeroBubble`` and ``DualPipeV``.",
    ),
    Option(
        "pp_split",
        "list[int] | None",
        None,
        "Decoder layers per stage, in order (``pp_size * pp_stages_per_rank`` numbers adding up to the model's "
        "layers). ``None``: balanced by parameters.",
    ),
    Option(
        "pp_pad_to_multiple_of",
        "int | None",
        None,
        "Pad each batch's sequence length up to a multiple of this before the pipeline runs it (input ids with the "
        "pad token, labels with -100, the attention mask with zeros, position ids counting on): torch's stages fix "
        "their buffers' shapes, so a pipeline builds its stages for each new length, and with dynamic padding fewer "
        "lengths mean fewer rebuilds. The model's own loss is unchanged: the padding comes after every real token of "
        "a causal model and its labels are ignored (a custom pipeline loss sees the padded positions, labelled -100). "
        "``None``: each batch as it comes.",
    ),
    Option(
        "activation_checkpointing",
        "bool",
        False,
        "Recompute each decoder layer's activations in backward (Transformers' own activation checkpointing), "
        "trading compute for memory.",
    ),
    Option(
        "compile",
        "bool | dict[str, Any]",
        False,
        "``torch.compile`` each decoder layer in place, after TP and activation checkpointing, before FSDP2 "
        "(torchtitan's order); parameter names and checkpoints stay the uncompiled model's, so a checkpoint written "
        "compiled resumes uncompiled and back. A dict passes ``torch.compile``'s keyword arguments: "
        '``{"fullgraph": True}`` turns any graph break into an error that names it, ``{"mode": ...}`` picks the '
        "inductor mode.",
    ),
    Option(
        "reshard_after_forward",
        "bool",
        True,
        "FSDP2 frees each block's gathered parameters after its forward (less memory, one more all-gather in "
        "backward).",
    ),
    Option(
        "cpu_offload",
        "bool",
        False,
        "FSDP2 keeps sharded parameters, gradients and optimizer states in CPU memory.",
    ),
    Option(
        "accumulate_grads",
        'Literal["sharded", "unsharded"]',
        "sharded",
        "When gradients accumulate over micro-batches (the Trainer's ``accumulate_grad_batches > 1``, Fabric's "
        "``fabric.no_backward_sync``) with data or context parallelism, what FSDP2 does with the gradients of the "
        'micro-batches before an optimizer step\'s last. ``"sharded"`` (default): it reduce-scatters each '
        "micro-batch's, and every rank keeps only its shard (as Lightning's ``ModelParallelStrategy`` and torchtitan "
        "do), except that under HSDP the all-reduce across replicas waits for the last micro-batch (FSDP2 keeps the "
        'partial sum, in the reduce dtype, on the device). ``"unsharded"``: one reduce-scatter per step, but every '
        "rank keeps each parameter's whole gradient of its TP shard until then, ``4 P / tp`` bytes in fp32 (about "
        "35 GB per GPU for 70B at TP 8), on the GPU even with ``cpu_offload``.",
    ),
    Option(
        "fsdp_blocks",
        "list[str] | None",
        None,
        "Class names of the blocks FSDP2 shards one by one (default: each model's ``_no_split_modules``).",
    ),
    Option(
        "fsdp_param_dtype",
        'Literal["auto", "bf16"] | None',
        "auto",
        '``"auto"`` (default): under ``bf16-mixed`` FSDP2 all-gathers bf16 copies of the fp32 parameters (half the '
        "all-gather bytes) and reduces gradients in fp32 (torchtitan's recipe); every layer then runs on bf16 weights, "
        "and the loss drifts further from fp32 than one device's ``bf16-mixed`` does; other precisions gather their "
        'parameters\' own dtype. ``"bf16"``: the same, asked for (refused with ``32-true``/``16-true``, a warning '
        "where it does nothing). ``None``: FSDP2 gathers parameters in their own dtype, so ``bf16-mixed`` gives the "
        "numerics it gives on one device (autocast over fp32 weights) on every layout, for twice the all-gather "
        "bytes.",
    ),
    Option(
        "tp_grad_reduce_dtype",
        'Literal["fp32"] | None',
        None,
        "``None`` (default): the backward all-reduces of TP sum the activations' gradients in their own dtype (bf16 "
        'where the activations are bf16, as DTensor and Megatron-Core do). ``"fp32"``: 16-bit activation gradients '
        "are summed in fp32 and rounded once (twice the bytes on the backward's critical path); sequence "
        "parallelism's reduce-scatters stay in the activations' dtype.",
    ),
    Option(
        "throughput_monitor",
        "bool",
        True,
        "Add :class:`lightning_tp.ThroughputMonitor` (tokens/s, step time, peak memory, MFU on GPU) to the Trainer's "
        "callbacks when it has none.",
        trainer_only="it adds a Trainer callback; in Fabric, measure in your loop "
        "(lightning.fabric.utilities.throughput.ThroughputMonitor)",
    ),
    Option(
        "eval_weights",
        'Literal["sharded", "gathered"]',
        "sharded",
        'How validation, test and predict hold FSDP2\'s weights. ``"sharded"``: as in training, each layer gathered '
        "for its forward and freed after it, so a rank holds its share; every data-parallel rank must then run as many "
        "batches (Lightning's samplers pad validation and test; an uneven or unsized loader is refused before the "
        'loop, naming each rank\'s count). ``"gathered"``: the whole model (its TP shard) gathered once per loop and '
        "held until it ends, so that ranks may run different numbers of forwards (Lightning's predict sampler, which "
        "does not pad); for models whose TP shard fits a device whole.",
        trainer_only="Fabric has no evaluation loop; its forwards keep the weights sharded",
    ),
    Option(
        "gc_every_n_steps",
        "int | None",
        50,
        "Python's garbage collector runs on every rank at the same step, every this many optimizer steps, with "
        "automatic collection off while training (:class:`lightning_tp.GarbageCollection`): a full collection at a "
        "moment of its own on each rank stalls the others in their next collective. ``None``: Python's automatic "
        "collection.",
        trainer_only="it hooks the Trainer's steps; in Fabric, call `gc.freeze()` and `gc.disable()` before your loop "
        "and `gc.collect(1)` every N steps on every rank",
    ),
    Option(
        "sequence_parallel",
        "bool",
        False,
        "Split the activations between the TP regions (norms, residuals) on the sequence dim: all-gathers and "
        "reduce-scatters instead of all-reduces, 1/tp of their memory. Sequence lengths must be divisible by "
        "``tp_size``. Transformers decoder models with column-/row-wise plans.",
    ),
    Option(
        "loss_parallel",
        "bool",
        False,
        "Keep the ``lm_head`` output sharded on the vocabulary and compute the cross-entropy of "
        "``model(..., labels=...)`` on the shards: no rank holds the full logits. ``outputs.logits`` is then a "
        "DTensor when ``labels`` are passed (``.full_tensor()`` gathers it).",
    ),
    Option(
        "save_distributed_checkpoint",
        "bool",
        True,
        "Each rank writes its shards (``True``, a directory that loads on any layout) or rank 0 writes one full file. "
        "Either way the checkpoint is written under a hidden temporary name and renamed into place once complete.",
    ),
    Option(
        "save_frozen_weights",
        "bool",
        True,
        "Write parameters that do not train (the base model of a LoRA run) into checkpoints. ``False`` keeps "
        "checkpoints to the trained weights; on resume the frozen ones come from where ``configure_model`` loaded "
        "them.",
    ),
    Option(
        "preemption_signals",
        "Sequence[str | int] | None",
        ("SIGTERM", "SIGUSR1"),
        'Signals that announce a preemption (names such as ``"SIGTERM"``). On one, every rank finishes its optimizer '
        'step, all save ``hpc_ckpt_N`` in ``default_root_dir`` (``ckpt_path="hpc"`` resumes from it) and the run ends '
        "with exit code ``128 + signal``; on SLURM the requeue signal also requeues the job. Replaces Lightning's "
        "handlers for these signals. ``None`` turns this off.",
        trainer_only="it saves through the Trainer's loop; in Fabric, handle the signal in your loop and call "
        "`fabric.save`",
    ),
    Option(
        "step_timeout",
        'timedelta | float | Literal["auto"] | None',
        "auto",
        "A rank that makes no training progress (no batch starting or ending, no save) for this long dumps every "
        "thread's stack and exits, so that the launcher ends the job instead of its peers waiting in a collective. "
        '``"auto"``: a step may take 10 times the slowest step so far, at least 45 s, once the first two are behind; '
        "anything else (the first steps, validation, saves, epoch ends) and first-time work (a torch.compile "
        "compilation, the first step of a new batch shape, on this rank or on a peer it may be waiting for) twice "
        "``timeout``. A number: that limit for everything. ``None``: no watchdog.",
        trainer_only="it watches the Trainer's steps; in Fabric, `timeout` bounds every collective",
    ),
    Option(
        "process_group_backend",
        "str | None",
        None,
        '``"nccl"``, ``"gloo"``, ...; ``None`` (default): chosen from the device.',
    ),
    Option(
        "timeout",
        "timedelta | None",
        default_pg_timeout,
        "Timeout of collective operations; it reaches every group of the mesh, not only the world group.",
    ),
)

#: Each argument's default, by name (for the modules that use one outside the constructors).
DEFAULTS: dict[str, Any] = {option.name: option.default for option in OPTIONS}

#: The Trainer-only arguments, each with why Fabric's strategy refuses it and what to do there instead.
TRAINER_ONLY: dict[str, str] = {option.name: option.trainer_only for option in OPTIONS if option.trainer_only}


def options_of(strategy: Literal["trainer", "fabric"]) -> tuple[Option, ...]:
    """The arguments the Trainer's or Fabric's strategy takes, in the order of its constructor."""
    if strategy not in ("trainer", "fabric"):
        raise ValueError(f"`strategy` must be 'trainer' or 'fabric', got {strategy!r}.")
    return tuple(option for option in OPTIONS if strategy == "trainer" or not option.trainer_only)


def document(strategy: Literal["trainer", "fabric"]) -> Callable[[_T], _T]:
    """A class decorator that appends the ``Args:`` of ``strategy``'s arguments to the class docstring (Google style,
    which Sphinx's napoleon and jsonargparse's help read), and for Fabric a sentence naming the Trainer-only ones."""
    options = options_of(strategy)

    def decorate(cls: _T) -> _T:
        if cls.__doc__ is None:  # python -OO
            return cls
        parts = [cls.__doc__.rstrip()]
        if strategy == "fabric":
            names = ", ".join(f"``{name}``" for name in TRAINER_ONLY)
            parts.append(
                textwrap.fill(
                    f"The Trainer strategy's own arguments ({names}) are refused with a ``ValueError`` saying what to "
                    "use instead.",
                    width=120,
                    initial_indent="    ",
                    subsequent_indent="    ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
        entries = [
            textwrap.fill(
                option.doc,
                width=120,
                initial_indent=f"        {option.name}: ",
                subsequent_indent=" " * 12,
                break_long_words=False,
                break_on_hyphens=False,
            )
            for option in options
        ]
        parts.append("    Args:\n" + "\n".join(entries))
        parts.append(
            "    Raises:\n"
            + textwrap.fill(
                "ValueError: an argument of the wrong type or value, or arguments that do not compose (each message "
                "names the arguments and the fix); raised when the strategy is built, or at its setup, on every rank "
                "alike and before any weight moves, for what needs the world size or the model.",
                width=120,
                initial_indent="        ",
                subsequent_indent=" " * 12,
                break_long_words=False,
                break_on_hyphens=False,
            )
        )
        cls.__doc__ = "\n\n".join(parts) + "\n    "
        return cls

    return decorate
