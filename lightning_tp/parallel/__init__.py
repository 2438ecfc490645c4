"""The parallelisms, each applied to a module by one stage of :func:`lightning_tp.parallelize`.

- ``tensor_parallel`` (a resolved plan applied with ``layers``, this package's TP layer for each style name),
  ``blocks`` (head-parallel mixers' packed parameters), ``kv_heads``, ``sequence_parallel``, ``loss_parallel``,
  ``context_parallel`` (with ``blockwise``, attention by tiles, and ``ring``, its point-to-point exchange),
  ``expert_parallel``, ``pipeline`` (stages on the ``pp`` axis), ``fsdp`` (FSDP2 / HSDP on the
  data-parallel axes), ``lora`` (adapters sharded with their base);
- what they share: ``collectives`` (autograd functions), ``hooks``, ``gather`` (whole tensors from shards), ``grad``
  (norms and clipping across meshes), ``rng`` and ``random_init`` (random numbers of sharded tensors),
  ``router_loss`` (the MoE load-balancing loss over the whole batch).

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``plans``.
"""

__all__ = [
    "blocks",
    "blockwise",
    "collectives",
    "context_parallel",
    "cp_attention",
    "cp_checks",
    "cp_split",
    "expert_parallel",
    "fsdp",
    "gather",
    "grad",
    "hooks",
    "kv_heads",
    "layers",
    "lora",
    "loss_parallel",
    "pipeline",
    "pipeline_gather",
    "pipeline_plan",
    "pipeline_stages",
    "pipeline_tied",
    "random_init",
    "ring",
    "rng",
    "router_loss",
    "sequence_parallel",
    "tensor_parallel",
]
