import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

from lightning_tp import TensorParallelStrategy, clip_grad_norm_, grad_norm
from tests.helpers.models import ParityModule, build_causal_lm, tiny_config


def test_registered_as_tp():
    assert "tp" in StrategyRegistry.available_strategies()
    assert isinstance(StrategyRegistry.get("tp"), TensorParallelStrategy)


def test_constructor_stores_configuration_and_checks_it_early():
    strategy = TensorParallelStrategy(2, tp_plan={"model.layers.*.mlp.up_proj": "colwise"}, dp_replicate_size=2)
    assert strategy.options.tp_size == 2 and strategy.options.dp_replicate_size == 2
    with pytest.raises(ValueError, match='"auto" or a dict'):
        TensorParallelStrategy(tp_plan="colwise")
    with pytest.raises(ValueError, match=r"tp_plan\['x'\] = 'sequence_parallel' is not supported"):
        TensorParallelStrategy(tp_plan={"x": "sequence_parallel"})
    with pytest.raises(ValueError, match="`tp_size` must be a positive integer"):
        TensorParallelStrategy(tp_size=0)
    with pytest.raises(TypeError):
        TensorParallelStrategy(2, "auto")  # keyword-only after the first argument


def test_mesh_and_layout_before_setup_raise_a_clear_error():
    strategy = TensorParallelStrategy()
    with pytest.raises(RuntimeError, match="built in `setup_environment`.*configure_model"):
        strategy.device_mesh
    with pytest.raises(RuntimeError, match="built in `setup_environment`"):
        strategy.tp_mesh
    with pytest.raises(RuntimeError, match="resolved in `setup_environment`"):
        strategy.layout


def test_unsupported_precision_is_refused_before_processes_start():
    from lightning_tp import ParallelOptions

    with pytest.raises(ValueError, match=r"precision='64-true'.*32-true, bf16-mixed, bf16-true, 16-true"):
        ParallelOptions(precision="64-true")


def test_trainer_with_unsupported_precision_fails_in_fit_without_a_process_group():
    module = ParityModule(lambda: build_causal_lm(tiny_config("qwen3")))
    trainer = L.Trainer(strategy="tp", precision="64-true", accelerator="cpu", devices=1, logger=False, max_steps=1)
    with pytest.raises(ValueError, match="does not support `Trainer\\(precision='64-true'\\)`"):
        trainer.fit(module, [])
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch_on_plain_tensors(norm_type):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(clones, params, strict=True):
        c.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(clones, 1.0, norm_type)
    total = clip_grad_norm_(params, 1.0, norm_type)
    torch.testing.assert_close(total, expected)
    for c, p in zip(clones, params, strict=True):
        torch.testing.assert_close(p.grad, c.grad)
    assert grad_norm([]).item() == 0.0


def test_sizes_from_accelerate_parallelism_config():
    from types import SimpleNamespace

    config = SimpleNamespace(tp_size=2, dp_shard_size=2, dp_replicate_size=2, cp_size=1)
    strategy = TensorParallelStrategy(parallelism_config=config)
    assert (strategy.options.tp_size, strategy.options.dp_shard_size, strategy.options.dp_replicate_size) == (2, 2, 2)
    with pytest.raises(ValueError, match="either `parallelism_config` or the sizes"):
        TensorParallelStrategy(2, parallelism_config=config)
    # accelerate's `cp_size` is context parallelism, which the strategy offers; its `sp_size` (Ulysses) it does not.
    strategy = TensorParallelStrategy(parallelism_config=SimpleNamespace(tp_size=2, cp_size=2))
    assert (strategy.options.tp_size, strategy.options.cp_size) == (2, 2)
    with pytest.raises(ValueError, match=r"\{'sp_size': 2\}"):
        TensorParallelStrategy(parallelism_config=SimpleNamespace(tp_size=2, sp_size=2))
    with pytest.raises(ValueError, match="either `parallelism_config` or the sizes"):
        TensorParallelStrategy(cp_size=2, parallelism_config=config)
    accelerate = pytest.importorskip("accelerate")
    real = accelerate.ParallelismConfig(tp_size=2, dp_shard_size=2, cp_size=2)
    strategy = TensorParallelStrategy(parallelism_config=real)
    assert (strategy.options.tp_size, strategy.options.dp_shard_size, strategy.options.dp_replicate_size) == (2, 2, 1)
    assert strategy.options.cp_size == 2


