"""Plans as data: which style each module of a model gets, resolved and validated once, before any weight moves and
without any collective.

- ``styles``: the one table of Transformers' style names (what each splits, whether this package applies it);
- ``resolve``: reading a model's plan, merging overrides, expanding wildcards, the checks with errors naming the key;
- ``derived``: plans derived from a decoder's structure for models whose config has none;
- ``mixers``: the sequence mixers split by heads (linear attention, state-space layers, latent attention), as data;
- ``structure``: what the rewrites and the parallelisms ask of a model's structure (its decoder layer classes, the
  layers with plan entries, the text decoder's stack, the output head);
- ``rewrite``: a resolved plan rewritten before anything is sharded (dense-layer regions, sequence parallelism, loss
  parallelism's output head), the styles of :mod:`lightning_tp.parallel` given as factories;
- ``discovery``: which modules of a LightningModule are Transformers (or PEFT) models, and what a checkpoint records
  about them.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``.
"""

__all__ = ["discovery", "derived", "mixers", "resolve", "rewrite", "structure", "styles"]
