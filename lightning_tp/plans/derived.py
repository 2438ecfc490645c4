"""Plans derived from a decoder's structure, for Transformers models whose config has no ``base_model_tp_plan``.

The decoder layers are found (the ``nn.ModuleList`` of the model's ``_no_split_modules`` blocks), and each layer's
modules that hold parameters are recognised by name and type:

- attention: separate ``q_proj``/``k_proj``/``v_proj`` (or ``query``/``key``/``value``) column-wise, or one fused
  QKV projection whose head layout is known (:data:`FUSED_QKV_LAYOUTS`), and its one other linear layer (the output
  projection) row-wise; the attention module itself gets ``local_heads``: its head counts become the rank's own, since
  these families reshape by ``self.num_heads`` rather than by ``-1``;
- MLP: up-projections (:data:`UP_NAMES`) column-wise and the down-projection (:data:`DOWN_NAMES`) row-wise;
- norms stay whole; the input embedding is split on the vocabulary (``embedding_rowwise``) and ``lm_head`` column-wise
  with its output gathered (``colwise_gather_output``); position embeddings stay whole.

The result is a plain plan of style names, resolved and checked like any other
(:func:`lightning_tp.plans.resolve.resolve_plan`) and overridable key by key with ``tp_plan``. What is not recognised
raises a ``ValueError`` naming the module and how to write the plan instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_tp.compat import no_split_modules
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES

QUERY_NAMES = ("q_proj", "query")
KEY_NAMES = ("k_proj", "key")
VALUE_NAMES = ("v_proj", "value")
FUSED_QKV_NAMES = ("c_attn", "query_key_value", "Wqkv", "qkv_proj")
UP_NAMES = ("up_proj", "gate_proj", "fc1", "c_fc", "fc_in", "dense_h_to_4h", "w1", "w3")
DOWN_NAMES = ("down_proj", "fc2", "c_proj", "fc_out", "dense_4h_to_h", "w2")


@dataclass(frozen=True)
class FusedLayout:
    """How one family packs q, k and v into its fused projection's output features.

    ``per_head``: head by head, each head's q, k and v together (``[h0: q k v | h1: q k v | ...]``): a plain column
    split gives each rank whole heads, so ``colwise`` fits. ``refused``: why the layout is not derived (yet), given the
    config; ``None``: derived.
    """

    description: str
    style: str | None
    refused: Callable[[object], str | None]
    #: The style of the attention module holding the projection.
    attention_style: str = "local_heads"


def _never(config: object) -> str | None:
    return None


def _falcon(config: object) -> str | None:
    if getattr(config, "alibi", False):
        return "ALiBi (`alibi=True`) biases are built for every head outside the attention, not split yet"
    # `new_decoder_architecture`: grouped per KV head ([q.. k v] per group), so a column split gives whole groups.
    # Multi-query attention ([q heads | k | v]) is split by lightning_tp.plans.mixers, which overrides this rule.
    return None


def _mpt(config: object) -> str | None:
    attn = getattr(config, "attn_config", None)
    if attn is not None and getattr(attn, "qk_ln", False):
        return "its q/k LayerNorms (`attn_config.qk_ln=True`) normalise over every head, not split yet"
    return None


#: The fused-QKV head layouts, one fact per family (``config.model_type``).
FUSED_QKV_LAYOUTS: dict[str, FusedLayout] = {
    # `.view(batch, seq, num_heads, 3 * head_dim).split(head_dim)` (multi-head attention).
    # (With `multi_query=True`, [q | k | v] with one K/V head: lightning_tp.plans.mixers overrides this rule.)
    "gpt_bigcode": FusedLayout("per head [q k v] (multi-head attention)", "colwise", _never),
    # `.split(split_size, dim=2)` into q, k, v: each rank takes its slice of each block.
    "gpt2": FusedLayout("[q | k | v] blocks in a Conv1D (weight stored [in, out])", "conv1d_colwise_qkv", _never),
    # `.view(batch, seq, num_heads, 3, head_dim)`, or per KV group with `new_decoder_architecture`.
    "falcon": FusedLayout("per head [q k v], or per KV group [q.. k v]", "colwise", _falcon),
    # `.view(batch, seq, num_heads, 3, head_dim)`; ALiBi biases built for every head by the model, sliced per rank.
    "bloom": FusedLayout("per head [q k v], ALiBi biases", "colwise", _never, attention_style="local_heads_alibi"),
    # `.chunk(3, dim=2)` into q, k, v blocks; ALiBi `position_bias` built for every head by the model.
    "mpt": FusedLayout(
        "[q | k | v] blocks, ALiBi biases", "packed_colwise_qkv", _mpt, attention_style="local_heads_alibi"
    ),
}


def _how_to_write(model: nn.Module, example: str) -> str:
    return (
        f"Pass `tp_plan` to the strategy with the module paths of {type(model).__name__}, e.g. {example} "
        "(style names: lightning_tp.plans.styles.SUPPORTED_STYLES; 'local_heads' on the attention module when its "
        "code reshapes by its head count), or use tp_size=1."
    )


#: The styles of GPT-2's Conv1D (weight stored [in, out]) for the column-/row-wise roles of a linear layer.
_CONV1D_STYLES = {"colwise": "conv1d_colwise", "rowwise": "conv1d_rowwise"}


def _conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _linear(module: nn.Module) -> bool:
    """A linear layer: ``nn.Linear``, or GPT-2's ``Conv1D`` (the same layer with its weight transposed)."""
    return isinstance(module, nn.Linear) or _conv1d(module)


