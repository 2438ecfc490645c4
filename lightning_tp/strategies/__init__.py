"""Lightning's entry points, thin: each hook delegates to :func:`lightning_tp.parallelize` and the shared functions.

- ``trainer``: ``TensorParallelStrategy`` for the Trainer; ``fabric``: the same for Fabric;
- ``shared``: what both share beyond the pipeline (options, process groups, metric syncs, clipping);
- ``inference``: evaluation, prediction and ``generate`` whatever each data-parallel rank is given.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``options``, ``plans``, ``parallel``, ``checkpoint``, ``runtime``, ``parallel_options``, ``stages``, ``parallelize``.
"""

__all__ = ["fabric", "inference", "shared", "trainer"]
