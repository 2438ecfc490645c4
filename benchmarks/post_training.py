"""Post-training's two costs, side by side in one run: rollout tokens per second of ``generate`` under TP (every rank
of the launch) against one process generating the same prompts, and the weights' hand-off by
:func:`lightning_tp.stream_weights` against ``save_pretrained`` to a directory and a reload from it.

    python benchmarks/post_training.py --out benchmarks/post_training.json               # one process
    torchrun --standalone --nproc-per-node 2 benchmarks/post_training.py --out benchmarks/post_training.json

Each launch adds its entry (keyed by its TP size) to ``--out``. The model: a Llama-style decoder of ``--hidden``
width and ``--layers`` layers, random weights, fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lightning_tp


def build(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(2, hidden // 64),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def rollout_tokens_per_second(model: torch.nn.Module, *, batch: int, prompt: int, new: int, repeats: int) -> float:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=generator)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            model.generate(ids, **kwargs)
    return batch * new * repeats / (time.perf_counter() - start)


def hand_off(model: torch.nn.Module, directory: Path) -> dict[str, float]:
    """Seconds and bytes of one stream (consumed on the first rank) and of save_pretrained + a reload."""
    total = 0
    start = time.perf_counter()
    for _, tensor in lightning_tp.stream_weights(model, targets="first", device="cpu"):
        total += tensor.numel() * tensor.element_size()
    stream = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    model.save_pretrained(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        from safetensors.torch import load_file

        for file in sorted(directory.glob("*.safetensors")):
            load_file(file)
    if dist.is_initialized():
        dist.barrier()
    save_reload = time.perf_counter() - start
    return {"bytes": total, "stream_s": stream, "save_reload_s": save_reload}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/post_training.json"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model = build(args.hidden, args.layers, args.vocab)
    if world > 1:
        lightning_tp.parallelize(model, tp_size=world)
    entry = {
        "tp_size": world,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "rollout": {"batch": args.batch, "prompt": args.prompt, "new_tokens": args.new},
        "rollout_tokens_per_s": rollout_tokens_per_second(
            model, batch=args.batch, prompt=args.prompt, new=args.new, repeats=args.repeats
        ),
    }
    directory = Path(tempfile.mkdtemp(prefix="lightning_tp_bench_")) if not dist.is_initialized() else None
    if dist.is_initialized():
        paths = [str(Path(tempfile.mkdtemp(prefix="lightning_tp_bench_"))) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(paths)
        directory = Path(paths[0])
    entry["hand_off"] = hand_off(model, directory / "save")
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(directory)  # made by mkdtemp above: ours
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        results[f"tp{world}"] = entry
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(entry, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
