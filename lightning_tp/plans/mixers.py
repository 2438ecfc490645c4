"""Head-parallel sequence mixers: the linear-attention and state-space layers of hybrid models, split by heads.

Transformers' plans leave these mixers whole (Nemotron-H, Granite 4) or gather their projections so that every rank
computes the whole recurrence (Qwen3.5's ``colwise_gather_output``). Each kind below is described as data: how it is
recognised (the parameters it holds), which of its size attributes its forward reshapes by (divided by the TP size,
as ``local_heads`` does for attention), and for each parameter the blocks its dim 0 concatenates. Every rank then
holds, and computes, its slice of every block: its own heads of q, k, v, z, the conv channels of those heads, their
``A_log``/``dt_bias``/``D``; the output projection is row-wise, its partial outputs summed. Megatron-Core and vLLM
split these mixers the same way.

A parameter with one block is a plain column split (``colwise``, or ``local_blocks`` for a parameter the mixer reads
itself, split on dim 0 or on the dim :attr:`MixerKind.dims` names); one with several (a fused ``[q | k | v]``
projection, the conv over those channels) is ``colwise_blocks`` / ``local_blocks``, whose storage is a plain
``Shard(0)`` of the whole tensor (so checkpoints, resharding and export see the model's own layout) and whose forward
takes the rank's rows of each block (see :mod:`lightning_tp.parallel.blocks`).

A block size is written as attribute names of the mixer joined by ``*`` (``"n_groups*ssm_state_size"``), read from
the module before its attributes are divided.

The last kinds describe modules a model's plan usually covers, applied only where it leaves them whole
(``complete_only``): plain attention, gated MLPs, and a mixture-of-experts layer's stacked experts (split on each
expert's intermediate features, as Transformers 5.24's plans split them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from torch import nn

from lightning_tp.compat import config_value
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES


@dataclass(frozen=True)
class MixerKind:
    """One kind of head-structured sequence mixer.

    ``holds``: parameter names (relative to the mixer) it must all have to be recognised as this kind; ``lacks``:
    names it must not have (to tell similar kinds apart). ``styles``: relative module or parameter path -> style
    (``""``: the mixer module itself); a path the mixer lacks is skipped (a bias, an optional projection).
    ``blocks``: relative parameter path -> block sizes of its dim 0. ``attributes``: the size attributes divided by
    the TP size. ``heads``: the attributes whose counts the TP size must divide (key heads or groups first; dotted: a
    child's, ``"config.num_key_value_heads"``), named in the refusal.
    """

    name: str
    description: str
    holds: tuple[str, ...]
    styles: Mapping[str, str]
    blocks: Mapping[str, tuple[str, ...]]
    attributes: tuple[str, ...]
    heads: tuple[str, ...]
    lacks: tuple[str, ...] = ()
    #: Modules holding a norm over one head (or group) whose weight every head shares: kept whole, their gradient
    #: summed over the TP group (each rank's heads contribute their part).
    shared_norms: tuple[str, ...] = field(default=())
    #: Buffers that the forward multiplies with a packed output or per head: name -> (dim, block sizes); kept whole
    #: (so saved whole), each call sees the rank's slice of every block. Recognition needs them too.
    buffers: Mapping[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    #: Applied only where the model's own plan leaves the module whole (no rule for any of its ``styles`` paths):
    #: plain attention, which a plan usually covers with KV-head replication and checks of its own.
    complete_only: bool = False
    #: Whether a decoder layer holding it is compiled with ``compile=True``: torch 2.13's compiled backward of the
    #: Gated DeltaNet torch fallback fails ("view size is not compatible", on one process with one key head, and
    #: split by heads), so those layers run eager, said in a warning.
    compiles: bool = True
    #: A package whose fused kernel Transformers uses for this kind in training when it is installed, reading the
    #: mixer's parameters itself (Mamba2's `mamba_ssm`): refused with a split mixer, before anything moves.
    fused_kernel: str | None = None
    #: Attribute values the module must have to be this kind (``{"multi_query": True}``; dotted: an attribute's
    #: attribute, ``"config.alibi"``).
    requires: Mapping[str, object] = field(default_factory=dict)
    #: Attributes set to the rank's number of rows of a parameter (relative path) rather than divided: a size made of
    #: split and whole blocks (Mamba2's ``conv_dim`` with its B/C groups whole).
    local_sizes: Mapping[str, str] = field(default_factory=dict)
    #: A gated norm (relative path) over one group that spans every rank: its mean square is summed over the TP
    #: group (:mod:`lightning_tp.parallel.blocks`).
    norm_across_ranks: str | None = None
    #: ``local_blocks`` parameters (relative path) that hold their heads on another dim than 0 (Kimi-Linear's
    #: ``A_log`` of shape [1, 1, heads, 1]): split on that dim (one block).
    dims: Mapping[str, int] = field(default_factory=dict)
    #: Stacked expert weights (relative path) -> the size each of their dims holds, by name (``"2*intermediate"``: two
    #: packed halves of that size): the layout the styles assume, checked against the shapes before anything is split
    #: (:func:`stacked_sizes`).
    stacked: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Modules or parameters (relative paths) the split keeps whole on purpose, besides its ``styles``: a router (the
    #: routing must be the same on every rank) and a bias added after the partial outputs are summed (JetMoE's).
    whole: tuple[str, ...] = ()


_GDN_ATTRIBUTES = ("num_v_heads", "num_k_heads", "key_dim", "value_dim", "conv_dim")
_GN = "n_groups*ssm_state_size"
#: Mamba2's fused input projection: [z (gate) | x | B | C | dt].
_ZXBCDT = ("intermediate_size", "intermediate_size", _GN, _GN, "num_heads")
_MAMBA2_STYLES = {
    "in_proj": "colwise_blocks",
    "conv1d": "local_blocks",
    "A_log": "local_blocks",
    "dt_bias": "local_blocks",
    "D": "local_blocks",
    # The gated norm normalises groups of channels (`group_size` of them, kept): per channel weights, sliced with x.
    "norm": "local_blocks",
    "out_proj": "rowwise",
}
_MAMBA2_BLOCKS = {
    "in_proj.weight": _ZXBCDT,
    "in_proj.bias": _ZXBCDT,
    "conv1d.weight": ("intermediate_size", _GN, _GN),
    "conv1d.bias": ("intermediate_size", _GN, _GN),
}
_MAMBA2_ATTRIBUTES = ("intermediate_size", "conv_dim", "num_heads", "n_groups")
_QKV = ("key_dim", "key_dim", "value_dim")

#: Every mixer kind this package splits by heads.
MIXER_KINDS: tuple[MixerKind, ...] = (
    MixerKind(
        name="latent_attention",
        description="multi-head latent attention (DeepSeek-V2/V3 style)",
        holds=("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "o_proj.weight"),
        # The up-projections split by head, the output projection row-wise. The low-rank down-projections and their
        # norms stay whole: their outputs feed column-wise layers, whose input gradient is summed over the TP group,
        # except the rotary key slice of `kv_a_proj_with_mqa`, which reaches the heads unprojected (`mla_kv_a_proj`
        # sums its gradient). A sparse-attention indexer (V3.2, GLM-5) stays whole: it picks the same keys for
        # every head, from its own few heads, and that choice must agree on every rank.
        styles={
            "q_proj": "colwise",
            "q_b_proj": "colwise",
            "kv_b_proj": "colwise",
            "kv_a_proj_with_mqa": "mla_kv_a_proj",
            # A head-wise output gate (Ling 3's `g_proj`: one logit per head).
            "g_proj": "colwise",
            "o_proj": "rowwise",
        },
        blocks={},
        attributes=("num_heads",),
        heads=("num_heads",),
        # A norm of the rotary key alone (Dots 3): its output reaches the rank's heads only.
        shared_norms=("k_rope_only_layernorm",),
    ),
    MixerKind(
        name="gated_deltanet",
        compiles=False,
        description="Gated DeltaNet (separate q|k|v, z, b, a projections: Qwen3.5)",
        holds=("in_proj_qkv.weight", "in_proj_z.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"),
        styles={
            "in_proj_qkv": "colwise_blocks",
            "in_proj_z": "colwise",
            "in_proj_b": "colwise",
            "in_proj_a": "colwise",
            "conv1d": "local_blocks",
            "A_log": "local_blocks",
            "dt_bias": "local_blocks",
            "out_proj": "rowwise",
        },
        blocks={
            "in_proj_qkv.weight": _QKV,
            "in_proj_qkv.bias": _QKV,
            "conv1d.weight": _QKV,
            "conv1d.bias": _QKV,
            "A_log": ("num_v_heads",),
            "dt_bias": ("num_v_heads",),
        },
        attributes=_GDN_ATTRIBUTES,
        heads=("num_k_heads", "num_v_heads"),
        shared_norms=("norm",),
    ),
    MixerKind(
        name="gated_deltanet_separate",
        compiles=False,
        description="Gated DeltaNet with separate q, k, v, g, a, b projections (OLMo-hybrid)",
        holds=("q_proj.weight", "k_proj.weight", "v_proj.weight", "conv1d.weight", "A_log", "dt_bias", "o_proj.weight"),
        styles={
            **dict.fromkeys(("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj"), "colwise"),
            "conv1d": "local_blocks",
            "A_log": "local_blocks",
            "dt_bias": "local_blocks",
            "o_proj": "rowwise",
        },
        blocks={
            "conv1d.weight": _QKV,
            "conv1d.bias": _QKV,
            "A_log": ("num_v_heads",),
            "dt_bias": ("num_v_heads",),
        },
        attributes=_GDN_ATTRIBUTES,
        heads=("num_k_heads", "num_v_heads"),
        shared_norms=("o_norm",),
    ),
    MixerKind(
        name="gated_deltanet_grouped",
        compiles=False,
        description="Gated DeltaNet with q|k|v|z and b|a fused per key head (Qwen3-Next)",
        holds=("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "out_proj.weight"),
        styles={
            # Grouped by key head: a plain column split gives each rank whole key heads with their value heads.
            "in_proj_qkvz": "colwise",
            "in_proj_ba": "colwise",
            "conv1d": "local_blocks",
            "A_log": "local_blocks",
            "dt_bias": "local_blocks",
            "out_proj": "rowwise",
        },
        blocks={
            "conv1d.weight": _QKV,
            "conv1d.bias": _QKV,
            "A_log": ("num_v_heads",),
            "dt_bias": ("num_v_heads",),
        },
        attributes=_GDN_ATTRIBUTES,
        heads=("num_k_heads", "num_v_heads"),
        shared_norms=("norm",),
    ),
)


# With one group of B/C (Granite 4, Bamba, Falcon-H1 and Zamba2 ship n_groups=1) the TP size cannot split the groups:
# every rank computes B and C whole (the small `n_groups * ssm_state_size` rows) with its own heads of x, z and dt, as
# vLLM does; Megatron-Core refuses these. The gated norm then normalises one group spread over every rank.
_SHARED = "=" + _GN
_ZXBCDT_SHARED = ("intermediate_size", "intermediate_size", _SHARED, _SHARED, "num_heads")
_MAMBA2_SHARED_BLOCKS = {
    "in_proj.weight": _ZXBCDT_SHARED,
    "in_proj.bias": _ZXBCDT_SHARED,
    "conv1d.weight": ("intermediate_size", _SHARED, _SHARED),
    "conv1d.bias": ("intermediate_size", _SHARED, _SHARED),
}
_MAMBA2_SHARED = dict(
    fused_kernel="mamba_ssm",
    blocks=_MAMBA2_SHARED_BLOCKS,
    attributes=("intermediate_size", "num_heads"),
    heads=("num_heads",),
    requires={"n_groups": 1},
    local_sizes={"conv_dim": "conv1d.weight"},
    norm_across_ranks="norm",
)

MIXER_KINDS += (
    MixerKind(
        name="mamba2_mup_one_group",
        description="Mamba2 mixer with muP multipliers and one group of B/C (Falcon-H1)",
        holds=("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "D", "out_proj.weight"),
        styles=_MAMBA2_STYLES,
        buffers={"mup_vector": (2, _ZXBCDT_SHARED)},
        **_MAMBA2_SHARED,
    ),
    MixerKind(
        name="mamba2_one_group",
        description="Mamba2 mixer with one group of B/C (Granite 4, Bamba, Zamba2)",
        holds=("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "D", "out_proj.weight"),
        styles=_MAMBA2_STYLES,
        **_MAMBA2_SHARED,
    ),
    MixerKind(
        name="mamba2_mup",
        description="Mamba2 mixer with muP multipliers (Falcon-H1)",
        holds=("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "D", "out_proj.weight"),
        styles=_MAMBA2_STYLES,
        blocks=_MAMBA2_BLOCKS,
        # Its norm keeps the group count rather than the group size.
        attributes=(*_MAMBA2_ATTRIBUTES, "norm.n_groups"),
        heads=("n_groups", "num_heads"),
        fused_kernel="mamba_ssm",
        buffers={"mup_vector": (2, _ZXBCDT)},
    ),
    MixerKind(
        name="mamba2",
        description="Mamba2 mixer (Nemotron-H, Granite 4, Bamba, Zamba2, Mamba2)",
        holds=("in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "D", "out_proj.weight"),
        styles=_MAMBA2_STYLES,
        blocks=_MAMBA2_BLOCKS,
        attributes=_MAMBA2_ATTRIBUTES,
        heads=("n_groups", "num_heads"),
        fused_kernel="mamba_ssm",
    ),
)


# Multi-query attention with q, k and v fused: every rank computes its query heads against the one K/V head, so it
# takes its slice of q and all of k and v (their gradients summed over the TP group as the packed weight's).
_MQA_BLOCKS = ("embed_dim", "=kv_dim", "=kv_dim")
_FALCON_MQA_BLOCKS = ("num_heads*head_dim", "=head_dim", "=head_dim")
MIXER_KINDS += (
    MixerKind(
        name="multi_query_attention",
        description="multi-query attention fused as [q | k | v] (GPT-BigCode `multi_query=True`)",
        holds=("c_attn.weight", "c_proj.weight"),
        styles={"c_attn": "colwise_blocks", "c_proj": "rowwise"},
        blocks={"c_attn.weight": _MQA_BLOCKS, "c_attn.bias": _MQA_BLOCKS},
        attributes=("embed_dim", "num_heads", "num_key_value_groups"),
        heads=("num_heads",),
        requires={"multi_query": True},
    ),
    MixerKind(
        name="multi_query_attention_falcon",
        description="multi-query attention fused as [q heads | k | v] (Falcon `multi_query=True`)",
        holds=("query_key_value.weight", "dense.weight"),
        styles={"query_key_value": "colwise_blocks", "dense": "rowwise"},
        blocks={"query_key_value.weight": _FALCON_MQA_BLOCKS, "query_key_value.bias": _FALCON_MQA_BLOCKS},
        attributes=("num_heads",),
        heads=("num_heads",),
        # ALiBi biases are built for every head outside the attention: not split (the layers stay whole).
        requires={"multi_query": True, "new_decoder_architecture": False, "config.alibi": False},
    ),
)

# Dynamic-mask attention (Doge): a per-KV-head score `dt` computed from every head's values (`dt_proj`), scaled by a
# per-head `A`, masks each head's keys. The rank computes the values of its own KV heads; `dt_proj` sums the partial
# scores over the TP group and keeps the rank's heads of them (Transformers' plan sums them for every head, which
# does not fit the rank's attention weights).
MIXER_KINDS += (
    MixerKind(
        name="dynamic_mask_attention",
        description="attention with a dynamic mask from the values (`dt_proj`, per-head `A`: Doge)",
        holds=("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "dt_proj.weight", "A"),
        styles={
            "q_proj": "colwise",
            "k_proj": "colwise",
            "v_proj": "colwise",
            "dt_proj": "rowwise_local_output",
            "A": "local_blocks",
            "o_proj": "rowwise",
        },
        blocks={},
        # Its forward reshapes by `head_dim` and groups by `num_key_value_groups` (a ratio): no count to divide.
        attributes=(),
        heads=("config.num_key_value_heads", "config.num_attention_heads"),
        shared_norms=("q_norm", "k_norm"),
    ),
)

# Kimi Delta Attention (Kimi-Linear, Ling 3's linear layers): Gated DeltaNet with a decay per channel. q, k, v, the
# per-head input gate `b_proj` and the output gate split by heads with the conv over [q | k | v]; the forget gate's
# per-channel projection, `dt_bias` and per-head `A_log` too. Its low-rank down-projections (`f_a_proj`, `g_a_proj`)
# stay whole: they feed column-wise layers, which sum their input gradient over the TP group.
_KDA_HOLDS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "conv1d.weight", "b_proj.weight", "o_proj.weight")
_KIMI_DELTA_ATTENTION = MixerKind(
    name="kimi_delta_attention",
    compiles=False,
    description="Kimi Delta Attention with a low-rank forget gate (Kimi-Linear)",
    holds=(*_KDA_HOLDS, "forget_gate.f_b_proj.weight", "forget_gate.A_log", "forget_gate.dt_bias"),
    styles={
        **dict.fromkeys(("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "g_b_proj"), "colwise"),
        **dict.fromkeys(("forget_gate.f_proj", "forget_gate.f_b_proj"), "colwise"),
        "conv1d": "local_blocks",
        "forget_gate.dt_bias": "local_blocks",
        "forget_gate.A_log": "local_blocks",
        "o_proj": "rowwise",
    },
    blocks={"conv1d.weight": ("qkv_dim",) * 3, "conv1d.bias": ("qkv_dim",) * 3},
    attributes=("num_heads", "qkv_dim", "conv_dim", "forget_gate.num_heads", "forget_gate.qkv_dim"),
    heads=("num_heads",),
    shared_norms=("o_norm",),
    dims={"forget_gate.A_log": 2},
)
MIXER_KINDS += (
    _KIMI_DELTA_ATTENTION,
    # Ling 3's: a full-rank forget gate (`f_proj`), its `A_log` one value per head on dim 0.
    replace(
        _KIMI_DELTA_ATTENTION,
        name="kimi_delta_attention_full_gate",
        description="Kimi Delta Attention with a full-rank forget gate (Ling 3)",
        holds=(*_KDA_HOLDS, "forget_gate.f_proj.weight", "forget_gate.A_log", "forget_gate.dt_bias"),
        dims={},
    ),
)

# Lightning attention (MiniMax): linear attention with a decay per head. Its fused projection interleaves q, k and v
# per head, so a plain column split gives each rank whole heads; its decays (buffers, one per head) are sliced to
# the rank's heads in each call; its norm spans every head, so its mean square is summed over the TP group.
_HEADS = ("num_attention_heads",)
MIXER_KINDS += (
    MixerKind(
        name="lightning_attention",
        description="lightning attention (MiniMax): q|k|v interleaved per head, a decay per head",
        holds=("qkv_proj.weight", "output_gate.weight", "norm.weight", "out_proj.weight"),
        styles={"qkv_proj": "colwise", "output_gate": "colwise", "norm": "local_blocks", "out_proj": "rowwise"},
        blocks={},
        attributes=_HEADS,
        heads=_HEADS,
        buffers={
            "slope_rate": (0, _HEADS),
            "query_decay": (0, _HEADS),
            "key_decay": (0, _HEADS),
            "diagonal_decay": (1, _HEADS),
        },
        norm_across_ranks="norm",
    ),
)

#: The names of an attention's output gate (its values multiply the attention output, per feature or per head).
OUTPUT_GATES = ("gate_proj", "g_proj")
MIXER_KIND_ATTENTION = MixerKind(
    name="attention",
    description="attention with separate q, k, v and output projections",
    holds=("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"),
    # Attention sinks (gpt-oss): one logit per query head, read by the attention function from the module. An output
    # gate (AFMoE's `gate_proj`, LFM3's `g_proj`) splits with the heads where it has one value per query feature or
    # per head, which `_attention_problem` checks.
    styles={
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "o_proj": "rowwise",
        "sinks": "local_blocks",
        **dict.fromkeys(OUTPUT_GATES, "colwise"),
    },
    blocks={},
    attributes=HEAD_COUNT_ATTRIBUTES,
    heads=(),
    # Its per-head norms (any names: q_norm, query_layernorm, ...) are found by `per_head_norms`.
    complete_only=True,
)
#: A gated MLP that the model's plan leaves whole (Bamba's): up-projections column-wise, down row-wise.
MIXER_KIND_MLP = MixerKind(
    name="mlp",
    description="gated MLP (gate, up and down projections)",
    holds=("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    styles={"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"},
    blocks={},
    attributes=(),
    heads=(),
    complete_only=True,
)
#: The same, spelled ``out_proj`` (LFM2) and ``w1``/``w3``/``w2`` (LFM2, Mixtral-style).
MIXER_KIND_ATTENTION_OUT = replace(
    MIXER_KIND_ATTENTION,
    name="attention_out_proj",
    holds=("q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"),
    styles={
        "q_proj": "colwise",
        "k_proj": "colwise",
        "v_proj": "colwise",
        "out_proj": "rowwise",
        "sinks": "local_blocks",
        **dict.fromkeys(OUTPUT_GATES, "colwise"),
    },
)
MIXER_KIND_MLP_W = replace(
    MIXER_KIND_MLP,
    name="mlp_w",
    holds=("w1.weight", "w3.weight", "w2.weight"),
    styles={"w1": "colwise", "w3": "colwise", "w2": "rowwise"},
)
#: Gate and up packed as two halves of one projection, chunked in two by the forward (Granite 4's, GraniteMoE-Shared's
#: shared MLP: `input_linear` [gate | up], `output_linear`): each rank takes its slice of each half.
MIXER_KIND_MLP_PACKED = replace(
    MIXER_KIND_MLP,
    name="mlp_packed",
    description="gated MLP with gate and up packed in one projection (input_linear [gate | up], output_linear)",
    holds=("input_linear.weight", "output_linear.weight"),
    styles={"input_linear": "packed_colwise", "output_linear": "rowwise"},
)
#: Without a gate (Nemotron-H's dense layers, Ergo's): up column-wise, down row-wise.
MIXER_KIND_MLP_UNGATED = replace(
    MIXER_KIND_MLP,
    name="mlp_ungated",
    description="MLP without a gate (up and down projections)",
    holds=("up_proj.weight", "down_proj.weight"),
    lacks=("gate_proj",),
    styles={"up_proj": "colwise", "down_proj": "rowwise"},
)
#: JetMoE's mixture of MLP experts: its own module holding the router, the stacked experts as two modules
#: (`input_linear` [experts, 2 x intermediate, hidden], gate and up packed; `output_linear` [experts, hidden,
#: intermediate]) and a bias added after the experts. Each expert split column-/row-wise like a packed MLP: each
#: rank's routed tokens' partial outputs are summed (top_k rows per token) before the routing weights and the bias;
#: the router stays whole. Its mixture of attention experts (`num_experts` kept on the module) stays whole.
MIXER_KIND_MLP_EXPERTS_MODULES = replace(
    MIXER_KIND_MLP_PACKED,
    name="mlp_experts_modules",
    description="mixture of MLP experts with its router (input_linear [experts, 2 x intermediate, hidden] gate|up, "
    "output_linear [experts, hidden, intermediate], a bias after them: JetMoE)",
    holds=("input_linear.weight", "output_linear.weight", "router.layer.weight", "bias"),
    lacks=("num_experts",),
    whole=("router", "bias"),
)
MIXER_KINDS += (
    MIXER_KIND_ATTENTION,
    MIXER_KIND_ATTENTION_OUT,
    MIXER_KIND_MLP,
    MIXER_KIND_MLP_W,
    MIXER_KIND_MLP_EXPERTS_MODULES,
    MIXER_KIND_MLP_PACKED,
    MIXER_KIND_MLP_UNGATED,
)
#: The kinds whose split is checked as attention's (head counts from the config).
ATTENTION_KINDS = (MIXER_KIND_ATTENTION, MIXER_KIND_ATTENTION_OUT)

# A mixture-of-experts layer's experts that the model's plan leaves whole (Transformers 5.25's plans dropped the
# expert rules its 5.24 plans had): Transformers' stacked expert weights, each rank holding its slice of every
# expert's intermediate features, as those rules split them; `moe_tp_experts` sums the partial outputs over the TP
# group, and the gradients of the hidden states and routing weights it is given. Recognised by the flags
# `@use_experts_implementation` sets (how the weights are stored, and its calling convention: hidden states, expert
# ids, routing weights), the shapes checked against `stacked`; experts without those flags (Llama 4's) are left to
# the model's plan. A norm after each expert (Ergo's, MuseSpark's) is not described: those experts stay whole.
_EXPERTS_FLAGS = {"is_concatenated": True, "has_bias": False, "has_post_expert_norm": False}
MIXER_KIND_EXPERTS = MixerKind(
    name="experts",
    description="stacked experts, gate|up [experts, 2 x intermediate, hidden] and down [experts, hidden, intermediate]",
    holds=("gate_up_proj", "down_proj"),
    # Each packed half (gate, up) split on the intermediate features, down on the same features.
    styles={"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "": "moe_tp_experts"},
    blocks={},
    attributes=(),
    heads=(),
    requires={"has_gate": True, "is_transposed": False, **_EXPERTS_FLAGS},
    complete_only=True,
    stacked={
        "gate_up_proj": ("experts", "2*intermediate", "hidden"),
        "down_proj": ("experts", "hidden", "intermediate"),
    },
)
#: Stored transposed for ``x @ weight`` (Aria's), gate and up packed on the last dim.
MIXER_KIND_EXPERTS_TRANSPOSED = replace(
    MIXER_KIND_EXPERTS,
    name="experts_transposed",
    description="stacked experts, gate|up [experts, hidden, 2 x intermediate] and down [experts, intermediate, hidden]",
    styles={"gate_up_proj": "packed_rowwise", "down_proj": "colwise", "": "moe_tp_experts"},
    requires={"has_gate": True, "is_transposed": True, **_EXPERTS_FLAGS},
    stacked={
        "gate_up_proj": ("experts", "hidden", "2*intermediate"),
        "down_proj": ("experts", "intermediate", "hidden"),
    },
)
#: Without a gate (Nemotron-H's): up and down.
MIXER_KIND_EXPERTS_UNGATED = replace(
    MIXER_KIND_EXPERTS,
    name="experts_ungated",
    description="stacked experts without a gate, up [experts, intermediate, hidden] and down [experts, hidden, "
    "intermediate]",
    holds=("up_proj", "down_proj"),
    styles={"up_proj": "colwise", "down_proj": "rowwise", "": "moe_tp_experts"},
    requires={"has_gate": False, "is_transposed": False, **_EXPERTS_FLAGS},
    stacked={"up_proj": ("experts", "intermediate", "hidden"), "down_proj": ("experts", "hidden", "intermediate")},
)
#: Stored transposed, gate and up interleaved feature by feature ([g0, u0, g1, u1, ...] on the last dim) and biases
#: (gpt-oss): a contiguous slice of the last dim holds whole (gate, up) pairs, the features of the rank's rows of
#: `down_proj`. The down-projection's bias, added to each expert's output before the routing weights, is kept whole
#: and added once over the TP group (`partial_bias`).
MIXER_KIND_EXPERTS_INTERLEAVED = replace(
    MIXER_KIND_EXPERTS,
    name="experts_interleaved",
    description="stacked experts with biases, gate and up interleaved, gate|up [experts, hidden, 2 x intermediate] "
    "and down [experts, intermediate, hidden]",
    holds=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    styles={
        "gate_up_proj": "colwise_transposed",
        "gate_up_proj_bias": "colwise_transposed",
        "down_proj": "colwise",
        "down_proj_bias": "partial_bias",
        "": "moe_tp_experts",
    },
    requires={
        "has_gate": True,
        "is_transposed": True,
        "is_concatenated": False,
        "has_bias": True,
        "has_post_expert_norm": False,
    },
    stacked={
        "gate_up_proj": ("experts", "hidden", "2*intermediate"),
        "gate_up_proj_bias": ("experts", "2*intermediate"),
        "down_proj": ("experts", "intermediate", "hidden"),
        "down_proj_bias": ("experts", "hidden"),
    },
)
#: The kinds of stacked experts, whose split is checked on their shapes (:func:`stacked_sizes`).
EXPERTS_KINDS = (
    MIXER_KIND_EXPERTS,
    MIXER_KIND_EXPERTS_TRANSPOSED,
    MIXER_KIND_EXPERTS_UNGATED,
    MIXER_KIND_EXPERTS_INTERLEAVED,
)
MIXER_KINDS += EXPERTS_KINDS


def rotary_width(attention: nn.Module) -> int | None:
    """The rotary key width of a latent attention (``qk_rope_head_dim``): its own attribute (per layer), else its
    config's; ``None`` when neither holds one."""
    width = getattr(attention, "qk_rope_head_dim", None)
    if not isinstance(width, int):
        width = config_value(getattr(attention, "config", None), "qk_rope_head_dim")
    return width if isinstance(width, int) else None


def per_head_norms(attention: nn.Module, head_dim: int) -> list[str]:
    """The children of ``attention`` holding one 1-D ``weight`` of ``head_dim`` features and no other parameter:
    norms applied to each head (Qwen3's ``q_norm``, Hunyuan's ``query_layernorm``), shared by every head."""
    found = []
    for name, child in attention.named_children():
        params = dict(child.named_parameters())
        weight = params.get("weight")
        if weight is not None and weight.ndim == 1 and weight.numel() == head_dim and set(params) <= {"weight", "bias"}:
            found.append(name)
    return found


#: Marks a block every rank takes whole (a multi-query attention's single K/V head): ``"=kv_dim"``.
WHOLE = "="


def _names(expression: str) -> list[str]:
    """The attribute names a block size expression multiplies (``"=n_groups*ssm_state_size"``)."""
    return expression.removeprefix(WHOLE).split("*")


def _size(module: nn.Module, expression: str) -> int:
    return math.prod(int(getattr(module, name)) for name in _names(expression))


def _whole(expressions: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(i for i, e in enumerate(expressions) if e.startswith(WHOLE))


def attribute(module: nn.Module, path: str) -> object:
    """The attribute at ``path`` (``"norm.n_groups"``: a child's), or ``None``."""
    owner, _, name = path.rpartition(".")
    for part in owner.split(".") if owner else ():
        module = getattr(module, part, None)
    return config_value(module, name)


def _has(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        holder = module.get_submodule(owner) if owner else module
    except AttributeError:
        return False
    return getattr(holder, leaf, None) is not None


def _base(module: nn.Module) -> nn.Module:
    """A PEFT-wrapped layer's base layer (the plan names the wrapper)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") and hasattr(module, "base_layer") else module


def _has_param(module: nn.Module, path: str) -> bool:
    owner, _, leaf = path.rpartition(".")
    try:
        holder = _base(module.get_submodule(owner)) if owner else module
    except AttributeError:
        return False
    return isinstance(getattr(holder, leaf, None), nn.Parameter)


def mixer_kind(module: nn.Module) -> MixerKind | None:
    """The kind of ``module``, or ``None`` when it is not a mixer this package splits by heads."""
    for kind in MIXER_KINDS:
        if all(_has_param(module, path) for path in kind.holds) and not any(_has(module, p) for p in kind.lacks):
            buffers = dict(module.named_buffers())
            # A child's attribute (dotted) is divided where the child has it (Falcon-H1's norm may be an Identity).
            required = [a for a in kind.attributes if "." not in a] if not kind.complete_only else []
            if (
                all(isinstance(attribute(module, a), int) for a in required)
                and set(kind.buffers) <= set(buffers)
                and all(attribute(module, a) == value for a, value in kind.requires.items())
            ):
                return kind
    return None


def find_mixers(model: nn.Module) -> dict[str, MixerKind]:
    """Every head-structured mixer of ``model``: path -> kind."""
    return {name: kind for name, m in model.named_modules() if (kind := mixer_kind(m)) is not None}


def heads_problem(name: str, mixer: nn.Module, kind: MixerKind, tp_size: int) -> str | None:
    """Why ``tp_size`` cannot split this mixer's heads, naming the sizes that work; ``None`` when it can."""
    counts = {a: int(attribute(mixer, a)) for a in kind.heads}
    sizes = {a: c for a, c in counts.items() if c % tp_size}
    if not sizes:
        for path, expressions in kind.blocks.items():
            if _has_param(mixer, path):
                uneven = [e for e in expressions if not e.startswith(WHOLE) and _size(mixer, e) % tp_size]
                if uneven:
                    sizes = {e: _size(mixer, e) for e in uneven}
                    break
    if not sizes:
        return None
    works = [t for t in range(2, max(counts.values()) + 1) if all(c % t == 0 for c in counts.values())]
    return (
        f"{type(mixer).__name__} ({kind.description}) has {counts}: tp_size={tp_size} does not divide {sizes}, so "
        f"its heads cannot be split; TP sizes that split it: {works or 'none above 1'}"
    )


def mixer_entries(name: str, mixer: nn.Module, kind: MixerKind) -> dict[str, str]:
    """The plan entries (full paths) that split the mixer at ``name`` by heads."""
    prefix = f"{name}." if name else ""
    entries = {}
    for path, style in kind.styles.items():
        if not path:
            entries[name] = style
        elif _has(mixer, path):
            entries[prefix + path] = style
    for norm in shared_norm_names(mixer, kind):
        entries[prefix + norm] = "replicated_with_grad_allreduce"
    return entries


def stacked_sizes(mixer: nn.Module, kind: MixerKind) -> dict[str, int] | None:
    """The sizes :attr:`MixerKind.stacked` names, read from the shapes of the mixer's stacked weights.

    Args:
        mixer: An experts module recognised as ``kind`` (it holds every weight ``kind.stacked`` names).
        kind: One of :data:`EXPERTS_KINDS`.

    Returns:
        Size name -> size (``{"experts": 8, "intermediate": 32, "hidden": 64}``), or ``None`` when a shape does not
        fit the layout (other dims, sizes that disagree between the weights, an odd packed pair).
    """
    sizes: dict[str, int] = {}
    for path, dims in kind.stacked.items():
        shape = tuple(getattr(mixer, path).shape)
        if len(shape) != len(dims):
            return None
        for dim, size in zip(dims, shape, strict=True):
            factor, _, size_name = dim.rpartition("*")
            count, left = divmod(size, int(factor or 1))
            if left or sizes.setdefault(size_name, count) != count:
                return None
    return sizes


def shared_norm_names(mixer: nn.Module, kind: MixerKind) -> list[str]:
    """The relative names of the mixer's norms whose gradient is summed over the TP group."""
    names = list(kind.shared_norms)
    if kind in ATTENTION_KINDS and (heads := config_heads(mixer)):
        names += per_head_norms(mixer, mixer.q_proj.weight.shape[0] // heads)
    return [n for n in names if _has(mixer, n)]


def config_heads(attention: nn.Module) -> int | None:
    """The query heads of the config an attention module keeps (``self.config``), or ``None``."""
    config = getattr(attention, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config_value(config, "num_attention_heads")
    return heads if isinstance(heads, int) else None


@dataclass(frozen=True)
class SplitMixer:
    """A mixer split by heads, as its plan holds it: its kind, and what is read from the module once, before its
    head counts are divided (the sizes its kind's block expressions name, which of its optional parameters it holds,
    the width of its norm across ranks). Everything else the split needs is derived from these."""

    kind: MixerKind
    #: The size attributes its kind's ``blocks`` and ``buffers`` expressions name -> their whole values.
    sizes: Mapping[str, int]
    #: The relative paths of its kind's ``blocks`` and ``dims`` that it holds as parameters.
    params: frozenset[str]
    #: The whole width of its :attr:`MixerKind.norm_across_ranks` norm (``None``: no such norm, or no weight).
    norm_width: int | None = None

    def size(self, expression: str) -> int:
        return math.prod(self.sizes[name] for name in _names(expression))

    @property
    def blocks(self) -> dict[str, tuple[int, ...]]:
        """Relative parameter path -> whole block sizes, for its parameters with more than one block."""
        out = {}
        for path, expressions in self.kind.blocks.items():
            if len(expressions) > 1 and path in self.params:
                out[path] = tuple(self.size(e) for e in expressions)
        return out

    @property
    def whole_blocks(self) -> dict[str, tuple[int, ...]]:
        """Relative parameter path -> the indices of its blocks that every rank takes whole (none: absent)."""
        return {
            path: _whole(expressions)
            for path, expressions in self.kind.blocks.items()
            if _whole(expressions) and path in self.params
        }

    @property
    def dims(self) -> dict[str, int]:
        """Relative parameter path -> the dim it is split on, for its parameters not split on dim 0."""
        return {path: dim for path, dim in self.kind.dims.items() if path in self.params}

    @property
    def buffers(self) -> dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """Relative buffer path -> (dim, whole block sizes, indices of the blocks taken whole), for its packed
        buffers."""
        return {
            path: (dim, tuple(self.size(e) for e in expressions), _whole(expressions))
            for path, (dim, expressions) in self.kind.buffers.items()
        }

    def local_sizes(self, tp_size: int) -> dict[str, int]:
        """The attributes of :attr:`MixerKind.local_sizes`, set to the number of rows the rank takes of their
        parameter (the same on every rank)."""
        out = {}
        for attr, path in self.kind.local_sizes.items():
            expressions = self.kind.blocks[path]
            out[attr] = sum(self.size(e) if e.startswith(WHOLE) else self.size(e) // tp_size for e in expressions)
        return out

    @property
    def recurrent(self) -> bool:
        """Whether it is a recurrent mixer (linear attention, a state-space layer), whose heads are its own rather
        than the config's attention heads."""
        return not self.kind.complete_only and self.kind.name != "latent_attention"


def split_mixer(mixer: nn.Module, kind: MixerKind) -> SplitMixer:
    """Read once, before its head counts change, what splitting ``mixer`` as ``kind`` needs (:class:`SplitMixer`)."""
    expressions = [*(e for es in kind.blocks.values() for e in es), *(e for _, es in kind.buffers.values() for e in es)]
    sizes = {name: int(getattr(mixer, name)) for e in expressions for name in _names(e)}
    params = frozenset(path for path in (*kind.blocks, *kind.dims) if _has_param(mixer, path))
    norm = mixer.get_submodule(kind.norm_across_ranks) if kind.norm_across_ranks else None
    width = norm.weight.shape[0] if norm is not None and getattr(norm, "weight", None) is not None else None
    return SplitMixer(kind, sizes, params, width)