def test_from_pretrained_builds_on_meta_and_remembers_the_checkpoint(tmp_path):
    import lightning_tp
    from lightning_tp.checkpoint.loading import CHECKPOINT_ATTR, checkpoint_keys

    build_causal_lm(tiny_config("tied")).save_pretrained(tmp_path)
    model = lightning_tp.from_pretrained(tmp_path)
    assert all(p.is_meta for p in model.parameters())
    assert getattr(model, CHECKPOINT_ATTR) == str(tmp_path)
    assert next(model.parameters()).dtype == torch.float32  # "auto": the checkpoint's dtype
    assert "model.embed_tokens.weight" in checkpoint_keys(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        lightning_tp.from_pretrained(empty)


def test_cpu_offload_needs_data_parallelism_and_an_accelerator():
    strategy = TensorParallelStrategy(cpu_offload=True)
    strategy.precision_plugin = L.pytorch.plugins.precision.Precision()
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy.cluster_environment = L.fabric.plugins.environments.LightningEnvironment()
    strategy.cluster_environment.set_world_size(2)
    with pytest.raises(ValueError, match="needs data or context parallelism"):
        strategy.setup_environment()


def test_cpu_offload_leaves_parameters_and_moves_buffers_metrics_and_the_modules_device() -> None:
    """Under FSDP2's CPU offload the parameters stay in host memory, but what ``self.log(sync_dist=True)``,
    torchmetrics and ``torch.zeros(device=self.device)`` use must be on the accelerator (NCCL takes no CPU tensors).
    The meta device stands in for the accelerator here."""
    import torchmetrics

    from lightning_tp.stages import place_on_device

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(4.0))
            self.metric = torchmetrics.MeanMetric()

    module = Module()
    target = torch.device("meta")
    place_on_device(module, target, cpu_offload=True)
    assert module.net.weight.device.type == "cpu"  # FSDP2 moves each unit's parameters itself
    assert module.table.device == target
    assert module.device == target
    assert module.metric.device == target and module.metric.mean_value.device == target
    other = Module()
    place_on_device(other, target, cpu_offload=False)  # without offload: all of it
    assert other.net.weight.device == target and other.device == target


def test_frozen_weights_left_out_need_a_distributed_checkpoint() -> None:
    with pytest.raises(ValueError, match="needs `save_distributed_checkpoint=True`"):
        TensorParallelStrategy(2, save_frozen_weights=False, save_distributed_checkpoint=False)


def test_a_model_reachable_twice_is_sharded_once() -> None:
    from lightning_tp.plans.discovery import transformers_models
    from tests.helpers.models import build_causal_lm, tiny_config

    root = torch.nn.Module()
    root.model = build_causal_lm(tiny_config("llama"))
    root.backbone = root.model.model
    assert transformers_models(root) == [root.model]


def test_each_child_holding_parameters_is_one_fsdp_unit_and_shared_weights_are_refused() -> None:
    """A plain LightningModule under data parallelism: one FSDP2 unit per child holding parameters (the same child
    under two names once); children sharing a parameter get a clear error naming both."""
    from lightning_tp.parallel.fsdp import fsdp_units

    class Root(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 4)
            self.alias = self.net
            self.act = torch.nn.ReLU()
            self.head = torch.nn.Linear(4, 2)

    root = Root()
    assert fsdp_units(root) == [root.net, root.head]
    root.head.weight = root.net.weight
    with pytest.raises(ValueError, match=r"Root.head and Root.net share the parameter head.weight"):
        fsdp_units(root)


def test_16_bit_true_precisions_reduce_gradients_in_fp32() -> None:
    """A 16-bit reduce-scatter rounds at every hop of the ring; one process rounds a batch's gradient once."""
    from lightning_tp.parallel.fsdp import fsdp_mixed_precision

    for precision in ("bf16-true", "16-true"):
        policy = fsdp_mixed_precision(precision)
        assert policy.param_dtype is None and policy.reduce_dtype == torch.float32
    assert fsdp_mixed_precision("32-true").reduce_dtype is None


