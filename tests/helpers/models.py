"""Tiny models built from configs (no download), the LightningModule the parity tests train, and the
single-process reference that trains the very same module without any strategy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_tp import grad_norm

VOCAB = 96
SEQ = 16
#: A fixed batch of token ids for comparing logits (a sharded model against a reload on one process).
PROBE = torch.arange(12).reshape(2, 6) % 90
#: A labelled probe batch for pipelined models: 4 rows, for up to 4 micro-batches.
PP_PROBE = (torch.arange(24).reshape(4, 6) * 7) % 90


def tiny_config(kind: str, **overrides: Any):
    """Configs for the model families the tests cover. Head counts divide by 2 and 4."""
    from transformers import Gemma2Config, GraniteSWAConfig, LlamaConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=64,
    )
    if kind == "qwen3":  # q/k norms (replicated_with_grad_allreduce), GQA, untied
        cfg = Qwen3Config(**{**common, "num_key_value_heads": 2, "tie_word_embeddings": False})
    elif kind == "llama":  # GQA, untied
        cfg = LlamaConfig(**{**common, "num_key_value_heads": 2, "tie_word_embeddings": False})
    elif kind == "tied":  # Qwen3 with tied embedding and lm_head
        cfg = Qwen3Config(**{**common, "num_key_value_heads": 4, "tie_word_embeddings": True})
    elif kind == "qwen3_moe":  # moe_tp_experts with packed_colwise gate_up and rowwise down expert weights
        cfg = Qwen3MoeConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False},
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
    elif kind == "mixtral":  # 4 experts of top-2, softmax router; sliding window off, GQA, untied
        from transformers import MixtralConfig

        cfg = MixtralConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    elif kind == "phi3":  # fused qkv/gate_up: colwise_gather_output + rowwise_split_input
        cfg = Phi3Config(
            **{**common, "num_key_value_heads": 2, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}
        )
    elif kind == "granite_swa":  # attention sinks: a bare parameter sharded colwise, its owner run on local_params
        # (and a sliding window of 4 on its sliding layers)
        cfg = GraniteSWAConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 1}
        )
    elif kind == "llama4_text":  # chunked attention (chunks of 5) on 3 of its 4 layers, dense MLPs
        from transformers import Llama4TextConfig

        cfg = Llama4TextConfig(
            **{**common, "num_hidden_layers": 4, "num_key_value_heads": 2},
            intermediate_size_mlp=128,
            interleave_moe_layer_step=0,
            moe_layers=[],
            attention_chunk_size=5,
            no_rope_layers=[1, 1, 1, 0],
        )
    elif kind == "gemma2":  # sliding-window and full layers alternating, logit softcapping (eager), tied
        cfg = Gemma2Config(**{**common, "num_key_value_heads": 2, "sliding_window": 5})
    elif kind == "qwen3_5":  # hybrid: a Gated DeltaNet layer, then a gated full-attention layer; untied
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False},
            layer_types=["linear_attention", "full_attention"],
            # 2 key heads per rank at TP 2: with one, torch.compile's backward fails in the torch fallback of the
            # delta rule (upstream, on one process too: "view size is not compatible").
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    elif kind == "nemotron_h":  # hybrid: a Mamba2 mixer (2 groups of B/C, split by heads), then attention
        from transformers import NemotronHConfig

        cfg = NemotronHConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            intermediate_size=128,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            layers_block_type=["linear_attention", "full_attention"],
            mamba_num_heads=4,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            chunk_size=8,
            use_mamba_kernels=False,
        )
    elif kind == "bamba":  # hybrid: a Mamba2 mixer with one group of B/C (whole on every rank), then attention
        from transformers import BambaConfig

        cfg = BambaConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False},
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mamba_expand=2,
        )
    elif kind == "falcon_h1":  # attention and a Mamba2 mixer in parallel in every layer: one group, gated norm, muP
        from transformers import FalconH1Config

        cfg = FalconH1Config(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False},
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mamba_expand=2,
            mamba_d_ssm=128,
            mamba_rms_norm=True,
        )
    elif kind == "deepseek_v3":  # multi-head latent attention (its shipped plan leaves it whole), a dense and a MoE
        # layer with a shared expert
        from transformers import DeepseekV3Config

        cfg = DeepseekV3Config(
            **{**common, "num_key_value_heads": 4, "tie_word_embeddings": False, "head_dim": 8},
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
        )
    elif kind == "gpt_oss":  # experts stored [in, out], gate and up interleaved, with biases; attention sinks
        from transformers import GptOssConfig

        cfg = GptOssConfig(
            **{**common, "num_key_value_heads": 2, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=5,
        )
    elif kind == "granitemoehybrid":  # Granite 4: a Mamba2 layer (one group of B/C) and an attention layer, each with
        # experts and a shared MLP (input_linear [gate | up]) 4x the hidden size, wider than an expert
        from transformers import GraniteMoeHybridConfig

        cfg = GraniteMoeHybridConfig(
            **{**common, "num_key_value_heads": 2, "tie_word_embeddings": False, "intermediate_size": 32},
            shared_intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mamba_expand=2,
        )
    elif kind in DERIVED_KINDS:
        cfg = _derived_config(kind)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    # Attention sinks need eager attention; GPT-Neo, Bloom and MPT have no SDPA path.
    cfg._attn_implementation = (
        "eager" if kind in ("granite_swa", "gemma2", "gpt_neo", "bloom", "mpt", "gpt_oss") else "sdpa"
    )
    return cfg


#: Families whose config has no `base_model_tp_plan`: their plan is derived from the module structure.
DERIVED_KINDS = ("gpt_neo", "opt", "stablelm", "gpt_bigcode", "gpt2", "falcon", "bloom", "mpt")


def _derived_config(kind: str):
    """Tiny configs of the derived-plan families, dropout off (parity compares exact computations)."""
    from transformers import AutoConfig

    tokens = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    if kind == "gpt_neo":  # separate q/k/v under attn.attention, global and local attention layers, tied
        return AutoConfig.for_model(
            "gpt_neo",
            num_layers=2,
            attention_types=[[["global", "local"], 1]],
            num_heads=4,
            hidden_size=64,
            intermediate_size=128,
            window_size=8,
            max_position_embeddings=64,
            **tokens,
        )
    if kind == "opt":  # q/k/v/out_proj with biases, fc1/fc2 directly in the layer, learned positions, tied
        return AutoConfig.for_model(
            "opt",
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=64,
            ffn_dim=128,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            **tokens,
        )
    if kind == "stablelm":  # GQA with partial rotary, gated MLP, LayerNorm, untied
        return AutoConfig.for_model(
            "stablelm",
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=64,
            intermediate_size=128,
            max_position_embeddings=64,
            **tokens,
        )
    if kind == "falcon":  # fused query_key_value per head [q k v], rotary, sequential attention and MLP
        return AutoConfig.for_model(
            "falcon",
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_size=64,
            multi_query=False,
            parallel_attn=False,
            max_position_embeddings=64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **tokens,
        )
    if kind == "bloom":  # fused query_key_value per head [q k v], ALiBi biases, biases everywhere
        return AutoConfig.for_model(
            "bloom", n_layer=2, n_head=4, hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0, **tokens
        )
    if kind == "mpt":  # Wqkv packed as [q | k | v] blocks, ALiBi position_bias, no biases
        return AutoConfig.for_model(
            "mpt", n_layers=2, n_heads=4, d_model=64, expansion_ratio=2, max_seq_len=64, resid_pdrop=0.0, **tokens
        )
    if kind == "gpt2":  # Conv1D layers (weight [in, out]), c_attn packed as [q | k | v] blocks, tied
        return AutoConfig.for_model(
            "gpt2",
            n_layer=2,
            n_head=4,
            n_embd=64,
            n_inner=128,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **tokens,
        )
    # gpt_bigcode: fused c_attn laid out head by head (multi-head attention), tied
    return AutoConfig.for_model(
        "gpt_bigcode",
        n_layer=2,
        n_head=4,
        n_embd=64,
        n_inner=128,
        n_positions=64,
        multi_query=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **tokens,
    )


#: Vision-language families: a tiny vision tower and a tiny text model (Qwen2.5-VL's and Gemma 3's text models have
#: plans, their vision towers none; LLaVA's text model is Llama). Text tokens are drawn below 96; the image
#: placeholders (100 and up) lie inside the text model's vocabulary of 128.
VLM_KINDS = ("qwen2_5_vl", "gemma3", "llava")
VLM_VOCAB = 128


def tiny_vlm_config(kind: str, **overrides: Any):
    """Configs of the vision-language families the tests cover; head counts divide by 2."""
    from transformers import Gemma3Config, LlavaConfig, Qwen2_5_VLConfig

    text = dict(
        vocab_size=VLM_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    if kind == "qwen2_5_vl":  # patches merged 2 x 2 by the vision merger, windowed and full attention, 3-D rotary
        cfg = Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config={
                **vision,
                "depth": 2,
                "num_heads": 4,
                "out_hidden_size": 64,
                "patch_size": 4,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 8,
                "fullatt_block_indexes": [1],
            },
            image_token_id=100,
            video_token_id=101,
            vision_start_token_id=102,
            vision_end_token_id=103,
            tie_word_embeddings=False,
        )
    elif kind == "gemma3":  # SigLIP tower (its pooling head runs nn.MultiheadAttention), pooled to 4 tokens
        cfg = Gemma3Config(
            text_config={**text, "head_dim": 16, "sliding_window": 8},
            vision_config={
                **vision,
                "num_hidden_layers": 2,
                "image_size": 16,
                "patch_size": 4,
                "vision_use_head": True,
            },
            mm_tokens_per_image=4,
            image_token_index=100,
            boi_token_index=101,
            eoi_token_index=102,
        )
    elif kind == "llava":  # CLIP tower, 16 patch features per image through a 2-layer projector
        cfg = LlavaConfig(
            text_config={**text, "model_type": "llama"},
            vision_config={
                **vision,
                "model_type": "clip_vision_model",
                "num_hidden_layers": 2,
                "image_size": 16,
                "patch_size": 4,
                "projection_dim": 32,
            },
            image_token_index=100,
            vision_feature_layer=-1,
        )
    elif kind == "llama4":  # a plan for its vision tower too; dense text layers. Plans only: its forward fails in
        # Transformers 5.24 (`Llama4ForConditionalGeneration.forward` reads `outputs.image_outputs`, which is not set)
        from transformers import Llama4Config

        cfg = Llama4Config(
            text_config={
                **text,
                "head_dim": 16,
                "intermediate_size_mlp": 128,
                "num_local_experts": 2,
                "interleave_moe_layer_step": 0,
                "moe_layers": [],
                "attention_chunk_size": 64,
            },
            vision_config={
                **vision,
                "intermediate_size": 128,  # the pixel shuffle's width: 4 x hidden_size
                "num_hidden_layers": 2,
                "image_size": 16,
                "patch_size": 4,
                "vision_output_dim": 64,
                "projector_input_dim": 64,
                "projector_output_dim": 64,
            },
            image_token_index=100,
            boi_token_index=101,
            eoi_token_index=102,
        )
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_vlm(kind: str, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(tiny_vlm_config(kind), dtype=torch.float32)


def vlm_batches(
    kind: str, steps: int, batch_size: int = 4, seq: int = 24, seed: int = 1
) -> list[dict[str, torch.Tensor]]:
    """Image batches as each family's processor lays them out: one image per sequence, its placeholder tokens
    (``image_token_id``, as many as the model makes features per image) after two text tokens, wrapped in the
    family's begin/end markers where it has them; the loss on the text after the image."""
    cfg = tiny_vlm_config(kind)
    vision = cfg.vision_config
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, 96, (batch_size, seq), generator=g)
        batch: dict[str, torch.Tensor] = {}
        if kind == "qwen2_5_vl":  # pixel_values: [patches, channels * temporal * patch * patch], a 16 x 16 image
            grid = 16 // vision.patch_size
            tokens = grid * grid // vision.spatial_merge_size**2
            start, end = cfg.vision_start_token_id, cfg.vision_end_token_id
            width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            batch["pixel_values"] = torch.randn(batch_size * grid * grid, width, generator=g)
            batch["image_grid_thw"] = torch.tensor([[1, grid, grid]] * batch_size)
        else:
            if kind == "gemma3":
                tokens, start, end = cfg.mm_tokens_per_image, cfg.boi_token_index, cfg.eoi_token_index
            else:  # LLaVA: every patch feature (the CLS feature dropped), no markers
                tokens, start, end = (vision.image_size // vision.patch_size) ** 2, None, None
            size = vision.image_size
            batch["pixel_values"] = torch.randn(batch_size, vision.num_channels, size, size, generator=g)
        first = 2 if start is None else 3
        if start is not None:
            ids[:, 2], ids[:, first + tokens] = start, end
        ids[:, first : first + tokens] = cfg.image_token_id
        if kind == "gemma3":  # the image tokens attend to each other both ways in training
            batch["token_type_ids"] = (ids == cfg.image_token_id).long()
        labels = ids.clone()
        labels[:, : first + tokens + 1] = -100
        out.append({"input_ids": ids, "labels": labels, **batch})
    return out


def vlm_prompt(kind: str) -> dict[str, torch.Tensor]:
    """Two image prompts for ``generate`` (no labels; Gemma 3 needs no token types outside training)."""
    batch = vlm_batches(kind, 1, batch_size=2)[0]
    return {k: v for k, v in batch.items() if k not in ("labels", "token_type_ids")}


def tied_embeddings(model: nn.Module) -> bool | None:
    """Whether the output embedding is the input embedding (one parameter, or under pipeline parallelism one copy on
    each end's rank, kept equal); None for a model without embeddings."""
    if not hasattr(model, "get_output_embeddings"):
        return None
    from lightning_tp.parallel.pipeline import RUNNER_ATTR

    runner = getattr(model, RUNNER_ATTR, None)
    if runner is not None:
        if runner.tied is not None:
            return True
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        return head is not None and embedding is not None and head.weight is embedding.weight
    if model.get_output_embeddings() is None:
        return None
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A Trainer that writes and prints nothing and reads the data as given (no sampler injected); ``kwargs`` add to
    or override that."""
    defaults = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


def coverage_model(family: str) -> nn.Module:
    """``family``'s tiny model from the coverage benchmark (2 layers, 4 heads, hidden 64, vocabulary 128): the
    families without a tiny config here."""
    from benchmarks import coverage

    return build_causal_lm(coverage.tiny_config(family))


def build_causal_lm(config, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class MLP(nn.Module):
    """A plain module (not Transformers) for custom plans: norm -> up (colwise) -> down (rowwise) -> head."""

    def __init__(self, dim: int = 32, hidden: int = 64, classes: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(torch.relu(self.up(self.norm(x)))))


class Block(nn.Module):
    """A residual MLP block (for ``fsdp_blocks=["Block"]``)."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TwiceMLP(nn.Module):
    """A plain module whose block runs twice per forward (weights shared across the two calls)."""

    def __init__(self, dim: int = 32, classes: int = VOCAB):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.block = Block(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.norm(x))))


