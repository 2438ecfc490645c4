"""``lightning_tp.tools.export``: checkpoints of the strategy's format, made in one process without Lightning, exported
to Transformers and PEFT directories that load with no missing keys and give the original logits."""

import copy
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, GPT2Config

from lightning_tp.checkpoint.safetensors import Item, Spec, write_safetensors
from lightning_tp.plans.discovery import describe_models
from lightning_tp.tools.export import export_checkpoint, main
from tests.helpers.models import VOCAB, build_causal_lm, tiny_config
from tests.helpers.tolerances import cast_logits_tolerance, fp32_logits_gap, fp32_roundings

#: An export writes the values it read, and one process runs the same forward on them: bit for bit.
IDENTICAL = 0.0


def merged_gap(model: nn.Module, expected: torch.Tensor) -> float:
    """Bound on each logit of ``model``'s adapters merged into its weights against ``expected``, its logits with the
    adapters apart (tests/helpers/tolerances.py, :func:`fp32_logits_gap`): the adapters' path sums over each adapted
    matrix's input again and over its rank, counted as the forward again."""
    forward, _ = fp32_roundings([value.shape for value in model.state_dict().values()], 0)
    return fp32_logits_gap(2 * forward, expected.abs().max().item())


ROOT = Path(__file__).resolve().parents[2]
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


class Root(nn.Module):
    """What the strategy checkpoints: a LightningModule holding the model as ``self.model``."""

    def __init__(self, model: nn.Module, **others: nn.Module):
        super().__init__()
        self.model = model
        for name, module in others.items():
            setattr(self, name, module)


def save_dcp(root: nn.Module, path: Path, *, keep=lambda key: True, entry: bool = True) -> Path:
    """A distributed checkpoint as the strategy writes it: the model under "state_dict", the rest in meta.pt."""
    state = {k: v for k, v in get_model_state_dict(root).items() if keep(k)}
    dcp.save({"state_dict": state}, checkpoint_id=path, no_dist=True)
    meta = {"epoch": 0, **({"lightning_tp": describe_models(root)} if entry else {})}
    torch.save(meta, path / "meta.pt")
    return path


def save_file(root: nn.Module, path: Path) -> Path:
    """A single-file checkpoint (``save_distributed_checkpoint=False``)."""
    torch.save({"state_dict": get_model_state_dict(root), "lightning_tp": describe_models(root), "epoch": 0}, path)
    return path


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def load(directory: Path) -> nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def lora(model: nn.Module, config: LoraConfig, seed: int = 3) -> nn.Module:
    """A PEFT model whose adapters are not zero (a fresh ``lora_B`` is), as after training."""
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or param.requires_grad:
                param.normal_(0, 0.1)
    return peft_model


def safetensors_keys(path: Path) -> dict[str, torch.dtype]:
    with safe_open(path, framework="pt") as f:
        return {key: f.get_tensor(key).dtype for key in f.keys()}


def make_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# describe_models


def test_describe_models_reads_configs_only():
    model = build_causal_lm(tiny_config("qwen3"))
    entry = describe_models(Root(model))
    assert json.loads(json.dumps(entry)) == entry  # plain data
    assert entry["format_version"] == 1
    (described,) = entry["models"]
    assert described["prefix"] == "model." and described["architecture"] == "Qwen3ForCausalLM"
    assert described["config"]["num_hidden_layers"] == 2 and described["config"]["model_type"] == "qwen3"
    assert described["generation_config"] is not None and described["peft"] is None
    assert described["source"] is None  # built from a config
    assert describe_models(model)["models"][0]["prefix"] == ""  # the model itself as the root

    with torch.device("meta"):  # what a sharded or not yet materialised model holds: no values to read
        meta = AutoModelForCausalLM.from_config(tiny_config("qwen3"), dtype=torch.float32)
    assert describe_models(Root(meta)) == entry