def _norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def decoder_layer_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ``nn.ModuleList`` of decoder layers: the one list whose elements are the model's ``_no_split_modules``
    blocks."""
    blocks = set(no_split_modules(model))
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) and all(type(layer).__name__ in blocks for layer in m)
    ]
    if len(found) != 1:
        what = "no list" if not found else f"{len(found)} lists ({[n for n, _ in found]})"
        raise ValueError(
            f"{type(model).__name__} has no `base_model_tp_plan` and a plan could not be derived: {what} of decoder "
            f"layers ({sorted(blocks) or 'no `_no_split_modules`'}) found, where one was expected. "
            + _how_to_write(model, "{'<layers>.*.self_attn.q_proj': 'colwise', ...}")
        )
    return found[0]


def derive_plan(model: nn.Module) -> dict[str, str]:
    """The plan of a Transformers causal LM without ``base_model_tp_plan``, from its module structure. Raises a
    ``ValueError`` naming the first module it does not understand."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_name = type(model).__name__
    layers_name, layers = decoder_layer_list(model)
    template = _structure(layers[0])
    for index, layer in enumerate(layers):
        if _structure(layer) != template:
            raise ValueError(
                f"{model_name}: decoder layer {layers_name}.{index} is built differently from {layers_name}.0, so "
                "one derived rule per layer cannot describe it. "
                + _how_to_write(model, f"{{'{layers_name}.0.<module>': 'colwise', ...}}")
            )
    plan: dict[str, str] = {}
    layer = layers[0]
    prefix = f"{layers_name}.*."
    modules = _layer_modules(layer)

    def refuse(name: str, why: str) -> ValueError:
        full = f"{layers_name}.0.{name}"
        return ValueError(
            f"{model_name} has no `base_model_tp_plan` and a plan could not be derived: {full} "
            f"({type(modules[name]).__name__}) {why}. " + _how_to_write(model, f"{{'{prefix}{name}': '<style>', ...}}")
        )

    # Attention: the modules holding q/k/v (or a fused QKV) projections.
    attentions = {
        parent
        for name, m in modules.items()
        if _linear(m)
        for parent, _, leaf in [name.rpartition(".")]
        if leaf in QUERY_NAMES + KEY_NAMES + VALUE_NAMES + FUSED_QKV_NAMES
    }
    if len(attentions) != 1:
        raise ValueError(
            f"{model_name} has no `base_model_tp_plan` and a plan could not be derived: {len(attentions)} attention "
            f"modules found in {layers_name}.0 (modules holding {list(QUERY_NAMES + FUSED_QKV_NAMES)} linear layers: "
            f"{sorted(attentions)}), where one was expected. "
            + _how_to_write(model, f"{{'{prefix}self_attn.q_proj': 'colwise', ...}}")
        )
    attention = attentions.pop()
    attention_prefix = f"{attention}." if attention else ""
    children = {
        name: m
        for name, m in modules.items()
        if name.startswith(attention_prefix) and name != attention and list(m.parameters(recurse=False))
    }
    leaves = {name.rpartition(".")[2]: name for name in children}
    fused = [leaf for leaf in leaves if leaf in FUSED_QKV_NAMES and _linear(children[leaves[leaf]])]
    separate = [leaf for leaf in leaves if leaf in QUERY_NAMES + KEY_NAMES + VALUE_NAMES]
    for name, m in children.items():
        if not _linear(m):
            why = (
                "is a norm inside the attention (per-head norms see only the rank's heads)"
                if _norm(m)
                else "holds parameters but is not an nn.Linear (nor a Conv1D)"
            )
            raise refuse(name, why)
    if fused:
        if separate or len(fused) > 1:
            raise refuse(leaves[fused[0]], f"is a fused QKV projection next to {separate + fused[1:]}")
        layout = FUSED_QKV_LAYOUTS.get(getattr(config, "model_type", None))
        if layout is None:
            raise refuse(
                leaves[fused[0]],
                f"is a fused QKV projection of a family ({getattr(config, 'model_type', None)!r}) whose head layout "
                f"is not in lightning_tp.plans.derived.FUSED_QKV_LAYOUTS ({sorted(FUSED_QKV_LAYOUTS)})",
            )
        reason = layout.refused(config)
        if reason is not None or layout.style is None:
            raise refuse(leaves[fused[0]], f"is a fused QKV projection: {reason}")
        plan[prefix + leaves[fused[0]]] = layout.style
        attention_style = layout.attention_style
        projections = fused
    else:
        for names in (QUERY_NAMES, KEY_NAMES, VALUE_NAMES):
            found = [leaf for leaf in separate if leaf in names]
            if len(found) != 1:
                raise refuse(attention, f"holds {separate} as q/k/v projections, not one each")
            plan[prefix + leaves[found[0]]] = "colwise"
        projections = separate
        attention_style = "local_heads"
    outputs = [leaf for leaf in leaves if leaf not in projections]
    if len(outputs) != 1:
        raise refuse(
            attention, f"holds linear layers {outputs} besides q/k/v, where one output projection was expected"
        )
    plan[prefix + leaves[outputs[0]]] = "rowwise"
    if not any(isinstance(getattr(modules[attention], a, None), int) for a in HEAD_COUNT_ATTRIBUTES):
        raise refuse(attention, f"keeps its head count in none of {list(HEAD_COUNT_ATTRIBUTES)}")
    plan[prefix.rstrip(".") + (f".{attention}" if attention else "")] = attention_style
    plan.update(_conv1d_roles(plan, layer, prefix))

    # The rest of the layer: the MLP's linear layers, norms.
    ups, downs = [], []
    for name, m in modules.items():
        if not name or name == attention or name.startswith(attention_prefix):
            continue
        if not list(m.parameters(recurse=False)) or _norm(m):
            continue
        leaf = name.rpartition(".")[2]
        if _linear(m) and leaf in UP_NAMES:
            ups.append(name)
        elif _linear(m) and leaf in DOWN_NAMES:
            downs.append(name)
        else:
            raise refuse(name, f"is not an MLP projection this derivation knows ({list(UP_NAMES + DOWN_NAMES)})")
    if not ups or len(downs) != 1 or len({n.rpartition(".")[0] for n in ups + downs}) != 1:
        name = (downs or ups or [attention])[0]
        raise refuse(name, f"belongs to an MLP with up-projections {ups} and down-projections {downs}, not one MLP")
    plan.update({prefix + name: "colwise" for name in ups})
    plan[prefix + downs[0]] = "rowwise"
    plan.update(_conv1d_roles(plan, layer, prefix))

    plan.update(vocabulary_plan(model))
    return plan


