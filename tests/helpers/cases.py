"""Parity cases, by name, shared by the multi-process worker (which trains them sharded) and the tests (which train
the same case on one process and compare)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tests.helpers.models import (
    MLP,
    ParityModule,
    TwiceMLP,
    build_causal_lm,
    build_vlm,
    coverage_model,
    dynamic_lm_batches,
    lm_batches,
    mlp_batches,
    packed_lm_batches,
    padded_lm_batches,
    ragged_lm_batches,
    tiny_config,
    vlm_batches,
)


@dataclass
class Case:
    build: Callable[[], Any]
    batches: Callable[[], list]
    optimizer: str = "sgd"
    lr: float = 0.1
    opt_kwargs: dict[str, Any] = field(default_factory=dict)
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    clip: float | None = None
    precision: str = "32-true"
    accumulate: int = 1
    head: bool = False
    call_directly: str | None = None
    trim_padding: bool = False

    #: What the single-process reference builds, when it differs from ``build`` (a pre-sharded load).
    reference_build: Callable[[], Any] | None = None
    #: A long run: validation on ``val_batches()`` after every this many optimizer steps (``val_check_interval``),
    #: with a checkpoint halfway and an export at the end (tests/distributed/worker.py).
    val_every: int | None = None
    val_batches: Callable[[], list] | None = None

    def module(self, *, reference: bool = False) -> ParityModule:
        build = self.reference_build if reference and self.reference_build is not None else self.build
        return ParityModule(
            build,
            optimizer=self.optimizer,
            lr=self.lr,
            head=self.head,
            call_directly=self.call_directly,
            trim_padding=self.trim_padding,
            **self.opt_kwargs,
        )


# Paths relative to the LightningModule, since the module is not a Transformers model.
#: Tiny checkpoints the test session writes (see tests/distributed/conftest.py): a directory holding one
#: sub-directory per config kind ("qwen3", "tied").
CHECKPOINT_ENV = "LIGHTNING_TP_TEST_CHECKPOINT"


def _checkpoint(kind: str) -> str:
    import os

    return os.path.join(os.environ[CHECKPOINT_ENV], kind)


def _from_checkpoint(sharded: bool, kind: str = "qwen3") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, DistributedConfig

    kwargs = {"distributed_config": DistributedConfig(tp_size=2)} if sharded else {}
    model = AutoModelForCausalLM.from_pretrained(_checkpoint(kind), dtype=torch.float32, **kwargs)
    return model.train()


def _pretrained_as_loaded(kind: str) -> Any:
    """``from_pretrained`` from a directory, left in the eval mode it returns."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_checkpoint(kind), dtype=torch.float32)
    assert not model.training
    return model


def _meta_vlm_from_checkpoint(kind: str) -> Any:
    """No ``model_class``: LLaVA's config is not a causal LM's, so ``from_pretrained`` builds it as an
    image-text-to-text model; Gemma 3's causal-LM class is its conditional-generation model."""
    import lightning_tp

    return lightning_tp.from_pretrained(_checkpoint(kind)).train()


def _meta_from_config(kind: str) -> Any:
    """Built on the meta device with no checkpoint (seeded): the strategy initialises it after sharding."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind))


def _meta_initialised_on_one_process(kind: str) -> Any:
    """The single-process reference of a meta build: Transformers' own initialisation of the same meta model, whole
    (seeded as the sharded run is; nothing draws between the build and the initialisation)."""
    model = _meta_from_config(kind)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.initialize_weights()
    return model


def _meta_from_checkpoint(kind: str) -> Any:
    import lightning_tp

    return lightning_tp.from_pretrained(_checkpoint(kind), dtype="auto").train()


def _rank_seeded_llama() -> Any:
    """Each rank builds its model from a different seed (as scripts written for ModelParallelStrategy may)."""
    import os

    return build_causal_lm(tiny_config("llama"), seed=int(os.environ["RANK"]))


MLP_PLAN = {"model.up": "colwise", "model.down": "rowwise"}


def _mlp() -> MLP:
    import torch

    torch.manual_seed(0)
    return MLP()


TWICE_PLAN = {"model.block.up": "colwise", "model.block.down": "rowwise"}


def _twice_mlp() -> TwiceMLP:
    import torch

    torch.manual_seed(0)
    return TwiceMLP()


def _meta_mlp() -> MLP:
    """The plain module built on the meta device: the strategy resets each layer after sharding. Its constructor draws
    exactly what ``reset_parameters`` draws, layer by layer, so the reference is :func:`_mlp` built normally."""
    import torch

    torch.manual_seed(0)
    with torch.device("meta"):
        return MLP()


def _lora(kind: str, config_overrides: dict[str, Any] | None = None, **lora_kwargs: Any) -> Any:
    """The tiny model with LoRA applied the PEFT way; non-zero B (``init_lora_weights=False``) so adapters matter."""
    from peft import LoraConfig, get_peft_model

    config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False, **lora_kwargs}
    return get_peft_model(build_causal_lm(tiny_config(kind, **(config_overrides or {}))), LoraConfig(**config))


def _lora_from_adapter(kind: str) -> Any:
    """An adapter saved by a single process, loaded the PEFT way onto the (unsharded) model to continue training."""
    from peft import PeftModel

    return PeftModel.from_pretrained(
        build_causal_lm(tiny_config(kind)), _checkpoint(f"{kind}_adapter"), is_trainable=True
    )


def _meta_lora(kind: str) -> Any:
    """LoRA with PEFT's default initialisation (B = 0) on a model built on the meta device from a checkpoint."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(_meta_from_checkpoint(kind), LoraConfig(r=4, target_modules="all-linear"))


def _meta_lora_on_one_process(kind: str) -> Any:
    """The single-process reference of :func:`_meta_lora`: the same build, materialised whole on one process (the base
    read from its files, the adapters initialised the PEFT way)."""
    import torch

    from lightning_tp.checkpoint.loading import materialize
    from lightning_tp.parallel.lora import initialize_adapters

    model = _meta_lora(kind)
    materialize(model.get_base_model(), torch.device("cpu"), tied={})
    initialize_adapters(model)
    return model


_CLIP_LAYERS = "model.vision_tower.encoder.layers.*"
LLAVA_VISION_PLAN = {
    **{f"{_CLIP_LAYERS}.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")},
    f"{_CLIP_LAYERS}.self_attn.out_proj": "rowwise",
    f"{_CLIP_LAYERS}.mlp.fc1": "colwise",
    f"{_CLIP_LAYERS}.mlp.fc2": "rowwise",
    "model.multi_modal_projector.linear_1": "colwise",
    "model.multi_modal_projector.linear_2": "rowwise",
}


def _longcat_moe() -> Any:
    """LongCat-Flash's tiny config from the coverage benchmark (latent attention, routed and identity experts)."""
    return coverage_model("longcat_flash")


