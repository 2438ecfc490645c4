"""Context parallelism in one process: where each rank's tokens lie (pure arithmetic), what is refused before anything
moves, and the whole split (masks, pieces, positions, loss, logits) on a one-rank group, where it must change nothing.
The exchange between ranks is tested for real in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_tp.parallel import blockwise
from lightning_tp.parallel.context_parallel import ContextParallel, install_context_parallel
from lightning_tp.parallel.cp_checks import context_parallel_problem, decoder_stack, positions_from_mask
from lightning_tp.parallel.cp_split import (
    UNDECLARED_ATTENTION_INTERFACE,
    gathered_positions,
    local_positions,
    padded_length,
)
from lightning_tp.plans.structure import block_classes
from tests.helpers.models import (
    VOCAB,
    build_causal_lm,
    lm_batches,
    packed_lm_batches,
    padded_lm_batches,
    tiny_config,
    tiny_vlm_config,
)
from tests.helpers.process_group import one_rank_mesh as one_rank_mesh_of_gloo


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_each_position_is_on_exactly_one_rank_and_the_work_is_balanced(cp_size: int) -> None:
    length = 2 * cp_size * 5
    ranks = [local_positions(length, cp_size, rank) for rank in range(cp_size)]
    assert sorted(torch.cat(ranks).tolist()) == list(range(length))
    assert torch.equal(gathered_positions(length, cp_size), torch.cat(ranks))
    # Under a causal mask a query at position p reads p + 1 keys: every rank reads the same number.
    work = {int((positions + 1).sum()) for positions in ranks}
    assert len(work) == 1, work
    # Rank 0 holds the first and the last piece.
    assert ranks[0][0] == 0 and ranks[0][-1] == length - 1


def test_padded_length_rounds_up() -> None:
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_supported_models_pass_the_check() -> None:
    for kind in ("qwen3", "llama", "gemma2", "granite_swa", "qwen3_moe", "opt"):
        assert context_parallel_problem(_meta_model(tiny_config(kind))) is None, kind


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: torch.nn.Linear(2, 2), "not a Transformers model"),
        (lambda: _meta_model(tiny_config("qwen3", output_router_logits=True)), "output_router_logits"),
        (lambda: _meta_model(tiny_config("qwen3", is_causal=False)), "does not use causal attention"),
        (lambda: _meta_model(tiny_config("mpt")), "MptForCausalLM.is_backend_compatible()` is False"),
    ],
)
def test_what_cannot_be_split_is_refused_by_name(build, fragment: str) -> None:
    problem = context_parallel_problem(build())
    assert problem is not None and fragment in problem, problem


def test_any_attention_implementation_of_transformers_is_accepted_and_others_refused_by_name() -> None:
    """A split forward runs its own tiles whatever the model selects; a forward that decodes runs the model's own
    implementation, which must be one of Transformers' (or `eager`)."""
    model = _meta_model(tiny_config("qwen3"))
    for name in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        model.config._attn_implementation = name
        assert context_parallel_problem(model) is None, name
    model.config._attn_implementation = "my_kernel"
    problem = context_parallel_problem(model)
    assert "attn_implementation='my_kernel'" in problem and 'attn_implementation="sdpa"' in problem


def test_layers_that_mix_the_sequence_without_attention_are_refused_by_name() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_next",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )
    problem = context_parallel_problem(_meta_model(config))
    assert "['linear_attention']" in problem


def test_vision_language_models_are_refused_by_name() -> None:
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_vlm_config("llava"))
    assert "composite" in context_parallel_problem(model)


def test_the_decoder_stack_holds_the_embedding_and_the_layers() -> None:
    for kind, expected in (("qwen3", "Qwen3Model"), ("opt", "OPTDecoder"), ("gpt2", "GPT2Model")):
        assert type(decoder_stack(_meta_model(tiny_config(kind)))).__name__ == expected


# ---------------------------------------------------------------------------------------------------------------------
# The split on one rank: every piece of the machinery runs (masks at global positions, two pieces per rank, padding,
# the loss's shift and normalisation, logits gathered without labels), and the model must compute what it computes
# without it.


@pytest.fixture(scope="module")
def one_rank_mesh():
    with one_rank_mesh_of_gloo() as mesh:
        yield mesh


def _split_copy(model, mesh, multiple: int = 2):
    split = copy.deepcopy(model)
    install_context_parallel(split, mesh, multiple=multiple, blocks=block_classes(split))
    return split


