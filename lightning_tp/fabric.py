"""``from lightning_tp.fabric import TensorParallelStrategy``: the Fabric strategy, where Lightning users look for it
(``lightning.fabric`` beside ``lightning.pytorch``). The code lives in :mod:`lightning_tp.strategies.fabric`."""

from lightning_tp.strategies.fabric import TensorParallelStrategy

__all__ = ["TensorParallelStrategy"]
