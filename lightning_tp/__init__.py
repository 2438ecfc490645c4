"""Tensor-parallel training of Hugging Face Transformers models in PyTorch Lightning.

The public surface is this module's ``__all__``, :mod:`lightning_tp.fabric` (the Fabric strategy) and the commands
``python -m lightning_tp.export|inspect|gguf``. The package's layers, lowest first, each importing only those below:
``compat``, ``layout`` and ``options`` (the strategies' arguments, each defined once); ``plans/`` (what to do with a
model); ``parallel/`` (the parallelisms); ``checkpoint/`` (storage); ``runtime/`` (what runs beside training);
``parallel_options`` and ``stages`` (the options, each stage implemented); ``parallelize`` (the order of the stages);
``strategies/`` (Lightning's Trainer and Fabric); ``tools/`` (the commands).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_tp import fabric
from lightning_tp.checkpoint.hf_saves import save_merged
from lightning_tp.checkpoint.loading import from_pretrained, load_sharded
from lightning_tp.checkpoint.stream import stream_weights
from lightning_tp.checkpoint.trust import UntrustedCheckpointError
from lightning_tp.checkpoint.validation import IncompleteCheckpointError
from lightning_tp.layout import ParallelLayout
from lightning_tp.parallel.expert_parallel import expert_load
from lightning_tp.parallel.grad import clip_grad_norm_, grad_norm
from lightning_tp.parallel.loss_parallel import (
    keep_logits_sharded,
    token_entropy,
    token_logprobs,
    vocab_parallel_cross_entropy,
)
from lightning_tp.parallel.pipeline import set_pipeline_loss
from lightning_tp.parallel_options import ParallelOptions
from lightning_tp.parallelize import parallelize
from lightning_tp.runtime.garbage_collection import GarbageCollection
from lightning_tp.runtime.monitor import ExpertLoadMonitor, ThroughputMonitor
from lightning_tp.state import ParallelState, parallel_state
from lightning_tp.strategies.trainer import TensorParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "ExpertLoadMonitor",
    "GarbageCollection",
    "IncompleteCheckpointError",
    "ParallelLayout",
    "ParallelOptions",
    "ParallelState",
    "TensorParallelStrategy",
    "ThroughputMonitor",
    "UntrustedCheckpointError",
    "clip_grad_norm_",
    "set_pipeline_loss",
    "expert_load",
    "from_pretrained",
    "grad_norm",
    "keep_logits_sharded",
    "load_sharded",
    "parallel_state",
    "parallelize",
    "save_merged",
    "stream_weights",
    "token_entropy",
    "token_logprobs",
    "vocab_parallel_cross_entropy",
]

#: Names this module exported before that are internals (the plan's machinery), by where they live now: still
#: importable from here, with a FutureWarning, for one release.
_MOVED = {
    "REFUSED_STYLES": "lightning_tp.plans.styles",
    "SUPPORTED_STYLES": "lightning_tp.plans.styles",
    "ResolvedPlan": "lightning_tp.plans.resolved",
    "resolve_plan": "lightning_tp.plans.resolve",
    "apply_tensor_parallel": "lightning_tp.parallel.tensor_parallel",
}


def __getattr__(name: str) -> object:
    """The names in :data:`_MOVED`, from their modules, with a warning that says where to import them from."""
    if name not in _MOVED:
        raise AttributeError(f"module 'lightning_tp' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(
        f"`lightning_tp.{name}` is internal and no longer part of the public surface; import it from "
        f"`{_MOVED[name]}` (this alias goes in the next release). `lightning_tp.parallelize` and the strategies "
        "resolve and apply plans themselves.",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)


# `Trainer(strategy="tp")` and `--trainer.strategy=tp` in LightningCLI; `Fabric(strategy="tp")`. Two registries, one
# name each: neither overrides the other.
TensorParallelStrategy.register_strategies(StrategyRegistry)
fabric.TensorParallelStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