@pytest.mark.parametrize("precision", ["32-true", "16-true"])
def test_bf16_all_gathers_refused_without_bf16_compute(precision: str) -> None:
    from lightning_tp import ParallelLayout, ParallelOptions

    options = ParallelOptions(precision=precision, fsdp_param_dtype="bf16")
    with pytest.raises(ValueError, match=f"precision='{precision}'.*Use `precision='bf16-mixed'`"):
        options.check_layout(ParallelLayout.resolve(4, tp_size=2), device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("precision", "world", "fragment"), [("bf16-true", 4, "bf16 already"), ("bf16-mixed", 2, "no data")]
)
def test_bf16_all_gathers_warn_where_ignored(precision: str, world: int, fragment: str) -> None:
    import warnings

    from lightning_tp import ParallelLayout, ParallelOptions

    options = ParallelOptions(precision=precision, fsdp_param_dtype="bf16")
    with pytest.warns(UserWarning, match=f"fsdp_param_dtype='bf16'` is ignored.*{fragment}"):
        options.check_layout(ParallelLayout.resolve(world, tp_size=2), device=torch.device("cpu"))
    quiet = ParallelOptions(precision="bf16-mixed", fsdp_param_dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the setting it is meant for: no warning
        quiet.check_layout(ParallelLayout.resolve(4, tp_size=2), device=torch.device("cpu"))


def test_fsdp_param_dtype_values_are_checked_when_the_strategy_is_built() -> None:
    with pytest.raises(ValueError, match="`fsdp_param_dtype` must be 'auto' .* 'bf16' .* or None .*got 'fp16'"):
        TensorParallelStrategy(fsdp_param_dtype="fp16")


class _CreatesAFile:
    def __init__(self, probe):
        self.probe = probe

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.probe}",))


def test_resume_unpickles_only_plain_data_onto_the_cpu(tmp_path, monkeypatch):
    """Lightning passes `weights_only=None`: a crafted meta.pt is refused (naming the opt-in) before any collective,
    and meta.pt is loaded onto the CPU (saved from cuda:0, it would land on GPU 0 of every rank otherwise)."""
    import torch.distributed.checkpoint as dcp

    from lightning_tp.checkpoint.trust import UntrustedCheckpointError

    path = tmp_path / "ckpt"
    dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=path, no_dist=True)
    probe = tmp_path / "probe"
    torch.save({"epoch": 0, "hyper_parameters": {"x": _CreatesAFile(probe)}}, path / "meta.pt")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    with pytest.raises(
        UntrustedCheckpointError, match=r"posix.system.*run code.*`weights_only=False` to `trainer.fit`"
    ):
        TensorParallelStrategy().load_checkpoint(path)
    assert not probe.exists()
    assert loads == [{"map_location": "cpu", "mmap": False, "weights_only": True}]


def test_shard_files_unpickle_only_plain_data(tmp_path):
    """DCP stores non-tensor entries (an optimizer's ``param_groups``) pickled inside the shard files, and torch's load
    planner unpickles them unrestricted: a crafted ``.distcp`` ran code on resume. The strategy's planner refuses it,
    naming the entry and the opt-in, and still loads plain values."""
    import torch.distributed.checkpoint as dcp

    from lightning_tp.checkpoint.trust import UntrustedCheckpointError, index_reader, safe_load_planner

    probe = tmp_path / "probe"
    crafted, plain = tmp_path / "crafted", tmp_path / "plain"
    dcp.save({"optimizer_0": {"param_groups": [{"lr": _CreatesAFile(probe)}]}}, checkpoint_id=crafted, no_dist=True)
    dcp.save({"optimizer_0": {"param_groups": [{"lr": 0.25}]}}, checkpoint_id=plain, no_dist=True)
    template = {"optimizer_0": {"param_groups": [{"lr": 0.0}]}}
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP gathers every rank's read failure into one CheckpointException, raised on every rank.
    match = rf"{UntrustedCheckpointError.__name__}: the checkpoint entry 'optimizer_0.param_groups.0.lr'.*posix.system"
    with pytest.raises(CheckpointException, match=match):
        dcp.load(
            template,
            storage_reader=index_reader(crafted),
            planner=safe_load_planner(weights_only=True, opt_in="opt in"),
            no_dist=True,
        )
    assert not probe.exists()
    dcp.load(template, storage_reader=index_reader(plain), planner=safe_load_planner(weights_only=True, opt_in="-"))
    assert template["optimizer_0"]["param_groups"][0]["lr"] == 0.25