def vocabulary_plan(model: nn.Module) -> dict[str, str]:
    """The input embedding split on the vocabulary and ``lm_head`` column-wise with its output gathered: the rules
    of any causal LM, also one whose layers no derived rule describes (a recurrent model, layers built
    differently), whose layers then stay whole (or are split by :mod:`lightning_tp.plans.mixers`)."""
    plan = {}
    names = {id(m): name for name, m in model.named_modules()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, nn.Embedding) and id(embedding) in names:
        plan[names[id(embedding)]] = "embedding_rowwise"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and id(head) in names:
        plan[names[id(head)]] = "colwise_gather_output"
    return plan


def _conv1d_roles(plan: dict[str, str], layer: nn.Module, prefix: str) -> dict[str, str]:
    """The column-/row-wise entries of ``layer`` that name a Conv1D, given its styles."""
    modules = _layer_modules(layer)
    return {
        key: _CONV1D_STYLES[style]
        for key, style in plan.items()
        if key.startswith(prefix) and style in _CONV1D_STYLES and _conv1d(modules.get(key[len(prefix) :]))
    }


def _structure(layer: nn.Module) -> list[tuple[str, str]]:
    """The names and types of a layer's modules that hold parameters (equal lists: one derived rule fits both)."""
    return [(name, type(m).__name__) for name, m in _layer_modules(layer).items() if list(m.parameters(recurse=False))]


def _layer_modules(layer: nn.Module) -> dict[str, nn.Module]:
    """The layer's modules by name, a PEFT-wrapped layer seen as its base layer (its adapters left out): the plan
    names the wrapper, and :func:`lightning_tp.parallel.lora.extend_plan_to_adapters` moves the style onto its parts."""
    modules: dict[str, nn.Module] = {}
    wrappers: list[str] = []
    for name, m in layer.named_modules():
        if any(name.startswith(f"{w}.") for w in wrappers):
            continue
        if hasattr(m, "get_base_layer") and hasattr(m, "base_layer"):
            wrappers.append(name)
            m = m.get_base_layer()
        modules[name] = m
    return modules