def _with_expert_biases(kind: str) -> Any:
    """``kind``'s tiny model with its experts' biases drawn (Transformers initialises them to zeros, which would
    hide a bias added more than once in the first forward)."""
    import torch

    model = build_causal_lm(tiny_config(kind))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def coverage_lm(family: str) -> Case:
    """A case of the coverage benchmark's tiny model of ``family`` on its batches (3 steps)."""
    return Case(partial(coverage_model, family), _coverage_batches)


def _coverage_batches() -> list:
    from benchmarks import coverage

    return coverage.lm_batches(coverage.VOCAB)


def lora_case(kind: str, steps: int = 3, **lora_kwargs: Any) -> Case:
    return Case(partial(_lora, kind, **lora_kwargs), partial(lm_batches, steps), optimizer="adamw", lr=1e-2)


def odd_lm_batches(steps: int) -> list[dict[str, Any]]:
    """:func:`lm_batches` cut to 15 positions: a length no TP size above 1 divides."""
    return [{key: value[:, :15] for key, value in batch.items()} for batch in lm_batches(steps)]


def lm(kind: str, steps: int = 5, *, config: dict[str, Any] | None = None, **kwargs: Any) -> Case:
    """A causal-LM case: the tiny model of ``kind`` (seeded, its config changed by ``config``), trained on ``steps``
    fixed batches."""
    return Case(partial(build_causal_lm, tiny_config(kind, **(config or {}))), partial(lm_batches, steps), **kwargs)


#: Pipeline cases: 4 decoder layers (Qwen3's layer types follow), 2 pipeline ranks, no TP.
_DEEP = {"num_hidden_layers": 4}
_DEEP_QWEN3 = {**_DEEP, "layer_types": ["full_attention"] * 4}
_PP2 = {"tp_size": 1, "pp_size": 2}

