"""The README's main job and the LoRA example, launched the way a user launches them: Lightning starts the second
process itself."""

from __future__ import annotations

import re

from tests.helpers.launch import run_script


def test_train_tp_example_loss_falls() -> None:
    stdout = run_script("examples/train_tp.py", "--steps", "20")
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([\d.]+)$", stdout, flags=re.M)]
    assert len(losses) == 20, stdout
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses


def test_finetune_lora_example_accuracy_rises_and_saves_the_adapter(tmp_path) -> None:
    out = tmp_path / "adapter"
    stdout = run_script("examples/finetune_lora.py", "--steps", "60", "--out", str(out))
    accuracy = [float(v) for v in re.findall(r"answer-token accuracy ([\d.]+)", stdout)]
    assert len(accuracy) == 4, stdout  # before training, then every 20 steps
    assert accuracy[-1] > accuracy[0] + 0.3, accuracy
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()


def test_fabric_tp_example_loss_falls_and_saves(tmp_path) -> None:
    checkpoint = tmp_path / "fabric.ckpt"
    stdout = run_script("examples/fabric_tp.py", "--steps", "20", "--checkpoint", str(checkpoint))
    losses = [float(v) for v in re.findall(r"^step +\d+ +loss ([\d.]+)$", stdout, flags=re.M)]
    assert len(losses) == 20, stdout
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    assert (checkpoint / "meta.pt").is_file() and (checkpoint / ".metadata").is_file()


def test_plain_torch_example_loss_falls() -> None:
    from tests.helpers.launch import torchrun

    stdout = torchrun("examples/plain_torch.py", 2, "--steps", "20")
    losses = [float(v) for v in re.findall(r"^step \d+ loss ([\d.]+)", stdout, flags=re.M)]
    assert len(losses) == 3, stdout  # steps 0, 10 and 19
    assert losses[-1] < 0.8 * losses[0], losses


def _dpo_steps(stdout: str) -> list[tuple[float, float]]:
    steps = re.findall(r"^step +\d+ +loss ([\d.]+) +margin ([-\d.]+)$", stdout, flags=re.M)
    return [(float(loss), float(margin)) for loss, margin in steps]


def test_dpo_example_at_tp2_matches_one_process() -> None:
    """examples/dpo.py: the policy and its frozen reference sharded at TP 2, the log-probabilities computed on
    vocabulary-sharded logits (loss parallelism), give one process's DPO losses and reward margins; the held-out
    preference accuracy goes from 0 (policy = reference) to above 0.9."""
    runs = {devices: run_script("examples/dpo.py", "--steps", "8", "--devices", str(devices)) for devices in (1, 2)}
    single, sharded = _dpo_steps(runs[1]), _dpo_steps(runs[2])
    assert len(single) == len(sharded) == 8, runs[2]
    for (loss, margin), (ref_loss, ref_margin) in zip(sharded, single, strict=True):
        assert abs(loss - ref_loss) < 1e-5 and abs(margin - ref_margin) < 1e-5, (sharded, single)
    accuracy = [float(v) for v in re.findall(r"preference accuracy ([\d.]+)", runs[2])]
    assert accuracy[0] == 0.0 and accuracy[-1] > 0.9, accuracy
