"""A real pretrained model: SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 KV heads, tied embeddings, vocabulary
49152) at TP 3 on 3 processes, against the same model on one process. One launch for every case."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from tests.helpers.launch import workers
from tests.helpers.models import ParityModule, reference_run
from tests.helpers.parity import fp32_bounds
from tests.helpers.real_model import (
    CHAT_QUESTIONS,
    MISSING,
    available,
    build_lora,
    chat_answers,
    model_dir,
    training_batches,
)
from tests.helpers.tolerances import assert_step_gaps, rms_gap, weight_drift

pytestmark = pytest.mark.skipif(not available(), reason=MISSING)
WORKER = Path(__file__).with_name("real_model_worker.py")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return model_dir()


@pytest.fixture(scope="module")
def sharded(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("smollm2_tp3")
    workers(WORKER, 3, str(smollm2), str(out), timeout=900)
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def _one_process(smollm2: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2)


def test_chat_answers_at_tp3_equal_one_process(sharded: dict, smollm2: Path, tokenizer) -> None:
    """Greedy answers, token for token; each rank holds 3 of the 9 query heads and 1 of the 3 KV heads."""
    reference = chat_answers(_one_process(smollm2).eval(), tokenizer, CHAT_QUESTIONS)
    assert sharded["chat"]["answers"] == reference, [tokenizer.decode(a) for a in sharded["chat"]["answers"]]
    assert "Paris" in tokenizer.decode(reference[0])
    assert sharded["chat"]["q_proj_local_shape"] == (192, 576)
    assert sharded["chat"]["tied"]


def _assert_parity(result: dict, ref: dict, trained: dict, bounds: dict) -> None:
    """Losses and gradient norms within fp32's bounds (tests/helpers/parity.py, :func:`fp32_bounds`), and the
    ``trained`` tensors (the sharded run's saved ones, by the reference's names) within their ``state`` bound of the
    reference's, each, and their ``state_rms`` over all of them (AdamW)."""
    assert_step_gaps(result["losses"], ref["losses"], bounds["loss"], relative=False, what="losses")
    assert_step_gaps(result["grad_norms"], ref["grad_norms"], bounds["grad_norm_rel"], relative=True, what="norms")
    assert result["all_dtensor"]
    want = {k: ref["state"][k] for k in trained}
    worst = max((trained[k] - v).abs().max().item() for k, v in want.items())
    assert worst <= bounds["state"], (worst, bounds["state"])
    if bounds["state_rms"] is not None:
        assert rms_gap(trained, want) <= bounds["state_rms"], (rms_gap(trained, want), bounds["state_rms"])


def test_full_fine_tuning_at_tp3_matches_one_process_and_exports(sharded: dict, smollm2: Path, tokenizer) -> None:
    """Three AdamW steps of every weight, loaded from the meta device by the strategy; the exported directory
    reloads on one process with the reference's trained weights."""
    from transformers import AutoModelForCausalLM

    batches = training_batches(tokenizer)
    ref = reference_run(ParityModule(partial(_one_process, smollm2), optimizer="adamw", lr=1e-5), batches)
    exported = AutoModelForCausalLM.from_pretrained(sharded["full"]["saved"])
    state = exported.state_dict()
    assert state.keys() == ref["state"].keys()
    # AdamW moves a weight whose gradient is zero up to rounding by about lr a step either way: each weight within
    # 2 x lr x 3 steps (one ended 1.04e-5 apart at lr 1e-5 on a fresh machine), all of them within the root mean
    # square bound (tests/helpers/tolerances.py, adamw_weight_gap and adamw_rms_gap).
    bounds = fp32_bounds(ref, optimizer="adamw", lr=1e-5, drift=weight_drift(state, ref["state"]))
    _assert_parity(sharded["full"], ref, state, bounds)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight  # still tied


def test_lora_at_tp3_matches_one_process_and_the_adapter_reloads(sharded: dict, smollm2: Path, tokenizer) -> None:
    """Three SGD steps of LoRA adapters on every linear layer; the adapter saved the PEFT way reloads on one process
    with the reference's adapter weights."""
    from peft import PeftModel
    from safetensors.torch import load_file

    batches = training_batches(tokenizer)
    ref = reference_run(ParityModule(partial(build_lora, smollm2), optimizer="sgd", lr=0.5), batches)
    assert sharded["lora"]["trainable"] == 30 * 7 * 2  # lora_A and lora_B of 7 projections in 30 layers
    saved = load_file(Path(sharded["lora"]["saved"]) / "adapter_model.safetensors")
    # PEFT drops the adapter's name in the file.
    trained = {k: saved[k.replace(".default", "")] for k in ref["state"] if "lora_" in k}
    assert len(trained) == len(saved)
    # fp32 sums in another order over 30 layers, times SGD's lr of 0.5 (tests/helpers/tolerances.py, sgd_weight_gap),
    # where the adapters moved by far more (lora_B starts at zero).
    bounds = fp32_bounds(
        ref, optimizer="sgd", lr=0.5, drift=weight_drift(trained, {k: ref["state"][k] for k in trained})
    )
    _assert_parity(sharded["lora"], ref, trained, bounds)
    worst = max((trained[k] - ref["state"][k]).abs().max().item() for k in trained)
    moved = max(ref["state"][k].abs().max().item() for k in trained if "lora_B" in k)
    assert moved > 100 * worst, (worst, moved)
    model = PeftModel.from_pretrained(_one_process(smollm2), sharded["lora"]["saved"])
    assert chat_answers(model.eval(), tokenizer, CHAT_QUESTIONS[:1])[0]  # it loads and answers
