"""``lightning_tp.patches``: what an undo restores, what is refused, what an owner's undo covers, and the package's
patches going through it (the router's loss function given back at a strategy's teardown)."""

import copy
import gc
import pickle
import sys
import types
import weakref

import pytest
import torch
from torch import nn

from lightning_tp import patches
from lightning_tp.patches import ABSENT, install, installed, owned_by, patched, undo_owned


class Thing:
    def method(self) -> str:
        return "class"


class Owner:
    """Any weakly referenceable object can own patches."""


def replacement() -> str:
    return "patched"


def test_undo_deletes_an_instance_attribute_that_shadowed_the_class_method():
    thing, owner = Thing(), Owner()
    patch = install(thing, "method", replacement, owner=owner)
    assert thing.method() == "patched" and patch.previous is ABSENT
    assert patch.undo() is True
    assert "method" not in vars(thing) and thing.method() == "class"
    assert installed(thing, "method") is None
    assert patch.undo() is False  # undoing twice does nothing


def test_undo_restores_the_objects_own_previous_value():
    thing, owner = Thing(), Owner()
    own = lambda: "own"  # noqa: E731
    thing.method = own
    patch = install(thing, "method", replacement, owner=owner)
    patch.undo()
    assert vars(thing)["method"] is own


def test_a_module_attribute_absent_before_is_absent_after():
    module = types.ModuleType("lightning_tp_test_module")
    with patched(module, "added", 1) as patch:
        assert module.added == 1 and patch.previous is ABSENT
    assert not hasattr(module, "added")


def test_a_class_patch_restores_the_base_classs_method():
    class Child(Thing):
        pass

    owner = Owner()
    install(Child, "method", lambda self: "child", owner=owner)
    assert Child().method() == "child" and Thing().method() == "class"
    assert installed(Child(), "method") is None  # the class is patched, not its instances
    assert [p.target for p in undo_owned(owner)] == [Child]
    assert "method" not in vars(Child) and Child().method() == "class"


def test_the_context_manager_undoes_on_an_exception():
    thing = Thing()
    with pytest.raises(RuntimeError, match="inside"):
        with patched(thing, "method", replacement):
            assert thing.method() == "patched"
            raise RuntimeError("inside")
    assert thing.method() == "class" and installed(thing, "method") is None


def test_a_second_patch_of_the_same_attribute_is_refused():
    thing, first, second = Thing(), Owner(), Owner()
    install(thing, "method", replacement, owner=first)
    with pytest.raises(ValueError, match="patched already"):
        install(thing, "method", lambda: "again", owner=second)
    with pytest.raises(ValueError, match="patched already"):
        install(thing, "method", lambda: "again", owner=first)
    assert thing.method() == "patched"
    undo_owned(first)
    install(thing, "method", lambda: "again", owner=second)  # once undone, it may be patched again
    assert thing.method() == "again"


def test_what_is_not_a_plain_attribute_is_refused():
    owner = Owner()
    linear = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a plain attribute"):
        install(linear, "weight", torch.zeros(2, 2), owner=owner)  # a parameter, served by `__getattr__`
    with pytest.raises(ValueError, match="does not set a plain attribute"):
        install(linear, "extra", nn.ReLU(), owner=owner)  # `nn.Module` registers a submodule elsewhere
    assert "extra" not in dict(linear.named_children()) and installed(linear, "extra") is None

    class WithProperty:
        @property
        def value(self) -> int:
            return 1

    with pytest.raises(ValueError, match="property"):
        install(WithProperty(), "value", 2, owner=owner)
    with pytest.raises(ValueError, match="__dict__"):
        install(1, "real", 2, owner=owner)
    with pytest.raises(ValueError, match="weakly"):
        install(Thing(), "method", replacement, owner="a string")
    assert owned_by(owner) == []


def test_undo_owned_undoes_every_patch_of_the_owner_latest_first_and_no_other():
    owner, other = Owner(), Owner()
    a, b, c = Thing(), Thing(), Thing()
    module = types.ModuleType("lightning_tp_test_owned")
    module.function = replacement
    original = module.function
    install(a, "method", lambda: "a", owner=owner)
    install(module, "function", lambda: "wrapped", owner=owner)
    install(b, "method", lambda: "b", owner=owner)
    install(c, "method", lambda: "c", owner=other)
    assert [p.target for p in owned_by(owner)] == [a, module, b]
    undone = undo_owned(owner)
    assert [p.target for p in undone] == [b, module, a]
    assert a.method() == b.method() == "class" and module.function is original
    assert c.method() == "c" and owned_by(owner) == [] and [p.target for p in owned_by(other)] == [c]
    assert undo_owned(owner) == []


