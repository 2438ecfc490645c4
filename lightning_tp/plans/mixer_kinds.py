"""The kinds of sequence mixers split by heads, as data: the linear-attention and state-space layers of hybrid
models, latent, multi-query and dynamic-mask attention.

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

The kinds that describe modules a model's plan usually covers (attention, MLPs, experts) are in
:mod:`lightning_tp.plans.fallback_kinds`; how a module is recognised and what is read from it, in
:mod:`lightning_tp.plans.mixers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace


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
    #: (:func:`lightning_tp.plans.mixers.stacked_sizes`).
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

#: The kinds split by heads wherever a model holds them (none ``complete_only``), in the order they are tried;
#: :data:`lightning_tp.plans.mixers.MIXER_KINDS` adds those of :mod:`lightning_tp.plans.fallback_kinds`.
HEAD_MIXER_KINDS: tuple[MixerKind, ...] = (
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

HEAD_MIXER_KINDS += (
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
HEAD_MIXER_KINDS += (
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
HEAD_MIXER_KINDS += (
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
HEAD_MIXER_KINDS += (
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
HEAD_MIXER_KINDS += (
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


__all__ = [
    "HEAD_MIXER_KINDS",
    "MixerKind",
]
