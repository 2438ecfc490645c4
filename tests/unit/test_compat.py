"""The upstream shims (lightning_tp/compat/) and what moved onto them: parameter views as forward hooks, one
publishing ``save_pretrained`` for Transformers and PEFT models."""

import sys
import warnings
from datetime import timedelta

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lightning_tp import compat
from lightning_tp.checkpoint.hf_saves import install_distributed_save, install_distributed_save_pretrained
from lightning_tp.parallel.hooks import run_on_parameter_views
from tests.helpers.models import build_causal_lm, tiny_config


def test_distributed_is_initialized_without_a_process_group():
    assert compat.distributed_is_initialized() is False


def test_group_options_carry_the_timeout():
    options = compat.group_options("gloo", timedelta(seconds=7))
    assert options._timeout == timedelta(seconds=7)


def test_fsspec_reader_and_writer_by_their_public_names_where_torch_has_them():
    """torch 2.15 exports DCP's fsspec reader and writer and deprecates its private module with a warning at import:
    the shims then hand back the public classes and never import that module."""
    import torch.distributed.checkpoint as dcp

    if not hasattr(dcp, "FsspecWriter"):
        pytest.skip("torch < 2.15: the private module is their only spelling (tests/unit/test_remote.py uses it)")
    private = "torch.distributed.checkpoint._fsspec_filesystem"
    saved = sys.modules.pop(private, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert compat.fsspec_writer_class() is dcp.FsspecWriter
            assert compat.fsspec_reader_class() is dcp.FsspecReader
        assert private not in sys.modules
    finally:
        if saved is not None:
            sys.modules[private] = saved


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        self.seen.append(self.weight)
        if fail:
            raise RuntimeError("boom")
        return x * self.weight


def test_parameter_views_are_swapped_in_forward_and_restored_on_error():
    module = _Fails()
    param = module.weight
    run_on_parameter_views(module, {"weight": lambda p: p * 2})
    out = module(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and module.seen[-1] is not param
    assert module.weight is param and isinstance(module.weight, nn.Parameter)
    with pytest.raises(RuntimeError, match="boom"):
        module(torch.ones(3), fail=True)
    assert module.weight is param  # put back although the forward raised
    out.sum().backward()
    assert torch.equal(param.grad, torch.full((3,), 2.0))  # the view's gradient reaches the parameter


def test_parameter_views_of_a_holder_survive_a_failing_pre_hook():
    owner, holder = nn.Module(), nn.ParameterDict({"a": nn.Parameter(torch.ones(2))})
    owner.holder = holder
    owner.forward = lambda: owner.holder["a"] + 0  # a container has no forward: its owner reads it
    param = holder["a"]
    owner.register_forward_pre_hook(lambda m, args: (_ for _ in ()).throw(ValueError("before")))
    run_on_parameter_views(owner, {"a": lambda p: p * 3}, holder=holder)
    with pytest.raises(ValueError, match="before"):
        owner()
    assert holder["a"] is param


def _adapter_files(directory):
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def test_one_save_pretrained_patch_for_models_and_adapters(tmp_path):
    """In one process both patched ``save_pretrained`` write what the unpatched ones write, into the same names."""
    model = build_causal_lm(tiny_config("qwen3"))
    model.save_pretrained(tmp_path / "reference")
    install_distributed_save_pretrained(model)
    install_distributed_save_pretrained(model)  # once only
    model.save_pretrained(tmp_path / "mine")
    assert _adapter_files(tmp_path / "mine") == _adapter_files(tmp_path / "reference")
    name = "model.safetensors"
    assert (tmp_path / "mine" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()

    peft_model = get_peft_model(build_causal_lm(tiny_config("qwen3")), LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "adapter_reference", save_embedding_layers=False)
    install_distributed_save(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert _adapter_files(tmp_path / "adapter") == _adapter_files(tmp_path / "adapter_reference")
    name = "adapter_model.safetensors"
    assert (tmp_path / "adapter" / name).read_bytes() == (tmp_path / "adapter_reference" / name).read_bytes()


def test_no_cache_under_grad_is_installed_once_per_model_and_found_on_it():
    """The hook is found on the model (no registry of models): a second call, or a deep copy's, installs none; under
    grad a forward gets ``use_cache=False`` unless given one, without grad it is left alone."""
    import copy

    from lightning_tp.parallel.hooks import no_cache_under_grad
    from tests.helpers.models import build_causal_lm, tiny_config

    model = build_causal_lm(tiny_config("llama"))
    assert no_cache_under_grad(model) is True and no_cache_under_grad(model) is False
    assert no_cache_under_grad(copy.deepcopy(model)) is False
    seen = []  # what the forward gets, after the hook
    model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs.get("use_cache")), with_kwargs=True)
    ids = torch.tensor([[1, 2, 3]])
    model(ids)
    model(ids, use_cache=True)
    with torch.no_grad():
        model(ids)
    assert seen == [False, True, None]
