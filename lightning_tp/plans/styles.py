"""The one table of TP style names: what each does to the parameters and outputs of the module it is given, and
whether this package applies or refuses it. Every other fact about styles in the package (the supported and refused
lists, the layout of a tied weight, the per-rank shapes of ``inspect``, which LoRA half follows the base, which styles
sequence parallelism can rewrite, which embeddings keep their gradient's layout, the layer that applies each one in
:mod:`lightning_tp.parallel.layers`) is derived from :data:`STYLES`, so a new style is one entry here.

The names are the ones models' plans use (``base_model_tp_plan``, read as data) and this package's own. Every one is
applied with this package's layers, written on torch's ``ParallelStyle`` and DTensor; Transformers' layers are not
used. ``tests/unit/test_styles.py`` checks that every name in the plans of the installed Transformers is in the table,
and the table's layouts against what each layer does to a real ``nn.Linear``/``nn.Embedding`` on a one-rank process
group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

#: ``column``: output features split (the weight's rows); ``row``: input features split (the weight's columns), partial
#: outputs summed; ``embedding``: an embedding table split on the vocabulary or the hidden dim; ``replicated``: kept
#: whole; ``module``: changes the module's forward only, its parameters are split by their own entries (or not at all);
#: ``expert``: whole experts per rank (expert parallelism).
#: ``heads``: an attention module whose head counts become each rank's own (this package's style, for derived plans).
Kind = Literal["column", "row", "embedding", "replicated", "module", "expert", "heads"]


@dataclass(frozen=True)
class StyleFacts:
    """What one style name means.

    ``weight_dim``: the dim of a weight (2-D, or 3-D for stacked expert weights) the style splits: negative counts from
    the end (the output features are ``-2``, the input features ``-1``, whatever leading expert dim there is),
    non-negative from the start (an embedding's vocabulary ``0``, its hidden dim ``1``); ``None``: kept whole.
    ``bias_split``: whether a parameter named ``bias`` is split too (on its only dim); ``False``: it is replicated (a
    row-wise bias is added once, after the partial outputs are summed).
    ``vector_split``: whether a 1-D parameter (a bias where ``bias_split``) is split (on its only dim).
    ``blocks``: how many blocks a parameter packs on its split dim (fused gate|up: 2; q|k|v: 3); above 1 the style is
    ``strided``: each rank holds a slice of each block (``_StridedShard``), a layout of its own; a 1-D parameter (the
    fused bias) too, so that it matches its weight's blocks.
    ``output_sharded``: each rank's output holds its own slice of the features (heads), so what follows runs on shards.
    ``input_sharded``: a row-wise layer that takes its input as the rank's slice of the features (from an
    ``output_sharded`` layer); the row-wise styles that take a replicated input and split it locally do not.
    ``lora_half``: the LoRA matrix that shares the base's split dim and gets the same style (``lora_B`` reads the
    replicated low-rank input and writes the base's output slice; ``lora_A`` reads the base's input slice); the other
    half stays whole. ``None``: both stay whole (refused by :func:`lightning_tp.parallel.lora.extend_plan_to_adapters`
    when the base's output stays sharded: a whole adapter's output would not match the base's slice).
    ``sums_gradients``: a replicated parameter whose gradient this package sums over the TP group, with the model's
    other whole parameters (no layer of its own).
    ``rewritable``: sequence parallelism's rewrite (and the dense-layer rewrite) replaces it with torch's style of the
    same kind, or keeps it as is (a norm).
    ``expert_parallel``: an expert-parallel style of Transformers' ``ep_plan``, applied on the expert mesh (``ep``) by
    :mod:`lightning_tp.parallel.expert_parallel` when ``ep_size > 1``; refused in a ``tp_plan``.
    ``output_hook``: a style that changes its module's output gradient (a sum over TP of part of it): on a LoRA
    wrapper it stays on the wrapper, so that it covers the adapters' output too, and the adapters stay whole.
    ``added_once``: a parameter kept whole that its module adds to each rank's partial output before the partial
    outputs are summed over the TP group (a stacked experts' down-projection bias, gpt-oss's): each rank's call sees
    ``1/tp`` of it, so the sum holds it once, and keeps the whole gradient (the same on every rank: the output's
    gradient is whole on every rank). :class:`lightning_tp.parallel.layers.ExpertsParallel` applies it.
    ``refused``: why this package refuses the style in a ``tp_plan``, and the fix; ``None``: applied.
    ``registered``: a style name models' plans use (Transformers' names); ``False``: this package's own name, given by
    its derived plans and checks.
    ``same_as``: another name for the same split (Transformers 5.25's ``unit_colwise`` is ``colwise`` where the TP
    size divides the heads, and replicates KV heads where it does not, as this package's KV-head replication does):
    read as that name when a plan is resolved.
    """

    description: str
    kind: Kind
    weight_dim: int | None = None
    bias_split: bool = False
    vector_split: bool = True
    blocks: int = 1
    output_sharded: bool = False
    input_sharded: bool = False
    lora_half: Literal["lora_A", "lora_B"] | None = None
    sums_gradients: bool = False
    rewritable: bool = False
    expert_parallel: bool = False
    output_hook: bool = False
    added_once: bool = False
    refused: str | None = None
    registered: bool = True
    same_as: str | None = None

    @property
    def strided(self) -> bool:
        return self.blocks > 1

    @property
    def supported(self) -> bool:
        return self.refused is None

    def split_dim(self, ndim: int, *, is_bias: bool = False) -> int | None:
        """The dim that a parameter of ``ndim`` dims is split on (non-negative), or ``None`` when it stays whole.
        ``is_bias``: the parameter is named ``bias`` (Transformers decides by the name)."""
        if self.weight_dim is None or ndim == 0 or (is_bias and not self.bias_split):
            return None
        if ndim == 1 and not self.vector_split:
            return None
        # Transformers' `Shard(ndim - 2)` of a 1-D parameter is `Shard(-1)`: its only dim, as `% ndim` gives.
        dim = self.weight_dim % ndim if self.weight_dim < 0 else self.weight_dim
        if dim >= ndim:
            raise ValueError(f"a style that splits dim {self.weight_dim} cannot split a parameter of {ndim} dims")
        return dim

    def layout(self, ndim: int, *, is_bias: bool = False) -> str:
        """A name for the layout of a parameter of ``ndim`` dims: equal names, equal shards on every rank."""
        dim = self.split_dim(ndim, is_bias=is_bias)
        if dim is None:
            return "replicated"
        return f"strided shard({dim})" if self.strided else f"shard({dim})"


_MOE = (
    "Transformers uses it for mixture-of-experts layers, whose tensor parallelism is not verified for training with "
    "this strategy yet; map the rule to 'replicate' to keep that module whole"
)
_EP = (
    "it is expert parallelism, applied on the expert mesh from the model's own expert-parallel plan "
    "(`base_model_ep_plan`) when `ep_size > 1`, not as a TP rule; in a `tp_plan`, shard the experts with "
    "`moe_tp_experts` instead"
)

#: The attributes an attention module keeps its head counts in (families spell them differently), GPT-2's
#: ``split_size`` (the width of its q, k, v blocks) and ``embed_dim`` (the width XGLM reshapes its attention output
#: to): ``local_heads`` divides each one the module has by the TP size.
HEAD_COUNT_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_heads",
    "split_size",
    "embed_dim",
)
#: The head-count attributes that count KV heads (grouped-query attention): with KV-head replication they become the
#: rank's KV heads, not ``count / tp_size``.
KV_HEAD_COUNT_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads")
#: The head-count attributes that count query heads.
QUERY_HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_heads")
#: The attribute attention modules keep their query-heads-per-KV-head ratio in (``repeat_kv``, SDPA's GQA): KV-head
#: replication sets it to the rank's own.
KV_GROUPS_ATTRIBUTE = "num_key_value_groups"

#: Every Transformers style name this package knows: applied ones and refused ones.
STYLES: dict[str, StyleFacts] = {
    "colwise": StyleFacts(
        "linear, weight sharded on the output dim, output stays sharded",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        output_sharded=True,
        lora_half="lora_B",
        rewritable=True,
    ),
    "colwise_gather_output": StyleFacts(
        "colwise, output gathered to every rank (e.g. lm_head)",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        lora_half="lora_B",
    ),
    "colwise_rep": StyleFacts(
        "colwise, output gathered to every rank", kind="column", weight_dim=-2, bias_split=True, lora_half="lora_B"
    ),
    "rowwise": StyleFacts(
        "linear, weight sharded on the input dim, output all-reduced",
        kind="row",
        weight_dim=-1,
        input_sharded=True,
        lora_half="lora_A",
        rewritable=True,
    ),
    "rowwise_rep": StyleFacts(
        "rowwise with a replicated input that is split locally", kind="row", weight_dim=-1, lora_half="lora_A"
    ),
    "rowwise_split_input": StyleFacts(
        "rowwise with a replicated input that is split locally", kind="row", weight_dim=-1, lora_half="lora_A"
    ),
    "embedding_rowwise": StyleFacts(
        "embedding sharded on the vocabulary, partial lookups summed", kind="embedding", weight_dim=0, bias_split=True
    ),
    "embedding_colwise": StyleFacts(
        "embedding sharded on the hidden dim, slices gathered", kind="embedding", weight_dim=1, bias_split=True
    ),
    "replicated_with_grad_allreduce": StyleFacts(
        "replicated parameter whose gradient is summed over the TP group (q/k norms)",
        kind="replicated",
        sums_gradients=True,
        rewritable=True,
    ),
    "replicate": StyleFacts("kept whole on every rank", kind="replicated"),
    "local_params": StyleFacts("module runs on its local parameter shards", kind="module"),
    "moe_tp_experts": StyleFacts(
        "mixture-of-experts block: every expert sharded, partial outputs summed", kind="module"
    ),
    "packed_colwise": StyleFacts(
        "fused gate/up expert weight, each packed half sharded column-wise",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        blocks=2,
        output_sharded=True,
    ),
    # This package's own: the head layout of an attention module whose code reshapes by its global head counts.
    "local_heads": StyleFacts(
        "attention module whose head-count attributes (num_heads, num_key_value_heads, ...) are divided by the TP "
        "size, so that its reshapes fit the column-sharded q/k/v outputs (derived plans; parameters untouched)",
        kind="heads",
        registered=False,
    ),
    "local_heads_alibi": StyleFacts(
        "local_heads, and the ALiBi biases given to its forward (`alibi` [batch * heads, 1, keys] or `position_bias` "
        "[heads, 1, keys], built for every head) sliced to the rank's heads (Bloom, MPT)",
        kind="heads",
        registered=False,
    ),
    # This package's own: stacked expert weights stored [experts, in, out] for `x @ weight` whose gate and up are
    # interleaved feature by feature (gpt-oss's [g0, u0, g1, u1, ...]), and their [experts, out] bias: a contiguous
    # slice of the last dim holds whole (gate, up) pairs, the features the rank's slice of the down-projection reads.
    "colwise_transposed": StyleFacts(
        "weight stored [in, out] for `x @ weight` (stacked experts [experts, in, out]; its bias [experts, out]) "
        "sharded on the last (output) dim in contiguous slices, output stays sharded: gate and up interleaved "
        "feature by feature stay in pairs",
        kind="column",
        weight_dim=-1,
        bias_split=True,
        output_sharded=True,
        registered=False,
    ),
    # This package's own: the bias a module adds to each rank's partial output before the sum (gpt-oss's experts add
    # their down-projection bias per expert, before the routing weights).
    "partial_bias": StyleFacts(
        "bias kept whole that its module adds inside its row-wise part, before the partial outputs are summed "
        "(stacked experts' down-projection bias): each rank adds 1/tp of it, so the sum holds it once",
        kind="replicated",
        added_once=True,
        registered=False,
    ),
    # This package's own: KV-head replication (lightning_tp.parallel.kv_heads), given by the plan check to the K/V
    # projections of a model whose KV heads the TP size does not divide, in place of their `colwise`.
    "colwise_kv_heads": StyleFacts(
        "K or V projection stored as colwise; each rank gathers it and computes the KV heads its query heads read "
        "(KV-head replication: TP sizes that divide the query heads but not the KV heads)",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        output_sharded=True,
        lora_half="lora_B",
        rewritable=True,
        registered=False,
    ),
    # This package's own: GPT-2's Conv1D, a linear layer whose weight is stored [in, out] (nn.Linear's transposed).
    "conv1d_colwise": StyleFacts(
        "Conv1D (weight [in, out]) sharded on the output dim, output stays sharded",
        kind="column",
        weight_dim=-1,
        bias_split=True,
        output_sharded=True,
        registered=False,
    ),
    "conv1d_colwise_qkv": StyleFacts(
        "Conv1D with q, k and v packed as [q | k | v] blocks on the output dim: each rank holds its slice of each "
        "block ([q_r | k_r | v_r]), output stays sharded",
        kind="column",
        weight_dim=-1,
        bias_split=True,
        blocks=3,
        output_sharded=True,
        registered=False,
    ),
    "packed_colwise_qkv": StyleFacts(
        "linear with q, k and v packed as [q | k | v] blocks on the output dim: each rank holds its slice of each "
        "block ([q_r | k_r | v_r]), output stays sharded (MPT's Wqkv)",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        blocks=3,
        output_sharded=True,
        registered=False,
    ),
    "conv1d_rowwise": StyleFacts(
        "Conv1D (weight [in, out]) sharded on the input dim, output all-reduced, bias added once",
        kind="row",
        weight_dim=-2,
        input_sharded=True,
        registered=False,
    ),
    # This package's own: head-parallel sequence mixers (lightning_tp.plans.mixers, lightning_tp.parallel.blocks).
    "colwise_blocks": StyleFacts(
        "linear whose output packs blocks (a mixer's [q | k | v]): stored as a plain row split, each rank computes "
        "its slice of every block (its heads), its input's gradient summed over the TP group",
        kind="column",
        weight_dim=-2,
        bias_split=True,
        output_sharded=True,
        lora_half="lora_B",
        registered=False,
    ),
    "local_blocks": StyleFacts(
        "parameters a mixer reads itself (its conv1d over [q | k | v] channels, per-head A_log, dt_bias, D): stored "
        "as a plain split of dim 0 (of its heads' dim where the plan says so: Kimi's A_log), the mixer reads its "
        "slice of every block",
        kind="module",
        weight_dim=0,
        bias_split=True,
        registered=False,
    ),
    "rowwise_local_output": StyleFacts(
        "linear, weight sharded on the input dim, partial outputs summed and scattered: each rank keeps its slice of "
        "the output features (a per-head output computed from every head, Doge's `dt_proj`)",
        kind="row",
        weight_dim=-1,
        input_sharded=True,
        output_sharded=True,
        registered=False,
    ),
    # Refused.
    "ep_dispatch_experts": StyleFacts(
        "experts module whose tokens go to the ranks holding their experts (all-to-all) and come back",
        kind="module",
        expert_parallel=True,
        refused=_EP,
    ),
    "grouped_gemm": StyleFacts(
        "stacked expert weight, whole experts per rank on the expert-parallel axis",
        kind="expert",
        weight_dim=0,
        bias_split=True,
        expert_parallel=True,
        refused=_EP,
    ),
    "sequence_parallel": StyleFacts(
        "module runs on sequence shards",
        kind="module",
        refused="Transformers' sequence-parallel style is not wired into its layers yet; leave the norms replicated "
        "(drop the rule)",
    ),
    "moe_identity_expert": StyleFacts("identity expert, input divided by the TP size", kind="module", refused=_MOE),
    "all_reduce": StyleFacts("partial output summed over the TP group", kind="module", refused=_MOE),
    # Llama 4 and Aria store expert weights [experts, in, out], gate and up packed on the last (output) dim: each rank
    # holds its slice of each half, like `packed_colwise` on the transposed layout.
    "packed_rowwise": StyleFacts(
        "fused gate/up expert weight stored [in, out], each packed half sharded on the last (output) dim",
        kind="column",
        weight_dim=-1,
        vector_split=False,
        blocks=2,
        output_sharded=True,
    ),
    "mla_kv_a_proj": StyleFacts(
        "latent-attention KV down-projection ([latent | rotary key]) kept whole; the rotary key goes to the rank's "
        "heads unprojected, so its output gradient is summed over the TP group (the latent's is summed by the "
        "column-wise up-projection it feeds)",
        kind="replicated",
        output_hook=True,
    ),
}
# Transformers 5.25's per-head column and row styles: the same splits as `colwise` and `rowwise` here (where the TP size
# does not divide the KV heads, the plan check gives the K/V projections `colwise_kv_heads`).
STYLES["unit_colwise"] = replace(STYLES["colwise"], description="colwise split by whole heads", same_as="colwise")
STYLES["unit_rowwise"] = replace(STYLES["rowwise"], description="rowwise split by whole heads", same_as="rowwise")


def canonical(style: object) -> object:
    """The name a style is applied as (:attr:`StyleFacts.same_as`); anything else as it is."""
    fact = facts(style)
    return fact.same_as if fact is not None and fact.same_as else style


def facts(style: object) -> StyleFacts | None:
    """The facts of a style name, or ``None`` for anything else (a torch ``ParallelStyle``, an unknown name, none)."""
    return STYLES.get(style) if isinstance(style, str) else None


def style_names(**where: object) -> tuple[str, ...]:
    """The names whose facts have every given value, e.g. ``style_names(kind="embedding")``. A tuple: ``style in``
    compares with ``==``, so a plan value that is an unhashable ``ParallelStyle`` (a dataclass) is simply absent."""
    return tuple(
        name for name, fact in STYLES.items() if all(getattr(fact, key) == value for key, value in where.items())
    )


#: Style names this package applies (each with its layer in :mod:`lightning_tp.parallel.layers`).
SUPPORTED_STYLES: dict[str, str] = {name: fact.description for name, fact in STYLES.items() if fact.supported}

#: Transformers style names this package refuses, with the reason and the fix.
REFUSED_STYLES: dict[str, str] = {name: fact.refused for name, fact in STYLES.items() if fact.refused is not None}