def test_options_and_strategies_pickle_and_copy_with_a_plan() -> None:
    """A dict `tp_plan` kept the strategy picklable before the pipeline moved it into `ParallelOptions`."""
    import copy
    import pickle

    from lightning_tp import ParallelOptions
    from lightning_tp.strategies.fabric import TensorParallelStrategy as FabricStrategy

    plan = {"model.layers.*.mlp.down_proj": "rowwise"}
    options = ParallelOptions(tp_plan=plan)
    assert pickle.loads(pickle.dumps(options)) == options
    for strategy in (TensorParallelStrategy(tp_plan=plan), FabricStrategy(tp_plan=plan)):
        assert copy.deepcopy(strategy).options.parallel.tp_plan == plan


def test_a_mesh_parallelize_does_not_know_is_refused_by_name() -> None:
    """An axis named otherwise (torchtitan's `dp`) or a sub-mesh would leave ranks training apart, silently."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_tp.parallelize import layout_of

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        foreign = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"axes are \('dp', 'tp'\).*knows only"):
            layout_of(foreign)
        ours = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        assert layout_of(ours).dp_shard_size == 2
        with pytest.raises(ValueError, match="covers 2 ranks .* the world has 4"):
            layout_of(ours["tp"])
    finally:
        dist.destroy_process_group()


def test_compile_takes_torch_compile_arguments_and_names_a_wrong_key() -> None:
    """``compile`` is True/False or ``torch.compile``'s keyword arguments, checked against its signature."""
    from lightning_tp import ParallelOptions

    assert ParallelOptions(compile={"fullgraph": True, "mode": "max-autotune"}).compile == {
        "fullgraph": True,
        "mode": "max-autotune",
    }
    with pytest.raises(ValueError, match=r"'full_graph' is not a `torch.compile` argument.*fullgraph"):
        ParallelOptions(compile={"full_graph": True})
    with pytest.raises(ValueError, match="'model' is not a `torch.compile` argument"):
        ParallelOptions(compile={"model": None})
    with pytest.raises(ValueError, match="`compile` must be True, False or a dict"):
        ParallelOptions(compile="yes")


def test_accumulate_grads_is_checked_when_built_and_warned_about_where_ignored() -> None:
    from lightning_tp.strategies.fabric import TensorParallelStrategy as FabricStrategy

    for strategy in (TensorParallelStrategy, FabricStrategy):
        with pytest.raises(ValueError, match="`accumulate_grads` must be one of .*got 'whole'"):
            strategy(accumulate_grads="whole")
    options = TensorParallelStrategy(2, accumulate_grads="unsharded").options
    with pytest.warns(UserWarning, match="`accumulate_grads='unsharded'` is ignored: the layout"):
        options.layout(2)  # TP over both ranks: nothing to reduce between micro-batches
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options.layout(4)  # dp_shard 2 x tp 2: it applies, no warning


def test_the_batches_an_evaluation_loop_runs_under_its_limits() -> None:
    """What sharded evaluation compares across ranks: the batches Lightning's loop runs, not the loader's length."""
    from lightning_tp.strategies.inference import batches_run

    assert batches_run(12, 1.0) == 12 and batches_run(12, None) == 12
    assert batches_run(11, 8) == batches_run(12, 8) == 8  # `limit_val_batches=8`: even, whatever the lengths
    assert batches_run(None, 8) == 8  # an unsized (streaming) loader under an int limit
    assert batches_run(None, 1.0) is None  # unsized, unlimited: unknown, refused with sharded weights
    assert batches_run(10, 0.25) == 2