def lm_batches(steps: int, batch_size: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def padded_lm_batches(steps: int, batch_size: int = 4, seq: int = 15, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Batches of an odd length, each row left-padded by a different amount (0 to 3 pad tokens), as a tokenizer pads
    for a decoder: ``attention_mask`` 0 and labels -100 on the padding (and on the first real token, which no pad
    position may predict)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        for row in range(batch_size):
            pad = row % 4
            ids[row, :pad], mask[row, :pad] = 0, 0
            labels[row, : pad + 1] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def dynamic_lm_batches(
    steps: int, batch_size: int = 4, lengths: range = range(9, 21), seed: int = 4
) -> list[dict[str, torch.Tensor]]:
    """Dynamic padding: each step's batch as long as its longest row, a new length each step (``lengths`` in turn),
    every other row right-padded by one token (``attention_mask`` 0 and labels -100 on the padding), so that each
    half of a batch (a data-parallel rank's) holds as many labelled tokens and the mean of the halves' losses is the
    batch's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        length = lengths[step % len(lengths)]
        ids = torch.randint(3, VOCAB, (batch_size, length), generator=g)
        mask = torch.ones_like(ids)
        for row in range(1, batch_size, 2):
            ids[row, -1:], mask[row, -1:] = 0, 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 0] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def ragged_lm_batches(steps: int, batch_size: int = 4, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Dynamic padding whose data-parallel halves differ in length: a new length every step, and on odd steps row 1
    padded by 2 and rows 2 and 3 by 1, so that the second half (rows 2 and 3) ends in a column of padding alone (a
    rank that trims it, :class:`ParityModule`'s ``trim_padding``, runs a shorter batch), while each half keeps as many
    labelled tokens (the mean of the halves' losses is the batch's)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        length = 9 + step
        ids = torch.randint(3, VOCAB, (batch_size, length), generator=g)
        mask = torch.ones_like(ids)
        if step % 2:
            for row, pad in ((1, 2), (2, 1), (3, 1)):
                ids[row, -pad:], mask[row, -pad:] = 0, 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 0] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def packed_lm_batches(steps: int, batch_size: int = 2, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Batches of packed sequences: several documents per row, ``position_ids`` restarting at 0 at each (no
    ``attention_mask``), labels -100 on each document's first token. ``use_cache=False``: with its default cache,
    Transformers 5.24 ignores the packing on one process (it attends across the documents)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(5, 7, 4), (9, 7)]
    out = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (batch_size, SEQ), generator=g)
        positions = torch.cat([torch.cat([torch.arange(n) for n in lengths[row % 2]]) for row in range(batch_size)])
        positions = positions.reshape(batch_size, SEQ)
        labels = ids.masked_fill(positions == 0, -100)
        out.append({"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False})
    return out


def mlp_batches(steps: int, batch_size: int = 8, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(batch_size, 32, generator=g), "y": torch.randint(0, 8, (batch_size,), generator=g)}
        for _ in range(steps)
    ]


class ParityModule(L.LightningModule):
    """Trains a model built in ``configure_model`` and records the loss and the pre-clip gradient norm per step.

    ``trim_padding``: each rank drops the columns of padding alone at the end of its rows (its replicas' lengths
    then differ).

    ``call_directly``: the path of a module inside the model that the step also calls on its own (plain models).
    ``dp_split``: with data parallelism each rank trains on its slice of the global batch, so that the run is
    comparable with one process on the whole batch.
    """

    def __init__(
        self,
        build: Callable[[], nn.Module],
        *,
        optimizer: str = "sgd",
        lr: float = 0.1,
        head: bool = False,
        call_directly: str | None = None,
        trim_padding: bool = False,
        **opt_kwargs: Any,
    ):
        super().__init__()
        self.build = build
        self.trim_padding = trim_padding
        self.call_directly = call_directly
        self.model: nn.Module | None = None
        if head:  # a trainable module outside the Transformers model, e.g. a value head
            torch.manual_seed(1)
            self.head = nn.Linear(VOCAB, 1)
        self.optimizer_name = optimizer
        self.lr = lr
        self.opt_kwargs = opt_kwargs
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.val_losses: list[float] = []
        #: Per optimizer step, the parameters whose gradient is not laid out as the parameter, and how many were
        #: checked (sharded parameters with a gradient).
        self.grad_layouts: list[dict[str, Any]] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "x" in batch:
            logits = self.model(batch["x"])
            loss = nn.functional.cross_entropy(logits, batch["y"])
            if hasattr(self, "head"):  # a second child of the LightningModule, called on its own
                loss = loss + self.head(logits).pow(2).mean()
            if self.call_directly:  # a module inside the model called from training_step, then the model again
                inner = self.get_submodule(self.call_directly)
                loss = loss + nn.functional.cross_entropy(self.model(inner(batch["x"]) * 0.5), batch["y"])
            return loss
        out = self.model(**batch)  # input_ids and labels; pixel values and the like for vision-language models
        if hasattr(self, "head"):
            return out.loss + self.head(out.logits).pow(2).mean()
        return out.loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        dp_mesh = getattr(self._trainer.strategy, "dp_mesh", None) if self._trainer is not None else None
        if dp_mesh is not None and dp_mesh.size() > 1:
            batch = {k: v.chunk(dp_mesh.size())[dp_mesh.get_local_rank()] for k, v in batch.items()}
        if self.trim_padding:  # the columns of padding alone at the end dropped, as a collator pads to the longest row
            keep = int(batch["attention_mask"].sum(0).nonzero().max()) + 1
            batch = {k: v[:, :keep] for k, v in batch.items()}
        loss = self.compute_loss(batch)
        if dp_mesh is not None and dp_mesh.size() > 1:
            reported = loss.detach().clone()
            torch.distributed.all_reduce(reported, group=dp_mesh.get_group())
            self.losses.append(reported.item() / dp_mesh.size())
        else:
            self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """The loss of the whole batch on every rank (``Trainer.validate``: inference mode)."""
        self.val_losses.append(self.compute_loss(batch).item())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The module itself: under pipeline parallelism its parallel state says which ranks hold the other stages.
        self.grad_norms.append(grad_norm(self).item())
        from torch.distributed.tensor import DTensor

        # Each gradient is laid out as its parameter (a replicated gradient of a sharded weight wastes memory).
        checked = [(n, p) for n, p in self.named_parameters() if isinstance(p, DTensor) and p.grad is not None]
        self.grad_layouts.append(
            {
                "checked": len(checked),
                "mismatched": [
                    n
                    for n, p in checked
                    if not isinstance(p.grad, DTensor)
                    or (p.grad.device_mesh, p.grad.placements) != (p.device_mesh, p.placements)
                ],
            }
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, **self.opt_kwargs)
        return torch.optim.AdamW(params, lr=self.lr, **self.opt_kwargs)


def live_mib() -> float:
    """This process's live memory: its resident set once the garbage is collected and glibc has given its free pages
    back (``malloc_trim``), so that what the allocator keeps of freed blocks does not count."""
    import ctypes
    import gc
    import os

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``model``'s state dict whole, on the CPU of every rank (each rank must call it: gathering a
    shard is a collective), gathered as the package's own writers gather them (on the mesh's device, so CPU-offloaded
    shards too)."""
    from lightning_tp.parallel.gather import whole_tensor

    return {k: whole_tensor(v, keep=True).clone() for k, v in model.state_dict().items()}


def pipeline_state(model: nn.Module, pp_group: Any | None) -> dict[str, torch.Tensor]:
    """:func:`full_state` of a model whose stages are spread over ``pp_group`` (each rank holds its own): every
    stage's tensors, on every rank. ``None``: the model's own."""
    state = full_state(model)
    if pp_group is None:
        return state
    states: list[Any] = [None] * torch.distributed.get_world_size(pp_group)
    torch.distributed.all_gather_object(states, state, group=pp_group)
    return {key: value for part in states for key, value in part.items()}


def reference_run(
    module: ParityModule,
    batches: list[dict[str, torch.Tensor]],
    *,
    clip: float | None = None,
    accumulate: int = 1,
    precision: str = "32-true",
    device: torch.device | str = "cpu",
    val_every: int | None = None,
    val_batches: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Train ``module`` on one process with a plain loop on ``device``: the same hooks Lightning calls, no strategy.
    ``val_every``: after every this many optimizer steps, ``validation_step`` on each of ``val_batches`` (no grad,
    eval mode), as Lightning's ``val_check_interval``.
    ``precision``: ``bf16-true`` trains a bf16 model, ``bf16-mixed`` runs the step under the device's autocast. The
    final state comes back on the CPU.

    With each micro-batch's loss it records what its fp32 bound reads (tests/helpers/tolerances.py,
    :func:`~tests.helpers.tolerances.fp32_loss_gap`): ``output_scales``, ``norm(∂L/∂z ⊙ z)`` over the model's outputs
    ``z`` (its logits; both calls' where the step calls it twice), and ``output_rows`` and ``output_classes``, the
    largest outputs' rows and last dimension; and with each step's gradient norm ``grad_terms``, the norm of what
    its gradients sum: for each linear layer's weight the magnitudes of its terms, ``norm(|dy|ᵀ |x|)`` over the
    step's rows, and each parameter's own gradient (:func:`~tests.helpers.tolerances.fp32_grad_norm_gap`)."""
    import contextlib
    import math

    device = torch.device(device)
    module = copy.deepcopy(module)
    module.configure_model()
    module.to(device)
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    bf16_mixed = precision == "bf16-mixed"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16_mixed else contextlib.nullcontext()
    optimizer = module.configure_optimizers()
    optimizer.zero_grad()
    outputs: list[torch.Tensor] = []
    scales: list[float] = []
    rows = classes = 0

    def keep_output(_module: nn.Module, _args: Any, output: Any) -> None:
        logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            logits.retain_grad()
            outputs.append(logits)

    terms: dict[int, torch.Tensor] = {}
    grad_terms: list[float] = []

    def keep_terms(layer: nn.Module, args: Any, output: Any) -> None:
        if not (isinstance(output, torch.Tensor) and output.requires_grad and args):
            return
        x = args[0].detach()

        def magnitudes(grad: torch.Tensor) -> None:
            dy, xs = grad.detach().reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            term = dy.abs().double().T @ xs.abs().double()
            terms[id(layer)] = terms[id(layer)] + term if id(layer) in terms else term

        output.register_hook(magnitudes)

    hook = module.model.register_forward_hook(keep_output)
    term_hooks = [
        layer.register_forward_hook(keep_terms)
        for layer in module.model.modules()
        if isinstance(layer, nn.Linear) and layer.weight.requires_grad
    ]
    for i, batch in enumerate(batches):
        with autocast:
            on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            loss = module.training_step(on_device, i)
        (loss / accumulate).backward()
        kept = [z for z in outputs if z.grad is not None]
        squares = sum((z.grad.double() * z.detach().double()).pow(2).sum().item() for z in kept)
        scales.append(accumulate * math.sqrt(squares))  # of the micro-batch's own loss, not its share of the step's
        for z in kept:
            rows, classes = max(rows, z.numel() // max(z.shape[-1], 1)), max(classes, z.shape[-1])
        outputs.clear()
        if (i + 1) % accumulate:
            continue
        module.on_before_optimizer_step(optimizer)
        squares = sum(t.pow(2).sum().item() for t in terms.values())
        squares += sum(p.grad.double().pow(2).sum().item() for p in module.parameters() if p.grad is not None)
        grad_terms.append(math.sqrt(squares))
        terms.clear()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if val_every is not None and ((i + 1) // accumulate) % val_every == 0:
            module.eval()
            with torch.no_grad():
                for j, val_batch in enumerate(val_batches or []):
                    module.validation_step({k: v.to(device) for k, v in val_batch.items()}, j)
            module.train()
    hook.remove()
    for term_hook in term_hooks:
        term_hook.remove()
    state = {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()}
    return {
        "losses": module.losses,
        "grad_norms": module.grad_norms,
        "state": state,
        "tied": tied_embeddings(module.model),
        "output_scales": scales,
        "grad_terms": grad_terms,
        "output_rows": rows,
        "output_classes": classes,
        "val_losses": module.val_losses,
    }


class FeatureModule(ParityModule):
    """Exercises what a user does around training: validation with ``generate``, predict, ``self.log`` with
    ``sync_dist`` and a torchmetrics metric. Records what each produced."""

    def __init__(self, build: Callable[[], nn.Module], **kwargs: Any):
        super().__init__(build, **kwargs)
        import torchmetrics

        self.samples = torchmetrics.SumMetric()
        self.generated: list[torch.Tensor] = []
        self.logged: dict[str, Any] = {}

    def configure_model(self) -> None:
        self.logged["mesh_axes"] = self.device_mesh.mesh_dim_names
        super().configure_model()

    def on_fit_start(self) -> None:
        strategy = self.trainer.strategy
        first = self.global_rank == 0
        self.logged["decisions"] = [
            strategy.reduce_boolean_decision(True),
            strategy.reduce_boolean_decision(first, all=True),
            strategy.reduce_boolean_decision(first, all=False),
        ]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"][:, :6]
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        self.generated.append(out.cpu())
        self.samples.update(torch.ones(ids.shape[0]))
        self.log("val_samples", float(ids.shape[0]), reduce_fx="sum", sync_dist=True, batch_size=ids.shape[0])
        self.log("val_metric", self.samples, batch_size=ids.shape[0])

    def on_validation_epoch_end(self) -> None:
        self.logged["samples_metric"] = float(self.samples.compute())

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"]).logits.argmax(-1)


def reference_generate(build: Callable[[], nn.Module], batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    model = build().eval()
    with torch.no_grad():
        return [
            model.generate(
                b["input_ids"][:, :6],
                attention_mask=torch.ones_like(b["input_ids"][:, :6]),
                max_new_tokens=4,
                do_sample=False,
            )
            for b in batches
        ]
