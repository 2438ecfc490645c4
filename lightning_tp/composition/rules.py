"""The composition table's rules, as data: what composes with pipeline parallelism (each a parity case), what the
layout check refuses or ignores, and what a model must be for each axis.

The lowest layer: imports nothing of the package but the rule's class.
"""

from __future__ import annotations

from lightning_tp.composition.rule import Rule

RULES: tuple[Rule, ...] = (
    # Next to pipeline parallelism: each a parity case against one process (tests/distributed/test_pipeline.py).
    Rule(
        key="pp+tp",
        axes=("pp", "tp"),
        verdict="allowed",
        when="TP (`tp_size`)",
        ranks="4",
        evidence="at parity (`llama_pp2_tp2`)",
        reason="each stage over its TP group",
    ),
    Rule(
        key="pp+dp_shard",
        axes=("pp", "dp_shard"),
        verdict="allowed",
        when="FSDP2 (`dp_shard_size`)",
        ranks="4",
        evidence="at parity (`qwen3_pp2_dp2`)",
        reason=(
            "each stage its own FSDP2 root; torch's stage reduces the gradients once per schedule step, so "
            '`accumulate_grads="unsharded"` is ignored, with a warning'
        ),
    ),
    Rule(
        key="pp+dp_replicate",
        axes=("pp", "dp_replicate"),
        verdict="allowed",
        when="HSDP (`dp_replicate_size`)",
        ranks="4",
        evidence="at parity (`qwen3_pp2_hsdp`)",
        reason="each stage's FSDP2 root replicated over `dp_replicate`",
    ),
    Rule(
        key="pp+tp_dp_shard",
        axes=("pp", "tp_dp_shard"),
        verdict="allowed",
        when="TP and FSDP2 (3-D)",
        ranks="8",
        evidence="at parity (`llama_pp2_tp2_dp2`, AdamW and clipping)",
        reason="pp 2 x dp_shard 2 x tp 2",
    ),
    Rule(
        key="pp+sequence_parallel",
        axes=("pp", "sp"),
        verdict="allowed",
        when="sequence parallelism",
        ranks="4",
        evidence=(
            "at parity (`llama_pp2_tp2_sp`; with loss parallelism and one layer per stage: "
            "`qwen3_pp2_tp2_sp_lp_interleaved`)"
        ),
        reason=(
            "activations go between stages whole: each stage's first layer cuts the sequence, its last layer "
            "gathers it, so every stage computes masks and positions from the whole sequence"
        ),
    ),
    Rule(
        key="pp+loss_parallel",
        axes=("pp", "loss_parallel"),
        verdict="allowed",
        when="loss parallelism",
        ranks="4",
        evidence="at parity (`qwen3_pp2_tp2_lp`, tied, AdamW, clipping)",
        reason="the last stage's head keeps its logits vocabulary-sharded; the loss runs on the shards",
    ),
    Rule(
        key="pp+ep",
        axes=("pp", "ep"),
        verdict="allowed",
        when="expert parallelism (`ep_size`)",
        ranks="4",
        evidence="at parity (`qwen3_moe_pp2_expert_parallel`)",
        reason="an EP group stays inside one stage (the expert mesh has `pp` outermost)",
    ),
    Rule(
        key="pp+tied",
        axes=("pp", "tied"),
        verdict="allowed",
        when="tied embeddings",
        ranks="2",
        evidence="at parity (`tied_pp2_clip`, `gemma2_pp2_tied`); resumes across pp sizes (`test_checkpoint.py`)",
        reason="the first and last stages each keep a copy, gradients summed between them",
    ),
    Rule(
        key="pp+zero_bubble",
        axes=("pp", "zero_bubble"),
        verdict="allowed",
        when="zero-bubble schedules",
        ranks="2, 4",
        evidence="at parity (`llama_pp2_zbv`, `qwen3_pp2_dualpipev`, `llama_pp2_tp2_zero_bubble`)",
        reason="see above",
    ),
    Rule(
        key="pp+lora",
        axes=("pp", "lora"),
        verdict="allowed",
        when="LoRA (PEFT)",
        ranks="2",
        evidence=("at parity (`qwen3_pp2_lora`); `save_merged` equal to PEFT's `merge_and_unload` of the same weights"),
        reason=(
            "adapters live on their stage; `save_pretrained` gathers every stage's adapters; `save_merged` merges"
            " each stage's on its rank and gathers the merged tensors"
        ),
    ),
    Rule(
        key="pp+from_pretrained",
        axes=("pp", "from_pretrained"),
        verdict="allowed",
        when="a `from_pretrained` model (eval mode)",
        ranks="2",
        evidence="at parity (`qwen3_pp2_from_pretrained`)",
        reason="train or evaluate by the grad mode",
    ),
    Rule(
        key="pp+activation_checkpointing_compile",
        axes=("pp", "activation_checkpointing_compile"),
        verdict="allowed",
        when="activation checkpointing, `compile`",
        ranks="2, 4",
        evidence=(
            "at parity (`qwen3_pp2_compile`, aot_eager, graphs built; activation checkpointing with SP: "
            "`llama_pp2_tp2_sp_activation_checkpointing`; both together with FSDP2 checked by hand)"
        ),
        reason="per decoder layer, as without a pipeline",
    ),
    Rule(
        key="pp+validate",
        axes=("pp", "validate"),
        verdict="allowed",
        when="`Trainer.validate`",
        ranks="2, 4, 8",
        evidence=(
            "every pp case above validates its trained model: one process's loss, on every rank (through FSDP2 "
            "where dp > 1)"
        ),
        reason="a forward-only schedule in inference mode",
    ),
    Rule(
        key="pp+cp",
        axes=("pp", "cp"),
        verdict="allowed",
        when="context parallelism (`cp_size`)",
        ranks="4",
        evidence=(
            "at parity (`llama_pp2_cp2_padded`: left-padded rows at an odd length, AdamW, clipping; "
            '`qwen3_pp2_cp2_ring_packed`: packed documents, `cp_comm="ring"`)'
        ),
        reason=(
            "each stage splits the sequence as the first does (its stand-in embeddings have the whole sequence's "
            "shape; the received chunk replaces them), and the last stage's model computes the loss with CP's "
            "loss function, labels split the same way"
        ),
    ),
    Rule(
        key="pp+router_loss",
        axes=("pp", "router_loss"),
        verdict="allowed",
        when="the router's load-balancing loss (`output_router_logits=True`)",
        ranks="2, 4",
        evidence=(
            "at parity with `GPipe` or `LoopedBFS` (`mixtral_pp2_router_loss_looped`: 4 stages of one layer, "
            "padded rows; `qwen3_moe_pp2_expert_parallel`: with ep 2 over 2 data-parallel ranks); refused by name"
            " with the other schedules"
        ),
        reason=(
            "`E · Σ_e f_e · P_e`, `f_e` and `P_e` means over the whole batch's tokens and every layer: each stage"
            " adds its layers' sums (probabilities, counts, tokens: `2E + 1` numbers) to the ones it received and"
            " sends them on beside its activation, and the last stage keeps each micro-batch's; the loss is "
            "counted once, and its gradient `E · f_e / tokens` reaches every micro-batch's routers back through "
            "the stages. That gradient needs every micro-batch's routing, so the last stage must run all its "
            "forwards before its first backward: 1F1B, the interleaved and the zero-bubble schedules run the "
            "first micro-batch's backward before the last one's forward (and recomputing the routing first would "
            "cost a whole forward more)"
        ),
    ),
    Rule(
        key="pp+cpu_offload",
        axes=("pp", "cpu_offload"),
        verdict="allowed",
        when="`cpu_offload` (FSDP2's, on an accelerator)",
        ranks="4, 8 GPUs",
        evidence=(
            "allowed where it is without pp (an accelerator and data parallelism); `tests/gpu/multi_gpu.py` has "
            "its parity checks on pp 2 x dp 2 (and pp 2 x tp 2 x dp 2 on 8), with a tied embedding and with AdamW"
            " and clipping, not yet run on GPUs; the CPU suite cannot run it (offload has no meaning there)"
        ),
        reason=(
            "each stage's FSDP2 root keeps its shards in host memory and gathers them to the device for its "
            "forward and backward, as without pp (torch's stage never moves its module's parameters); what the "
            "pipeline itself sends between ranks (the tied embedding's values and gradients, `save_pretrained`'s "
            "tensors) goes through the device, since NCCL sends device tensors only"
        ),
    ),
    # Decided from the configuration alone (`ParallelOptions.check_layout`), on every rank, before the process group
    # starts.
    Rule(
        key="pp+compile+split_backward",
        axes=("pp", "compile"),
        verdict="refused",
        when="`compile` with a zero-bubble schedule (`InterleavedZeroBubble`, `ZBVZeroBubble`, `DualPipeV`)",
        reason=(
            "the zero-bubble schedules split each backward into an input- and a weight-gradient pass, which torch "
            "does not support through compiled layers."
        ),
        fix="Drop `compile`, or use a schedule without the split (1F1B, Interleaved1F1B).",
    ),
    Rule(
        key="pp_options_without_pp",
        axes=("pp",),
        verdict="ignored",
        when=(
            "`pp_schedule`, `pp_microbatches`, `pp_stages_per_rank`, `pp_split` or `pp_pad_to_multiple_of` with "
            "pp_size=1"
        ),
        reason="pp_size=1 runs no pipeline.",
        fix="Drop those options, or set `pp_size`.",
    ),
    Rule(
        key="cp_comm_without_cp",
        axes=("cp",),
        verdict="ignored",
        when="`cp_comm` other than `all_gather` with cp_size=1",
        reason="cp_size=1 exchanges no keys and values.",
        fix="Drop `cp_comm`, or set `cp_size`.",
    ),
    Rule(
        key="cp+compile+fullgraph",
        axes=("cp", "compile"),
        verdict="refused",
        when="`compile={'fullgraph': True}` with cp_size > 1",
        reason=(
            "context parallelism's attention runs its tiles outside the compiled graph (their number and masks "
            "follow each batch's documents and padding), so a decoder layer is two graphs around it, not one."
        ),
        fix="Drop `fullgraph`, or use cp_size=1.",
    ),
    Rule(
        key="cpu_offload+cpu",
        axes=("cpu_offload",),
        verdict="refused",
        when="`cpu_offload=True` on `accelerator='cpu'`",
        reason=(
            "FSDP2's offload moves the shards from an accelerator to pinned host memory; on `accelerator='cpu'` the "
            "model is in host memory already."
        ),
        fix="Drop `cpu_offload`.",
    ),
    Rule(
        key="cpu_offload+no_fsdp",
        axes=("cpu_offload", "tp"),
        verdict="refused",
        when="`cpu_offload=True` with neither data nor context parallelism",
        reason="FSDP2's offload needs data or context parallelism, and the layout has neither.",
        fix="Use fewer TP ranks (`tp_size` below the world size) or drop `cpu_offload`.",
    ),
    Rule(
        key="fsdp_param_dtype+full_precision",
        axes=("fsdp_param_dtype",),
        verdict="refused",
        when="`fsdp_param_dtype='bf16'` with `precision='32-true'` or `'16-true'`",
        reason=(
            "it gathers bf16 copies of the parameters for a bf16 forward, but the precision asks for 32- or 16-bit "
            "compute."
        ),
        fix="Use `precision='bf16-mixed'` with it, or drop `fsdp_param_dtype`.",
    ),
    Rule(
        key="fsdp_param_dtype+bf16_true",
        axes=("fsdp_param_dtype",),
        verdict="ignored",
        when="`fsdp_param_dtype='bf16'` with `precision='bf16-true'`",
        reason="the parameters are bf16 already, and so are FSDP2's all-gathers.",
        fix="Drop `fsdp_param_dtype`.",
    ),
    Rule(
        key="fsdp_param_dtype+no_fsdp",
        axes=("fsdp_param_dtype", "tp"),
        verdict="ignored",
        when="`fsdp_param_dtype='bf16'` with neither data nor context parallelism",
        reason=("FSDP2 gathers nothing in this layout; `bf16-mixed` autocasts over fp32 weights as on one device."),
        fix="Drop `fsdp_param_dtype`.",
    ),
    # How context parallelism exchanges keys and values (`cp_comm`): the inspector prints the chosen one's rule.
    Rule(
        key="cp+all_gather",
        axes=("cp",),
        verdict="allowed",
        when="`cp_comm='all_gather'` (the default)",
        ranks="2, 4",
        evidence="at parity (`qwen3_cp2`, `qwen3_cp2_packed`, `gemma2_cp2_tp2_lp`)",
        reason=(
            "each attention layer all-gathers its keys and values over the CP group in one collective before its "
            "tiles, and the backward reduce-scatters their gradients: the most memory (the whole sequence's keys "
            "and values for one layer at a time), the fewest collectives."
        ),
    ),
    Rule(
        key="cp+ring",
        axes=("cp",),
        verdict="allowed",
        when="`cp_comm='ring'`",
        ranks="2, 4",
        evidence="at parity (`granite_swa_cp2_ring_padded`, `qwen3_cp4_ring_packed`)",
        reason=(
            "keys and values pass around the CP group point to point, one other rank's chunk at a time, overlapping "
            "each send with the tiles of the chunk held; their gradients travel beside them in the backward: the "
            "same bytes as the all-gather in cp - 1 steps, with one chunk's keys and values in flight instead of "
            "the whole sequence's."
        ),
    ),
    # What a model must be for each axis: refused before anything moves, read from its structure and config (never
    # its code), the same on every rank. The checks name the model and what it has; the rule says why and what to do.
    Rule(
        key="cp+not_transformers",
        axes=("cp",),
        verdict="refused",
        when="a model that is not a Transformers model",
        reason="context parallelism splits the sequences of Transformers' causal LMs, read from their config.",
        fix="Use tp_size or dp_shard_size for it.",
    ),
    Rule(
        key="cp+composite",
        axes=("cp",),
        verdict="refused",
        when="a composite (vision-language or audio) model",
        reason=(
            "context parallelism supports text causal LMs; image and audio tokens have positions and masks of "
            "their own."
        ),
        fix="Use tp_size or dp_shard_size for it.",
    ),
    Rule(
        key="cp+not_causal",
        axes=("cp",),
        verdict="refused",
        when="a model without causal attention (an encoder, an encoder-decoder)",
        reason="the load-balanced split assumes a causal mask.",
        fix="Use tp_size or dp_shard_size for it.",
    ),
    Rule(
        key="cp+attn_implementation",
        axes=("cp",),
        verdict="refused",
        when="an `attn_implementation` outside Transformers' attention interface",
        reason=(
            "context parallelism runs inside `eager` or an implementation Transformers' attention interface holds "
            "(`sdpa`, `flash_attention_2`, `flex_attention`, ...): its tiles replace the attention of a split "
            "forward, and a forward that decodes runs the model's own."
        ),
        fix='Load the model with `attn_implementation="sdpa"`.',
    ),
    Rule(
        key="cp+sequence_mixers",
        axes=("cp",),
        verdict="refused",
        when="layers that mix the sequence without attention (`config.layer_types`: linear attention, state-space, "
        "convolution)",
        reason=(
            "each rank would see its chunk only: a recurrence over a chunk needs the state the previous rank's chunk "
            "ended with."
        ),
        fix="Use tp_size (their heads are split) or dp_shard_size instead.",
    ),
    Rule(
        key="cp+router_loss",
        axes=("cp",),
        verdict="refused",
        when="a router's load-balancing loss in the model's loss (`output_router_logits=True`)",
        reason="it would be computed over each rank's chunk of the tokens.",
        fix="Set `output_router_logits=False`.",
    ),
    Rule(
        key="cp+custom_loss",
        axes=("cp",),
        verdict="refused",
        when="a model whose `loss_function` is not Transformers' causal-LM loss",
        reason="the split shifts the causal-LM loss's labels before cutting them, and knows no other loss.",
        fix="Keep the model's causal-LM loss, or use cp_size=1.",
    ),
    Rule(
        key="cp+own_attention",
        axes=("cp",),
        verdict="refused",
        when="layers with attention code of their own (`is_backend_compatible()` False: GPT-Neo, Bloom, MPT, Falcon)",
        reason=(
            "Transformers' attention interface is the only place where context parallelism exchanges keys and "
            "values; such layers would attend within each rank's chunk."
        ),
        fix="Run it without `cp_size` (tp_size or dp_shard_size instead).",
    ),
    Rule(
        key="cp+stack_signature",
        axes=("cp",),
        verdict="refused",
        when="a decoder stack whose `forward` takes no `position_ids` or `attention_mask`",
        reason="the split passes the whole sequence's positions and mask to the decoder stack.",
        fix="Use tp_size or dp_shard_size for it.",
    ),
    Rule(
        key="pp+not_transformers",
        axes=("pp",),
        verdict="refused",
        when="a model that is not a Transformers causal LM, or one sharded by Transformers at load time",
        reason="pipeline parallelism cuts Transformers causal LMs along their `base_model_pp_plan`.",
        fix="Load it without `distributed_config`, or use pp_size=1.",
    ),
    Rule(
        key="pp+no_plan",
        axes=("pp",),
        verdict="refused",
        when="no `config.base_model_pp_plan`, and a base model that is not one embedding, one list of layers, one norm",
        reason="there are no stages to cut it into.",
        fix="Use pp_size=1.",
    ),
    Rule(
        key="pp+plan_not_layers",
        axes=("pp",),
        verdict="refused",
        when="a pipeline plan whose second entry is not a list of decoder layers",
        reason="the stages are cut between decoder layers.",
        fix="Use pp_size=1.",
    ),
    Rule(
        key="pp+parameters_outside_plan",
        axes=("pp",),
        verdict="refused",
        when="a base model with parameters outside its pipeline plan",
        reason="no stage would compute them.",
        fix="Use pp_size=1.",
    ),
    Rule(
        key="pp+v_shaped+tied+dp",
        axes=("pp", "dp_shard"),
        verdict="refused",
        when="a V-shaped schedule (`ZBVZeroBubble`, `DualPipeV`) with tied embeddings and FSDP2",
        reason=(
            "it places the first and the last stage on one rank, so the embedding tied to the head is one parameter "
            "in two stages, which FSDP2 shards each on its own and would split into two."
        ),
        fix="Use a loop schedule (Interleaved1F1B, InterleavedZeroBubble), no data parallelism, or untie the "
        "embeddings.",
    ),
    Rule(
        key="pp+custom_loss",
        axes=("pp",),
        verdict="refused",
        when="`set_pipeline_loss` with CP, loss parallelism or a router's loss in the model's",
        reason=(
            "the loss would get the whole micro-batch's logits, but CP gives the last stage its rank's chunk of the "
            "sequence, loss parallelism keeps its logits vocabulary-sharded, and a router's load-balancing loss over "
            "the whole batch would be dropped."
        ),
        fix="Use the model's own loss (its `loss_function`, which those wrap), or drop that parallelism "
        "(`config.output_router_logits=False` for the router's).",
    ),
    Rule(
        key="ep+tp_not_multiple",
        axes=("ep", "tp"),
        verdict="refused",
        when="`ep_size` not a multiple of `tp_size`",
        reason="an EP group holds whole TP groups, whose ranks share one batch.",
        fix="Use a multiple of tp_size.",
    ),
    Rule(
        key="tp+dp+uneven_kv",
        axes=("tp", "dp_shard"),
        verdict="refused",
        when="KV heads replicated over `tp_size` into a width it does not divide, with FSDP2 (data or context "
        "parallelism)",
        reason="the projection's TP shards are uneven, which FSDP2 cannot shard further.",
        fix="Use a tp_size that divides that width, or no data parallelism.",
    ),
    Rule(
        key="tp+presharded+kv_replicated",
        axes=("tp",),
        verdict="refused",
        when="a model sharded by Transformers at load time whose KV heads `tp_size` does not divide",
        reason="Transformers' load-time sharding cannot split KV heads that the TP size does not divide.",
        fix="Load it without `distributed_config`: the strategy then replicates the KV heads (each rank computes "
        "those of its query heads).",
    ),
    Rule(
        key="sp+style_not_rewritable",
        axes=("sp", "tp"),
        verdict="refused",
        when="`sequence_parallel=True` with a decoder layer entry whose style is not column- or row-wise",
        reason="sequence parallelism rewrites a decoder layer's column-/row-wise pairs with torch's styles and knows "
        "no other.",
        fix="Drop `sequence_parallel` for this model, or override that entry.",
    ),
    Rule(
        key="sp+no_rowwise",
        axes=("sp", "tp"),
        verdict="refused",
        when="`sequence_parallel=True` with a decoder layer without a row-wise projection",
        reason="the sequence is scattered again at each row-wise exit: a layer without one has no region to gather.",
        fix="Drop `sequence_parallel` for this model.",
    ),
    Rule(
        key="sp+rowwise_in_layer",
        axes=("sp", "tp"),
        verdict="refused",
        when="`sequence_parallel=True` with a row-wise projection directly in a decoder layer",
        reason="a region's input is its parent module's: here the whole layer, norms and residuals included, with no "
        "attention or MLP module around it.",
        fix="Drop `sequence_parallel` for this model.",
    ),
    Rule(
        key="save_frozen_weights+full_file",
        axes=("checkpoint",),
        verdict="refused",
        when="`save_frozen_weights=False` without `save_distributed_checkpoint=True`",
        reason="a full checkpoint file is loaded weight by weight and must hold every weight.",
        fix="Set `save_distributed_checkpoint=True`, or keep the frozen weights.",
    ),
    Rule(
        key="ep+presharded",
        axes=("ep",),
        verdict="refused",
        when="a model sharded by Transformers at load time (`distributed_config`)",
        reason="its own TP plan split the experts already.",
        fix="Load it without `distributed_config`: the strategy then splits the experts over the EP ranks.",
    ),
    Rule(
        key="ep+sequence_parallel",
        axes=("ep", "sp", "tp"),
        verdict="refused",
        when="`sequence_parallel=True` with ep_size > 1",
        reason=(
            "sequence parallelism gives each TP rank its own tokens, which the experts' dispatch takes for the TP "
            "group's shared ones."
        ),
        fix="Drop one of them.",
    ),
    Rule(
        key="ep+fp16",
        axes=("ep",),
        verdict="refused",
        when="`precision='16-true'` with ep_size > 1",
        reason="FSDP2 (torch 2.13) divides the experts' fp16 gradients twice where a rank holds its experts alone.",
        fix="Use 'bf16-true' or 'bf16-mixed'.",
    ),
    Rule(
        key="ep+no_plan",
        axes=("ep",),
        verdict="refused",
        when="a model without an expert-parallel plan (`base_model_ep_plan`), or one with styles not applied here",
        reason="the strategy knows a model's experts, and how to split them, from that plan only.",
        fix="Use ep_size=1 (a mixture-of-experts plan's `moe_tp_experts` splits each expert over the TP ranks "
        "instead).",
    ),
)


__all__ = ["RULES"]
