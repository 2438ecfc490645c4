"""Tensor-parallel training of Hugging Face Transformers models in PyTorch Lightning.

The public surface is this module's ``__all__``, :mod:`lightning_tp.fabric` (the Fabric strategy) and the commands
``python -m lightning_tp.export|inspect|gguf``. The package's layers, lowest first, each importing only those below:
``compat``, ``layout`` and ``options`` (the strategies' arguments, each defined once); ``plans/`` (what to do with a
model); ``parallel/`` (the parallelisms); ``checkpoint/`` (storage); ``runtime/`` (what runs beside training);
``parallelize`` (the order of the stages); ``strategies/`` (Lightning's Trainer and Fabric); ``tools/`` (the commands).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_tp import compat, fabric
from lightning_tp.checkpoint.hf_saves import save_merged
from lightning_tp.checkpoint.loading import from_pretrained, load_sharded
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
from lightning_tp.parallel.tensor_parallel import apply_tensor_parallel
from lightning_tp.parallelize import ParallelOptions, parallelize
from lightning_tp.plans.resolve import REFUSED_STYLES, SUPPORTED_STYLES, ResolvedPlan, resolve_plan
from lightning_tp.runtime.garbage_collection import GarbageCollection
from lightning_tp.runtime.monitor import ExpertLoadMonitor, ThroughputMonitor
from lightning_tp.strategies.trainer import TensorParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "REFUSED_STYLES",
    "SUPPORTED_STYLES",
    "ExpertLoadMonitor",
    "GarbageCollection",
    "IncompleteCheckpointError",
    "ParallelLayout",
    "ParallelOptions",
    "ResolvedPlan",
    "TensorParallelStrategy",
    "ThroughputMonitor",
    "UntrustedCheckpointError",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "set_pipeline_loss",
    "expert_load",
    "from_pretrained",
    "grad_norm",
    "keep_logits_sharded",
    "load_sharded",
    "parallelize",
    "resolve_plan",
    "save_merged",
    "token_entropy",
    "token_logprobs",
    "vocab_parallel_cross_entropy",
]

compat.quiet_upstream_deprecations()

# `Trainer(strategy="tp")` and `--trainer.strategy=tp` in LightningCLI; `Fabric(strategy="tp")`. Two registries, one
# name each: neither overrides the other.
TensorParallelStrategy.register_strategies(StrategyRegistry)
fabric.TensorParallelStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
