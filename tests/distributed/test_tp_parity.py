"""Real multi-process runs (gloo, CPU) against a single process training the same module on the same data."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from tests.helpers.cases import (
    BF16_CASES,
    CASES,
    CP_2D_CASES,
    EP_2D_CASES,
    ERROR_CASES,
    FSDP_ONLY_CASES,
    PP_2D_CASES,
    TP4_CASES,
    TP_PARITY_CASES,
    TWO_D_CASES,
)
from tests.helpers.models import (
    SEQ,
    ParityModule,
    build_causal_lm,
    lm_batches,
    reference_generate,
    reference_run,
    tiny_config,
)
from tests.helpers.parity import assert_parity, reference_of
from tests.helpers.selection import scenario_result as _result
from tests.helpers.tolerances import (
    assert_step_gaps,
    cross_entropy_scale,
    error_ratio_limit,
    parity_tolerances,
    relative_distance,
)


@pytest.mark.parametrize("name", TP_PARITY_CASES)
@pytest.mark.scenarios("tp2", "{name}")
def test_tp2_matches_single_process(tp2_results: list[dict], name: str) -> None:
    result = _result(tp2_results, name)
    assert_parity(result, reference_of(name), name)
    assert result["sampler"] == {"num_replicas": 1, "rank": 0}
    # Both ranks of the TP group saw the same losses.
    assert tp2_results[1][name]["losses"] == result["losses"]


@pytest.mark.parametrize(
    "name",
    [
        name
        for name in TWO_D_CASES
        if name in CASES
        and name
        not in BF16_CASES | FSDP_ONLY_CASES | TP4_CASES | set(CP_2D_CASES) | set(EP_2D_CASES) | set(PP_2D_CASES)
    ],
)
@pytest.mark.scenarios("2d", "{name}")
def test_2d_matches_single_process(two_d_results: list[dict], name: str) -> None:
    """dp_shard 2 x tp 2: each data-parallel rank trains on half of the global batch."""
    assert_parity(_result(two_d_results, name), reference_of(name), name)
    samplers = [r[name]["sampler"] for r in two_d_results]
    assert samplers == [{"num_replicas": 2, "rank": rank // 2} for rank in range(4)]


@pytest.mark.parametrize("name", sorted(TP4_CASES))
@pytest.mark.scenarios("2d", "{name}")
def test_tp4_matches_single_process(two_d_results: list[dict], name: str) -> None:
    """TP 4 over the tiny Qwen3's 2 KV heads: each rank computes the one KV head its query head reads."""
    assert_parity(_result(two_d_results, name), reference_of(name), name)
    assert [r[name]["sampler"] for r in two_d_results] == [{"num_replicas": 1, "rank": 0}] * 4


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.scenarios("{layout}", *FSDP_ONLY_CASES)
def test_plain_module_under_fsdp_alone_matches_single_process(layout_results: list[dict], layout: str) -> None:
    """tp_size=1: FSDP2 over every rank. training_step calls `self.model(x)`, which gathers its own parameters."""
    results = layout_results
    for name in FSDP_ONLY_CASES:
        assert_parity(_result(results, name), reference_of(name), name)
        samplers = [r[name]["sampler"] for r in results]
        assert samplers == [{"num_replicas": len(results), "rank": rank} for rank in range(len(results))]


