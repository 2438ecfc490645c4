"""Structure queries a plan's rewrites and the parallelisms ask of a model: its decoder layer classes, the layers
holding plan entries, their stacks (one per tower), the text decoder's stack, and the output head.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from lightning_tp.compat import no_split_modules


def block_classes(module: nn.Module, names: Iterable[str] | None = None) -> set[type[nn.Module]]:
    """The classes of the blocks to shard one by one: ``names``, or each Transformers model's ``_no_split_modules``
    (its decoder layer)."""
    wanted = set(names or ())
    if not wanted:
        for submodule in module.modules():
            wanted.update(no_split_modules(submodule))
    return {type(m) for m in module.modules() if type(m).__name__ in wanted}


def layer_entries(styles: Mapping[str, Any], layer: str) -> dict[str, Any]:
    """The module entries (not ``.weight``/``.bias`` ones) of the plan under ``layer``."""
    return {k: v for k, v in styles.items() if k.startswith(f"{layer}.") and not k.endswith((".weight", ".bias"))}


def decoder_layers(model: nn.Module, styles: Mapping[str, Any], blocks: set[type]) -> list[str]:
    """The decoder layers (instances of ``blocks``) with plan entries: ``_no_split_modules`` also lists vision and
    audio blocks, which the plan leaves alone."""
    return [name for name, m in model.named_modules() if type(m) in blocks and layer_entries(styles, name)]


def layer_stacks(layers: list[str]) -> dict[str, list[str]]:
    """The layers grouped by the module list holding them (``model.language_model.layers``,
    ``model.vision_tower.encoder.layers``): a vision-language model has one stack per tower."""
    stacks: dict[str, list[str]] = {}
    for layer in layers:
        stacks.setdefault(layer.rpartition(".")[0], []).append(layer)
    return stacks


def text_decoder_layers(model: nn.Module, layers: list[str]) -> list[str]:
    """The stack of ``layers`` that runs on the token embeddings: the one under the module holding the input
    embedding (a vision tower's stack runs on patches, whose sequence is another). All of them when that module is
    not found."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    owner = next((name.rpartition(".")[0] for name, m in model.named_modules() if m is embedding and name), None)
    if owner is None:
        return layers
    mine = [layer for layer in layers if layer.rpartition(".")[0].rpartition(".")[0] == owner]
    return mine or layers


def output_head(model: nn.Module, styles: Mapping[str, Any]) -> str:
    """The path of the model's output embeddings (``lm_head``), which must be in the plan."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if get_output is not None else None
    names = [name for name, m in model.named_modules() if m is head]
    if head is None or not names or names[0] not in styles:
        raise ValueError(
            f"loss_parallel=True needs a sharded output head (`lm_head`); {type(model).__name__} has none in its plan."
        )
    return names[0]