CASES: dict[str, Case] = {
    "qwen3_sgd": lm("qwen3", 5),
    "llama_sgd": lm("llama", 5),
    "tied_sgd": lm("tied", 5),
    "qwen3_moe_sgd": lm("qwen3_moe", 5),
    "phi3_sgd": lm("phi3", 5),
    "granite_swa_sgd": lm("granite_swa", 5),
    # Plans derived from the module structure (no `base_model_tp_plan` in the config).
    "gpt_neo_derived": lm("gpt_neo", 4),
    "opt_derived": lm("opt", 4),
    "stablelm_derived": lm("stablelm", 4, optimizer="adamw", lr=1e-3),
    "gpt_bigcode_derived": lm("gpt_bigcode", 4),
    "gpt2_derived": lm("gpt2", 4, optimizer="adamw", lr=1e-3),
    "falcon_derived": lm("falcon", 4),
    # Falcon-40B/180B's layout: q, k, v grouped per KV head, attention and MLP in parallel (added in place).
    "falcon_grouped_derived": lm(
        "falcon", 3, config={"new_decoder_architecture": True, "num_kv_heads": 2, "parallel_attn": True}
    ),
    # Multi-query attention ([q | k | v], one K/V head): each rank takes its q slice and all of k and v.
    "gpt_bigcode_multi_query_derived": lm("gpt_bigcode", 3, config={"multi_query": True}),
    "bloom_derived": lm("bloom", 4),
    "mpt_derived": lm("mpt", 4),
    # Sequence and loss parallelism on derived plans: Bloom (ALiBi sliced per rank, an embedding norm before the
    # layers), GPT-Neo (its attention region inside a wrapper module).
    "bloom_derived_sp_lp": lm("bloom", 3, strategy_kwargs={"sequence_parallel": True, "loss_parallel": True}),
    "gpt_neo_derived_sp_lp": lm("gpt_neo", 3, strategy_kwargs={"sequence_parallel": True, "loss_parallel": True}),
    # KV-head replication: TP 2 over 1 KV head (Qwen3's k_norm sums its gradient), over 3 KV heads for 6 query heads
    # (rank 0 reads KV heads 0, 0, 1: expanded to one per query head), on a derived plan (local_heads), with sequence
    # and loss parallelism, with LoRA on k_proj/v_proj; TP 4 over 2 KV heads (4-process launch).
    "qwen3_kv1": lm("qwen3", 4, config={"num_key_value_heads": 1}),
    "llama_kv3_of_6": lm("llama", 4, config={"num_attention_heads": 6, "num_key_value_heads": 3}),
    "stablelm_kv1_derived": lm("stablelm", 4, config={"num_key_value_heads": 1}),
    "qwen3_kv1_sp_lp": lm(
        "qwen3",
        3,
        config={"num_key_value_heads": 1},
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        strategy_kwargs={"sequence_parallel": True, "loss_parallel": True},
    ),
    "qwen3_kv1_lora": Case(
        partial(_lora, "qwen3", {"num_key_value_heads": 1}), partial(lm_batches, 3), optimizer="adamw", lr=1e-2
    ),
    "qwen3_tp4": lm("qwen3", 3, strategy_kwargs={"tp_size": 4}),
    "qwen3_lora_tp4": Case(
        partial(_lora, "qwen3"),
        partial(lm_batches, 3),
        optimizer="adamw",
        lr=1e-2,
        strategy_kwargs={"tp_size": 4},
    ),
    # Vision-language models: the text model sharded by its plan, the vision tower and projector (no plan entries)
    # replicated over the TP group, trained on image batches.
    "qwen2_5_vl_sgd": Case(partial(build_vlm, "qwen2_5_vl"), partial(vlm_batches, "qwen2_5_vl", 3)),
    # (lr 0.02: at 0.1 the projector weight grows to ~27 in 3 steps, where 1e-5 is 4 fp32 ulps.)
    "gemma3_sgd": Case(partial(build_vlm, "gemma3"), partial(vlm_batches, "gemma3", 3), lr=0.02),
    "llava_sgd": Case(partial(build_vlm, "llava"), partial(vlm_batches, "llava", 3)),
    "qwen2_5_vl_sp_lp": Case(
        partial(build_vlm, "qwen2_5_vl"),
        partial(vlm_batches, "qwen2_5_vl", 3),
        strategy_kwargs={"sequence_parallel": True, "loss_parallel": True},
    ),
    # Built on the meta device and loaded sharded from files `save_pretrained` wrote under the original layouts'
    # names (LLaVA's and Gemma 3's `language_model.model.*`, renamed by Transformers when it loads).
    "llava_meta_load": Case(
        partial(_meta_vlm_from_checkpoint, "llava"),
        partial(vlm_batches, "llava", 2),
        reference_build=partial(build_vlm, "llava"),
    ),
    "gemma3_meta_load": Case(
        partial(_meta_vlm_from_checkpoint, "gemma3"),
        partial(vlm_batches, "gemma3", 2),
        lr=0.02,
        reference_build=partial(build_vlm, "gemma3"),
    ),
    # LLaVA with plan entries for its vision tower and projector too: the CLIP layers sharded by them (plain TP: the
    # tower's sequence is the patches), the language model's layers under sequence and loss parallelism.
    "llava_vision_plan_sp_lp": Case(
        partial(build_vlm, "llava"),
        partial(vlm_batches, "llava", 3),
        strategy_kwargs={"tp_plan": LLAVA_VISION_PLAN, "sequence_parallel": True, "loss_parallel": True},
    ),
    # The other style names on a dense model: hidden-dim embedding, gathered MLP with a locally split down_proj.
    "llama_alt_styles": lm(
        "llama",
        5,
        strategy_kwargs={
            "tp_plan": {
                "model.embed_tokens": "embedding_colwise",
                "model.layers.*.mlp.gate_proj": "colwise_rep",
                "model.layers.*.mlp.up_proj": "colwise_rep",
                "model.layers.0.mlp.down_proj": "rowwise_rep",
                "model.layers.1.mlp.down_proj": "rowwise_split_input",
                "lm_head": "replicate",
            }
        },
    ),
    "mlp_custom_plan": Case(_mlp, partial(mlp_batches, 5), strategy_kwargs={"tp_plan": MLP_PLAN}),
    # A plain module under data parallelism only (training_step calls `self.model(x)`: each child of the
    # LightningModule is its own FSDP2 unit).
    "mlp_fsdp_only": Case(_mlp, partial(mlp_batches, 4), strategy_kwargs={"tp_plan": MLP_PLAN, "tp_size": 1}),
    # A plain module whose block (its own FSDP2 unit) runs twice per forward, and a second child of the
    # LightningModule (`self.head`) called from training_step on its own; foreach AdamW.
    "plain_twice_with_head": Case(
        _twice_mlp,
        partial(mlp_batches, 4),
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        head=True,
        strategy_kwargs={"tp_plan": TWICE_PLAN, "fsdp_blocks": ["Block"]},
    ),
    # training_step calls `self.model.norm(x)` on its own, then `self.model` twice: the norm's class is named in
    # `fsdp_blocks`, so it is a unit with its own hooks.
    "plain_direct_call": Case(
        _mlp,
        partial(mlp_batches, 4),
        optimizer="adamw",
        lr=1e-2,
        call_directly="model.norm",
        strategy_kwargs={"tp_plan": MLP_PLAN, "fsdp_blocks": ["LayerNorm"]},
    ),
    # Each rank builds the model from its own seed (seed + rank): rank 0's values are taken, so the run equals one
    # process built with rank 0's seed.
    "llama_rank_seeded": Case(
        _rank_seeded_llama,
        partial(lm_batches, 3),
        reference_build=partial(build_causal_lm, tiny_config("llama"), seed=0),
    ),
    "mlp_meta_init": Case(
        _meta_mlp, partial(mlp_batches, 5), strategy_kwargs={"tp_plan": MLP_PLAN}, reference_build=_mlp
    ),
    # AdamW with foreach and fused kernels (CUDA's default is foreach), and clipping by the global norm.
    "qwen3_adamw_foreach_clip": lm(
        "qwen3",
        5,
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
    ),
    # Gradient accumulation over 2 micro-batches.
    "llama_accumulate": lm("llama", 6, accumulate=2),
    # The same, FSDP2 keeping whole gradients until each step's last micro-batch (one reduce-scatter per step).
    "llama_accumulate_unsharded": lm("llama", 6, accumulate=2, strategy_kwargs={"accumulate_grads": "unsharded"}),
    # Sharded by Transformers at load time: recognised, not sharded twice, and trained with foreach AdamW.
    "presharded_adamw_foreach": Case(
        partial(_from_checkpoint, True),
        partial(lm_batches, 3),
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        reference_build=partial(_from_checkpoint, False),
    ),
    # Built on the meta device, sharded, then each rank reads its slices of the safetensors files.
    "qwen3_meta_load": Case(
        partial(_meta_from_checkpoint, "qwen3"),
        partial(lm_batches, 3),
        reference_build=partial(_from_checkpoint, False),
    ),
    "tied_meta_load": Case(
        partial(_meta_from_checkpoint, "tied"),
        partial(lm_batches, 3),
        reference_build=partial(_from_checkpoint, False, "tied"),
    ),
    # Random initialisation after sharding: each shard a slice of the whole tensor one process draws.
    "qwen3_meta_init": Case(
        partial(_meta_from_config, "qwen3"),
        partial(lm_batches, 2),
        reference_build=partial(_meta_initialised_on_one_process, "qwen3"),
    ),
    # Head-split mixers initialised after sharding: Transformers sizes what it writes by the head counts TP divided
    # (`A_log`), and writes Falcon-H1's whole muP vector into its (unsaved) buffer.
    "qwen3_5_meta_init": Case(
        partial(_meta_from_config, "qwen3_5"),
        partial(lm_batches, 2),
        reference_build=partial(_meta_initialised_on_one_process, "qwen3_5"),
    ),
    "falcon_h1_meta_init": Case(
        partial(_meta_from_config, "falcon_h1"),
        partial(lm_batches, 2),
        reference_build=partial(_meta_initialised_on_one_process, "falcon_h1"),
    ),
    # ... with tied embeddings (lm_head's init redraws the shared weight) and with MoE experts (packed weights).
    "tied_meta_init": Case(
        partial(_meta_from_config, "tied"),
        partial(lm_batches, 2),
        reference_build=partial(_meta_initialised_on_one_process, "tied"),
    ),
    "qwen3_moe_meta_init": Case(
        partial(_meta_from_config, "qwen3_moe"),
        partial(lm_batches, 2),
        reference_build=partial(_meta_initialised_on_one_process, "qwen3_moe"),
    ),
    "qwen3_activation_checkpointing": lm(
        "qwen3",
        3,
        strategy_kwargs={"activation_checkpointing": True},
    ),
    # bf16-mixed with fp32 all-gathers (autocast over fp32 weights, as on one device: `fsdp_param_dtype=None`), and
    # with FSDP2's bf16 all-gathers, the default (2-D only).
    "qwen3_bf16_mixed": lm("qwen3", 3, precision="bf16-mixed", strategy_kwargs={"fsdp_param_dtype": None}),
    "qwen3_bf16_all_gather": lm("qwen3", 3, precision="bf16-mixed"),
    # HSDP: two replicas of a (shard 1 x tp 2) group on 4 ranks.
    "qwen3_hsdp": lm("qwen3", 3, strategy_kwargs={"dp_replicate_size": 2}),
    # HSDP with accumulation: the all-reduce across the replicas waits for each step's last micro-batch.
    "qwen3_hsdp_accumulate": lm("qwen3", 4, accumulate=2, strategy_kwargs={"dp_replicate_size": 2}),
    # A value head outside the Transformers model: replicated over TP (FSDP2 in 2-D), foreach AdamW.
    "qwen3_with_head": lm(
        "qwen3",
        3,
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        head=True,
    ),
    # Tied embedding and lm_head left whole by the plan: still one parameter.
    "tied_replicated": lm(
        "tied",
        3,
        strategy_kwargs={"tp_plan": {"model.embed_tokens": "replicate", "lm_head": "replicate"}},
    ),
    # q/k/v gathered: q/k norms see every head, so their gradients must not be summed over the TP group.
    "qwen3_gathered_attention": lm(
        "qwen3",
        3,
        strategy_kwargs={
            "tp_plan": {
                "model.layers.*.self_attn.q_proj": "colwise_rep",
                "model.layers.*.self_attn.k_proj": "colwise_rep",
                "model.layers.*.self_attn.v_proj": "colwise_rep",
                "model.layers.*.self_attn.o_proj": "rowwise_split_input",
            }
        },
    ),
    # FSDP2 keeping gathered weights between forward and backward (2-D only).
    "qwen3_no_reshard": lm(
        "qwen3",
        3,
        strategy_kwargs={"reshard_after_forward": False},
    ),
    # LoRA on every linear layer (column-wise bases shard lora_B, row-wise bases shard lora_A), rsLoRA, and LoRA on
    # the vocabulary-sharded embedding (adapters whole).
    "qwen3_lora": lora_case("qwen3"),
    # The 2026 families: a hybrid whose Gated DeltaNet mixer is split by heads (its fused q|k|v projection and conv
    # by blocks), and multi-head latent attention that the model's own plan leaves whole. LoRA on every linear layer,
    # the mixers' in/out projections included.
    "qwen3_5_hybrid_sgd": lm("qwen3_5", 3),
    "deepseek_v3_mla_sgd": lm("deepseek_v3", 3),
    "nemotron_h_mamba2_sgd": lm("nemotron_h", 3),
    # One group of B/C, whole on every rank; the gated norm's mean square summed over the TP group.
    "bamba_one_group_sgd": lm("bamba", 3),
    # Kimi Delta Attention split by heads: a low-rank forget gate, `A_log` split on its dim 2 (Kimi-Linear, with a
    # latent-attention layer); a full-rank gate, and latent attention with a head-wise output gate (Ling 3).
    "kimi_linear_kda_sgd": coverage_lm("kimi_linear"),
    "bailing_hybrid_kda_sgd": coverage_lm("bailing_hybrid"),
    # Doge's dynamic-mask attention: per-KV-head scores from every head's values, reduce-scattered to the rank.
    "doge_dynamic_mask_sgd": coverage_lm("doge"),
    # MiniMax's lightning attention: per-head decays sliced per call, a norm over every head summed over TP.
    "minimax_lightning_sgd": coverage_lm("minimax"),
    # Llama 4's experts (`packed_rowwise` gate/up stored [in, out]) and its shared expert added in place.
    "llama4_moe_sgd": lm(
        "llama4_text", 3, config={"moe_layers": [1, 3], "num_local_experts": 4, "intermediate_size": 32}
    ),
    # gpt-oss's experts (stored [in, out], gate and up interleaved, biases): each rank a contiguous slice of every
    # expert's (gate, up) pairs and of its down-projection, the down-projection's bias added once over TP.
    "gpt_oss_experts_sgd": Case(partial(_with_expert_biases, "gpt_oss"), partial(lm_batches, 3)),
    # Granite 4: its shared MLP (input_linear [gate | up]) split per half, beside the experts and a Mamba2 mixer.
    "granitemoehybrid_shared_mlp_sgd": lm("granitemoehybrid", 3),
    # SGD: AdamW's normalised step turns the rounding-level gradient differences of the delta rule's near-zero
    # entries into full-size updates (first-step gradients agree to 3e-6 relative; the losses drifted 3e-4 by step 3).
    "qwen3_5_hybrid_lora": Case(partial(_lora, "qwen3_5"), partial(lm_batches, 3)),
    # Every projection of the latent attention: the KV down-projection's adapters too, under its rotary gradient sum.
    "deepseek_v3_mla_lora": lora_case(
        "deepseek_v3", target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    ),
    "llama_rslora": lora_case("llama", use_rslora=True),
    "qwen3_lora_embedding": lora_case("qwen3", target_modules=["embed_tokens", "q_proj", "o_proj", "down_proj"]),
    "qwen3_lora_from_adapter": Case(
        partial(_lora_from_adapter, "qwen3"), partial(lm_batches, 3), optimizer="adamw", lr=1e-2
    ),
    # New adapters on a meta model: lora_A drawn whole and sliced, as one process draws it (B = 0).
    "qwen3_meta_lora": Case(
        partial(_meta_lora, "qwen3"),
        partial(lm_batches, 2),
        optimizer="adamw",
        lr=1e-2,
        reference_build=partial(_meta_lora_on_one_process, "qwen3"),
    ),
    "llama_adamw_fused": lm(
        "llama",
        5,
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"fused": True},
    ),
    # Sequence parallelism, loss parallelism, both (with foreach AdamW and clipping), and loss parallelism on a tied
    # model whose vocabulary (97) the TP size does not divide; -100 labels in every batch (see `lm_batches`).
    "qwen3_sequence_parallel": lm("qwen3", 4, strategy_kwargs={"sequence_parallel": True}),
    "llama_loss_parallel": lm("llama", 4, strategy_kwargs={"loss_parallel": True}),
    "qwen3_sp_lp_adamw_clip": lm(
        "qwen3",
        4,
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        strategy_kwargs={"sequence_parallel": True, "loss_parallel": True},
    ),
    # A sequence length (15) the TP size does not divide: padded to 16 between the regions, cut off where gathered.
    "qwen3_sp_lp_odd_length": Case(
        partial(build_causal_lm, tiny_config("qwen3")),
        partial(odd_lm_batches, 4),
        strategy_kwargs={"sequence_parallel": True, "loss_parallel": True},
    ),
    "tied_uneven_vocab_sp_lp": Case(
        partial(build_causal_lm, tiny_config("tied", vocab_size=97)),
        partial(lm_batches, 4),
        strategy_kwargs={"sequence_parallel": True, "loss_parallel": True},
    ),
    # Context parallelism: each sequence split over 2 ranks (2 processes: cp 2; 4 processes: cp 2 x tp 2, cp 2 x dp 2).
    # Foreach AdamW with clipping; left padding with an odd length (padded to the split's multiple); packed sequences
    # (position ids restarting); Gemma 2's sliding-window layers and softcapping (eager); sinks; activation
    # checkpointing with FSDP2 units that are not decoder layers (the MLPs); LoRA on every linear layer.
    "qwen3_cp2": lm(
        "qwen3", 4, optimizer="adamw", lr=1e-3, opt_kwargs={"foreach": True}, clip=0.5, strategy_kwargs={"cp_size": 2}
    ),
    "llama_cp2_padded": Case(
        partial(build_causal_lm, tiny_config("llama")), partial(padded_lm_batches, 3), strategy_kwargs={"cp_size": 2}
    ),
    "qwen3_cp2_packed": Case(
        partial(build_causal_lm, tiny_config("qwen3")), partial(packed_lm_batches, 3), strategy_kwargs={"cp_size": 2}
    ),
    "gemma2_cp2": lm("gemma2", 3, lr=0.02, strategy_kwargs={"cp_size": 2}),
    # Attention sinks (one logit per head with no value) and sliding windows, on left-padded rows (eager).
    "granite_swa_cp2_padded": Case(
        partial(build_causal_lm, tiny_config("granite_swa")),
        partial(padded_lm_batches, 3),
        strategy_kwargs={"cp_size": 2},
    ),
    "qwen3_cp2_activation_checkpointing": lm(
        "qwen3",
        3,
        strategy_kwargs={
            "cp_size": 2,
            "activation_checkpointing": True,
            "fsdp_blocks": ["Qwen3DecoderLayer", "Qwen3MLP"],
        },
    ),
    # Mixture of experts with zero-computation (identity) experts: one rank's tokens leave an expert without any, so
    # its weights get no gradient there (FSDP2 reduce-scatters only what has one: the ranks' collectives mismatched).
    "longcat_moe_cp2": Case(_longcat_moe, _coverage_batches, strategy_kwargs={"cp_size": 2}),
    "qwen3_cp2_lora": Case(
        partial(_lora, "qwen3"), partial(lm_batches, 3), optimizer="adamw", lr=1e-2, strategy_kwargs={"cp_size": 2}
    ),
    # cp 2 x tp 2 (plain; with sequence and loss parallelism on padded batches; Gemma 2 with loss parallelism), and
    # cp 2 x dp_shard 2 (FSDP2 over all 4 ranks).
    "qwen3_cp2_tp2": lm("qwen3", 3, strategy_kwargs={"cp_size": 2}),
    "llama_cp2_tp2_sp_lp": Case(
        partial(build_causal_lm, tiny_config("llama")),
        partial(padded_lm_batches, 3),
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        strategy_kwargs={"cp_size": 2, "sequence_parallel": True, "loss_parallel": True},
    ),
    "gemma2_cp2_tp2_lp": lm("gemma2", 3, lr=0.02, strategy_kwargs={"cp_size": 2, "loss_parallel": True}),
    "qwen3_cp2_dp2": lm("qwen3", 3, strategy_kwargs={"cp_size": 2, "tp_size": 1}),
    # The ring exchange (`cp_comm="ring"`): keys and values passed point to point, their gradients travelling beside
    # them; on 2 ranks (sinks, windows, left padding) and around a ring of 4 (packed documents).
    "granite_swa_cp2_ring_padded": Case(
        partial(build_causal_lm, tiny_config("granite_swa")),
        partial(padded_lm_batches, 3),
        strategy_kwargs={"cp_size": 2, "cp_comm": "ring"},
    ),
    "qwen3_cp4_ring_packed": Case(
        partial(build_causal_lm, tiny_config("qwen3")),
        partial(packed_lm_batches, 3),
        strategy_kwargs={"cp_size": 4, "tp_size": 1, "cp_comm": "ring"},
    ),
    # torch.compile per decoder layer: TP 2 with sequence parallelism at 12 layers, each layer one graph, shared by
    # the layers (`fullgraph`: a graph break, or a recompilation per layer past dynamo's limit of 8, fails the case;
    # the graphs built are counted), foreach AdamW, clipping; in 2-D with activation checkpointing and LoRA (breaks
    # allowed).
    # TP 2 and LoRA compile with the `aot_eager` backend: what they check is the tracing of the sharded layers (with
    # PEFT's over DTensors) and their gradients through AOTAutograd; inductor's kernels are the 2-D case's
    # (`compile=True`, with activation checkpointing). A cold inductor compile of the TP 2 case took 43 s of the suite.
    "qwen3_compile": lm(
        "qwen3",
        3,
        config={"num_hidden_layers": 12, "layer_types": ["full_attention"] * 12},
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        strategy_kwargs={"compile": {"fullgraph": True, "backend": "aot_eager"}, "sequence_parallel": True},
    ),
    "qwen3_compile_activation_checkpointing": lm(
        "qwen3", 3, strategy_kwargs={"compile": True, "activation_checkpointing": True}
    ),
    "qwen3_lora_compile": Case(
        partial(_lora, "qwen3"),
        partial(lm_batches, 3),
        optimizer="adamw",
        lr=1e-2,
        strategy_kwargs={"compile": {"backend": "aot_eager"}},
    ),
    # Pipeline parallelism (4 decoder layers): pp 2 with 1F1B (one stage per rank), Interleaved1F1B (two per rank: 4
    # stages of one layer), GPipe over 4 micro-batches with foreach AdamW, clipping (the norm over both stages) and
    # gradient accumulation, LoRA; on 4 ranks pp 2 x tp 2 and pp 2 x dp 2 (FSDP2 on each stage).
    "llama_pp2": lm("llama", 4, config=_DEEP, strategy_kwargs=_PP2),
    # What a real run does, small: 8 layers, 200 steps of 12 lengths (dynamic padding), validation every 50 steps, a
    # checkpoint at step 100 and an export at the end, in 2-D (dp_shard 2 x tp 2).
    "llama8_long_run": Case(
        partial(build_causal_lm, tiny_config("llama", num_hidden_layers=8, hidden_size=16, intermediate_size=32)),
        partial(dynamic_lm_batches, 200),
        lr=0.01,  # small steps: 200 of them amplify a rounding's difference little
        val_every=50,
        val_batches=partial(dynamic_lm_batches, 1, seed=9),
    ),
    # Dynamic padding: 12 steps of 12 lengths. The pipeline keeps its stages for the last KEPT_SHAPES shapes only;
    # padded to multiples of 8, the lengths (9 to 20) take 2 shapes.
    "llama_pp2_dynamic_lengths": Case(
        partial(build_causal_lm, tiny_config("llama", **_DEEP)),
        partial(dynamic_lm_batches, 12),
        strategy_kwargs=_PP2,
    ),
    "llama_pp2_bucketed_lengths": Case(
        partial(build_causal_lm, tiny_config("llama", **_DEEP)),
        partial(dynamic_lm_batches, 12),
        strategy_kwargs={**_PP2, "pp_pad_to_multiple_of": 8},
    ),
    "qwen3_pp2_interleaved": lm("qwen3", 4, config=_DEEP_QWEN3, strategy_kwargs={**_PP2, "pp_stages_per_rank": 2}),
    "llama_pp2_gpipe_adamw_clip_accumulate": lm(
        "llama",
        4,
        config=_DEEP,
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        accumulate=2,
        strategy_kwargs={**_PP2, "pp_schedule": "GPipe", "pp_microbatches": 4},
    ),
    "qwen3_pp2_lora": Case(
        partial(_lora, "qwen3", _DEEP_QWEN3), partial(lm_batches, 3), optimizer="adamw", lr=1e-2, strategy_kwargs=_PP2
    ),
    # Loaded as the README loads a model: `from_pretrained` from a directory, which returns it in eval mode (Lightning
    # keeps a submodule's mode): it trains so, as on one process (the reference loads it the same way).
    "qwen3_pp2_from_pretrained": Case(
        partial(_pretrained_as_loaded, "qwen3"), partial(lm_batches, 3), strategy_kwargs=_PP2
    ),
    # Input embedding tied to the head (`tie_word_embeddings`): the first stage's copy and the last stage's, their
    # gradients summed, the clipped norm counting it once; Gemma 2 (tied, scaled embedding, softcapping) with AdamW.
    "tied_pp2_clip": lm("tied", 3, config=_DEEP_QWEN3, optimizer="adamw", lr=1e-3, clip=0.5, strategy_kwargs=_PP2),
    "gemma2_pp2_tied": lm(
        "gemma2",
        3,
        config={**_DEEP, "layer_types": ["sliding_attention", "full_attention"] * 2},
        optimizer="adamw",
        lr=1e-3,
        strategy_kwargs=_PP2,
    ),
    "llama_pp2_zbv": lm(
        "llama", 3, config=_DEEP, strategy_kwargs={**_PP2, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 2}
    ),
    # V-shaped with tied embeddings: the first and the last stage on rank 0 share the one parameter.
    "tied_pp2_zbv": lm(
        "tied",
        3,
        config=_DEEP_QWEN3,
        optimizer="adamw",
        lr=1e-3,
        strategy_kwargs={**_PP2, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 2},
    ),
    "qwen3_pp2_dualpipev": lm(
        "qwen3", 3, config=_DEEP_QWEN3, strategy_kwargs={**_PP2, "pp_schedule": "DualPipeV", "pp_stages_per_rank": 2}
    ),
    "llama_pp2_tp2_zero_bubble": lm(
        "llama",
        3,
        config=_DEEP,
        strategy_kwargs={"tp_size": 2, "pp_size": 2, "pp_schedule": "InterleavedZeroBubble", "pp_stages_per_rank": 2},
    ),
    "llama_pp2_tp2": lm("llama", 3, config=_DEEP, strategy_kwargs={"tp_size": 2, "pp_size": 2}),
    # Each decoder layer compiled (aot_eager) on its stage (activation checkpointing under pp: the SP case below).
    "qwen3_pp2_compile": lm(
        "qwen3", 3, config=_DEEP_QWEN3, strategy_kwargs={**_PP2, "compile": {"backend": "aot_eager"}}
    ),
    # The 3-D layout on 8 processes: 2 stages, each over dp_shard 2 x tp 2 (FSDP2 over TP shards), AdamW and clipping.
    "llama_pp2_tp2_dp2": lm(
        "llama",
        3,
        config=_DEEP,
        optimizer="adamw",
        lr=1e-3,
        clip=0.5,
        strategy_kwargs={"tp_size": 2, "pp_size": 2, "dp_shard_size": 2},
    ),
    "llama_pp2_tp2_sp_activation_checkpointing": lm(
        "llama",
        3,
        config=_DEEP,
        strategy_kwargs={"tp_size": 2, "pp_size": 2, "sequence_parallel": True, "activation_checkpointing": True},
    ),
    "llama_pp2_tp2_sp": lm(
        "llama", 3, config=_DEEP, strategy_kwargs={"tp_size": 2, "pp_size": 2, "sequence_parallel": True}
    ),
    # Interleaved: stages of one layer each, which cuts the sequence and gathers it again.
    "qwen3_pp2_tp2_sp_lp_interleaved": lm(
        "qwen3",
        3,
        config=_DEEP_QWEN3,
        strategy_kwargs={
            "tp_size": 2,
            "pp_size": 2,
            "pp_stages_per_rank": 2,
            "sequence_parallel": True,
            "loss_parallel": True,
        },
    ),
    "qwen3_pp2_tp2_lp": lm(
        "tied",
        3,
        config=_DEEP_QWEN3,
        optimizer="adamw",
        lr=1e-3,
        clip=0.5,
        strategy_kwargs={"tp_size": 2, "pp_size": 2, "loss_parallel": True},
    ),
    "qwen3_pp2_dp2": lm("qwen3", 3, config=_DEEP_QWEN3, strategy_kwargs=_PP2),
    # Each data-parallel replica trims its half's trailing padding: on odd steps the replicas' lengths differ, and one
    # would meet a new shape alone (the replicas agree on the longest and pad to it).
    "llama_pp2_dp2_ragged": Case(
        partial(build_causal_lm, tiny_config("llama", **_DEEP)),
        partial(ragged_lm_batches, 4),
        strategy_kwargs=_PP2,
        trim_padding=True,
    ),
    # Context parallelism inside each stage: cp 2 (padded rows at an odd length, AdamW, clipping), and a ring over
    # packed documents with Interleaved1F1B.
    "llama_pp2_cp2_padded": Case(
        partial(build_causal_lm, tiny_config("llama", **_DEEP)),
        partial(padded_lm_batches, 3),
        optimizer="adamw",
        lr=1e-3,
        clip=0.5,
        strategy_kwargs={**_PP2, "cp_size": 2},
    ),
    "qwen3_pp2_cp2_ring_packed": Case(
        partial(build_causal_lm, tiny_config("qwen3", **_DEEP_QWEN3)),
        partial(packed_lm_batches, 3),
        strategy_kwargs={**_PP2, "cp_size": 2, "cp_comm": "ring"},
    ),
    # HSDP on each stage (dp_replicate 2: each stage's FSDP2 root replicated over 2 ranks, sharded over 1), and expert
    # parallelism inside each stage (ep 2 over the stage's 2 data-parallel ranks; the experts' FSDP2 on 1 rank each).
    "qwen3_pp2_hsdp": lm("qwen3", 3, config=_DEEP_QWEN3, strategy_kwargs={**_PP2, "dp_replicate_size": 2}),
    # With the routers' load-balancing loss over the whole batch (both data-parallel ranks' micro-batches, every
    # stage's layers): GPipe runs every forward before the first backward, which that loss's gradient needs.
    "qwen3_moe_pp2_expert_parallel": lm(
        "qwen3_moe",
        3,
        config={"num_hidden_layers": 4, "output_router_logits": True, "router_aux_loss_coef": 0.5},
        strategy_kwargs={**_PP2, "ep_size": 2, "pp_schedule": "GPipe"},
    ),
    # A dense first layer (Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's `first_k_dense_replace`): the stages hold
    # different numbers of experts modules (1 and 2), whose load the expert-load monitor reports over every rank.
    "qwen3_moe_dense_first_pp2_expert_parallel": lm(
        "qwen3_moe",
        3,
        config={
            "num_hidden_layers": 4,
            "mlp_only_layers": [0],
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
        },
        strategy_kwargs={**_PP2, "ep_size": 2, "pp_schedule": "GPipe"},
    ),
    # The router loss through 4 stages of one layer (LoopedBFS: each rank's stages breadth-first), on padded rows.
    "mixtral_pp2_router_loss_looped": Case(
        partial(
            build_causal_lm,
            tiny_config("mixtral", **_DEEP, output_router_logits=True, router_aux_loss_coef=0.5),
        ),
        partial(padded_lm_batches, 3),
        strategy_kwargs={**_PP2, "pp_schedule": "LoopedBFS", "pp_stages_per_rank": 2},
    ),
    # Expert parallelism: whole experts per rank, tokens exchanged by all-to-all. On 2 processes: ep 2 over the
    # data-parallel ranks (tp 1: the experts' FSDP2 has one rank each; the router's load-balancing loss over the whole
    # batch), ep 2 over the TP group (the ranks share one batch and each sends half of it), LoRA on the attention.
    # On 4 (dp_shard 2 x tp 2): ep 2 (the experts sharded by FSDP2 over the 2 ranks holding the same ones; foreach
    # AdamW and clipping over the two meshes), ep 4 (every expert on one rank), and HSDP (dp_replicate 2 x dp_shard 2).
    "qwen3_moe_ep2": lm(
        "qwen3_moe",
        4,
        config={"output_router_logits": True, "router_aux_loss_coef": 0.5},
        strategy_kwargs={"tp_size": 1, "ep_size": 2},
    ),
    "mixtral_ep2_tp2": lm("mixtral", 4, strategy_kwargs={"ep_size": 2}),
    # ep 2 over the CP group: the two ranks hold different pieces of the same rows, so their tokens differ.
    "qwen3_moe_ep2_over_cp": lm("qwen3_moe", 3, strategy_kwargs={"tp_size": 1, "cp_size": 2, "ep_size": 2}),
    "qwen3_moe_ep2_lora": Case(
        partial(_lora, "qwen3_moe", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        partial(lm_batches, 3),
        optimizer="adamw",
        lr=1e-2,
        strategy_kwargs={"tp_size": 1, "ep_size": 2},
    ),
    "qwen3_moe_ep2_tp2": lm(
        "qwen3_moe",
        4,
        config={"output_router_logits": True, "router_aux_loss_coef": 0.5},
        optimizer="adamw",
        lr=1e-3,
        opt_kwargs={"foreach": True},
        clip=0.5,
        strategy_kwargs={"ep_size": 2},
    ),
    "mixtral_ep4_tp2": lm(
        "mixtral", 4, config={"output_router_logits": True, "router_aux_loss_coef": 0.5}, strategy_kwargs={"ep_size": 4}
    ),
    "qwen3_moe_ep2_hsdp": lm(
        "qwen3_moe",
        3,
        config={"output_router_logits": True, "router_aux_loss_coef": 0.5},
        strategy_kwargs={"tp_size": 1, "dp_replicate_size": 2, "ep_size": 2},
    ),
    "qwen3_moe_ep4_activation_checkpointing": lm(
        "qwen3_moe", 3, strategy_kwargs={"tp_size": 1, "ep_size": 4, "activation_checkpointing": True}
    ),
}