@pytest.mark.scenarios("2d", "plain_twice_with_head", "mlp_custom_plan", "plain_direct_call")
def test_plain_module_children_are_fsdp_units(two_d_results: list[dict]) -> None:
    """Each child of the LightningModule holding parameters is its own FSDP2 unit (the block run twice per forward
    is one more, by `fsdp_blocks`): the model, its block, and the head."""
    assert _result(two_d_results, "plain_twice_with_head")["fsdp_units"] == ["head", "model", "model.block"]
    assert _result(two_d_results, "mlp_custom_plan")["fsdp_units"] == ["model"]
    assert _result(two_d_results, "plain_direct_call")["fsdp_units"] == ["model", "model.norm"]


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.scenarios("{layout}", "llama_rank_seeded", "qwen3_sgd")
def test_ranks_seeded_apart_train_rank_zeros_model(layout_results: list[dict], layout: str) -> None:
    """Each rank built its model from seed + rank: rank 0's values are taken (and said so), so the run equals one
    process built with rank 0's seed (parity in `test_*_matches_single_process`)."""
    results = layout_results
    infos = _result(results, "llama_rank_seeded")["infos"]
    assert any("were set to rank 0's values" in line and "16 tensor(s)" in line for line in infos), infos
    assert not any("rank 0's values" in line for line in _result(results, "qwen3_sgd")["infos"])
    # Their generators differ too (dropout on what a TP group holds in common would differ): warned, on rank 0.
    differ = "random generators of the ranks of a TP group differ (seeded per rank?)"
    assert any(differ in w for w in _result(results, "llama_rank_seeded")["warnings"])
    assert not any(differ in w for w in _result(results, "qwen3_sgd")["warnings"])


@pytest.mark.scenarios("2d", "sp_odd_on_one_group")
def test_sequence_parallel_odd_length_on_one_data_parallel_group_trains(two_d_results: list[dict]) -> None:
    """dp 2 x tp 2, only data-parallel rank 1 gets length 15: its TP group pads the sequence, and every rank trains
    through both steps, within seconds (its parity with one process is the case `qwen3_sp_lp_odd_length`)."""
    for result in [r["sp_odd_on_one_group"] for r in two_d_results]:
        assert result["type"] is None, result
        assert result["seconds"] < 30, result


@pytest.mark.scenarios("2d", "llama_accumulate", "llama_accumulate_unsharded", "qwen3_sgd")
def test_2d_accumulation_reduce_scatters_as_accumulate_grads_says(two_d_results: list[dict]) -> None:
    """6 micro-batches, 3 optimizer steps. By default FSDP2 reduce-scatters each micro-batch's gradients (each rank
    keeps its shard); `accumulate_grads="unsharded"` once per optimizer step. Both at parity (the DP parity test)."""
    sharded = _result(two_d_results, "llama_accumulate")
    assert sharded["optimizer_steps"] == 3 and sharded["fsdp_groups"] == 3  # 2 decoder layers + the root
    assert sharded["reduce_scatters"] == 6 * sharded["fsdp_groups"]
    unsharded = _result(two_d_results, "llama_accumulate_unsharded")
    assert unsharded["reduce_scatters"] == unsharded["optimizer_steps"] * unsharded["fsdp_groups"]
    plain = _result(two_d_results, "qwen3_sgd")  # no accumulation: one per step
    assert plain["reduce_scatters"] == plain["optimizer_steps"] * plain["fsdp_groups"]


@pytest.mark.scenarios("2d", "qwen3_hsdp", "qwen3_hsdp_accumulate")
def test_hsdp_replicates_instead_of_scattering(two_d_results: list[dict]) -> None:
    """dp_replicate 2 x dp_shard 1 x tp 2: gradients are all-reduced across the replicas, never reduce-scattered;
    with accumulation (2 micro-batches a step) the all-reduce runs on each step's last micro-batch only."""
    for name in ("qwen3_hsdp", "qwen3_hsdp_accumulate"):
        result = _result(two_d_results, name)
        assert result["reduce_scatters"] == 0
        assert result["fsdp_all_reduces"] == result["optimizer_steps"] * result["fsdp_groups"] > 0, result


