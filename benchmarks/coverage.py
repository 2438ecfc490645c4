"""Which Transformers causal-LM families ``lightning_tp.parallelize`` shards, and at what parity: one row per family of
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, written to ``benchmarks/coverage.md`` and ``benchmarks/coverage.json``.

    torchrun --standalone --nproc-per-node 2 benchmarks/coverage.py                  # every family (~10-15 min, CPU)
    torchrun --standalone --nproc-per-node 2 benchmarks/coverage.py --families llama,gpt2 --out-md /tmp/c.md \\
        --out-json /tmp/c.json
    torchrun --standalone --nproc-per-node 2 benchmarks/coverage.py --cases kv_replication --merge
        # re-run one column only (e.g. after KV-head replication lands) and keep the rest of the JSON

Each family gets a tiny config: its class's defaults with generic overrides applied by attribute name where the config
has the attribute (:data:`TINY`, 2 layers, 4 query heads, hidden 64, vocabulary 128, dropout off), and the few
documented per-family exceptions of :data:`EXCEPTIONS`. Case ``tp2`` (2 KV heads) trains 3 SGD steps on generated
token batches (fp32, eager attention) sharded with ``lightning_tp.parallelize`` at TP 2, against the same model
trained whole on the same process (every rank runs the reference: its numbers are the same on each), and reports the
largest loss gap over the steps and the largest parameter gap after them. Case ``kv_replication`` does the same with
one KV head, i.e. a TP size above the KV-head count: refused until KV heads can be replicated. Case ``cp2`` trains the
``tp2`` model with context parallelism instead (``cp_size=2``, no TP): each sequence split over the 2 ranks. Case
``ep2`` trains it with expert parallelism instead (``ep_size=2``, no TP): each rank holds half of every
mixture-of-experts layer's experts whole, tokens exchanged by all-to-all (both ranks read the same batches, so their
experts see every token twice and FSDP2's division gives one process's gradient); n/a for a model without an
expert-parallel plan (``base_model_ep_plan``). Case ``ep2_tp2``: ep 2 over the TP group, with the model's TP plan
on the rest (each of the two ranks, which share the batch, sends half of its tokens).

The largest TP size of the *published default* config (``ConfigClass()``, built on the meta device) is the largest
``t <= 64`` that divides every dim its plan splits (found from the plan's styles, as ``lightning_tp.plans.styles`` says
which dim each splits) and the query heads; "without KV replication" also needs ``t`` to divide the KV heads (and the
K/V projections' split dims), "with" needs only ``t`` and the KV-head count to divide one another. A fused QKV
projection counts in both columns (its KV part cannot be replicated alone).

All families run in one launch: skipping and refusing are decided on every rank alike before any collective, each
family runs under try/except, and the ranks agree after each (an all-reduce of a flag), so a failure moves on to the
next family; a 120 s process-group timeout and ``faulthandler.dump_traceback_later`` turn a hang into stacks.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import inspect
import json
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3
LR = 0.1
BATCH, SEQ = 2, 16
VOCAB = 128
MAX_TP = 64
#: Loss and parameter gaps under which a family counts as at parity (fp32, 3 SGD steps).
PARITY_TOL = 1e-4
#: The float64 re-run of a family not at parity in fp32, on its first gradients: relative gaps at this level come
#: from the fp32 casts some models keep inside (norms, rotary), a sharding error gives gaps of order one.
FP64_TOL = 1e-6
#: The statuses of a case that trained: "parity in fp64" when its fp32 gaps were rounding the model amplified.
TRAINED = ("parity", "parity in fp64", "not at parity")
#: ``uneven_vocab``: TP 2 with a vocabulary of 127, which the "uneven vocab" TP sizes assume splits at parity.
CASES = ("tp2", "kv_replication", "uneven_vocab", "cp2", "ep2", "ep2_tp2")
#: KV heads of the tiny config per case (4 query heads; TP 2 throughout, but ``cp2`` and ``ep2``).
CASE_KV_HEADS = {"tp2": 2, "kv_replication": 1, "uneven_vocab": 2, "cp2": 2, "ep2": 2, "ep2_tp2": 2}
#: The sizes ``parallelize`` gets per case (the others: TP over both ranks). ``cp2``: context parallelism, each
#: sequence split over the 2 ranks (FSDP2 over them), no TP.
CASE_LAYOUT: dict[str, dict[str, int]] = {
    "cp2": {"tp_size": 1, "cp_size": 2},
    "ep2": {"tp_size": 1, "ep_size": 2},
    "ep2_tp2": {"tp_size": 2, "ep_size": 2},
}
#: The vocabulary of a case that splits it unevenly (the others: ``VOCAB``).
CASE_VOCAB = {"uneven_vocab": 127}

#: Vocabulary sizes (a per-layer input embedding's too), set per case.
VOCAB_NAMES = ("vocab_size", "vocab_size_per_layer_input")
#: Generic tiny-config overrides: each group of synonymous attribute names gets the value where the config class
#: has the attribute (in its ``__init__`` signature or its defaults). Nothing here names a family.
TINY: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    (("hidden_size", "n_embd", "d_model", "dim", "embedding_size", "word_embed_proj_dim"), 64),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    (("head_dim", "attention_head_dim", "kv_channels"), 16),
    # Latent attention (MLA): the rotary part of each head (also `head_dim`, see `tiny_kwargs`), the rest, the
    # low-rank sizes, and a sparse-attention indexer's heads.
    (("qk_rope_head_dim",), 8),
    (("qk_nope_head_dim", "index_head_dim"), 16),
    (("v_head_dim",), 16),
    (("kv_lora_rank", "q_lora_rank"), 32),
    (("index_n_heads",), 4),
    # Linear-attention mixers (Gated DeltaNet, Kimi Delta Attention): their own heads, 2 key heads for 4 value heads.
    (("linear_num_heads", "linear_num_value_heads"), 4),
    (("linear_num_key_heads",), 2),
    (("linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"), 16),
    (("rotary_dim",), 8),
    (("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff", "decoder_ffn_dim"), 64),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size"), 32),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "num_experts_per_token", "moe_topk"), 2),
    (("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    (("n_group", "num_expert_group", "topk_group", "moe_num_groups"), 1),  # grouped routing: one group of experts
    (VOCAB_NAMES, VOCAB),
    (("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length"), 64),
    (("pad_token_id",), 0),
    (("bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id"), 1),
    (("is_decoder",), True),
    (("use_cache",), False),
)
#: KV-head attribute names (set per case).
KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
#: Attribute names holding dropout probabilities or noise scales (a router's jitter): set to 0 (parity compares exact
#: computations, and random draws in training would differ between the sharded and the whole model).
DROPOUT = re.compile(r"dropout|pdrop|layerdrop|drop_path|jitter")

#: The documented per-family exceptions to the generic overrides (keep it small): family -> (overrides, why).
EXCEPTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "mamba2": ({"head_dim": 32, "n_groups": 2}, "its heads span hidden_size * expand (2); 2 groups of B/C for 4 heads"),
    "zaya": ({"num_experts_per_tok": 1}, "ZAYA supports one expert per token only"),
}


class Skip(Exception):
    """A family that is not a decoder LM this benchmark can build tiny; the message says why."""


# ---------------------------------------------------------------------------------------------------------------------
# Configs


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def model_class_name(family: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]
    return name if isinstance(name, str) else name[0]


def config_class(family: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[family]


def default_config(family: str):
    """The published default config (``ConfigClass()``)."""
    return config_class(family)()


def _accepted_names(cls, default) -> set[str]:
    names = set(default.to_dict()) if default is not None else set()
    names |= {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    names |= set(getattr(cls, "attribute_map", {}) or {})
    return names


def tiny_kwargs(cls, default, *, kv_heads: int, vocab: int = VOCAB) -> dict[str, Any]:
    """The generic overrides ``cls`` accepts, sub-configs (``text_config``, ``vision_config``, ...) made tiny alike."""
    names = _accepted_names(cls, default)
    values = default.to_dict() if default is not None else {}
    kwargs: dict[str, Any] = {}
    for group, value in TINY:
        present = [n for n in group if n in names]
        # One name per group: the canonical one first (aliases of `attribute_map` resolve to it anyway).
        canonical = [n for n in present if n not in (getattr(cls, "attribute_map", {}) or {})]
        for name in canonical or present[:1]:
            kwargs[name] = value
    for name in ("q_lora_rank",):  # None means "no low-rank query projection": keep it so
        if name in kwargs and values.get(name, 0) is None:
            kwargs[name] = None
    if "qk_rope_head_dim" in kwargs and "head_dim" in kwargs:  # MLA's head_dim is its rotary part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    for name in VOCAB_NAMES:
        if name in kwargs:
            kwargs[name] = vocab
    # Latent attention expands K/V per query head from its latent: its KV-head count is the query heads'.
    latent = "kv_lora_rank" in names
    for name in KV_HEAD_NAMES:
        if name in names:
            kwargs[name] = 4 if latent else kv_heads
    for name, value in values.items():
        if DROPOUT.search(name) and isinstance(value, float):
            kwargs[name] = 0.0
    layers = kwargs.get(next((n for n in TINY[0][0] if n in kwargs), ""), None)
    default_layers = next((values[n] for n in TINY[0][0] if isinstance(values.get(n), int)), None)
    for name, value in values.items():
        # Per-layer lists (layer types, ...) of the default depth: keep one layer of each of the first two kinds.
        if layers and isinstance(value, list) and default_layers and len(value) == default_layers and value:
            other = next((v for v in value if v != value[0]), value[0])
            kwargs[name] = [value[0], other][:layers]
    for name in getattr(cls, "sub_configs", None) or {}:
        sub = getattr(default, name, None) if default is not None else None
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        kwargs[name] = type(sub)(**tiny_kwargs(type(sub), sub, kv_heads=kv_heads, vocab=vocab))
    return kwargs


def tiny_config(family: str, *, kv_heads: int = 2, vocab: int = VOCAB):
    """A tiny config of ``family``: the generic overrides (:data:`TINY`), then the family's :data:`EXCEPTIONS`.
    Raises :class:`Skip` for an encoder-decoder or a config that cannot be built."""
    cls = config_class(family)
    try:
        default = cls()
    except Exception as err:  # noqa: BLE001 - any failure is a reason to skip
        raise Skip(f"default config fails to build: {_first_line(err)}") from err
    if getattr(default, "is_encoder_decoder", False):
        raise Skip("encoder-decoder")
    try:
        kwargs = tiny_kwargs(cls, default, kv_heads=kv_heads, vocab=vocab)
        kwargs.update(EXCEPTIONS.get(family, ({}, ""))[0])
        return cls(**kwargs)
    except Exception as err:  # noqa: BLE001
        raise Skip(f"tiny config fails to build: {_first_line(err)}") from err


def build_model(config, *, seed: int = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:240]


# ---------------------------------------------------------------------------------------------------------------------
# The largest TP size of the published default config


#: Leaf names of the projections that hold K/V heads alone, and of fused projections that hold them with the queries.
KV_PROJECTIONS = ("k_proj", "v_proj", "key", "value", "kv_proj")
FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv")


def _int_attribute(config, names: Iterable[str]) -> int | None:
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute a heterogeneous config refuses to read globally
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def head_counts(config) -> tuple[int | None, int | None]:
    """Query heads and KV heads of ``config``'s text model (KV heads default to the query heads)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = _int_attribute(text, TINY[2][0])
    kv = _int_attribute(text, KV_HEAD_NAMES)
    if getattr(text, "multi_query", False) is True:
        kv = 1
    return heads, kv or heads