#: Cases that must fail, with the strategy kwargs / model that trigger it and a fragment the message must contain.
ERROR_CASES: dict[str, tuple[Callable[[], Any], dict[str, Any], str]] = {
    # 3 query heads cannot be split over 2 ranks (fewer KV heads than ranks can: they are replicated).
    "query_heads": (
        partial(build_causal_lm, tiny_config("llama", num_attention_heads=3, num_key_value_heads=1)),
        {},
        "num_attention_heads=3 not divisible by tp_size=2",
    ),
    # Pipeline parallelism refuses by name, on every rank before anything moves: more stages than decoder layers.
    "pp_too_many_stages": (
        partial(build_causal_lm, tiny_config("llama")),
        {"tp_size": 1, "pp_size": 2, "pp_stages_per_rank": 2},
        "has 2 decoder layers, fewer than its 4 pipeline stages",
    ),
    "world_not_divisible": (
        partial(build_causal_lm, tiny_config("qwen3")),
        {"tp_size": 4},
        "not divisible by tp_size=4",
    ),
    "unmatched_key": (
        partial(build_causal_lm, tiny_config("qwen3")),
        {"tp_plan": {"model.layers.*.mlp.nope": "colwise"}},
        "model.layers.*.mlp.nope",
    ),
    "no_plan_plain_module": (_mlp, {}, "holds no Transformers"),
    # A derived plan whose fused QKV packs KV groups the TP size does not divide: refused naming the module.
    "derived_plan_refused": (
        partial(build_causal_lm, tiny_config("falcon", new_decoder_architecture=True, num_kv_heads=1)),
        {},
        "transformer.h.0.self_attention (FalconAttention) has head counts {'num_kv_heads': 1} not divisible",
    ),
    "sequence_parallel_plain_module": (_mlp, {"tp_plan": MLP_PLAN, "sequence_parallel": True}, "is not one"),
    "dora": (partial(_lora, "qwen3", use_dora=True), {}, "use `use_dora=True`, which is not supported"),
    # Under FSDP2 alone (tp_size=1 on 2 ranks), `self.model.norm(x)` called from training_step outside the model's
    # unit: a clear error naming it and the fix (see ERROR_MODULE_KWARGS).
    "direct_call_inside_unit": (_mlp, {"tp_plan": MLP_PLAN, "tp_size": 1}, "`model.norm` was called on its own"),
    # FSDP2's CPU offload pins host memory: it needs an accelerator, and data parallelism.
    "cpu_offload_on_cpu": (
        partial(build_causal_lm, tiny_config("qwen3")),
        {"cpu_offload": True, "tp_size": 1},
        "on `accelerator='cpu'`",
    ),
    # Context parallelism refuses, before anything moves, what it cannot split.
    "cp_plain_module": (_mlp, {"tp_plan": MLP_PLAN, "cp_size": 2}, "cp_size=2 splits the sequences"),
    # Expert parallelism refuses, before anything moves, what it cannot split.
    "ep_dense_model": (partial(build_causal_lm, tiny_config("qwen3")), {"ep_size": 2}, "has no expert-parallel plan"),
    "ep_uneven_experts": (
        partial(build_causal_lm, tiny_config("qwen3_moe", num_experts=3)),
        {"tp_size": 1, "ep_size": 2},
        "has 3 experts, not divisible by ep_size=2",
    ),
    "ep_sequence_parallel": (
        partial(build_causal_lm, tiny_config("qwen3_moe")),
        {"ep_size": 2, "sequence_parallel": True},
        "sequence_parallel=True is not supported with expert parallelism",
    ),
    "cp_router_loss": (
        partial(build_causal_lm, tiny_config("qwen3_moe", output_router_logits=True)),
        {"cp_size": 2},
        "cp_size=2: Qwen3MoeForCausalLM adds its router's load-balancing loss",
    ),
}