def _check_features(results: list[dict], dp_size: int) -> None:
    """Validation with generate, predict, logging and metrics, then fit, on one launch: what each rank saw."""
    build = partial(build_causal_lm, tiny_config("qwen3"))
    batches = lm_batches(2)
    reference = reference_generate(build, batches)
    model = build().eval()
    samples = sum(b["input_ids"].shape[0] for b in batches)
    for rank, all_results in enumerate(results):
        result = all_results["features"]
        assert "crash" not in result, result.get("crash")
        dp_rank = result["dp_rank"]
        assert dp_rank == rank // (len(results) // dp_size)
        # The sampler gives each data-parallel rank its share of the batches; greedy generation on the sharded model
        # gives the single-process tokens for them.
        mine = batches[dp_rank::dp_size]
        assert len(result["generated"]) == len(mine)
        for got, want in zip(result["generated"], reference[dp_rank::dp_size], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        with torch.no_grad():
            for got, batch in zip(result["predict"], mine, strict=True):
                torch.testing.assert_close(got, model(input_ids=batch["input_ids"]).logits.argmax(-1), rtol=0, atol=0)
        # A logged sum and a torchmetrics sum count each sample once: reduced over the data-parallel ranks (each
        # holding a different share), not over the TP ranks (holding the same one).
        assert result["validate"]["val_samples"] == samples
        assert result["validate"]["val_metric"] == samples
        assert result["logged"]["samples_metric"] == samples
        assert result["logged"]["mesh_axes"] == ("dp_replicate", "dp_shard", "cp", "tp")
        # Decisions are taken over every rank: all ranks True -> True; only rank 0 -> False with all=True.
        assert result["decisions"] == [True, False, True]
        # The second setup (fit after validate/predict) found the model sharded and left it as it was.
        assert result["q_proj_local_shape_after_fit"] == result["q_proj_local_shape"]
        assert result["q_proj_local_shape"][0] == tiny_config("qwen3").num_attention_heads * 16 // len(results)
    # The TP ranks of a data-parallel group see the same batches (Lightning's sampler over data-parallel ranks only).
    sums = [r["features"]["batch_sums"] for r in results][0]
    tp = len(results) // dp_size
    for rank in range(len(results)):
        assert sums[rank] == sums[(rank // tp) * tp]
    if dp_size > 1:
        assert sums[0] != sums[tp]


@pytest.mark.scenarios("tp2", "features")
def test_validate_predict_generate_logging_tp2(tp2_results: list[dict]) -> None:
    _check_features(tp2_results, dp_size=1)


@pytest.mark.scenarios("2d", "features")
def test_validate_predict_generate_logging_2d(two_d_results: list[dict]) -> None:
    _check_features(two_d_results, dp_size=2)


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.scenarios("{layout}", "features")
def test_bf16_precisions_match_a_bf16_single_process(layout_results: list[dict], layout: str, precision: str) -> None:
    """bf16-mixed autocasts over fp32 weights under TP alone; in 2-D FSDP2 gathers bf16 copies of them by default
    (reducing in fp32), so the layers run on bf16 weights there."""
    result = _result(layout_results, "features")[precision]
    module = ParityModule(partial(build_causal_lm, tiny_config("qwen3")))
    ref = reference_run(module, lm_batches(2), precision=precision)
    # bf16 rounds differently when TP splits the matmuls: bounds from bf16's unit roundoff (tests/helpers/tolerances.py;
    # bf16-true computes with bf16 weights, so its residual stream is bf16 too).
    module.configure_model()
    scale = cross_entropy_scale(module.model, lm_batches(2), precision="bf16-mixed", states=(ref["state"],))
    layers = module.model.config.num_hidden_layers
    bounds = parity_tolerances(
        torch.bfloat16,
        layers,
        tp=2,
        dp=2 if layout == "2d" else 1,
        steps=len(ref["losses"]),
        loss_scale=scale,
        bf16_weights=precision == "bf16-true" or layout == "2d",
    )
    assert_step_gaps(result["losses"], ref["losses"], bounds["loss"], relative=False, what="losses")
    assert_step_gaps(result["grad_norms"], ref["grad_norms"], bounds["grad_norm_rel"], relative=True, what="norms")
    assert result["dtype"] == ("torch.bfloat16" if precision == "bf16-true" else "torch.float32")


@pytest.mark.scenarios("2d", "qwen3_bf16_mixed", "qwen3_bf16_all_gather")
def test_2d_bf16_mixed_has_the_numerics_of_one_device_bf16_mixed(two_d_results: list[dict]) -> None:
    """``bf16-mixed`` in 2-D gathers bf16 copies of the weights by default (torchtitan's recipe: half the all-gather
    bytes, gradients reduced in fp32), and its trained weights are further from an fp32 run's than one device's
    bf16-mixed weights are; ``fsdp_param_dtype=None`` gathers fp32 and is autocast over fp32 weights, as on one device,
    so it rounds as much (up to its extra TP roundings and the fluctuation, see :func:`error_ratio_limit`). Losses and
    gradient norms of both within bounds derived from bf16's unit roundoff (tests/helpers/tolerances.py)."""
    case = CASES["qwen3_bf16_mixed"]
    module = case.module()
    ref = reference_run(module, case.batches(), precision="bf16-mixed")
    fp32 = reference_run(module, case.batches(), precision="32-true")
    result = _result(two_d_results, "qwen3_bf16_mixed")
    bf16_gathers = _result(two_d_results, "qwen3_bf16_all_gather")
    module.configure_model()
    initial = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    layers = module.model.config.num_hidden_layers
    scale = cross_entropy_scale(module.model, case.batches(), precision="bf16-mixed", states=(ref["state"],))
    for run, bf16_weights in ((result, False), (bf16_gathers, True)):
        bounds = parity_tolerances(
            torch.bfloat16, layers, tp=2, dp=2, steps=len(ref["losses"]), loss_scale=scale, bf16_weights=bf16_weights
        )
        assert_step_gaps(run["grad_norms"], ref["grad_norms"], bounds["grad_norm_rel"], relative=True, what="norms")
        assert_step_gaps(run["losses"], ref["losses"], bounds["loss"], relative=False, what="losses")
    assert result["state"]["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32

    # The rounding error of each run: its trained weights' distance from the fp32 run's, relative to that update.
    update = {k: fp32["state"][k] - initial[k] for k in initial}
    one_device, sharded, cast = (
        relative_distance(run["state"], fp32["state"], update) for run in (ref, result, bf16_gathers)
    )
    limit = error_ratio_limit(layers, tp=2, dp=2, update=update)
    assert sharded <= limit * one_device, (sharded / one_device, limit)
    assert cast > limit * one_device, (cast / one_device, limit)  # the weights really were gathered in bf16
    assert bf16_gathers["all_gather_bytes"] * 2 == result["all_gather_bytes"] > 0


@pytest.mark.scenarios("tp2", "tied_replicated")
def test_tied_weights_left_whole_stay_one_parameter(tp2_results: list[dict]) -> None:
    result = _result(tp2_results, "tied_replicated")
    assert result["tied"] is True
    assert result["num_params"] == len(list(build_causal_lm(tiny_config("tied")).parameters()))


@pytest.mark.parametrize("name", list(ERROR_CASES))
@pytest.mark.scenarios("tp2", "error:{name}")
def test_bad_configuration_raises_on_every_rank(tp2_results: list[dict], name: str) -> None:
    """Each rank raises the same clear error before any collective; the worker's barrier after the case proves that
    no rank was left waiting."""
    fragment = ERROR_CASES[name][2]
    for results in tp2_results:
        error = results[f"error:{name}"]
        assert error["type"] == "ValueError", error
        assert fragment in error["message"]


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.parametrize("kind", ["qwen3", "tied"])
@pytest.mark.scenarios("{layout}", "{kind}_meta_load")
def test_meta_loading_gives_the_plain_weights_and_rotary_buffers(
    layout_results: list[dict], layout: str, kind: str
) -> None:
    """Built on meta, sharded, then each rank read its slices: exactly the weights of a plain single-process load,
    and the rotary inv_freq that to_empty had left as garbage."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.cases import _checkpoint

    initial = _result(layout_results, f"{kind}_meta_load")["initial_state"]
    plain = AutoModelForCausalLM.from_pretrained(_checkpoint(kind), dtype=torch.float32)
    expected = {**plain.state_dict(), **{f"buffer:{k}": v for k, v in plain.named_buffers()}}
    assert initial.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(initial[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    assert any("inv_freq" in key for key in expected)


def _halves_repeat(weight: torch.Tensor) -> bool:
    """Whether the two halves of a weight along a dimension are equal (what every rank drawing the same numbers for
    its own TP/FSDP shard gives)."""
    return any(weight.shape[dim] % 2 == 0 and torch.equal(*weight.chunk(2, dim)) for dim in range(weight.dim()))


@pytest.mark.parametrize(
    ("layout", "name"),
    [("tp2", "qwen3_meta_init"), ("tp2", "tied_meta_init"), ("tp2", "qwen3_moe_meta_init")]
    + [("2d", "qwen3_meta_init"), ("2d", "tied_meta_init")],
)
@pytest.mark.scenarios("{layout}", "{name}")
def test_meta_model_without_checkpoint_is_initialised_after_sharding(
    layout_results: list[dict], layout: str, name: str
) -> None:
    """Built on the meta device, sharded, then initialised: each shard is the slice of the whole tensor that
    Transformers' initialisation draws on one process from the same seed (no two ranks with the same rows), norms at
    one, the rotary tables computed (not the garbage `to_empty` leaves). The training that follows is compared with
    that process by the parity tests."""
    initial = _result(layout_results, name)["initial_state"]
    reference = CASES[name].reference_build()
    plain = build_causal_lm(tiny_config(name.removesuffix("_meta_init")))
    for key, buffer in plain.named_buffers():
        torch.testing.assert_close(initial[f"buffer:{key}"], buffer, rtol=0, atol=0)
    assert reference.state_dict().keys() == plain.state_dict().keys()
    for key, value in reference.state_dict().items():
        got = initial[key]
        torch.testing.assert_close(got, value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        if key.endswith("norm.weight"):
            assert torch.equal(got, torch.ones_like(got)), key
        else:
            assert not _halves_repeat(got), key
            assert 0.015 < got.std().item() < 0.025, (key, got.std())  # initializer_range 0.02


@pytest.mark.scenarios("tp2", "mlp_meta_init")
def test_meta_plain_module_is_initialised_like_one_process(tp2_results: list[dict]) -> None:
    """A plain module built on meta and given a plan: each layer's ``reset_parameters`` draws its whole weight and
    each rank keeps its slice, so the sharded module starts as ``MLP()`` built normally from the same seed."""
    initial = _result(tp2_results, "mlp_meta_init")["initial_state"]
    reference = CASES["mlp_meta_init"].reference_build().state_dict()
    assert initial.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(initial[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
        if value.dim() == 2:
            assert not _halves_repeat(initial[key]), key


@pytest.mark.parametrize(("layout", "dp_size"), [("tp2", 1), ("2d", 2)])
@pytest.mark.scenarios("{layout}", "features")
def test_throughput_monitor_sums_over_data_parallel_ranks_only(
    layout_results: list[dict], layout: str, dp_size: int
) -> None:
    """On by default: tokens/s of each replica (a TP group) summed over the data-parallel ranks, never over TP."""
    results = layout_results
    tp = len(results) // dp_size
    figures = [r["features"]["throughput"] for r in results]
    for f in figures:
        assert f["step_time_s"] > 0 and f["peak_memory_mb"] > 100
    for rank, f in enumerate(figures):
        # Reduced over this rank's data-parallel group: the ranks at the same TP position, one per replica.
        group = [figures[r]["tokens_per_sec_per_replica"] for r in range(len(results)) if r % tp == rank % tp]
        assert len(group) == dp_size
        assert f["tokens_per_sec"] == pytest.approx(sum(group), rel=1e-6)
        assert f["tokens_per_sec_per_device"] == pytest.approx(f["tokens_per_sec"] / len(results), rel=1e-6)


@pytest.mark.scenarios("tp2", "collectives")
def test_collectives_per_step_match_the_theory(tp2_results: list[dict]) -> None:
    """One forward and backward of the 2-layer Qwen3, its collectives counted by kind (whether DTensor or a direct
    ``torch.distributed`` call issues them)."""
    counts = _result(tp2_results, "collectives")
    layers = 2
    # Plain TP: per layer 2 all-reduces forward (o_proj, down_proj) and 2 backward (the attention's and the MLP's
    # input gradients, summed over their column-wise projections first; Transformers' own layers would reduce one
    # per projection: 5); the vocabulary-sharded embedding reduces its output, lm_head gathers its output and reduces
    # its input gradient; q/k norms sum their gradients.
    assert counts["plain"] == {"all_reduce": layers * (2 + 2) + 1 + 1 + layers * 2, "all_gather": 1}
    # Sequence parallelism: per layer 2 all-gathers and 2 reduce-scatters each way, no all-reduce. Around them: the
    # first layer cuts its input (free), its backward gathers the gradient; the final norm gathers its output (so the
    # model's hidden states are whole), lm_head gathers its logits and all-reduces its input gradient; the embedding
    # still reduces. Norms outside the regions see one sequence shard each: 2 per layer and the final norm sum their
    # gradients, with the q/k norms.
    norms = layers * 2 + layers * 2 + 1
    sp = {"all_reduce": 2 + norms, "all_gather": layers * 4 + 1 + 1 + 1, "reduce_scatter": layers * 4}
    assert counts["sequence_parallel"] == sp
    # Loss parallelism: no gather of the logits; the cross-entropy all-reduces the row max and the sums.
    assert counts["sp_lp"] == {**sp, "all_gather": sp["all_gather"] - 1, "all_reduce": sp["all_reduce"] + 2}


@pytest.mark.scenarios("tp2", "collectives")
def test_packed_mixer_weights_are_exchanged_by_rows_not_gathered(tp2_results: list[dict]) -> None:
    """Qwen3.5's Gated DeltaNet layer packs [q | k | v] in its input projection and its conv, stored as a plain split
    of dim 0: each rank computes its rows of every block. One all-to-all each moves the rows (a rank sends its shard,
    half of each weight at TP 2, its own rows included), and one sends their gradients back; no weight is gathered
    whole (the forward's one all-gather is lm_head's logits) and no whole-size gradient is reduce-scattered."""
    by_phase = _result(tp2_results, "collectives")["packed_mixer"]
    config = tiny_config("qwen3_5")
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    rows = 2 * key_dim + value_dim  # in_proj_qkv's and conv1d's
    shards = rows // 2 * (config.hidden_size + config.linear_conv_kernel_dim) * 4  # fp32
    assert by_phase["forward"]["all_to_all"] == {"count": 2, "bytes": shards}
    assert by_phase["backward"]["all_to_all"] == {"count": 2, "bytes": shards}
    logits = 4 * SEQ * config.vocab_size * 4  # lm_batches: 4 rows
    assert by_phase["forward"]["all_gather"] == {"count": 1, "bytes": logits}
    assert "reduce_scatter" not in by_phase["backward"]


@pytest.mark.scenarios("tp2", "collectives")
def test_generate_under_sequence_and_loss_parallelism(tp2_results: list[dict]) -> None:
    """Decoding steps have length 1, which tp_size does not divide: outside training they run unsplit."""
    for rank in tp2_results:
        for name in ("sequence_parallel_generate", "sp_lp_generate"):
            generated = rank["collectives"][name]
            assert generated["sharded"] == generated["whole"], name
        # The model's output holds every position again: `logits_to_keep` picks the right ones.
        for name in ("sequence_parallel_logits_to_keep", "sp_lp_logits_to_keep"):
            assert rank["collectives"][name] is not None and rank["collectives"][name] < 1e-5, name


@pytest.mark.scenarios("tp2", "loss_parallel_checks")
def test_vocab_parallel_cross_entropy_matches_torch(tp2_results: list[dict]) -> None:
    """Forward and backward against F.cross_entropy on the full logits: even and uneven vocabularies, ignored
    labels, every reduction, fp32 and bf16; a tiny Qwen3 with a vocabulary-sharded lm_head; two collectives (see
    tests/distributed/loss_parallel_checks.py). Every check ran, on both ranks, within its bound."""
    from tests.distributed.loss_parallel_checks import CHECKS, CROSS_ENTROPY_CASES

    for rank in range(len(tp2_results)):
        records = {r["check"]: r for r in _result(tp2_results, "loss_parallel_checks", rank=rank)["checks"]}
        assert list(records) == list(CHECKS), sorted(set(CHECKS) ^ set(records))
        assert len([name for name in records if name.startswith("cross_entropy ")]) == len(CROSS_ENTROPY_CASES) == 17
        for name, record in records.items():
            for measure in ("loss", "grad"):
                if f"{measure}_diff" in record:
                    assert record[f"{measure}_diff"] <= record[f"{measure}_tol"], (name, record)
        assert records["all_ignored"]["loss_is_nan"] is True
        assert records["second_backward"]["raised"] == "RuntimeError"
        assert records["causal_lm_loss"]["variants"] == 3
        assert records["qwen3"]["generate_equal"] is True and records["qwen3"]["logits_diff"] <= 1e-6
        assert records["collectives"]["total"] == 2


#: Where each vision-language family keeps its vision tower and projector (no plan entries: replicated over TP).
_VISION_PARTS = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")


@pytest.mark.parametrize("name", ["qwen2_5_vl_sgd", "gemma3_sgd", "llava_sgd"])
@pytest.mark.scenarios("tp2", "{name}")
def test_vision_tower_replicated_and_language_model_sharded(tp2_results: list[dict], name: str) -> None:
    """The text model holds its plan's shards, the vision tower and projector whole copies on each TP rank, which
    end the training equal on both ranks (their gradients are whole on each rank: the column-wise projections
    all-reduce the gradient of the image features they read). Parity with one process: the test above."""
    result = _result(tp2_results, name)
    placements = result["placements"]
    vision = {n: p for n, p in placements.items() if n.startswith(_VISION_PARTS)}
    assert vision and all(p == ["R"] for p in vision.values()), vision
    assert placements["model.language_model.layers.0.self_attn.q_proj.weight"] == ["S(0)"]
    assert placements["model.language_model.layers.0.mlp.down_proj.weight"] == ["S(1)"]
    other = _result(tp2_results, name, rank=1)["state"]
    for key, value in result["state"].items():
        if key.startswith(_VISION_PARTS):
            torch.testing.assert_close(other[key], value, atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.scenarios("tp2", "llava_vision_plan_sp_lp")
def test_vision_tower_sharded_by_its_plan_entries(tp2_results: list[dict]) -> None:
    """Plan entries for the CLIP layers and the projector shard them (parity: test_tp2_matches_single_process), and
    sequence parallelism splits the language model's sequence only: the tower's layers are another stack."""
    placements = _result(tp2_results, "llava_vision_plan_sp_lp")["placements"]
    layer = "model.vision_tower.encoder.layers.0"
    assert placements[f"{layer}.self_attn.q_proj.weight"] == ["S(0)"]
    assert placements[f"{layer}.mlp.fc2.weight"] == ["S(1)"]
    assert placements["model.multi_modal_projector.linear_1.weight"] == ["S(0)"]
    assert placements[f"{layer}.layer_norm1.weight"] == ["R"]
    assert placements["model.vision_tower.embeddings.patch_embedding.weight"] == ["R"]


@pytest.mark.scenarios("tp2", "vlm_generate")
def test_vision_language_models_generate_the_single_process_tokens(tp2_results: list[dict]) -> None:
    from tests.helpers.models import build_vlm, vlm_prompt

    for rank in range(2):
        result = _result(tp2_results, "vlm_generate", rank=rank)
        for kind in ("gemma3", "qwen2_5_vl"):
            with torch.no_grad():
                whole = build_vlm(kind).eval().generate(**vlm_prompt(kind), max_new_tokens=3, do_sample=False)
            assert result[kind] == whole.tolist(), (rank, kind)


@pytest.mark.parametrize("layout", ["tp2", "2d"])
@pytest.mark.scenarios("{layout}", "whole_tensors")
def test_whole_tensors_gathered_in_slices_match_full_tensor(layout_results: list[dict], layout: str) -> None:
    """The gather behind save_pretrained, the adapter save and save_merged: in slices (a third of each here) along a
    dimension no placement splits, for TP, 2-D (FSDP2's strided shards), uneven and fully split layouts; the whole
    tensor on rank 0's CPU only."""
    results = [_result(layout_results, "whole_tensors", rank=rank) for rank in range(len(layout_results))]
    assert results[0]["differ"] == [] and results[0]["kept"] == results[0]["count"] > 20, results[0]
    assert all(r["kept"] == 0 for r in results[1:])
    if layout == "2d":
        assert any("_StridedShard" in p for p in results[0]["placements"]), results[0]["placements"]


@pytest.mark.scenarios("2d", "llama8_long_run")
def test_a_long_run_with_dynamic_padding_validation_checkpoint_and_export(two_d_results: list[dict]) -> None:
    """8 layers, 200 steps of 12 lengths, validation every 50 steps, a checkpoint at step 100 and an export at the end,
    in 2-D (dp_shard 2 x tp 2): the training at parity (test_2d_matches_single_process), every validation loss at
    the bound of the training loss after as many steps, a rank's share of the parameters in validation as in
    training, live memory flat after the warm-up (the second validation's,
    within 1% of the process's), the export the trained weights exactly, the checkpoint whole."""
    from transformers import AutoModelForCausalLM

    from lightning_tp.checkpoint.validation import check_checkpoint
    from tests.helpers.parity import fp32_bounds, weight_drift

    name = "llama8_long_run"
    case, ref = CASES[name], reference_of(name)
    for result in two_d_results:
        split = result[name]["split"]
        bounds = fp32_bounds(
            ref, optimizer=case.optimizer, lr=case.lr, drift=weight_drift(result[name]["state"], ref["state"])
        )
        per_validation = len(ref["val_losses"]) // 4
        assert len(split["val_losses"]) == len(ref["val_losses"]) == 4 * per_validation > 0
        for i, (got, expected) in enumerate(zip(split["val_losses"], ref["val_losses"], strict=True)):
            steps = case.val_every * (i // per_validation + 1)
            assert abs(got - expected) <= bounds["loss"][steps - 1], (i, got, expected, bounds["loss"][steps - 1])
        # The share of the parameters a rank holds at each validation batch's start is a training batch's (1/4).
        assert set(split["held"]["validation"]) == set(split["held"]["train"]), split["held"]
        live = split["live_mib"]  # after each validation; the first two steps of 50 are the warm-up
        assert len(live) == 4 and max(live[2:]) - live[1] <= 0.01 * live[1], live
    directory = Path(two_d_results[0][name]["split"]["directory"])
    check_checkpoint(directory / "checkpoint")
    exported = AutoModelForCausalLM.from_pretrained(directory / "export", dtype=torch.float32).state_dict()
    trained = two_d_results[0][name]["state"]
    assert exported.keys() == trained.keys()
    for key, value in trained.items():
        torch.testing.assert_close(exported[key], value, atol=0, rtol=0)