CASES = {
    "qwen3": ("qwen3", lambda: lm_batches(1)[0]),
    "qwen3_odd_length": ("qwen3", lambda: {k: v[:, :13] for k, v in lm_batches(1)[0].items()}),
    "llama_padded": ("llama", lambda: padded_lm_batches(1)[0]),
    "qwen3_packed": ("qwen3", lambda: packed_lm_batches(1)[0]),
    # 13 tokens padded to 16: three padding tokens after the last document, each a document of its own.
    "qwen3_packed_odd_length": (
        "qwen3",
        lambda: {k: v[:, :13] for k, v in packed_lm_batches(1)[0].items() if k != "use_cache"} | {"use_cache": False},
    ),
    "gemma2_sliding_softcap": ("gemma2", lambda: lm_batches(1)[0]),
    "granite_swa_sinks_padded": ("granite_swa", lambda: padded_lm_batches(1)[0]),
    "opt": ("opt", lambda: lm_batches(1)[0]),
    "llama4_chunked_padded": ("llama4_text", lambda: padded_lm_batches(1)[0]),
}


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_split_on_one_rank_changes_nothing(one_rank_mesh, name: str, tile: int | None, monkeypatch) -> None:
    """Every family's masks through the tiles, at the default tile size (one tile a piece here) and at 3 tokens
    (many tiles: documents, windows, chunks and padding cut some; tiles beyond them are skipped)."""
    if tile is not None:
        monkeypatch.setattr(blockwise, "TILE", tile)
    kind, batch = CASES[name]
    batch = batch()
    model = build_causal_lm(tiny_config(kind))
    split = _split_copy(model, one_rank_mesh, multiple=4)  # 4: the odd lengths are padded
    out, ref = split(**batch), model(**batch)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    out.loss.backward()
    ref.loss.backward()
    for (name_, a), b in zip(split.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name_: f"{n}: {m}")
    # Without labels the logits are the whole sequence's (gathered, padding removed).
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(split(**no_labels).logits, model(**no_labels).logits, atol=1e-5, rtol=0)


def test_the_model_gets_its_own_config(one_rank_mesh) -> None:
    """A config shared with another model (a policy and its reference) is not changed under it."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen3")
    first, second = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    install_context_parallel(first, one_rank_mesh, multiple=2, blocks=block_classes(first))
    assert second.config._attn_implementation == "sdpa"
    assert first.model.layers[0].self_attn.config is first.config
    assert first.config._attn_implementation.startswith("lightning_tp_cp_")


def test_generate_runs_the_whole_sequence(one_rank_mesh) -> None:
    model = build_causal_lm(tiny_config("qwen3")).eval()
    split = _split_copy(model, one_rank_mesh)
    prompt = torch.arange(10).reshape(2, 5) + 3
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
        got = split.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, expected)


def test_inputs_it_cannot_split_are_refused_by_name(one_rank_mesh) -> None:
    split = _split_copy(build_causal_lm(tiny_config("qwen3")), one_rank_mesh)
    ids = torch.arange(8).reshape(1, 8)
    with pytest.raises(ValueError, match="a prepared .* mask cannot be split"):
        split(input_ids=ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="multi-axis positions"):
        split(input_ids=ids, position_ids=torch.zeros(3, 1, 8, dtype=torch.long))


def test_layers_with_attention_code_of_their_own_are_refused_or_found_in_the_first_forward(one_rank_mesh) -> None:
    """Falcon does not declare that its layers go through Transformers' attention interface (`is_backend_compatible()`
    is False: in Transformers 5.24 they compute attention with code of their own; in 5.25 they dispatch through it,
    ALiBi variants adding their bias to the mask themselves): refused before anything moves, whatever its code reads.
    A layer of a model that declares it but does not use it would attend within its chunk: the first split forward
    raises, naming it (here a decoder layer whose attention calls SDPA itself)."""
    problem = context_parallel_problem(_meta_model(tiny_config("falcon")))
    assert problem is not None and "FalconForCausalLM.is_backend_compatible()` is False" in problem, problem
    model = build_causal_lm(tiny_config("qwen3"))
    attention = model.model.layers[1].self_attn

    def own_attention(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return attention.o_proj(hidden_states), None

    attention.forward = own_attention
    split = _split_copy(model, one_rank_mesh)
    with pytest.raises(ValueError, match=r"decoder layers \['layers.1 \(Qwen3DecoderLayer\)'\]"):
        split(input_ids=torch.arange(8).reshape(1, 8) + 3)


def test_forwards_keeping_the_last_logits_run_unsplit(one_rank_mesh) -> None:
    """`logits_to_keep` (GRPO's per-token log-probabilities of a completion, `generate` without a cache) asks for the
    last positions, which are not this rank's: such a forward runs the whole sequence, as with a cache."""
    model = build_causal_lm(tiny_config("qwen3")).eval()
    split = _split_copy(model, one_rank_mesh, multiple=4)
    ids = torch.arange(26).reshape(2, 13) % 90 + 3
    with torch.no_grad():
        torch.testing.assert_close(
            split(input_ids=ids, logits_to_keep=3).logits, model(input_ids=ids, logits_to_keep=3).logits
        )
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, use_cache=False
        )
        got = split.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, use_cache=False
        )
    assert torch.equal(got, expected)