def sharded_sizes(model: torch.nn.Module) -> dict[str, Any]:
    """The sizes the model's plan splits, found from its styles: ``{"other": {size: example}, "kv": {...},
    "vocab": {...}, "fused_qkv": bool, "source": ...}`` (``vocab``: the split dims of the embeddings and
    ``lm_head``). Raises ``ValueError`` when the plan is refused or missing."""
    from lightning_tp.plans.resolve import resolve_plan
    from lightning_tp.plans.source import plan_source
    from lightning_tp.plans.styles import HEAD_COUNT_ATTRIBUTES, facts

    _, source, _ = plan_source(model)
    plan = resolve_plan(model, "auto", tp_size=1)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    other: dict[int, str] = {}
    kv: dict[int, str] = {}
    vocab: dict[int, str] = {}
    fused = False
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_name = next((n for n, m in modules.items() if m is output), None) if output is not None else None
    for name, style in plan.styles.items():
        fact = facts(style)
        if fact is None:
            continue
        if name in params:
            dim = fact.split_dim(params[name].ndim, is_bias=name.rpartition(".")[2] == "bias")
            if dim is None:
                continue
            leaf = name.rsplit(".", 2)[-2] if "." in name else name
            size = int(params[name].shape[dim])
            if leaf in FUSED_QKV:
                fused = True
            on_vocab = fact.kind == "embedding" or (output_name is not None and leaf == output_name.rsplit(".")[-1])
            (kv if leaf in KV_PROJECTIONS else vocab if on_vocab else other).setdefault(size, name)
        elif name in modules and fact.kind == "heads":
            for attr in HEAD_COUNT_ATTRIBUTES:
                count = getattr(modules[name], attr, None)
                if isinstance(count, int):
                    bucket = kv if "key_value" in attr or "kv" in attr else other
                    bucket.setdefault(count, f"{name}.{attr}")
    return {"source": source, "other": other, "kv": kv, "vocab": vocab, "fused_qkv": fused}


