"""Tensor-parallel training of Hugging Face Transformers models in PyTorch Lightning."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_tp import compat, fabric
from lightning_tp.expert_parallel import expert_load
from lightning_tp.garbage_collection import GarbageCollection
from lightning_tp.grad import clip_grad_norm_, grad_norm
from lightning_tp.layout import ParallelLayout
from lightning_tp.loading import from_pretrained, load_sharded
from lightning_tp.lora import save_merged
from lightning_tp.loss_parallel import keep_logits_sharded, token_entropy, token_logprobs, vocab_parallel_cross_entropy
from lightning_tp.monitor import ExpertLoadMonitor, ThroughputMonitor
from lightning_tp.parallelize import ParallelOptions, parallelize
from lightning_tp.plan import REFUSED_STYLES, SUPPORTED_STYLES, ResolvedPlan, resolve_plan
from lightning_tp.strategy import TensorParallelStrategy
from lightning_tp.tensor_parallel import apply_tensor_parallel

__version__ = "0.1.0"

__all__ = [
    "REFUSED_STYLES",
    "SUPPORTED_STYLES",
    "ExpertLoadMonitor",
    "GarbageCollection",
    "ParallelLayout",
    "ParallelOptions",
    "ResolvedPlan",
    "TensorParallelStrategy",
    "ThroughputMonitor",
    "apply_tensor_parallel",
    "clip_grad_norm_",
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