def test_tuple_outputs_and_padding_past_the_learned_positions(one_rank_mesh) -> None:
    """`return_dict=False` gets the whole sequence's logits too; GPT-2 at its longest sequence (15 positions here),
    padded to 16, repeats its last position for the padding instead of reading past its position table."""
    model = build_causal_lm(tiny_config("gpt2", n_positions=15)).eval()
    split = _split_copy(model, one_rank_mesh, multiple=4)
    ids = torch.arange(30).reshape(2, 15) % 90 + 3
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids=ids, return_dict=False)[0], model(input_ids=ids).logits)
        torch.testing.assert_close(split(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss)


def test_models_that_count_positions_from_the_mask_need_position_ids(one_rank_mesh) -> None:
    """OPT numbers a left-padded row from its first real token: the split cannot from its chunk, so a mask without
    `position_ids` is refused (whatever the mask holds: the decision is the same on every rank), and with the
    positions OPT would count the split matches one process."""
    model = build_causal_lm(tiny_config("opt"))
    split = _split_copy(model, one_rank_mesh)
    batch = padded_lm_batches(1)[0]
    with pytest.raises(
        ValueError, match=r"OPTDecoder.embed_positions \(OPTLearnedPositionalEmbedding\) derives the positions from"
    ):
        split(**batch)
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    torch.testing.assert_close(split(**batch, position_ids=positions).loss, model(**batch).loss, atol=1e-6, rtol=0)


def test_a_split_model_deep_copies_and_is_freed(one_rank_mesh) -> None:
    """A deep copy (a frozen reference) shares the split and computes the same; Transformers' registries hold the
    split weakly, so a model dropped is freed with it."""
    import gc
    import weakref

    model = build_causal_lm(tiny_config("qwen3"))
    split = _split_copy(model, one_rank_mesh)
    copied = copy.deepcopy(split)
    batch = lm_batches(1)[0]
    torch.testing.assert_close(copied(**batch).loss, model(**batch).loss, atol=1e-6, rtol=0)
    layer = weakref.ref(split.model.layers[0])
    del split, copied
    gc.collect()
    assert layer() is None


@pytest.mark.parametrize(("kind", "layer_type"), [("qwen3_5", "linear_attention"), ("nemotron_h", "linear_attention")])
def test_hybrid_families_are_refused_naming_only_their_sequence_mixing_layers(kind: str, layer_type: str) -> None:
    """A recurrence over one rank's chunk would miss the state of the chunks before it: refused before anything
    moves, naming the layer type (Nemotron-H's MLP layers mix no tokens and are not named)."""
    problem = context_parallel_problem(build_causal_lm(tiny_config(kind, _attn_implementation="sdpa")))
    assert problem is not None and f"['{layer_type}']" in problem and "tp_size" in problem


# ---------------------------------------------------------------------------------------------------------------------
# What the package decides without reading any code: class declarations, structure, and what the layers hand
# Transformers' attention interface


def test_models_that_do_not_declare_the_attention_interface_are_refused_unless_listed(monkeypatch) -> None:
    """A model whose class does not declare Transformers' attention interface (`is_backend_compatible()`) is refused by
    name, whatever its layers do; the families listed in `UNDECLARED_ATTENTION_INTERFACE` (which use it without
    declaring it) pass, by their class's own name only."""
    from transformers import Qwen3ForCausalLM

    model = _meta_model(tiny_config("qwen3"))
    assert context_parallel_problem(model) is None
    monkeypatch.setattr(Qwen3ForCausalLM, "is_backend_compatible", classmethod(lambda cls: False))
    problem = context_parallel_problem(model)
    assert "Qwen3ForCausalLM does not declare" in problem and "without `cp_size`" in problem, problem

    stablelm = _meta_model(tiny_config("stablelm"))
    assert type(stablelm).__name__ in UNDECLARED_ATTENTION_INTERFACE
    assert context_parallel_problem(stablelm) is None
    stablelm.__class__ = type("MyStableLm", (type(stablelm),), {})  # a subclass: its layers may be anything
    assert "MyStableLm does not declare" in context_parallel_problem(stablelm)


def _biogpt_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "biogpt",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


@pytest.mark.parametrize("kind", ["stablelm", "biogpt"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_listed_families_split_on_one_rank_and_change_nothing(one_rank_mesh, kind: str, implementation: str):
    """The families `UNDECLARED_ATTENTION_INTERFACE` admits run through the split, in eager and sdpa, and change
    nothing."""
    config = _biogpt_config() if kind == "biogpt" else tiny_config(kind)
    config._attn_implementation = implementation
    model = build_causal_lm(config)
    assert type(model).__name__ in UNDECLARED_ATTENTION_INTERFACE and not type(model).is_backend_compatible()
    split = _split_copy(model, one_rank_mesh)
    batch = lm_batches(1)[0]
    torch.testing.assert_close(split(**batch).loss, model(**batch).loss, atol=1e-6, rtol=0)


def test_position_tables_that_read_the_mask_are_found_by_structure() -> None:
    """An embedding table directly in the decoder stack whose forward takes `attention_mask` derives its indices from
    the mask (OPT, BioGPT); a plain table, or another module taking the mask (an encoder of layers), does not."""

    class MaskPositions(torch.nn.Embedding):
        def forward(self, attention_mask, cache_length=0, position_ids=None):
            return super().forward(attention_mask.cumsum(-1) - 1)

    class Encoder(torch.nn.Module):
        def forward(self, hidden_states, attention_mask=None):
            return hidden_states

    stack = torch.nn.Module()
    stack.tokens, stack.positions, stack.encoder = torch.nn.Embedding(4, 2), torch.nn.Embedding(4, 2), Encoder()
    assert positions_from_mask(stack) is None
    stack.positions = MaskPositions(4, 2)
    assert positions_from_mask(stack) == "Module.positions (MaskPositions)"
    for config, found in (
        (tiny_config("opt"), "OPTDecoder.embed_positions (OPTLearnedPositionalEmbedding)"),
        (_biogpt_config(), "BioGptModel.embed_positions (BioGptLearnedPositionalEmbedding)"),
        (tiny_config("qwen3"), None),
        (tiny_config("gpt2"), None),  # a plain learned table: positions 0 .. length - 1
    ):
        assert positions_from_mask(decoder_stack(_meta_model(config))) == found, config.model_type


def _split_of(model) -> ContextParallel:
    """The split installed on ``model`` (its decoder stack's pre-hook is the split's method)."""
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(getattr(hook, "__self__", None), ContextParallel):
                return hook.__self__
    raise AssertionError("no split installed")


def test_a_deep_copy_gets_a_split_of_its_own(one_rank_mesh) -> None:
    """An EMA or reference model made by `copy.deepcopy` of a split model: its own split (the same group), and both
    compute what the model computes, in turn and interleaved."""
    batch = packed_lm_batches(1)[0]
    model = build_causal_lm(tiny_config("qwen3"))
    split = _split_copy(model, one_rank_mesh)
    twin = copy.deepcopy(split)
    assert _split_of(twin) is not _split_of(split) and _split_of(twin).group is _split_of(split).group
    expected = model(**batch).loss
    for module in (split, twin, split):
        torch.testing.assert_close(module(**batch).loss, expected, atol=1e-6, rtol=0)
    del split
    torch.testing.assert_close(twin(**batch).loss, expected, atol=1e-6, rtol=0)


def test_the_registrations_are_given_up_on_teardown_and_taken_again(one_rank_mesh) -> None:
    """The attention and mask implementations are registered for the model; a strategy's teardown gives up its
    process-wide patches (`undo_owned(module, instances=False)`), which removes them; the next forward registers them
    again."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lightning_tp.strategies.shared import release_process_wide_patches

    batch = lm_batches(1)[0]
    model = build_causal_lm(tiny_config("qwen3"))
    split = _split_copy(model, one_rank_mesh)
    name = split.config._attn_implementation
    assert name == "lightning_tp_cp_sdpa"
    assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS
    release_process_wide_patches(split)
    assert name not in ALL_ATTENTION_FUNCTIONS and name not in ALL_MASK_ATTENTION_FUNCTIONS
    torch.testing.assert_close(split(**batch).loss, model(**batch).loss, atol=1e-6, rtol=0)
    assert name in ALL_ATTENTION_FUNCTIONS


def test_packed_rows_follow_transformers_rule_with_one_warning(one_rank_mesh) -> None:
    """One process tells packed documents apart only without a cache (`use_cache=False`); with the config's default
    cache it attends across them. The split computes the same in both cases, and says so once."""
    batch = packed_lm_batches(1)[0]
    model = build_causal_lm(tiny_config("qwen3"))
    split = _split_copy(model, one_rank_mesh)
    apart = {**batch, "use_cache": False}
    across = {k: v for k, v in batch.items() if k != "use_cache"}
    assert model.config.use_cache
    torch.testing.assert_close(split(**apart).loss, model(**apart).loss, atol=1e-6, rtol=0)
    with pytest.warns(UserWarning, match="attends across the documents") as record:
        torch.testing.assert_close(split(**across).loss, model(**across).loss, atol=1e-6, rtol=0)
        split(**across)
    assert len([w for w in record if "attends across" in str(w.message)]) == 1
    assert (split(**apart).loss - split(**across).loss).abs() > 1e-4  # the two rules differ on this row


def test_compiled_layers_run_the_split_attention_outside_their_graphs(one_rank_mesh) -> None:
    """`compile=True` compiles each decoder layer in place; the split's attention is a compile boundary (its tiles
    follow each batch's documents), so the compiled layers give the uncompiled model's loss and gradients. AOTAutograd
    (`aot_eager`) traces the layers as inductor would, without a C++ build."""
    batch = {**packed_lm_batches(1)[0]}
    model = build_causal_lm(tiny_config("qwen3"))
    split = _split_copy(model, one_rank_mesh)
    for layer in split.model.layers:
        layer.compile(backend="aot_eager")
    out, ref = split(**batch), model(**batch)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    out.loss.backward()
    ref.loss.backward()
    for a, b in zip(split.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)


def test_fullgraph_compile_with_context_parallelism_is_refused_by_name() -> None:
    from lightning_tp.layout import ParallelLayout
    from lightning_tp.parallel_options import ParallelOptions

    options = ParallelOptions(compile={"fullgraph": True})
    with pytest.raises(ValueError, match=r"fullgraph.*cp_size=2.*Drop `fullgraph`"):
        options.check_layout(ParallelLayout(tp_size=1, cp_size=2), device=torch.device("cpu"))
    ParallelOptions(compile=True).check_layout(ParallelLayout(tp_size=1, cp_size=2), device=torch.device("cpu"))


@pytest.mark.slow  # flex attention's CPU forward compiles its kernel: about 7 s
def test_a_flex_attention_model_trains_split(one_rank_mesh) -> None:
    """`flex_attention`: a split forward runs the tiles (flex has no backward on the CPU), at the loss of one process's
    flex forward and the gradients of the same weights under `sdpa`."""
    config = tiny_config("qwen3")
    config._attn_implementation = "flex_attention"
    model = build_causal_lm(config)
    assert context_parallel_problem(model) is None
    split = _split_copy(model, one_rank_mesh)
    batch = packed_lm_batches(1)[0]
    with torch.no_grad():
        expected = model(**batch).loss
    model.config._attn_implementation = "sdpa"  # the same weights, an attention with a CPU backward
    out, ref = split(**batch), model(**batch)
    torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.loss, expected, atol=1e-5, rtol=0)
    out.loss.backward()
    ref.loss.backward()
    for a, b in zip(split.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


def test_a_split_forward_inside_another_restores_its_state(one_rank_mesh) -> None:
    """A split model called inside another's forward (a reference model's loss computed in a hook) ends its own
    forward only: the outer forward's state is restored, so its loss is still the whole sequence's."""
    batch = lm_batches(1)[0]
    model = build_causal_lm(tiny_config("qwen3"))
    outer, inner = _split_copy(model, one_rank_mesh), _split_copy(model, one_rank_mesh)
    inner_losses = []
    outer.model.layers[0].register_forward_hook(lambda *args: inner_losses.append(inner(**batch).loss.detach()))
    expected = model(**batch).loss
    torch.testing.assert_close(outer(**batch).loss, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(inner_losses[0], expected, atol=1e-6, rtol=0)
    from lightning_tp.parallel.cp_split import CURRENT_FORWARD

    assert CURRENT_FORWARD.get() is None
    outer.model(input_ids=batch["input_ids"])  # the decoder stack called directly: its state ends with it
    assert CURRENT_FORWARD.get() is None


class _OneRankOnMeta:
    """A one-rank group's collectives as their results, for meta tensors (gloo takes none) and a ring's exchange with
    itself (gloo's has no pair for it): each copies its input."""

    @staticmethod
    def copy(output, input, *args, **kwargs) -> None:
        output.copy_(input)

    @staticmethod
    def all_reduce(tensor, *args, **kwargs) -> None:
        return None

    @staticmethod
    def batch_isend_irecv(ops) -> list:
        sends = [op.tensor for op in ops if op.op is torch.distributed.isend]
        receives = [op.tensor for op in ops if op.op is torch.distributed.irecv]
        for sent, received in zip(sends, receives, strict=True):
            received.copy_(sent)
        return []


@pytest.mark.parametrize(("name", "comm"), [("padded", "all_gather"), ("packed", "ring")])
def test_a_steady_state_split_step_reads_the_device_once(one_rank_mesh, name: str, comm: str, monkeypatch) -> None:
    """No host synchronisation in a split forward and backward but the one copy of the batch's position ids and
    padding mask to the host (`host_copies`), however many layers and kinds of mask (full and sliding-window
    layers): after the first forward (whose checks read the device), the model, its batch and so every tensor of
    the step are moved to the meta device, where reading a value raises (`.item()`, `bool()`, `.tolist()`,
    `.cpu()`), and the host copy gives the batch's values. The masks' ranges and tiles are cut from it alone."""
    from lightning_tp.parallel import context_parallel

    config = tiny_config("qwen3", num_hidden_layers=4, use_sliding_window=True, sliding_window=5)
    config.layer_types = ["full_attention", "sliding_attention"] * 2
    model = build_causal_lm(config)
    split = copy.deepcopy(model)
    install_context_parallel(split, one_rank_mesh, multiple=4, blocks=block_classes(split), comm=comm)
    batch = padded_lm_batches(1, seq=16)[0] if name == "padded" else packed_lm_batches(1)[0]
    for collective in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.setattr(torch.distributed, collective, _OneRankOnMeta.copy)
    monkeypatch.setattr(torch.distributed, "all_reduce", _OneRankOnMeta.all_reduce)
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", _OneRankOnMeta.batch_isend_irecv)  # gloo: no self
    split(**batch).loss.backward()  # the first split forward: its checks
    split.to("meta")
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    host = {id(meta[k]): batch[k] for k in meta if isinstance(meta[k], torch.Tensor)}
    copies = []

    def host_copies(*tensors):
        copies.append(len(tensors))
        return [None if t is None else host[id(t)] for t in tensors]

    masks = []
    make_mask = ContextParallel.mask
    monkeypatch.setattr(context_parallel, "host_copies", host_copies)
    monkeypatch.setattr(ContextParallel, "mask", lambda self, **kwargs: masks.append(1) or make_mask(self, **kwargs))
    out = split(**meta)
    out.loss.backward()
    assert out.loss.device.type == "meta"
    assert len(copies) == 1 and len(masks) == 2  # one copy; the full and the sliding-window mask, for 4 layers


def test_a_mask_function_holding_device_tensors_is_evaluated_on_the_device() -> None:
    """Llama 4's chunked mask holds each row's left padding, which Transformers counts on the device: evaluated on
    the host's index tensors it raises (two devices in one operation), so its first keys are found on the device
    (meta here) and read once; with host tensors it runs on the host."""
    from types import SimpleNamespace

    from transformers.masking_utils import chunked_causal_mask_function

    from lightning_tp.parallel.cp_split import split_first_keys

    split = SimpleNamespace(host_positions=torch.arange(8), positions=torch.arange(8, device="meta"), padded_len=8)
    left_padding = torch.zeros(1, dtype=torch.long)
    low, positions = split_first_keys(chunked_causal_mask_function(4, left_padding.to("meta")), split, batch=1)
    assert low.device.type == positions.device.type == "meta" and low.shape == (1, 8)
    low, positions = split_first_keys(chunked_causal_mask_function(4, left_padding), split, batch=1)
    assert positions is split.host_positions and low.tolist() == [[0, 0, 0, 0, 4, 4, 4, 4]]