#: ParityModule arguments of the error cases that need them.
ERROR_MODULE_KWARGS: dict[str, dict[str, Any]] = {"direct_call_inside_unit": {"call_directly": "model.norm"}}


# The folded launches of tests/distributed (see tests/distributed/conftest.py): which scenarios of
# tests/distributed/worker.py each launch runs when every test is selected, in this order.

TWO_D_CASES = [
    # The long run: 200 steps of dynamic padding, validation, a checkpoint and an export.
    "llama8_long_run",
    "qwen3_sp_lp_odd_length",
    "qwen3_sgd",
    "opt_derived",
    "tied_sgd",
    "qwen3_adamw_foreach_clip",
    "llama_accumulate",
    "llama_accumulate_unsharded",
    "qwen3_activation_checkpointing",
    "qwen3_meta_load",
    "tied_meta_load",
    "qwen3_hsdp",
    "qwen3_hsdp_accumulate",
    "qwen3_with_head",
    "tied_replicated",
    "qwen3_no_reshard",
    "qwen3_meta_init",
    "tied_meta_init",
    "qwen3_lora",
    "llama_rslora",
    "qwen3_meta_lora",
    "qwen3_5_hybrid_sgd",
    "deepseek_v3_mla_sgd",
    "gpt_oss_experts_sgd",
    "qwen3_sp_lp_adamw_clip",
    "qwen2_5_vl_sgd",
    "gemma3_sgd",
    "llava_vision_plan_sp_lp",
    "llava_meta_load",
    "qwen3_bf16_mixed",
    "qwen3_bf16_all_gather",
    "features",
    # Plain modules (not Transformers) under TP x FSDP2, FSDP2 alone (tp_size=1 on 4 ranks), ranks seeded apart.
    "mlp_custom_plan",
    "plain_twice_with_head",
    "plain_direct_call",
    "mlp_fsdp_only",
    "llama_rank_seeded",
    "sp_odd_on_one_group",
    # A derived plan in 2-D with the dense-layer rewrite (OPT keeps the plan's own layers).
    "bloom_derived",
    # KV-head replication in 2-D, and TP 4 over all 4 ranks (more TP ranks than KV heads).
    "qwen3_kv1",
    "qwen3_tp4",
    "qwen3_lora_tp4",
    # Context parallelism with TP or data parallelism.
    "qwen3_cp2_tp2",
    "llama_cp2_tp2_sp_lp",
    "gemma2_cp2_tp2_lp",
    "qwen3_cp2_dp2",
    "qwen3_cp4_ring_packed",
    # torch.compile in 2-D.
    "qwen3_compile_activation_checkpointing",
    # Pipeline parallelism with TP and with data parallelism.
    "llama_pp2_tp2",
    "llama_pp2_tp2_zero_bubble",
    "qwen3_pp2_tp2_lp",
    "llama_pp2_tp2_sp",
    "llama_pp2_tp2_sp_activation_checkpointing",
    "qwen3_pp2_tp2_sp_lp_interleaved",
    "qwen3_pp2_dp2",
    "llama_pp2_dp2_ragged",
    "qwen3_pp2_hsdp",
    "llama_pp2_cp2_padded",
    "qwen3_pp2_cp2_ring_packed",
    "qwen3_moe_pp2_expert_parallel",
    "qwen3_moe_dense_first_pp2_expert_parallel",
    # Expert parallelism with TP and data parallelism.
    "qwen3_moe_ep2_tp2",
    "mixtral_ep4_tp2",
    "qwen3_moe_ep2_hsdp",
    "qwen3_moe_ep4_activation_checkpointing",
]
#: Cases that only make sense with data parallelism.
DP_ONLY_CASES = {
    "qwen3_hsdp",
    "qwen3_hsdp_accumulate",
    "llama_accumulate_unsharded",
    "qwen3_no_reshard",
    "qwen3_bf16_mixed",
    "qwen3_bf16_all_gather",
}
#: Long runs: 2-D only (one launch of hundreds of steps is enough), checked in test_tp_parity.py.
LONG_RUN_CASES = {"llama8_long_run"}
#: bf16 cases, compared with a bf16 single process (not at fp32's tolerance).
BF16_CASES = {"qwen3_bf16_mixed", "qwen3_bf16_all_gather"}
#: Cases with tp_size=1 (FSDP2 alone over every rank): run in both launches, checked on their own.
FSDP_ONLY_CASES = {"mlp_fsdp_only"}
#: Cases with tp_size=4: TP over all 4 ranks of the 2-D launch, checked on their own.
TP4_CASES = {"qwen3_tp4", "qwen3_lora_tp4"}
#: Context parallelism on 2 processes (cp 2) and on 4 (with TP 2 or dp 2): checked in test_context_parallel.py.
#: (Context parallelism inside pipeline stages is checked with the pipelines.)
CP_CASES = [name for name in CASES if re.search(r"_cp\d", name) and "_pp" not in name and name not in TWO_D_CASES]
CP_2D_CASES = [name for name in CASES if re.search(r"_cp\d", name) and "_pp" not in name and name in TWO_D_CASES]
#: Expert parallelism on 2 processes and on 4: checked in test_expert_parallel.py.
EP_CASES = [name for name in CASES if "_ep" in name and name not in TWO_D_CASES]
EP_2D_CASES = [name for name in CASES if "_ep" in name and name in TWO_D_CASES]
#: Pipeline parallelism on 2 processes and on 4: checked in test_pipeline.py.
#: On 8 processes (pp 2 x dp_shard 2 x tp 2).
THREE_D_CASES = ["llama_pp2_tp2_dp2"]
PP_CASES = [name for name in CASES if "_pp2" in name and name not in TWO_D_CASES and name not in THREE_D_CASES]
PP_2D_CASES = [name for name in CASES if "_pp2" in name and name in TWO_D_CASES]
TP_PARITY_CASES = [
    name
    for name in CASES
    if name
    not in DP_ONLY_CASES
    | LONG_RUN_CASES
    | set(PP_CASES)
    | set(PP_2D_CASES)
    | set(THREE_D_CASES)
    | FSDP_ONLY_CASES
    | TP4_CASES
    | set(CP_CASES)
    | set(CP_2D_CASES)
    | set(EP_CASES)
    | set(EP_2D_CASES)
]
TP_CASES = [
    *TP_PARITY_CASES,
    *PP_CASES,
    *CP_CASES,
    *EP_CASES,
    *FSDP_ONLY_CASES,
    "features",
    "save_failure",
    "collectives",
    "whole_tensors",
    "vlm_generate",
    "loss_parallel_checks",
    "cp_rows_differ",
    *(f"error:{name}" for name in ERROR_CASES),
]
#: Launch name -> (its fixture in tests/distributed/conftest.py, every scenario it runs in a full run).
LAUNCHES: dict[str, tuple[str, list[str]]] = {
    "tp2": ("tp2_results", TP_CASES),
    "2d": ("two_d_results", [*TWO_D_CASES, "group_timeouts", "whole_tensors"]),
    "3d": ("three_d_results", THREE_D_CASES),
}
