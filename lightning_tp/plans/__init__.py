"""Plans as data: which style each module of a model gets, resolved and validated once, before any weight moves and
without any collective.

- ``styles``: the one table of Transformers' style names (what each splits, whether this package applies it);
- ``source``: a model's own plan (its config's, derived, or none and why), and plan keys as patterns over paths;
- ``resolve``: merging overrides into a model's plan and expanding its wildcards to concrete names, the checks run;
- ``resolved``: the resolved plan as data (each name's style, and what the parallelisms read from it);
- ``checks``: the checks of a plan's styles against the model (style names, even splits, tied weights, gradient sums);
- ``heads``: the head counts a plan splits, checked against the TP size, KV heads replicated where they can be;
- ``coverage``: the layer kinds a resolved plan keeps whole on every rank, with their share of the parameters;
- ``derived``: plans derived from a decoder's structure for models whose config has none;
- ``mixer_kinds``: the sequence mixers split by heads (linear attention, state-space layers, latent attention), as data;
- ``fallback_kinds``: attention, MLPs and experts, as data, split where the model's plan leaves them whole;
- ``mixers``: which kind each module is, the entries that split it, and what is read from it once;
- ``mixer_choice``: which sequence mixers a plan splits by heads, and why the others stay whole;
- ``structure``: what the rewrites and the parallelisms ask of a model's structure (its decoder layer classes, the
  layers with plan entries, the text decoder's stack, the output head);
- ``rewrite``: a resolved plan rewritten before anything is sharded (dense-layer regions, sequence parallelism, loss
  parallelism's output head), the styles of :mod:`lightning_tp.parallel` given as factories;
- ``discovery``: which modules of a LightningModule are Transformers (or PEFT) models, and what a checkpoint records
  about them.

May import (checked by tests/unit/test_repo.py): ``compat``, ``composition``, ``patches``, ``layout``.
"""

__all__ = [
    "checks",
    "coverage",
    "derived",
    "discovery",
    "fallback_kinds",
    "heads",
    "mixer_choice",
    "mixer_kinds",
    "mixers",
    "resolve",
    "resolved",
    "rewrite",
    "source",
    "structure",
    "styles",
]