def largest_tp(
    heads: int | None, kv_heads: int | None, sizes: Mapping[str, Any], *, replicate_kv: bool, even_vocab: bool = True
) -> int | None:
    """The largest ``t <= MAX_TP`` that divides the query heads and every size the plan splits; without KV
    replication (or with a fused QKV projection) ``t`` must also divide the KV heads and the K/V projections' sizes,
    with it the KV heads and ``t`` must divide one another (each KV head replicated on ``t / kv`` ranks).
    ``even_vocab=False`` leaves the vocabulary out (case ``uneven_vocab`` checks that an uneven split trains)."""
    if not heads:
        return None  # no attention heads to split: not a layout this benchmark sizes
    needed = [heads]
    needed += list(sizes.get("other", {})) + (list(sizes.get("vocab", {})) if even_vocab else [])
    strict_kv = not replicate_kv or sizes.get("fused_qkv", False)
    if strict_kv:
        needed += list(sizes.get("kv", {})) + ([kv_heads] if kv_heads else [])
    best = None
    for t in range(1, MAX_TP + 1):
        if any(n % t for n in needed):
            continue
        if not strict_kv and kv_heads and kv_heads % t and t % kv_heads:
            continue
        best = t
    return best


def default_tp(family: str) -> dict[str, Any]:
    """The largest TP sizes of ``family``'s published default config (built on the meta device)."""
    row: dict[str, Any] = {"default_heads": None, "default_kv_heads": None, "max_tp_kv_replication": None}
    row["max_tp_no_kv_replication"] = None
    try:
        config = default_config(family)
    except Exception as err:  # noqa: BLE001
        row["default_note"] = f"default config fails to build: {_first_line(err)}"
        return row
    if getattr(config, "is_encoder_decoder", False):
        row["default_note"] = "encoder-decoder"
        return row
    try:
        heads, kv = head_counts(config)
    except Exception as err:  # noqa: BLE001 - no one text config to read the heads from
        row["default_note"] = f"head counts unreadable: {_first_line(err)}"
        return row
    row.update(default_heads=heads, default_kv_heads=kv)
    try:
        model = build_model(config, device="meta")
        sizes = sharded_sizes(model)
        note = f"{sizes['source']} plan"
    except Exception as err:  # noqa: BLE001 - a refused plan: the heads alone
        sizes, note = {}, f"heads only ({_first_line(err)[:80]})"
    row["default_note"] = note
    row["max_tp_kv_replication"] = largest_tp(heads, kv, sizes, replicate_kv=True)
    row["max_tp_no_kv_replication"] = largest_tp(heads, kv, sizes, replicate_kv=False)
    row["max_tp_kv_replication_uneven_vocab"] = largest_tp(heads, kv, sizes, replicate_kv=True, even_vocab=False)
    row["max_tp_no_kv_replication_uneven_vocab"] = largest_tp(heads, kv, sizes, replicate_kv=False, even_vocab=False)
    return row