def test_describe_models_records_peft_adapters():
    peft_model = get_peft_model(build_causal_lm(tiny_config("qwen3")), LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.add_adapter("other", LoraConfig(r=2, target_modules=["v_proj"], use_rslora=True))
    (described,) = describe_models(Root(peft_model))["models"]
    assert described["prefix"] == "model." and described["architecture"] == "Qwen3ForCausalLM"
    peft = described["peft"]
    assert peft["prefix_in_model"] == "base_model.model." and peft["active_adapters"] == ["default"]
    assert set(peft["adapters"]) == {"default", "other"}
    assert peft["adapters"]["default"]["target_modules"] == ["q_proj"] and peft["adapters"]["default"]["r"] == 4
    assert peft["adapters"]["other"]["use_rslora"] is True
    json.dumps(described)


def test_describe_models_sees_through_fsdp2_classes():
    model = build_causal_lm(tiny_config("llama"))

    class Marker:  # FSDP2's fully_shard swaps the class for a subclass named FSDP<class>
        pass

    model.__class__ = type(f"FSDP{type(model).__name__}", (Marker, type(model)), {})
    assert describe_models(Root(model))["models"][0]["architecture"] == "LlamaForCausalLM"


# ---------------------------------------------------------------------------------------------------------------------
# Full models


@pytest.mark.parametrize("kind", ["qwen3", "tied"])
@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_round_trip_matches_save_pretrained(tmp_path, kind, fmt):
    model = build_causal_lm(tiny_config(kind))
    root = Root(model)
    ckpt = save_dcp(root, tmp_path / "ckpt") if fmt == "dcp" else save_file(root, tmp_path / "ckpt.pt")
    out = export_checkpoint(ckpt, tmp_path / "out")

    assert out == tmp_path / "out"
    assert torch.allclose(logits(load(out)), logits(model), rtol=0, atol=IDENTICAL)
    reference = tmp_path / "reference"
    model.save_pretrained(reference)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((reference / name).read_text())
    assert safetensors_keys(out / "model.safetensors") == safetensors_keys(reference / "model.safetensors")
    if kind == "tied":
        assert "lm_head.weight" not in safetensors_keys(out / "model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_shards_like_transformers(tmp_path):
    model = build_causal_lm(tiny_config("qwen3"))
    out = export_checkpoint(save_dcp(Root(model), tmp_path / "ckpt"), tmp_path / "out", max_shard_size="40KB")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    sizes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == sizes
    for file in files:  # each file is valid safetensors holding what the index says
        assert set(safetensors_keys(out / file)) == {k for k, f in index["weight_map"].items() if f == file}
    reference = tmp_path / "reference"
    model.save_pretrained(reference, max_shard_size="40KB")
    assert index == json.loads((reference / "model.safetensors.index.json").read_text())
    assert torch.allclose(logits(load(out)), logits(model), rtol=0, atol=IDENTICAL)


def test_export_again_replaces_the_weights(tmp_path):
    """Weight files of an earlier export are removed (Transformers would load a stale ``model.safetensors``);
    other files are kept."""
    model = build_causal_lm(tiny_config("qwen3"))
    ckpt = save_dcp(Root(model), tmp_path / "ckpt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    export_checkpoint(ckpt, out, max_shard_size="40KB")
    export_checkpoint(ckpt, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
    ]
    export_checkpoint(ckpt, out, max_shard_size="40KB")
    assert not (out / "model.safetensors").exists() and (out / "notes.txt").is_file()
    assert torch.allclose(logits(load(out)), logits(model), rtol=0, atol=IDENTICAL)


def test_fused_experts_keep_the_model_names(tmp_path, capsys):
    """Mixture-of-experts weights that Transformers fuses at load time are written fused, under the model's names."""
    model = build_causal_lm(tiny_config("qwen3_moe"))
    out = export_checkpoint(save_file(Root(model), tmp_path / "ckpt.pt"), tmp_path / "out")
    assert "model's own names" in capsys.readouterr().out
    assert set(safetensors_keys(out / "model.safetensors")) == set(model.state_dict())
    assert torch.allclose(logits(load(out)), logits(model), rtol=0, atol=IDENTICAL)


def test_dtype_casts_as_it_streams(tmp_path):
    model = build_causal_lm(tiny_config("qwen3"))
    out = export_checkpoint(save_dcp(Root(model), tmp_path / "ckpt"), tmp_path / "out", dtype="bfloat16")

    assert set(safetensors_keys(out / "model.safetensors").values()) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load(out)
    assert loaded.dtype == torch.bfloat16
    original = model.state_dict()
    assert all(torch.equal(v, original[k].to(torch.bfloat16)) for k, v in loaded.state_dict().items())
    expected = logits(model)
    atol = cast_logits_tolerance(torch.bfloat16, model.config.num_hidden_layers, expected.abs().max().item())
    assert torch.allclose(logits(loaded).float(), expected, rtol=0, atol=atol)


def test_reads_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Each read asks DCP for one tensor, and the tensor read before is freed by then: memory is one tensor."""
    model = build_causal_lm(tiny_config("qwen3"))
    ckpt = save_dcp(Root(model), tmp_path / "ckpt")
    real_load, alive, reads = dcp.load, [], []

    def spy(state_dict, **kwargs):
        assert len(state_dict) == 1, list(state_dict)
        assert all(ref() is None for ref in alive), "a tensor read earlier is still held"
        real_load(state_dict, **kwargs)
        reads.extend(state_dict)
        alive.extend(weakref.ref(t) for t in state_dict.values())

    monkeypatch.setattr(dcp, "load", spy)
    export_checkpoint(ckpt, tmp_path / "out")
    assert sorted(reads) == sorted(f"state_dict.model.{k}" for k in model.state_dict())


def test_single_file_is_memory_mapped(tmp_path, monkeypatch):
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mmap"))
        return real_load(*args, **kwargs)

    ckpt = save_file(Root(build_causal_lm(tiny_config("llama"))), tmp_path / "ckpt.pt")
    monkeypatch.setattr(torch, "load", spy)
    export_checkpoint(ckpt, tmp_path / "out")
    assert calls == [True]


def test_streaming_writer_matches_safetensors(tmp_path):
    from safetensors.torch import save_file as safetensors_save

    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.half": torch.randn(7).to(torch.bfloat16),
        "c.ids": torch.arange(4),
        "d.mask": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.zeros(0, 4),
    }
    items = [Item(k, Spec(tuple(v.shape), v.dtype), lambda v=v: v) for k, v in tensors.items()]
    write_safetensors(tmp_path / "mine.safetensors", items=items)
    safetensors_save(tensors, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    with safe_open(tmp_path / "mine.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())
    assert (tmp_path / "mine.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_from_the_run_or_the_option(tmp_path, capsys):
    model = build_causal_lm(tiny_config("llama"))
    tokenizer = make_tokenizer(tmp_path / "tok")
    model.config._name_or_path = str(tokenizer)  # the run loaded its model from this directory
    out = export_checkpoint(save_dcp(Root(model), tmp_path / "ckpt"), tmp_path / "out")
    assert (out / "tokenizer.json").is_file() and "tokenizer" not in capsys.readouterr().out.lower()

    model.config._name_or_path = ""
    ckpt = save_dcp(Root(model), tmp_path / "ckpt2")
    out = export_checkpoint(ckpt, tmp_path / "out2")
    assert not (out / "tokenizer.json").exists()
    assert capsys.readouterr().out.strip().startswith("No tokenizer written")
    out = export_checkpoint(ckpt, tmp_path / "out3", tokenizer=tokenizer)
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="--tokenizer .*cannot load a tokenizer"):
        export_checkpoint(ckpt, tmp_path / "out4", tokenizer=tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------------------------------
# LoRA


def test_lora_adapter_export_matches_peft(tmp_path):
    config = tiny_config("qwen3", attention_bias=True)
    targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    peft_model = lora(build_causal_lm(config), LoraConfig(r=4, lora_alpha=8, target_modules=targets, bias="lora_only"))
    peft_model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"]))
    out = export_checkpoint(save_dcp(Root(peft_model), tmp_path / "ckpt"), tmp_path / "out")

    reference = tmp_path / "reference"
    peft_model.save_pretrained(reference, save_embedding_layers=False)
    for name in ("adapter_model.safetensors", "other/adapter_model.safetensors"):
        assert (out / name).read_bytes() == (reference / name).read_bytes()
    for name in ("adapter_config.json", "other/adapter_config.json"):
        mine, theirs = json.loads((out / name).read_text()), json.loads((reference / name).read_text())
        assert set(mine.pop("target_modules")) == set(theirs.pop("target_modules")) and mine == theirs
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    loaded = PeftModel.from_pretrained(build_causal_lm(config), out)
    assert torch.equal(logits(loaded), logits(peft_model))


@pytest.mark.parametrize("fmt", ["dcp", "file"])
def test_lora_merge(tmp_path, fmt):
    """rsLoRA, an embedding adapter, trained biases (``bias="lora_only"``) and a rank pattern."""
    config = tiny_config("qwen3", attention_bias=True)
    lora_config = LoraConfig(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "o_proj", "gate_proj", "embed_tokens"],
        rank_pattern={"gate_proj": 2},
        bias="lora_only",
    )
    peft_model = lora(build_causal_lm(config), lora_config)
    root = Root(peft_model)
    ckpt = save_dcp(root, tmp_path / "ckpt") if fmt == "dcp" else save_file(root, tmp_path / "ckpt.pt")
    out = export_checkpoint(ckpt, tmp_path / "out", merge=True)

    expected = logits(peft_model)
    assert torch.allclose(logits(load(out)), expected, rtol=0, atol=merged_gap(peft_model, expected))
    assert torch.allclose(
        expected, logits(peft_model.merge_and_unload()), rtol=0, atol=merged_gap(peft_model, expected)
    )


def test_lora_merge_conv1d_fan_in_fan_out(tmp_path):
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0)
    config.eos_token_id = 0
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    peft_model = lora(base, LoraConfig(r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))
    out = export_checkpoint(save_file(Root(peft_model), tmp_path / "ckpt.pt"), tmp_path / "out", merge=True)
    expected = logits(peft_model)
    assert torch.allclose(logits(load(out)), expected, rtol=0, atol=merged_gap(peft_model, expected))


def _merge_cases() -> dict[str, tuple[Any, list[LoraConfig], str]]:
    """A Llama-like model (two active adapters, rsLoRA, a rank pattern, an embedding adapter) and GPT-2 with LoRA on
    its ``Conv1D`` ``c_attn`` (``fan_in_fan_out=True``: the weight is stored transposed, ``[in, out]``); with the name
    of one adapted weight."""
    llama = LoraConfig(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "down_proj", "embed_tokens"],
        rank_pattern={"down_proj": 2},
    )
    other = LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"])
    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)
    conv1d = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    return {
        "llama": (tiny_config("llama"), [llama, other], "model.layers.0.self_attn.q_proj.weight"),
        "gpt2_conv1d": (gpt2, [conv1d], "transformer.h.0.attn.c_attn.weight"),
    }


@pytest.mark.parametrize("case", ["llama", "gpt2_conv1d"])
def test_both_merges_equal_peft_merge_and_unload(tmp_path, case):
    """``save_merged`` (gathered tensors of a live run) and ``export --merge`` (tensors read from a checkpoint) write
    the tensors of PEFT's own ``merge_and_unload``, on one process."""
    from safetensors.torch import load_file

    from lightning_tp import save_merged

    config, lora_configs, adapted = _merge_cases()[case]
    peft_model = get_peft_model(build_causal_lm(config), lora_configs[0])
    for i, extra in enumerate(lora_configs[1:]):
        peft_model.add_adapter(f"extra{i}", extra)
    torch.manual_seed(4)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)  # every adapter non-zero, as after training
    peft_model.base_model.set_adapter(list(peft_model.peft_config))  # all active: merge_and_unload merges them all
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert not torch.allclose(expected[adapted], build_causal_lm(config).state_dict()[adapted])  # a merge to check

    save_merged(peft_model, tmp_path / "live")
    exported = export_checkpoint(save_file(Root(peft_model), tmp_path / "ckpt.pt"), tmp_path / "export", merge=True)
    for directory in (tmp_path / "live", exported):
        tensors = {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}
        tied = set(expected) - set(tensors)
        assert tied <= {"lm_head.weight"} and set(tensors) <= set(expected), (directory.name, tied)
        gaps = {k: (v - expected[k]).abs().max().item() for k, v in tensors.items()}
        assert max(gaps.values()) <= IDENTICAL, (directory.name, {k: g for k, g in gaps.items() if g > IDENTICAL})


@pytest.mark.parametrize("how", ["dora", "merged"])
def test_both_merges_refuse_what_they_cannot_merge(tmp_path, how):
    """One check for ``save_merged`` and ``export --merge``, naming the layers, before anything is written."""
    from lightning_tp import save_merged

    config = LoraConfig(r=4, target_modules=["q_proj"], use_dora=how == "dora")
    peft_model = get_peft_model(build_causal_lm(tiny_config("llama")), config)
    if how == "merged":
        peft_model.merge_adapter()
    with pytest.raises(ValueError, match=r"Cannot merge the adapters of \['model.layers.0.self_attn.q_proj'"):
        save_merged(peft_model, tmp_path / "live")
    if how == "dora":  # a checkpoint holds unmerged adapters
        with pytest.raises(ValueError, match=r"Cannot merge the adapters of \['model.layers.0.self_attn.q_proj'"):
            export_checkpoint(save_file(Root(peft_model), tmp_path / "ckpt.pt"), tmp_path / "export", merge=True)
    assert not (tmp_path / "live").exists() and not (tmp_path / "export").exists()


def test_lora_merge_reads_base_weights_from_a_directory(tmp_path):
    config = tiny_config("tied")
    base_dir = tmp_path / "base"
    build_causal_lm(config).save_pretrained(base_dir)
    peft_model = lora(build_causal_lm(config), LoraConfig(r=4, target_modules="all-linear"))
    adapters_only = save_dcp(Root(peft_model), tmp_path / "ckpt", keep=lambda key: "lora_" in key)

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"does not hold \d+ tensor.*embed_tokens.*--base PATH"):
        export_checkpoint(adapters_only, out, merge=True)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    export_checkpoint(adapters_only, out, merge=True, base=base_dir)
    expected = logits(peft_model)
    assert torch.allclose(logits(load(out)), expected, rtol=0, atol=merged_gap(peft_model, expected))

    # the run's source, when it is a local directory, is the default base
    peft_model.get_base_model().config._name_or_path = str(base_dir)
    ckpt = save_dcp(Root(peft_model), tmp_path / "ckpt2", keep=lambda key: "lora_" in key)
    out = export_checkpoint(ckpt, tmp_path / "out2", merge=True)
    expected = logits(peft_model)
    assert torch.allclose(logits(load(out)), expected, rtol=0, atol=merged_gap(peft_model, expected))


# ---------------------------------------------------------------------------------------------------------------------
# Command line and errors


def test_cli(tmp_path):
    model = build_causal_lm(tiny_config("llama"))
    ckpt = save_dcp(Root(model), tmp_path / "ckpt")
    tokenizer = make_tokenizer(tmp_path / "tok")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    args = [str(ckpt), str(tmp_path / "out"), "--dtype", "float16", "--tokenizer", str(tokenizer)]
    args += ["--max-shard-size", "100KB", "--model-prefix", "model."]
    run = subprocess.run(
        [sys.executable, "-m", "lightning_tp.export", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1].startswith("Exported")
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    expected = logits(model)
    atol = cast_logits_tolerance(torch.float16, model.config.num_hidden_layers, expected.abs().max().item())
    assert torch.allclose(logits(load(out)).float(), expected, rtol=0, atol=atol)


def test_cli_user_error_is_one_line_and_exit_code_1(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "does not exist" in err


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "missing", tmp_path / "out")

    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"not a distributed checkpoint \(no .metadata"):
        export_checkpoint(tmp_path / "plain", tmp_path / "out")

    model = build_causal_lm(tiny_config("llama"))
    foreign = save_dcp(Root(model), tmp_path / "foreign", entry=False)
    with pytest.raises(ValueError, match="not written by TensorParallelStrategy.*--model-prefix.*cannot be guessed"):
        export_checkpoint(foreign, tmp_path / "out")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint torch.load can memory-map"):
        export_checkpoint(tmp_path / "notes.txt", tmp_path / "out")
    torch.save({"state_dict": model.state_dict()}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not written by TensorParallelStrategy"):
        export_checkpoint(tmp_path / "foreign.pt", tmp_path / "out")

    meta = torch.load(save_dcp(Root(model), tmp_path / "custom") / "meta.pt", weights_only=False)
    meta["lightning_tp"]["models"][0]["architecture"] = "CustomForCausalLM"  # remote code
    torch.save(meta, tmp_path / "custom" / "meta.pt")
    with pytest.raises(ValueError, match="CustomForCausalLM is not a class of Transformers"):
        export_checkpoint(tmp_path / "custom", tmp_path / "out")

    with pytest.raises(ValueError, match="--merge.*no LoRA adapters"):
        export_checkpoint(save_dcp(Root(model), tmp_path / "full"), tmp_path / "out", merge=True)
    with pytest.raises(ValueError, match="dtype 'int8' is not one of"):
        export_checkpoint(tmp_path / "full", tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_several_models_need_a_prefix(tmp_path):
    policy, reward = build_causal_lm(tiny_config("llama")), build_causal_lm(tiny_config("qwen3"), seed=1)
    ckpt = save_dcp(Root(policy, reward=reward), tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"2 Transformers models, with prefixes \['model.', 'reward.'\]"):
        export_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(ValueError, match="--model-prefix 'value' matches no model"):
        export_checkpoint(ckpt, tmp_path / "out", model_prefix="value")
    out = export_checkpoint(ckpt, tmp_path / "out", model_prefix="reward")
    assert torch.allclose(logits(load(out)), logits(reward), rtol=0, atol=IDENTICAL)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints are untrusted input


class _CreatesAFile:
    """Unpickling this runs a command that creates a file: what a crafted checkpoint does."""

    def __init__(self, probe: Path):
        self.probe = probe

    def __reduce__(self):
        return (os.system, (f"touch {self.probe}",))


class _CustomHyperParameter:
    """A harmless object of a type torch's weights-only loader does not know (a user's hyper-parameter class)."""

    def __eq__(self, other):
        return type(other) is type(self)


def test_a_crafted_checkpoint_runs_no_code(tmp_path):
    """Issue 11, security: a crafted single file, a replaced meta.pt, a replaced DCP index each ran a command."""
    import pickle

    from lightning_tp.checkpoint.trust import UntrustedCheckpointError
    from lightning_tp.checkpoint.validation import check_checkpoint

    model = build_causal_lm(tiny_config("llama"))
    probe = tmp_path / "probe"
    single = save_file(Root(model), tmp_path / "ckpt.pt")
    checkpoint = torch.load(single, weights_only=True)
    torch.save({**checkpoint, "hyper_parameters": {"x": _CreatesAFile(probe)}}, single)
    meta = save_dcp(Root(model), tmp_path / "meta")
    torch.save({**torch.load(meta / "meta.pt", weights_only=True), "x": _CreatesAFile(probe)}, meta / "meta.pt")
    index = save_dcp(Root(model), tmp_path / "index")
    (index / ".metadata").write_bytes(pickle.dumps(_CreatesAFile(probe)))

    for crafted in (single, meta):
        with pytest.raises(UntrustedCheckpointError, match=r"posix.system.*--trust-checkpoint"):
            export_checkpoint(crafted, tmp_path / "out")
        assert main([str(crafted), str(tmp_path / "out")]) == 1
    for load_index in (
        lambda: export_checkpoint(index, tmp_path / "out", trust_checkpoint=True),
        lambda: check_checkpoint(index),
    ):
        with pytest.raises(UntrustedCheckpointError, match="names posix.system, which a DCP index does not hold"):
            load_index()  # the index is never trusted: a real one holds only DCP's own types
    assert not probe.exists() and not (tmp_path / "out").exists()


def test_trust_checkpoint_is_an_explicit_opt_in(tmp_path, capsys):
    model = build_causal_lm(tiny_config("llama"))
    ckpt = save_dcp(Root(model), tmp_path / "ckpt")
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    torch.save(
        {**meta, "hyper_parameters": {"path": Path("/data"), "custom": _CustomHyperParameter()}}, ckpt / "meta.pt"
    )

    assert main([str(ckpt), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "_CustomHyperParameter" in err and "run code" in err and "--trust-checkpoint" in err
    assert main([str(ckpt), str(tmp_path / "out"), "--trust-checkpoint"]) == 0
    assert torch.allclose(logits(load(tmp_path / "out")), logits(model), rtol=0, atol=IDENTICAL)

    # paths and namespaces (common hyper-parameters) load without the opt-in
    torch.save({**meta, "hyper_parameters": {"path": Path("/data")}}, ckpt / "meta.pt")
    export_checkpoint(ckpt, tmp_path / "out2")


def test_names_from_the_checkpoint_cannot_leave_the_output_directory(tmp_path):
    outside = tmp_path / "outside"
    assert "." not in str(outside), "PEFT refuses adapter names with dots"
    peft_model = lora(build_causal_lm(tiny_config("qwen3")), LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.add_adapter(str(outside), LoraConfig(r=2, target_modules=["v_proj"]))  # PEFT takes an absolute path
    ckpt = save_dcp(Root(peft_model), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="adapter names become directory names"):
        export_checkpoint(ckpt, tmp_path / "out" / "adapter")  # it was written to `outside` itself
    original = torch.load(ckpt / "meta.pt", weights_only=True)
    original["lightning_tp"]["models"][0]["peft"]["adapters"].pop(str(outside))
    for name in ("../outside", "a/../../outside", "..", "a\\..\\..\\outside", "C:outside"):
        meta = json.loads(json.dumps(original))
        adapters = meta["lightning_tp"]["models"][0]["peft"]["adapters"]
        adapters[name] = adapters["default"]
        torch.save(meta, ckpt / "meta.pt")
        with pytest.raises(ValueError, match="adapter names become directory names"):
            export_checkpoint(ckpt, tmp_path / "out" / "adapter")
    assert not outside.exists() and not (tmp_path / "out").exists()

    meta = json.loads(json.dumps(original))
    meta["lightning_tp"]["models"][0]["architecture"] = "pipeline"  # a callable of transformers, not a model class
    torch.save(meta, ckpt / "meta.pt")
    with pytest.raises(ValueError, match="pipeline is not a class of Transformers"):
        export_checkpoint(ckpt, tmp_path / "out")
    with pytest.raises(ValueError, match="is the checkpoint itself"):
        export_checkpoint(ckpt, ckpt)


def test_a_tokenizer_directory_named_by_the_checkpoint_runs_no_code(tmp_path):
    """The run's source comes from the checkpoint: a tokenizer there whose config points at its own code is not
    loaded with that code."""
    model = build_causal_lm(tiny_config("llama"))
    source = make_tokenizer(tmp_path / "source")
    probe = tmp_path / "probe"
    (source / "evil_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(probe)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    model.config._name_or_path = str(source)
    out = export_checkpoint(save_dcp(Root(model), tmp_path / "ckpt"), tmp_path / "out")
    assert not probe.exists()
    assert torch.allclose(logits(load(out)), logits(model), rtol=0, atol=IDENTICAL)
