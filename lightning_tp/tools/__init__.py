"""Command-line tools, run as ``python -m lightning_tp.export|inspect|plan|gguf``:

- ``export``: a checkpoint of this strategy as a standard Transformers directory (adapters merged on request);
- ``inspect``: will this model shard, and what will each rank hold (on the meta device, no processes);
- ``inspect_report``: what each rank would hold, computed for ``inspect`` (shapes, heads, bytes per rank);
- ``gguf``: a GGUF file converted once into a Transformers directory;
- ``plan``: which layouts of N GPUs fit a model, with per-GPU memory and collectives (the dry run, ``dryrun``).

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``, ``state``,
``plans``, ``parallel``, ``checkpoint``, ``runtime``, ``parallel_options``, ``dryrun``.
"""

__all__ = ["export", "gguf", "inspect", "inspect_report", "plan"]
