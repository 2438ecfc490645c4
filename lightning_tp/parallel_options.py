"""How to parallelise, apart from the sizes: :class:`ParallelOptions`, each field a strategy argument, checked when
built (a typo fails before any process starts) and against the layout and the device
(:meth:`ParallelOptions.check_layout`, before the process group starts); and the precisions tensor parallelism supports.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``runtime``: every layer below the stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_tp.composition import ignored, refusal
from lightning_tp.layout import ParallelLayout
from lightning_tp.options import OPTIONS
from lightning_tp.parallel.collectives import TP_GRAD_REDUCE_DTYPES
from lightning_tp.parallel.fsdp import BF16_NAMES
from lightning_tp.parallel.pipeline_plan import SPLIT_BACKWARD_SCHEDULES, schedule_class
from lightning_tp.plans.checks import check_style

#: Precisions (Lightning's flags) whose parameters and gradients stay exact under TP, and the dtype the ``-true``
#: ones cast the module to before sharding.
PRECISION_DTYPES: Mapping[str, torch.dtype | None] = MappingProxyType(
    {"32-true": None, "bf16-mixed": None, "bf16-true": torch.bfloat16, "16-true": torch.float16}
)
SUPPORTED_PRECISIONS = tuple(PRECISION_DTYPES)
#: How context parallelism may exchange keys and values (``cp_comm``; see :mod:`lightning_tp.parallel.ring`).
CP_COMMS = ("all_gather", "ring")


#: The pipeline's options besides its size (:data:`lightning_tp.options.OPTIONS`'s ``pp_*``): ignored with pp_size=1.
PIPELINE_OPTIONS = tuple(option for option in OPTIONS if option.name.startswith("pp_") and option.name != "pp_size")


@dataclass(frozen=True)
class ParallelOptions:
    """How to parallelise, apart from the sizes: each field but ``precision`` (the Trainer's or Fabric's flag) is the
    strategies' argument of that name, defined in :data:`lightning_tp.options.OPTIONS` (tests/unit/test_options.py
    checks the defaults agree). Checked when built, so that a typo fails before any process starts.

    Args:
        Each field: the strategies' argument of that name (:data:`lightning_tp.options.OPTIONS` has its meaning).

    Raises:
        ValueError: a field of the wrong type or value (named, with the values it takes).
    """

    tp_plan: Literal["auto"] | Mapping[str, Any] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    compile: bool | Mapping[str, Any] = False
    cp_comm: Literal["all_gather", "ring"] = "all_gather"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp_blocks: tuple[str, ...] | None = None
    fsdp_param_dtype: Literal["auto", "bf16"] | None = "auto"
    tp_grad_reduce_dtype: Literal["fp32"] | None = None
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_stages_per_rank: int = 1
    pp_split: tuple[int, ...] | None = None
    pp_pad_to_multiple_of: int | None = None
    precision: str = "32-true"

    def __post_init__(self) -> None:
        if isinstance(self.tp_plan, Mapping):
            for key, style in self.tp_plan.items():
                check_style(key, style)
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))  # a copy (a proxy would not pickle)
        elif self.tp_plan != "auto":
            raise ValueError(f'`tp_plan` must be "auto" or a dict of module path to style, got {self.tp_plan!r}.')
        if self.fsdp_blocks is not None:
            object.__setattr__(self, "fsdp_blocks", tuple(self.fsdp_blocks) or None)
        if isinstance(self.compile, Mapping):
            object.__setattr__(self, "compile", dict(self.compile))
            check_compile_options(self.compile)
        elif not isinstance(self.compile, bool):
            raise ValueError(
                f"`compile` must be True, False or a dict of `torch.compile` keyword arguments (say "
                f'{{"fullgraph": True}}), got {self.compile!r}.'
            )
        if self.cp_comm not in CP_COMMS:
            raise ValueError(
                f"`cp_comm` must be one of {', '.join(map(repr, CP_COMMS))} (how context parallelism exchanges keys "
                f"and values), got {self.cp_comm!r}."
            )
        if self.pp_split is not None:
            object.__setattr__(self, "pp_split", tuple(self.pp_split))
        if self.pp_schedule is not None:
            schedule_class(self.pp_schedule)  # an unknown name fails here, naming torch's
        if (
            not isinstance(self.pp_stages_per_rank, int)
            or isinstance(self.pp_stages_per_rank, bool)
            or self.pp_stages_per_rank < 1
        ):
            raise ValueError(f"`pp_stages_per_rank` must be a positive integer, got {self.pp_stages_per_rank!r}.")
        if self.fsdp_param_dtype not in (None, "auto", *BF16_NAMES):
            raise ValueError(
                "`fsdp_param_dtype` must be 'auto' (bf16 all-gathers under `bf16-mixed`), 'bf16' (gather bf16 copies, "
                "reduce gradients in fp32) or None (gather parameters in their own dtype), got "
                f"{self.fsdp_param_dtype!r}. fp16 would need loss scaling, which sharded gradients do not have."
            )
        if self.tp_grad_reduce_dtype not in TP_GRAD_REDUCE_DTYPES:
            raise ValueError(
                "`tp_grad_reduce_dtype` must be None (TP sums activation gradients in their own dtype) or 'fp32' (sums "
                f"16-bit ones in fp32), got {self.tp_grad_reduce_dtype!r}."
            )
        if self.precision not in PRECISION_DTYPES:
            raise ValueError(
                f"Tensor parallelism does not support precision={self.precision!r}. Choose one of "
                f"{', '.join(SUPPORTED_PRECISIONS)} (for 16-bit mixed precision use 'bf16-mixed': fp16 loss scaling "
                "is not implemented for sharded gradients)."
            )

    def check_layout(self, layout: ParallelLayout, *, device: torch.device) -> None:
        """What depends on the layout and the device: decided on every rank from the configuration alone, before the
        process group starts."""
        if layout.pp_size > 1:
            split_backward = {name.lower() for name in SPLIT_BACKWARD_SCHEDULES}
            if self.compile is not False and str(self.pp_schedule).lower() in split_backward:
                raise refusal("pp+compile+split_backward", f"`pp_schedule={self.pp_schedule!r}` with `compile`")
        elif given := [o.name for o in PIPELINE_OPTIONS if getattr(self, o.name) != o.default]:
            names = " and ".join(f"`{name}`" for name in given)
            rank_zero_warn(ignored("pp_options_without_pp", f"Each of {names}" if len(given) > 1 else names))
        if layout.cp_size == 1 and self.cp_comm != "all_gather":
            rank_zero_warn(ignored("cp_comm_without_cp", f"`cp_comm={self.cp_comm!r}`"))
        if layout.cp_size > 1 and isinstance(self.compile, Mapping) and self.compile.get("fullgraph"):
            raise refusal("cp+compile+fullgraph", f"`compile={{'fullgraph': True}}` with cp_size={layout.cp_size}")
        if self.cpu_offload and device.type == "cpu":
            raise refusal("cpu_offload+cpu", f"`cpu_offload=True` on device {device!s}")
        if self.cpu_offload and layout.fsdp_size == 1:
            raise refusal("cpu_offload+no_fsdp", f"`cpu_offload=True` with the layout {layout}")
        if self.fsdp_param_dtype in (None, "auto"):  # "auto" applies where it can, silently
            return
        if self.precision in ("32-true", "16-true"):
            raise refusal(
                "fsdp_param_dtype+full_precision",
                f"`fsdp_param_dtype={self.fsdp_param_dtype!r}` with precision={self.precision!r}",
            )
        if self.precision == "bf16-true":
            rank_zero_warn(
                ignored(
                    "fsdp_param_dtype+bf16_true",
                    f"`fsdp_param_dtype={self.fsdp_param_dtype!r}`",
                    context="under `precision='bf16-true'`",
                )
            )
        elif layout.fsdp_size == 1:
            rank_zero_warn(
                ignored(
                    "fsdp_param_dtype+no_fsdp",
                    f"`fsdp_param_dtype={self.fsdp_param_dtype!r}`",
                    context=f"with the layout {layout}, which has no data or context parallelism",
                )
            )


#: ``torch.compile`` arguments ``compile={...}`` may not set: the strategy compiles each layer in place itself.
_COMPILE_OWN_ARGUMENTS = ("model",)


def check_compile_options(options: Mapping[str, Any]) -> None:
    """``compile={...}`` holds ``torch.compile`` keyword arguments only (checked against its signature)."""
    import inspect

    accepted = [name for name in inspect.signature(torch.compile).parameters if name not in _COMPILE_OWN_ARGUMENTS]
    for key in options:
        if key not in accepted:
            raise ValueError(
                f"`compile={{{key!r}: ...}}`: {key!r} is not a `torch.compile` argument here. Use some of "
                f"{', '.join(accepted)}, or `compile=True` for its defaults."
            )


__all__ = ["PRECISION_DTYPES", "SUPPORTED_PRECISIONS", "ParallelOptions"]