# ---------------------------------------------------------------------------------------------------------------------
# Training one family, whole and sharded


def lm_batches(vocab: int, *, steps: int = STEPS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, vocab, (BATCH, SEQ), generator=g)  # past the pad/bos/eos ids the tiny configs use
        labels = ids.clone()
        labels[:, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )


def train(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """``STEPS`` plain SGD steps (exact: AdamW would amplify rounding in tiny gradients); the loss of each."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        loss = _loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


#: Leaf names of the projections that hold the query heads (alone or fused with K/V).
QUERY_PROJECTIONS = ("q_proj", "query", "q_b_proj", "q_a_proj", *FUSED_QKV)


def _is_split(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(param, DTensor) and any(not isinstance(p, Replicate) for p in param.placements)


def parity(model: torch.nn.Module, reference: torch.nn.Module, losses: list[float], ref_losses: list[float]) -> dict:
    """Largest loss gap over the steps and largest parameter gap after them (a collective: every rank calls it)."""
    ref = dict(reference.named_parameters())
    weights = {n: _full(p.detach()) for n, p in model.named_parameters()}  # same order on every rank
    gaps = {n: (weights[n] - ref[n].detach()).abs().max().item() for n in ref if n in weights}
    worst = max(gaps, key=gaps.get) if gaps else None
    split = [n for n, p in model.named_parameters() if _is_split(p)]
    total = sum(w.numel() for w in weights.values())
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return {
        # The share of the parameter elements this rank holds (1 / tp_size where everything is split).
        "held_fraction": held / total if total else 1.0,
        # What the plan split: the share of parameter elements, and whether the attention's query heads are split
        # (a plan may split the MLP alone).
        "split_fraction": sum(weights[n].numel() for n in split) / total if total else 0.0,
        "attention_split": any(n.rsplit(".", 2)[-2] in QUERY_PROJECTIONS for n in split if "." in n),
        "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_gap": gaps[worst] if worst else None,
        "worst_param": worst,
        "names_match": sorted(weights) == sorted(ref),
        "losses": losses,
        "ref_losses": ref_losses,
    }


def prepare_case(
    family: str, case: str, *, tp_size: int, result: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple | None:
    """The pure part of a case (no collective): the tiny model, its copy trained whole, the batches and the reference
    losses; ``None`` when the case ends here (``result`` then says why: skipped or n/a)."""
    from lightning_tp.plans.source import plan_source

    try:
        config = tiny_config(family, kv_heads=CASE_KV_HEADS[case], vocab=CASE_VOCAB.get(case, VOCAB))
        heads, kv = head_counts(config)
        result.update(tiny_heads=heads, tiny_kv_heads=kv)
        if case == "kv_replication" and not (kv is not None and kv < tp_size and heads and heads % tp_size == 0):
            result.update(status="n/a", detail=f"tiny config has {kv} KV heads for {heads} query heads")
            return None
        try:
            model = build_model(config).to(dtype)
        except Exception as err:  # noqa: BLE001
            raise Skip(f"fails to build: {_first_line(err)}") from err
        result["model_class"] = type(model).__name__
        result["plan_source"] = plan_source(model)[1]
        if case == "tp2":
            result.update(_kept_whole(model, tp_size))
        if case.startswith("ep2") and not getattr(model, "ep_plan", None):
            result.update(status="n/a", detail="no expert-parallel plan (`base_model_ep_plan`)")
            return None
        if case.startswith("ep2") and not _has_experts(model):
            result.update(status="n/a", detail="the tiny config's layers are all dense (no experts module)")
            return None
        reference = copy.deepcopy(model)
        batches = lm_batches(VOCAB)
        try:
            ref_losses = train(reference, batches)
        except Exception as err:  # noqa: BLE001
            raise Skip(f"fails on one process: {_first_line(err)}") from err
    except Skip as err:
        result.update(status="skipped", detail=str(err))
        return None
    return model, reference, batches, ref_losses


def _kept_whole(model: torch.nn.Module, tp_size: int) -> dict[str, Any]:
    """What the plan at ``tp_size`` leaves whole: the layer kinds no rule splits (share of the parameters, 1% or
    more) and the mixers kept whole with the reason (no collective; the plan is resolved once more, as
    ``parallelize`` will)."""
    from lightning_tp.plans.coverage import kept_whole
    from lightning_tp.plans.resolve import resolve_plan

    try:
        plan = resolve_plan(model, "auto", tp_size=tp_size)
    except ValueError:
        return {}
    reasons = {}
    for name, why in plan.whole_mixers.items():
        reasons.setdefault(why, name)
    return {
        "kept_whole": {kind: round(share, 4) for kind, (_, share) in kept_whole(model, plan).items() if share >= 0.01},
        "whole_mixers": {name: why for why, name in reasons.items()},
    }


def _has_experts(model: torch.nn.Module) -> bool:
    """Whether a module of ``model`` takes its expert-parallel plan's ``ep_dispatch_experts``."""
    from lightning_tp.plans.source import key_regex

    keys = [key_regex(k) for k, style in model.ep_plan.items() if style == "ep_dispatch_experts"]
    return any(regex.fullmatch(name) for name, _ in model.named_modules() for regex in keys)


def run_case(family: str, case: str, *, tp_size: int, all_ready: Callable[[bool], bool]) -> dict[str, Any]:
    """One family, one case. The pure part runs alike on every rank (seeded); ``all_ready`` (a collective: whether
    every rank got through it) gates the sharded part, so a rank that failed alone never leaves the others waiting in
    ``parallelize``'s collectives. Refusals raise in ``parallelize`` before any collective, on every rank alike."""
    import lightning_tp

    result: dict[str, Any] = {"status": None, "detail": None}
    prepared = None
    try:
        prepared = prepare_case(family, case, tp_size=tp_size, result=result)
    except Exception as err:  # noqa: BLE001
        result.update(status="error", detail=f"before sharding: {_first_line(err)}")
    if not all_ready(prepared is not None):
        if prepared is not None:
            result.update(status="error", detail="another rank failed before sharding")
        return result
    model, reference, batches, ref_losses = prepared
    try:
        lightning_tp.parallelize(model, **CASE_LAYOUT.get(case, {"tp_size": tp_size}))
    except ValueError as err:  # the package's refusals, raised on every rank before any collective
        return {**result, "status": "refused", "detail": _first_line(err).removeprefix("ValueError: ")}
    try:
        losses = train(model, batches)
    except Exception as err:  # noqa: BLE001
        return {**result, "status": "error", "detail": f"sharded training: {_first_line(err)}"}
    result.update(parity(model, reference, losses, ref_losses))
    ok = result["loss_gap"] <= PARITY_TOL and (result["param_gap"] or 0.0) <= PARITY_TOL and result["names_match"]
    result["status"] = "parity" if ok else "not at parity"
    if not all_ready(ok):  # collective: every rank reruns when one is not at parity, and all take its verdict
        result["fp64"] = _fp64_gaps(family, case, tp_size=tp_size, all_ready=all_ready)
        result["status"] = "parity in fp64" if all_ready(result["fp64"].get("ok", False)) else "not at parity"
    return result


def _fp64_gaps(family: str, case: str, *, tp_size: int, all_ready: Callable[[bool], bool]) -> dict[str, Any]:
    """The same case in float64, compared on its first gradients (before any step can amplify a difference): a
    largest relative gap at the level of the fp32 casts some models keep inside (``FP64_TOL``) means the fp32 gaps
    were rounding the model amplified (large embedding scales, soft-capping), not a sharding error, which shows as a
    gap of order one (a gradient summed twice, or not at all)."""
    import lightning_tp

    scratch: dict[str, Any] = {}
    try:
        prepared = prepare_case(family, case, tp_size=tp_size, result=scratch, dtype=torch.float64)
    except Exception:  # noqa: BLE001
        prepared = None
    if not all_ready(prepared is not None):
        return {"ok": False, "detail": scratch.get("detail") or "float64 run failed before sharding"}
    model, _, batches, _ = prepared
    whole = copy.deepcopy(model)
    lightning_tp.parallelize(model, **CASE_LAYOUT.get(case, {"tp_size": tp_size}))
    for m in (model, whole):
        m.train()
        _loss(m, batches[0]).backward()
    grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    gaps = {
        n: ((_full(p.grad) - grads[n]).abs().max() / grads[n].abs().max().clamp_min(1e-30)).item()
        for n, p in model.named_parameters()
        if p.grad is not None and n in grads
    }
    worst = max(gaps, key=gaps.get) if gaps else None
    gap = gaps[worst] if worst else 0.0
    return {"ok": gap <= FP64_TOL and len(gaps) == len(grads), "grad_gap": gap, "worst_param": worst}


# ---------------------------------------------------------------------------------------------------------------------
# The table


def plan_column(case: Mapping[str, Any]) -> str:
    """ "model", "derived", "refused: <first line>" or "skipped: <why>"."""
    status = case.get("status")
    if status in ("refused", "skipped"):
        return f"{status}: {case.get('detail')}"
    return str(case.get("plan_source"))


def reason_key(detail: str | None) -> str:
    """A refusal or skip reason with the names of the family taken out (model classes, module paths, plan keys,
    numbers), for counting like reasons together."""
    text = (detail or "").split(". ")[0]
    text = re.sub(r"^\w+(ForCausalLM|LMHeadModel|ForConditionalGeneration|Decoder|Model)\b", "<model>", text)
    text = text.replace("has no `base_model_tp_plan` and a plan could not be derived", "no plan, none derived")
    text = re.sub(r"'[\w.*]+': ", "", text)  # plan keys
    text = re.sub(r"\w+(\.[\w*]+)+", "<module>", text)  # module paths
    text = re.sub(r" \(\w+\)", "", text)  # the class of a module named just before
    text = re.sub(r"^(recurrent/state-space layers) .*", r"\1", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:110]


def _gap(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def _by_reason(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """The families refused, failing or not at parity at TP 2, grouped by reason (the worst parameter for a gap)."""
    groups: dict[str, list[str]] = {}
    for family, row in rows.items():
        case = row.get("cases", {}).get("tp2", {})
        status = case.get("status")
        if status == "not at parity":
            worst = re.sub(r"[.]\d+[.]", ".N.", str(case.get("worst_param")))
            reason = f"not at parity, worst parameter {worst}"
        elif status in ("refused", "error"):
            reason = f"{status}: {reason_key(case.get('detail'))}"
        else:
            continue
        groups.setdefault(reason, []).append(family)
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))


def _tp_cell(row: Mapping[str, Any], key: str) -> str:
    even, uneven = row.get(key), row.get(f"{key}_uneven_vocab")
    if even is None:
        return ""
    return f"{even} ({uneven} uneven vocab)" if uneven not in (None, even) else str(even)


def _split_cell(case: Mapping[str, Any]) -> str:
    if "split_fraction" not in case:
        return ""
    return f"{case['split_fraction']:.0%}" + ("" if case.get("attention_split") else ", attention whole")


def _held_cell(case: Mapping[str, Any]) -> str:
    if "held_fraction" not in case:
        return ""
    return f"{case['held_fraction']:.0%}"


def _whole_cell(case: Mapping[str, Any]) -> str:
    kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in (case.get("kept_whole") or {}).items())
    why = "; ".join(f"{name}: {reason}" for name, reason in (case.get("whole_mixers") or {}).items())
    return (kinds + (f" ({why[:160]})" if why else "")).replace("|", "\\|")