def test_undo_owned_of_the_process_wide_patches_only_keeps_the_instances():
    owner, thing = Owner(), Thing()
    module = types.ModuleType("lightning_tp_test_process_wide")
    install(thing, "method", replacement, owner=owner)
    install(module, "function", replacement, owner=owner)
    assert patches.is_process_wide(module) and patches.is_process_wide(Thing) and not patches.is_process_wide(thing)
    assert [p.target for p in undo_owned(owner, instances=False)] == [module]
    assert not hasattr(module, "function") and thing.method() == "patched"
    assert [p.target for p in owned_by(owner)] == [thing]


def test_a_shared_patch_is_undone_with_its_last_owner():
    first, second = Owner(), Owner()
    module = types.ModuleType("lightning_tp_test_shared")
    patch = install(module, "function", replacement, owner=first)
    patch.add_owner(second)
    patch.add_owner(second)  # once
    assert undo_owned(first) == [] and module.function is replacement
    assert patch.release(first) is False and patch.release(Owner()) is False  # not owners (any more)
    assert module.function is replacement
    assert undo_owned(second) == [patch] and not hasattr(module, "function")
    with pytest.raises(ValueError, match="was undone"):
        patch.add_owner(first)


def test_an_attribute_replaced_by_someone_else_is_left_as_they_set_it():
    thing, owner = Thing(), Owner()
    patch = install(thing, "method", replacement, owner=owner)
    theirs = lambda: "theirs"  # noqa: E731
    thing.method = theirs
    assert patch.undo() is False
    assert thing.method is theirs and installed(thing, "method") is None


def test_patches_keep_neither_their_objects_nor_their_owners_alive():
    module = types.ModuleType("lightning_tp_test_alive")
    owner, thing = Owner(), Thing()
    install(thing, "method", lambda held=thing: held, owner=thing)  # a value that refers to the object it patches
    install(module, "function", replacement, owner=owner)
    refs = weakref.ref(owner), weakref.ref(thing)
    del owner, thing
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert installed(module, "function") is not None  # a process-wide patch stays: no owner gave it up


def test_a_deep_copy_carries_its_own_patch():
    """A deep copy of a patched module runs its own copy of the patched method (the gated norm of blocks.py relies on
    it), and its record names the copy."""
    norm = nn.Linear(2, 2)
    install(norm, "forward", types.MethodType(lambda self, x: self.weight.sum() + 0 * x, norm), owner=norm)
    twin = copy.deepcopy(norm)
    with torch.no_grad():
        twin.weight.fill_(1.0)
    assert twin(torch.zeros(1)).item() == 4.0 and norm(torch.zeros(1)).item() != 4.0
    assert installed(twin, "forward").target is twin and installed(twin, "forward").undo()
    assert "forward" not in vars(twin) and installed(norm, "forward") is not None


def test_a_patched_object_is_freed_when_its_last_user_drops_it():
    """No reference cycle through the record (it holds its object weakly): a patched model goes when its last
    reference does, without waiting for the cyclic collector (whose pauses the strategy schedules)."""
    gc.disable()
    try:
        model = nn.Linear(1, 1)
        install(model, "config", {"own": True}, owner=model)
        ref = weakref.ref(model)
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_an_owners_list_does_not_grow_with_patches_installed_and_undone():
    """A patch installed and undone at every step (an embedding's ``padding_idx`` for one call) leaves nothing behind:
    its owner's list forgets it when it goes, and a patch for a call has no owner at all."""
    owner, thing = nn.Linear(1, 1), Thing()
    for _ in range(100):
        install(thing, "method", replacement, owner=owner).undo()
        patches.install_for_call(thing, "method", replacement).undo()
    assert len(vars(owner)[patches.OWNED_ATTR]) == 0 and installed(thing, "method") is None


def test_the_records_live_on_their_objects_not_in_the_module():
    """No registry of the process: the module holds no mutable state, an owner's patches are listed on the owner, and
    a copy or a pickle of an owner owns none of them (the original's undo still gives them up)."""
    mutable = {name for name, value in vars(patches).items() if isinstance(value, (dict, list, set, weakref.WeakSet))}
    assert mutable <= {"__all__", "__builtins__"}, mutable
    module = types.ModuleType("lightning_tp_test_records")
    owner = nn.Linear(1, 1)
    patch = install(module, "function", replacement, owner=owner)
    assert [p() for p in vars(owner)[patches.OWNED_ATTR]] == [patch]
    for twin in (copy.deepcopy(owner), pickle.loads(pickle.dumps(owner))):
        assert owned_by(twin) == [] and undo_owned(twin) == [] and module.function is replacement
    assert undo_owned(owner) == [patch] and not hasattr(module, "function")


# ---------------------------------------------------------------------------------------------------------------------
# The package's patches


def _moe_model():
    from tests.helpers.models import build_causal_lm, tiny_config

    return build_causal_lm(tiny_config("qwen3_moe", output_router_logits=True))


