"""One short check on a CUDA machine (NCCL, bf16), run by hand: ``python tests/gpu/check_cuda.py``.

One GPU, so one rank: it exercises the CUDA paths (NCCL process group, device meshes on cuda, bf16-mixed with foreach
AdamW, sequence and loss parallelism code, CUDA random states in checkpoints, DCP save/resume, export, MFU) rather
than multi-rank parity, which the CPU suite covers. Prints one JSON line per check."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_tp import TensorParallelStrategy  # noqa: E402
from tests.helpers.cases import CHECKPOINT_ENV  # noqa: E402
from tests.helpers.models import build_causal_lm, quiet_trainer, tiny_config  # noqa: E402


def report(name: str, **values) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


def fit(module, strategy=None, ckpt_path=None, callbacks=(), precision="32-true", steps=8):
    kwargs = {"strategy": strategy} if strategy is not None else {}
    trainer = quiet_trainer(
        accelerator="gpu", devices=1, max_steps=steps, precision=precision, callbacks=list(callbacks), **kwargs
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    build_causal_lm(tiny_config("qwen3")).save_pretrained(tmp / "qwen3")
    os.environ[CHECKPOINT_ENV] = str(tmp)
    from tests.helpers.resume import ResumeModule, SaveAt, probe_logits

    try:
        import torchdata  # noqa: F401

        stateful = True
    except ImportError:
        stateful = False
    report("env", torch=torch.__version__, device=torch.cuda.get_device_name(), stateful_data=stateful)
    for precision in ("bf16-mixed", "32-true"):
        ref = ResumeModule(stateful_data=stateful)
        fit(ref, precision=precision)
        tp = ResumeModule(stateful_data=stateful)
        fit(tp, TensorParallelStrategy(sequence_parallel=True, loss_parallel=True), precision=precision)
        gap = max(abs(tp.losses[s] - ref.losses[s]) for s in ref.losses)
        report("parity_vs_plain_trainer", precision=precision, max_loss_gap=gap, losses=list(tp.losses.values()))
    module = ResumeModule(dropout=0.1, stateful_data=stateful)
    trainer = fit(module, TensorParallelStrategy(), callbacks=[SaveAt(steps={6: tmp / "mid"})])
    t0 = time.perf_counter()
    trainer.save_checkpoint(tmp / "final")
    save_s = time.perf_counter() - t0
    logits = probe_logits(module.model).float()
    resumed = ResumeModule(dropout=0.1, stateful_data=stateful)
    fit(resumed, TensorParallelStrategy(), ckpt_path=tmp / "mid")
    gaps = {s: abs(resumed.losses[s] - module.losses[s]) for s in resumed.losses}
    report("resume_mid_epoch_with_dropout", gaps=gaps, save_s=save_s)
    from transformers import AutoModelForCausalLM

    from lightning_tp.tools.export import export_checkpoint

    out = export_checkpoint(tmp / "final", tmp / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out).cuda()
    exported_logits = probe_logits(exported).float()
    report("export", max_logit_gap=(exported_logits - logits.cpu()).abs().max().item())
    monitor = [v for k, v in trainer.callback_metrics.items() if k == "mfu"]
    report("monitor", mfu=float(monitor[0]) if monitor else None, keys=sorted(trainer.callback_metrics))


if __name__ == "__main__":
    main()
