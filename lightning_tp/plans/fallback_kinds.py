"""The kinds of modules a model's plan usually covers, split like the sequence mixers of
:mod:`lightning_tp.plans.mixer_kinds` only where it leaves them whole (``complete_only``), as data: plain attention,
gated MLPs, and a mixture-of-experts layer's stacked experts (split on each expert's intermediate features, as
Transformers 5.24's plans split them).
"""

from __future__ import annotations

from dataclasses import replace

from lightning_tp.plans.mixer_kinds import MixerKind
from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES

#: The names of an attention's output gate (its values multiply the attention output, per feature or per head).
OUTPUT_GATES = ("gate_proj", "g_proj")
MIXER_KIND_ATTENTION = MixerKind(
    name="attention",
    description="attention with separate q, k, v and output projections",
    holds=("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"),
    # Attention sinks (gpt-oss): one logit per query head, read by the attention function from the module. An output
    # gate (AFMoE's `gate_proj`, LFM3's `g_proj`) splits with the heads where it has one value per query feature or
    # per head, which lightning_tp.plans.mixer_choice checks.
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
#: The kinds applied only where the model's plan leaves the module whole, in the order they are tried.
FALLBACK_KINDS: tuple[MixerKind, ...] = (
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
#: The kinds of stacked experts, whose split is checked on their shapes
#: (:func:`lightning_tp.plans.mixers.stacked_sizes`).
EXPERTS_KINDS = (
    MIXER_KIND_EXPERTS,
    MIXER_KIND_EXPERTS_TRANSPOSED,
    MIXER_KIND_EXPERTS_UNGATED,
    MIXER_KIND_EXPERTS_INTERLEAVED,
)
FALLBACK_KINDS += EXPERTS_KINDS


__all__ = [
    "ATTENTION_KINDS",
    "EXPERTS_KINDS",
    "FALLBACK_KINDS",
    "MIXER_KIND_ATTENTION",
    "MIXER_KIND_ATTENTION_OUT",
    "MIXER_KIND_EXPERTS",
    "MIXER_KIND_EXPERTS_INTERLEAVED",
    "MIXER_KIND_EXPERTS_TRANSPOSED",
    "MIXER_KIND_EXPERTS_UNGATED",
    "MIXER_KIND_MLP",
    "MIXER_KIND_MLP_EXPERTS_MODULES",
    "MIXER_KIND_MLP_PACKED",
    "MIXER_KIND_MLP_UNGATED",
    "MIXER_KIND_MLP_W",
    "OUTPUT_GATES",
]