class _OneRankMesh:
    """What ``install_global_router_loss`` reads of a data-parallel mesh."""

    def get_group(self):
        return None

    def size(self):
        return 1


def test_the_router_loss_function_is_the_familys_again_after_the_strategys_teardown():
    from lightning_tp.parallel import router_loss
    from lightning_tp.parallel.router_loss import FUNCTION_NAME, install_global_router_loss, router_loss_module
    from lightning_tp.strategies.shared import release_process_wide_patches

    first, second = _moe_model(), _moe_model()
    module = router_loss_module(first)
    family = getattr(module, FUNCTION_NAME)
    assert installed(module, FUNCTION_NAME) is None
    assert install_global_router_loss(first, _OneRankMesh())
    assert install_global_router_loss(second, _OneRankMesh())  # shares the patch, refused by nobody
    patch = installed(module, FUNCTION_NAME)
    assert getattr(module, FUNCTION_NAME) is not family and patch.previous is family
    assert set(map(id, patch.owners)) == {id(first), id(second)}
    recorded = router_loss._RECORDED
    recorded.set(None)
    input_ids = torch.randint(0, 50, (1, 4))
    first.base_model(input_ids=input_ids)
    assert recorded.get() is not None  # the decoder's router logits are recorded for the causal LM's loss call
    first(input_ids=input_ids)
    assert recorded.get() is None  # and used by it once, then let go
    holder = nn.ModuleDict({"model": first})  # the LightningModule around the model
    assert release_process_wide_patches(holder) == []  # the second model still holds it
    assert getattr(module, FUNCTION_NAME) is not family and set(map(id, patch.owners)) == {id(second)}
    assert release_process_wide_patches(second) == [patch]
    assert getattr(module, FUNCTION_NAME) is family and FUNCTION_NAME in vars(module)
    assert installed(module, FUNCTION_NAME) is None
    # A registered model takes the patch again when it runs (validate, then fit: the second setup leaves it alone).
    recorded.set(None)
    first.base_model(input_ids=input_ids)
    again = installed(module, FUNCTION_NAME)
    assert again is not None and again.owners == [first] and recorded.get() is not None
    hooks = len(first.base_model._forward_hooks)
    assert install_global_router_loss(first, _OneRankMesh())  # registered again: its hook replaced, not added
    assert len(first.base_model._forward_hooks) == hooks and installed(module, FUNCTION_NAME) is again
    assert release_process_wide_patches(first) == [again] and getattr(module, FUNCTION_NAME) is family


def test_the_strategy_teardown_gives_the_patches_up():
    from lightning_tp.parallel.router_loss import FUNCTION_NAME, install_global_router_loss, router_loss_module
    from lightning_tp.strategies.shared import MeshMixin, clip_with_dtensor_support

    class Base:
        torn_down = False

        def teardown(self):
            self.torn_down = True

    class Plugin:
        def clip_grad_by_norm(self, optimizer, clip_val):
            return "lightning's"

    class Strategy(MeshMixin, Base):
        pass

    strategy = Strategy()
    strategy.model, strategy.precision_plugin = nn.ModuleDict({"model": _moe_model()}), Plugin()
    module = router_loss_module(strategy.model["model"])
    family = getattr(module, FUNCTION_NAME)
    install_global_router_loss(strategy.model["model"], _OneRankMesh())
    clip_with_dtensor_support(strategy.precision_plugin, state=None)
    # fit, then validate: the later setup's replaces it
    clip_with_dtensor_support(strategy.precision_plugin, state=None)
    assert "clip_grad_by_norm" in vars(strategy.precision_plugin)
    strategy.teardown()
    assert strategy.torn_down and getattr(module, FUNCTION_NAME) is family
    assert strategy.precision_plugin.clip_grad_by_norm(None, 1.0) == "lightning's"
    assert "clip_grad_by_norm" not in vars(strategy.precision_plugin)


def test_a_pipelined_forward_and_save_pretrained_are_recorded_patches(tmp_path):
    from lightning_tp.checkpoint.hf_saves import install_distributed_save_pretrained
    from lightning_tp.parallel.pipeline import refuse_generate

    model = _moe_model()
    install_distributed_save_pretrained(model)
    install_distributed_save_pretrained(model)  # once
    refuse_generate(model)
    assert {p.name for p in owned_by(model)} == {"save_pretrained", "generate"}
    with pytest.raises(ValueError, match="not supported on a pipelined"):
        model.generate()
    assert undo_owned(model, instances=False) == []  # the model keeps them after `fit`
    assert {p.name for p in undo_owned(model)} == {"save_pretrained", "generate"}
    assert "generate" not in vars(model) and "save_pretrained" not in vars(model)


def test_the_module_imports_nothing_of_the_package():
    source = open(patches.__file__).read()
    assert "import lightning_tp" not in source and "from lightning_tp" not in source and "from ." not in source
    assert "lightning_tp.patches" in sys.modules