def _case_cell(case: Mapping[str, Any] | None) -> str:
    if not case:
        return ""
    status = case.get("status")
    if status in TRAINED:
        cell = f"{status} ({_gap(case.get('loss_gap'))} / {_gap(case.get('param_gap'))}"
        fp64 = case.get("fp64") or {}
        if "grad_gap" in fp64:
            cell += f"; fp64 first gradients {_gap(fp64['grad_gap'])} relative"
        return cell + ")"
    if status == "n/a":
        return "n/a"
    return f"{status}: {str(case.get('detail'))[:120]}".replace("|", "\\|")


def summary(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Counts over the ``tp2`` case: plan source, refusal and skip reasons, parity; and the worst gaps."""
    tp2 = {f: r.get("cases", {}).get("tp2", {}) for f, r in rows.items()}
    kv = {f: r.get("cases", {}).get("kv_replication", {}) for f, r in rows.items()}
    ran = {f: c for f, c in tp2.items() if c.get("status") in TRAINED}
    worst = sorted(ran, key=lambda f: -max(ran[f]["loss_gap"], ran[f].get("param_gap") or 0.0))[:5]
    return {
        "families": len(rows),
        "status": dict(Counter(c.get("status") for c in tp2.values()).most_common()),
        "plan_source_of_trained": dict(Counter(c.get("plan_source") for c in ran.values()).most_common()),
        "plan_source_of_refused": dict(
            Counter(c.get("plan_source") for c in tp2.values() if c.get("status") == "refused").most_common()
        ),
        "refused_by_reason": dict(
            Counter(reason_key(c["detail"]) for c in tp2.values() if c.get("status") == "refused").most_common()
        ),
        "skipped_by_reason": dict(
            Counter(reason_key(c["detail"]) for c in tp2.values() if c.get("status") == "skipped").most_common()
        ),
        "kv_replication": dict(Counter(c.get("status") for c in kv.values()).most_common()),
        "uneven_vocab": dict(
            Counter(r.get("cases", {}).get("uneven_vocab", {}).get("status") for r in rows.values()).most_common()
        ),
        "cp2": dict(Counter(r.get("cases", {}).get("cp2", {}).get("status") for r in rows.values()).most_common()),
        "ep2": dict(Counter(r.get("cases", {}).get("ep2", {}).get("status") for r in rows.values()).most_common()),
        "ep2_tp2": dict(
            Counter(r.get("cases", {}).get("ep2_tp2", {}).get("status") for r in rows.values()).most_common()
        ),
        "trained_with_attention_whole": sorted(f for f, c in ran.items() if not c.get("attention_split", True)),
        "worst_gaps": {f: {"loss_gap": ran[f]["loss_gap"], "param_gap": ran[f].get("param_gap")} for f in worst},
    }


def write_table(rows: Mapping[str, Mapping[str, Any]], *, md: Path, js: Path, meta: Mapping[str, Any]) -> None:
    """``js``: every field, by family; ``md``: the table a reader scans, with the counts above it."""
    stats = summary(rows)
    js.write_text(json.dumps({"meta": dict(meta), "summary": stats, "families": dict(rows)}, indent=1) + "\n")
    lines = [
        "# Causal-LM families under `lightning_tp.parallelize`",
        "",
        f"Generated by `benchmarks/coverage.py` ({meta.get('versions', '')}; `{meta.get('command', '')}`, "
        f"{meta.get('seconds', '?')} s on 2 CPU processes"
        + "".join(f"; then `{c}`" for c in meta.get("merged", []))
        + "); every "
        "field is in `coverage.json`. Each family: a tiny config (2 layers, 4 query heads, hidden 64, vocabulary "
        f"{VOCAB}), {STEPS} SGD steps (fp32, eager attention) sharded at TP 2 against the same model trained whole; "
        f"gaps: largest |loss difference| over the steps / largest |parameter difference| after them; parity: both "
        f"<= {PARITY_TOL:g}. Max TP: the largest TP size <= {MAX_TP} its published default config allows (query "
        "heads and every dim its plan splits, the vocabulary included; in parentheses where an uneven vocabulary "
        "split, which case `uneven_vocab` (vocabulary 127 at TP 2) checks, allows more; without KV "
        "replication the "
        "KV heads too). 'TP 2 > KV heads': the same "
        "run with 1 KV head (regenerate with `--cases kv_replication --merge`); it trains where the plan gathers K/V "
        "or leaves the attention whole. 'split at TP 2': the share of parameter elements the plan splits, and "
        "'attention whole' where it splits no query projection (the MLP or experts alone). 'held per rank': the "
        "share of the parameter elements one rank holds at TP 2 (50% where everything is split). 'kept whole': the "
        "layer kinds no rule splits (1% of the parameters or more; norms and biases are always whole) and, in "
        "parentheses, why a mixer the package would split stays whole at TP 2 on the tiny config. 'cp 2': the same "
        "model "
        "with context parallelism instead (`cp_size=2`, no TP: each sequence split over the 2 ranks; regenerate with "
        "`--cases cp2 --merge`). 'ep 2': the same model with expert parallelism instead (`ep_size=2`, no TP: half of "
        "the experts on each rank, tokens exchanged by all-to-all; n/a without an expert-parallel plan; regenerate "
        "with `--cases ep2 --merge`); 'ep 2 x tp 2': ep 2 over the TP group, the TP plan on the rest.",
        "",
        "| count | |",
        "| --- | --- |",
    ]
    keys = (
        "status",
        "plan_source_of_trained",
        "plan_source_of_refused",
        "kv_replication",
        "uneven_vocab",
        "cp2",
        "ep2",
        "ep2_tp2",
    )
    for key in keys:
        lines.append(f"| {key.replace('_', ' ')} | {', '.join(f'{k}: {v}' for k, v in stats[key].items())} |")
    for key in ("refused_by_reason", "skipped_by_reason"):
        for reason, count in stats[key].items():
            lines.append(f"| {key.split('_')[0]}: {reason.replace('|', '/')} | {count} |")
    whole = ", ".join(stats["trained_with_attention_whole"])
    lines.append(f"| trained with the attention whole | {len(stats['trained_with_attention_whole'])}: {whole} |")
    worst = ", ".join(f"{f} ({_gap(g['loss_gap'])} / {_gap(g['param_gap'])})" for f, g in stats["worst_gaps"].items())
    lines += [f"| worst gaps (loss / param) | {worst} |", ""]
    lines += ["## Not trained at parity at TP 2, by reason", "", "| reason | families |", "| --- | --- |"]
    for reason, names in _by_reason(rows).items():
        lines.append(f"| {reason.replace('|', '/')} | {', '.join(names)} |")
    lines += ["", "## Families", ""]
    lines += [
        "| family | model class | plan source | max TP with KV replication | max TP without | TP 2 (gaps loss / param) "
        "| split at TP 2 | held per rank | kept whole | TP 2 > KV heads | cp 2 | ep 2 | ep 2 x tp 2 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for family, row in rows.items():
        tp2 = row.get("cases", {}).get("tp2", {})
        cells = [
            family,
            str(tp2.get("model_class") or row.get("model_class", "")),
            plan_column(tp2)[:140].replace("|", "\\|"),
            _tp_cell(row, "max_tp_kv_replication"),
            _tp_cell(row, "max_tp_no_kv_replication"),
            _case_cell(tp2) if tp2.get("status") in (*TRAINED, "error") else tp2.get("status", ""),
            _split_cell(tp2),
            _held_cell(tp2),
            _whole_cell(tp2),
            _case_cell(row.get("cases", {}).get("kv_replication")),
            _case_cell(row.get("cases", {}).get("cp2")),
            _case_cell(row.get("cases", {}).get("ep2")),
            _case_cell(row.get("cases", {}).get("ep2_tp2")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    md.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# The launch


def _agree(value: Any) -> list[Any]:
    """Every rank's ``value`` (a collective: the ranks meet here after each family)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _all_ready(ready: bool) -> bool:
    """Whether every rank is ``ready`` (a collective)."""
    import torch.distributed as dist

    flag = torch.tensor([int(ready)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=None, help="comma-separated families (default: every causal LM)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--out-md", type=Path, default=ROOT / "benchmarks" / "coverage.md")
    parser.add_argument("--out-json", type=Path, default=ROOT / "benchmarks" / "coverage.json")
    parser.add_argument("--merge", action="store_true", help="keep the rows and cases of --out-json not run now")
    parser.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument("--family-timeout", type=float, default=300.0, help="stacks dumped and exit past this")
    parser.add_argument("--table-only", action="store_true", help="rewrite --out-md from --out-json, run nothing")
    args = parser.parse_args(argv)
    if args.table_only:
        data = json.loads(args.out_json.read_text())
        write_table(data["families"], md=args.out_md, js=args.out_json, meta=data["meta"])
        return

    import warnings

    import torch.distributed as dist
    import transformers

    import lightning_tp

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    names = args.families.split(",") if args.families else families()
    unknown = sorted(set(names) - set(families()))
    cases = args.cases.split(",")
    if unknown or set(cases) - set(CASES):
        raise ValueError(
            f"Unknown families {unknown} or cases {cases}: families come from "
            f"MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, cases from {CASES}."
        )
    rows: dict[str, dict[str, Any]] = {}
    previous: dict[str, Any] = {}
    if args.merge and args.out_json.exists():
        data = json.loads(args.out_json.read_text())
        rows, previous = data["families"], data["meta"]
    start = time.perf_counter()
    # The default configs' TP sizes: pure, each rank takes its share, then every rank has all.
    mine = {f: default_tp(f) for i, f in enumerate(names) if i % world == rank}
    defaults = {k: v for part in _agree(mine) for k, v in part.items()}
    meta = {
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lightning_tp {lightning_tp.__version__}",
        "command": "torchrun --standalone --nproc-per-node 2 benchmarks/coverage.py"
        + (f" {' '.join(argv if argv is not None else sys.argv[1:])}" if (argv or sys.argv[1:]) else ""),
        "tp_size": world,
        "steps": STEPS,
        "parity_tol": PARITY_TOL,
    }
    if previous:  # a merge: the full run's facts stay, this run is listed after them
        meta = {**previous, "merged": [*previous.get("merged", []), meta["command"]]}
    for index, family in enumerate(names):
        faulthandler.dump_traceback_later(args.family_timeout, exit=True)
        began = time.perf_counter()
        row = rows.setdefault(family, {})
        row.update(model_class=model_class_name(family), **defaults[family])
        for case in cases:
            try:
                result = run_case(family, case, tp_size=world, all_ready=_all_ready)
            except Exception as err:  # noqa: BLE001 - one family's failure must not end the loop
                result = {"status": "error", "detail": _first_line(err), "trace": traceback.format_exc()[-2000:]}
            statuses = _agree((result["status"], result.get("detail")))
            if len(set(statuses)) > 1:
                result = {**result, "status": "error", "detail": f"ranks disagree: {statuses}"}
            row.setdefault("cases", {})[case] = result
        row["seconds"] = round(time.perf_counter() - began, 2)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            tp2 = row["cases"].get("tp2", {})
            print(
                f"[{index + 1}/{len(names)}] {family}: {tp2.get('status')} {str(tp2.get('detail') or '')[:100]} "
                f"({row['seconds']} s)",
                flush=True,
            )
            meta["seconds" if not previous else "merged_seconds"] = round(time.perf_counter() - start, 1)
            write_table(rows, md=args.out_md, js=args.out_json, meta=meta)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
