"""Tolerances of the low-precision parity checks, derived from the precision's unit roundoff and the number of
roundings in which the two compared runs differ (never a gap measured on one machine: bf16 kernels round in other
places on AVX2-only CPUs than on AVX-512/AMX ones, and on CUDA).

The model (Higham & Mary's probabilistic rounding-error analysis). A result rounded to a format of unit roundoff
``u = eps / 2`` (bf16: ``2**-8``, fp16: ``2**-11``, fp32: ``2**-24``) carries a relative error of at most ``u``; taken
as uniform on ``[-u, u]`` and independent from one rounding to the next, its variance is ``u**2 / 3``. Two runs of one
computation that round ``n`` values differently (counting both runs' roundings, each weighted by its share of the
value it rounds: the ``tp`` partial sums of a sharded matmul are together about one sum's worth) then differ by a
relative amount of root mean square

    rho(n) = u * sqrt(n / 3)                                   (:func:`rounding_gap`)

over the elements of what they compute. Everything else is the same in both runs and cancels: one device and the
sharded run call the same kernels on the same fp32 weights, and a matmul accumulates in fp32 and rounds its output
once, whatever its inner dimension ``K`` (checked on AVX2, AVX-512 and AMX kernels; cuBLAS accumulates in fp32 too),
so no ``sqrt(K)`` growth enters. The worst case, ``n * u`` (every rounding the same way), would be 0.1 to 0.3 here:
no check at all. The root mean square is over thousands of elements, so its ``sqrt(n)`` law holds with little
fluctuation (measured on the tiny Qwen3 at dp 2 x tp 2: 1.6 to 1.8 ``u`` for the first step's gradients over 12 seeds
on AVX2 and AMX kernels, where ``rho(29)`` is 3.1 ``u``).

The checks then bound what they compare by this root mean square, deterministically:

* a gradient norm: ``|norm(g') - norm(g)| <= norm(g' - g) = rho * norm(g)`` (triangle inequality); measured: the gap
  of norms is a few hundredths of ``rho`` (the differences have no preferred sign), so this bound catches a wrong
  reduction or scaling (a factor, a missing rank), not the choice of roundings;
* a mean cross-entropy loss: per predicted token ``|Δℓ_t| <= norm(p_t - y_t) * norm(Δz_t) <= rho * norm(p_t - y_t) *
  norm(z_t)`` (first order and Cauchy-Schwarz: ``p_t - y_t`` is the gradient of ``ℓ_t`` in the logits ``z_t``), so
  ``|ΔL| <= rho * mean_t(norm(p_t - y_t) * norm(z_t))`` (:func:`cross_entropy_scale`, :func:`cross_entropy_gap`);
* the rounding error itself, against an fp32 run in the same process with the same kernels: the sharded run's
  error may exceed one device's only by the variance of its extra roundings (:func:`error_ratio_limit`). This is the
  check that tells apart two rounding schemes of one computation (autocast over fp32 weights against bf16 weights):
  the norms and losses cannot. Over 12 seeds on AVX2 and AMX kernels the first step's gradient norm of the tiny
  Qwen3 at dp 2 x tp 2 is up to 4.8e-4 from one device's with autocast over fp32 weights, and as little as 8e-5 with
  bf16 weights: no bound on it tells the two apart (a bound of 1e-4 did at one seed, on AVX-512 without AMX).

Later steps: step ``t`` computes with weights that carry the differences of the ``t - 1`` updates before it, counted
as ``t - 1`` more steps' roundings (an over-count: an update is much smaller than the weight it changes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch

#: Standard deviations of a fluctuation a bound admits: 4 (a normal variable is beyond it with probability 6e-5).
SIGMAS = 4.0

#: Values one device rounds to bf16 per decoder layer under autocast, forward: the normed input of q/k/v, q, k, v,
#: the q/k norms, rotary q and k, two inside attention (scores, probabilities), its output through o_proj, the normed
#: input of the MLP, gate, up, the activation, its product, down (18).
FORWARD_LAYER_ROUNDINGS = 18
#: Backward: as many input gradients (18) and a weight gradient for each of the 7 matmuls (25).
#: :func:`error_ratio_limit` only needs the order of magnitude of both.
LAYER_ROUNDINGS = FORWARD_LAYER_ROUNDINGS + 25


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one round-to-nearest into ``dtype``."""
    return torch.finfo(dtype).eps / 2


def rounding_gap(dtype: torch.dtype, roundings: float) -> float:
    """Root mean square relative difference of two runs of one computation in ``dtype`` that round ``roundings``
    values differently, both runs counted (see the module's docstring): ``u * sqrt(roundings / 3)``."""
    return unit_roundoff(dtype) * math.sqrt(roundings / 3)


def sharded_roundings(layers: int, *, tp: int, dp: int, forward_only: bool = False, bf16_weights: bool = False) -> int:
    """What one training step of a decoder-only model of ``layers`` layers sharded ``dp x tp`` under bf16 autocast
    rounds differently from one device (both counted, each weighted by its share of the value it rounds; see
    :func:`rounding_gap`); ``forward_only``: up to the loss.

    * A TP reduction: one device rounds the whole sum once; each of the ``tp`` ranks rounds its partial sum (together
      about one sum's worth), then the bf16 all-reduce rounds each of its ``tp - 1`` additions: ``tp + 1``. There are
      two a layer forward (attention output ``o_proj``, MLP ``down_proj``) and ``2 * layers + 1`` backward (the input
      gradients of q/k/v, of gate/up, and of the vocabulary-split ``lm_head``).
    * Data parallelism: one device rounds each weight gradient once, each of the ``dp`` ranks its part of the batch's
      (together one), and FSDP2 sums them in fp32: 2. The forward of a row does not depend on the other rows.
    * ``bf16_weights`` (FSDP2 all-gathering bf16 copies, ``fsdp_param_dtype="bf16"``; ``bf16-true``): the residual
      stream is bf16 too, rounded after the embedding and each of the 2 residual additions a layer, forward, and so
      are its gradients backward.
    """
    per_reduction = tp + 1 if tp > 1 else 0
    stream = 2 * layers + 1 if bf16_weights else 0
    if forward_only:
        return 2 * layers * per_reduction + stream
    return (4 * layers + 1) * per_reduction + (2 if dp > 1 else 0) + 2 * stream


def parity_tolerances(
    dtype: torch.dtype, layers: int, *, tp: int, dp: int, steps: int, loss_scale: float, bf16_weights: bool = False
) -> dict[str, list[float]]:
    """Per training step, the bounds of a sharded run against one device: ``grad_norm_rel`` on the relative gap of
    the gradient norms, ``loss`` on the gap of the losses (``loss_scale``: :func:`cross_entropy_scale`; see the
    module's docstring; step ``t`` counts the roundings of the ``t - 1`` steps before it as well)."""
    step = sharded_roundings(layers, tp=tp, dp=dp, bf16_weights=bf16_weights)
    forward = sharded_roundings(layers, tp=tp, dp=dp, forward_only=True, bf16_weights=bf16_weights)
    return {
        "grad_norm_rel": [rounding_gap(dtype, (t + 1) * step) for t in range(steps)],
        "loss": [cross_entropy_gap(rounding_gap(dtype, forward + t * step), loss_scale) for t in range(steps)],
    }


def cross_entropy_gap(rho: float, scale: float) -> float:
    """Bound on the difference of two mean cross-entropy losses whose logits differ by a relative root mean square
    ``rho``: ``rho * scale``, ``scale`` from :func:`cross_entropy_scale` (the module's docstring has the derivation)."""
    return rho * scale


def _at_each_state(model: torch.nn.Module, states: tuple[dict[str, torch.Tensor], ...]) -> Iterator[torch.nn.Module]:
    """``model`` with its own weights, then a copy of it with each of ``states`` loaded (``model`` is left as is)."""
    import copy

    yield model
    for state in states:
        model = copy.deepcopy(model)
        model.load_state_dict(state)
        yield model


@torch.no_grad()
def cross_entropy_scale(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    *,
    precision: str,
    states: tuple[dict[str, torch.Tensor], ...] = (),
) -> float:
    """``mean_t(norm(p_t - y_t) * norm(z_t))`` over the predicted tokens of a batch (a Transformers causal LM's
    shifted labels, -100 ignored), the largest over ``batches`` and over ``model``'s weights and each of ``states``
    (say the initial and the trained weights, for every step between), run as ``precision`` (``bf16-mixed``: CPU
    autocast) on the CPU: what :func:`cross_entropy_gap` multiplies."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    largest = 0.0
    for at_state in _at_each_state(model, states):
        for batch in batches:
            with autocast:
                logits = at_state(input_ids=batch["input_ids"]).logits[:, :-1].float()
            labels = batch["labels"][:, 1:]
            kept = labels != -100
            z, y = logits[kept], labels[kept]
            p_minus_y = z.softmax(-1) - torch.nn.functional.one_hot(y, z.shape[-1]).float()
            per_token = torch.linalg.vector_norm(p_minus_y, dim=-1) * torch.linalg.vector_norm(z, dim=-1)
            largest = max(largest, per_token.mean().item())
    return largest


def cast_logits_tolerance(dtype: torch.dtype, layers: int, largest_logit: float) -> float:
    """Bound on each logit's gap between a model whose weights were cast to ``dtype`` (and which computes in it) and
    the fp32 model: every value of the forward rounded once, ``FORWARD_LAYER_ROUNDINGS`` and the 2 residual additions
    a layer, plus the embedding, the final norm and ``lm_head`` (the fp32 run's roundings are nothing beside them), a
    relative root mean square ``rounding_gap(dtype, n)``; ``SIGMAS`` of it, of the largest logit, for any one logit."""
    return SIGMAS * rounding_gap(dtype, (FORWARD_LAYER_ROUNDINGS + 2) * layers + 3) * largest_logit


def error_ratio_limit(layers: int, *, tp: int, dp: int, update: dict[str, torch.Tensor]) -> float:
    """How much larger the sharded run's rounding error (the distance of its trained weights from an fp32 run's) may
    be than one device's, as a ratio.

    Both rounding errors are root mean squares over the weights of independent roundings: one device's of variance
    ``~ LAYER_ROUNDINGS * layers`` per step (in units of ``u**2 / 3``), the sharded run's of that plus its extra ones,
    ``(tp - 1)`` for each of the ``4 * layers + 1`` TP reductions (data parallelism rounds no more than one device: one
    weight gradient's worth in all). So the ratio is ``sqrt(1 + extra / one_device)``, times the fluctuation of a
    root mean square over ``n_eff`` effective elements, ``1 + SIGMAS / sqrt(n_eff)``, where ``n_eff =
    sum(x**2)**2 / sum(x**4)`` of ``update`` (one device's trained weights minus the initial ones: the errors scale
    with it). Computing with bf16 weights (FSDP2's bf16 all-gather) rounds the residual stream, the embeddings and the
    norms' weights as well: more error than that.

    Measured (the tiny Qwen3, dp 2 x tp 2, 3 SGD steps, 12 seeds, AVX2 and AMX kernels): 0.98 to 1.04 with autocast
    over fp32 weights, 1.22 to 1.34 with bf16 weights; the limit is 1.106 for the suite's seed (``n_eff`` 5900; the
    measured spread is about 1.4 times the independent elements' ``1 / sqrt(n_eff)``, so ``SIGMAS`` covers near 3 of
    it).
    """
    extra = (tp - 1) * (4 * layers + 1) if tp > 1 else 0
    flat = torch.cat([value.detach().double().flatten() for value in update.values()])
    n_eff = (flat.pow(2).sum() ** 2 / flat.pow(4).sum()).item()
    return math.sqrt(1 + extra / (LAYER_ROUNDINGS * layers)) * (1 + SIGMAS / math.sqrt(n_eff))


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], scale: dict[str, torch.Tensor]) -> float:
    """``norm(a - b) / norm(scale)`` over every tensor of the state dicts (fp64)."""
    assert a.keys() == b.keys() == scale.keys(), sorted(a.keys() ^ b.keys() ^ scale.keys())
    num = sum((a[k].double() - b[k].double()).pow(2).sum() for k in a)
    den = sum(scale[k].double().pow(2).sum() for k in a)
    return math.sqrt(num / den)


def assert_step_gaps(
    got: list[float], want: list[float], bounds: list[float], *, relative: bool, what: str
) -> list[float]:
    """Each step's gap ``|got - want|`` (``relative``: over ``|want|``) within that step's bound; returns the gaps."""
    assert len(got) == len(want) == len(bounds) > 0, (what, got, want, bounds)
    gaps = [abs(a - b) / (abs(b) if relative else 1.0) for a, b in zip(got, want, strict=True)]
    assert all(gap <= bound for gap, bound in zip(gaps, bounds, strict=True)), f"{what}: gaps {gaps} beyond {bounds}"
    return gaps


# ------------------------------------------------------------------------------------------------------------- fp32
#
# In fp32 the roundings two runs do differently are those of their sums: a layout sums in another order (TP's
# row-wise matmuls and vocabulary-split head, the token sums that data, context, expert and pipeline parallelism
# split), and once two runs' values are an ulp apart every later rounding differs as well. A sum of ``K`` terms
# rounds each partial sum, ``u`` of it; weighted by its share of the result (``k / K`` for the ``k``-th of terms of
# random signs) a chain of them rounds ``(K + 1) / 2`` in each run: ``K`` for both (a kernel's SIMD lanes and blocks
# sum shorter chains: an over-count). So the model above holds with sum lengths as counts (:func:`fp32_roundings`),
# and a layout's count need not be named: any split rounds no more than the chain. The gap is relative to the
# magnitude of what is summed: where the terms cancel (a pretrained model's gradients) it is that much larger
# against the sum (the ``condition`` of :func:`fp32_grad_norm_gap`: 1.2 to 4.3 for the tiny cases, 1.8 for
# SmolLM2-135M).
#
# The optimizers turn the gradients' gap into the weights' differently:
#
# * SGD moves a weight by ``lr * g``: the runs' weights end ``lr * sum_t norm(Δg_t)`` apart at most, in norm and so in
#   each weight (:func:`sgd_weight_gap`).
# * AdamW moves a weight by ``lr * m̂ / sqrt(v̂)``, at most ``c_t * lr`` whatever the size of its gradient
#   (:func:`adamw_step_bound`): where a gradient is within its rounding of zero its sign can differ between the runs,
#   and the two runs end up to ``2 * lr * sum_t c_t`` apart in that weight (:func:`adamw_weight_gap`: the bound on
#   each weight); over all the weights the few such weights and the others' smaller moves stay within
#   :func:`adamw_rms_gap`.
#
# Later steps compute with weights that differ by the earlier updates' gaps. The bf16 model counts them as the
# earlier steps' roundings; in fp32 the optimizer makes more of them than that: AdamW's normalised step where a
# gradient is near zero (the tiny GPT-2, 4 steps at lr 1e-3 on 2 processes: weights up to 5e-5 apart, where SGD's
# are 1e-7; rsLoRA's adapters at lr 1e-2: gradient norms 2.7e-5 apart at step 3, where that step's roundings give
# 1.7e-5). So a later step's gradient norm is bounded with the runs' own trained weights' gap as well
# (:func:`weight_drift`). Its loss is not: it moves with the weights' gap by ``g · Δw`` (first order), and AdamW moves
# a weight most where its gradient ``g`` is nearest zero (measured: at most 2 ulps of the loss over the tiny cases,
# under a quarter of :func:`fp32_loss_gap`; the resumes of tests/distributed/test_checkpoint.py, 8 AdamW steps at lr
# 1e-2, under 0.3 of it).

FP32 = torch.float32


def fp32_roundings(shapes: Iterable[Sequence[int]], rows: int) -> tuple[int, int]:
    """``(forward, step)``: what two fp32 runs of a model whose parameters (and buffers) have ``shapes`` round
    differently, both counted (see the fp32 section above), in a forward and in a training step over ``rows`` rows
    (tokens; times the micro-batches a step accumulates).

    * Forward: each matrix (the last two dimensions of a tensor of 2 or more) sums over its last dimension (a linear
      layer's, an embedding's input; an embedding's lookup sums nothing and GPT-2's ``(in, out)`` layers are stored the
      other way: over-counts), each vector its length (a norm's mean of squares; a bias sums nothing: an over-count).
      The sums without a weight (attention's, over a head's dimension and over the keys) are no longer than the
      matrices' around them, and an elementwise rounding (activations, residual additions) is one beside the
      hundreds of a matrix: inside the over-counts.
    * Step: the forward's, each matrix's other dimension (the input gradients' sums, backward), and the weight
      gradients' sums over the ``rows`` (different elements of one gradient, each its own sum: counted once).
    """
    forward = backward = 0
    for shape in shapes:
        if len(shape) >= 2:
            forward += shape[-1]
            backward += shape[-2]
        elif len(shape) == 1:
            forward += shape[0]
    return forward, forward + backward + rows


def fp32_loss_gap(roundings: float, scale: float, loss: float, *, rows: int, classes: int) -> float:
    """Bound on the gap of two fp32 runs' losses whose outputs ``z`` (logits) differ by the relative root mean square
    ``rho = rounding_gap(FP32, roundings)`` (the forward's count, and the steps' before it):

    * through the outputs: ``ΔL = sum_i ∂L/∂z_i * z_i * ε_i`` over the outputs, their relative gaps ``ε_i`` taken as
      independent (the rounding model), so a root mean square ``rho * norm(∂L/∂z ⊙ z)`` (``scale``, recorded by
      :func:`tests.helpers.models.reference_run`), ``SIGMAS`` of it;
    * the loss's own sums: a cross-entropy's sum of exponentials over the ``classes`` of each row (its relative gap
      is an absolute one of its logarithm), independent from row to row: ``SIGMAS`` of its root mean square over the
      mean of ``rows`` of them; the mean over the ``rows`` (one sum): ``SIGMAS`` of its relative gap, of ``loss``;
    * the loss's final rounding in each run: ``2 u`` of it.

    Measured (the tiny cases at TP 2 and dp 2 x tp 2): at most 2 ulps of the loss (9.5e-7 at 4.6)."""
    u = unit_roundoff(FP32)
    outputs = SIGMAS * rounding_gap(FP32, roundings) * scale
    exponentials = SIGMAS * rounding_gap(FP32, classes) / math.sqrt(max(rows, 1))
    mean = SIGMAS * rounding_gap(FP32, rows) * abs(loss)
    return outputs + exponentials + mean + 2 * u * abs(loss)


def fp32_grad_norm_gap(roundings: float, condition: float = 1.0) -> float:
    """Bound on the relative gap of two fp32 runs' gradient norms whose gradients differ by the relative root mean
    square ``rho = rounding_gap(FP32, roundings)`` of what they sum (a step's count, and the steps' before it):
    ``|norm(g') - norm(g)| <= norm(g' - g) = rho * condition * norm(g)`` (as bf16's), where ``condition`` is the norm
    of the magnitudes of the gradients' terms over the norm of the gradients (1 without cancellation; a pretrained
    model's gradients are small sums of large terms: :func:`tests.helpers.models.reference_run` records it); and
    each run's final rounding of the norm, ``2 u``."""
    return rounding_gap(FP32, roundings) * condition + 2 * unit_roundoff(FP32)


def fp32_logits_gap(roundings: float, largest: float, *, drift: float = 0.0) -> float:
    """Bound on each output's gap between two fp32 forwards whose outputs differ by the relative root mean square
    ``rounding_gap(FP32, roundings)``, and by ``drift`` more where their weights differ (a forward takes each weight
    once: :func:`weight_drift` over ``sqrt(2)``): ``SIGMAS`` of it, of the ``largest`` output (as
    :func:`cast_logits_tolerance`), and each run's final rounding (``u`` of it each)."""
    return (SIGMAS * (rounding_gap(FP32, roundings) + drift) + 2 * unit_roundoff(FP32)) * largest


def sgd_weight_gap(lr: float, grad_terms: list[float], step_roundings: float, largest_weight: float) -> float:
    """Bound on each weight's gap (and on the norm of the gap over all of them) between two plain SGD runs after the
    steps whose gradients sum terms of norm ``grad_terms`` (:func:`fp32_grad_norm_gap`'s ``condition`` times the
    gradient norm; one run's): a step moves the weights by ``lr * g``, so by ``lr * norm(Δg_t)`` apart, ``norm(Δg_t)
    = rho_t * grad_terms[t]`` with ``rho_t = rounding_gap(FP32, (t + 1) * step_roundings)`` (step ``t``'s count and
    the steps' before it); and each run rounds each weight once a step (``u`` of the ``largest_weight``)."""
    u = unit_roundoff(FP32)
    moves = sum(lr * rounding_gap(FP32, (t + 1) * step_roundings) * terms for t, terms in enumerate(grad_terms))
    return moves + 2 * len(grad_terms) * u * largest_weight


def adamw_step_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """``c_t``: the largest ``|m̂_t / sqrt(v̂_t)|`` of AdamW's bias-corrected moments at step ``t`` (from 1), whatever
    the gradients. ``m̂_t = sum_i a_i g_i`` and ``v̂_t = sum_i b_i g_i**2`` with ``a_i = (1 - β1) β1**(t-i) / (1 -
    β1**t)``, ``b_i = (1 - β2) β2**(t-i) / (1 - β2**t)``; Cauchy-Schwarz gives ``|m̂_t| <= sqrt(sum_i a_i**2 / b_i) *
    sqrt(v̂_t)``: 1 at the first step (``lr * sign(g)``), 1.011 at the fifth with the default betas (``eps`` only
    lowers it)."""
    beta1, beta2 = betas
    a = [(1 - beta1) * beta1 ** (step - i) / (1 - beta1**step) for i in range(1, step + 1)]
    b = [(1 - beta2) * beta2 ** (step - i) / (1 - beta2**step) for i in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b, strict=True)))


def adamw_weight_gap(lrs: list[float], largest_weight: float = 0.0) -> float:
    """Bound on each weight's gap between two AdamW runs after steps of learning rates ``lrs``, whose gradients differ
    by rounding: a step moves a weight by at most ``c_t * lr_t`` (:func:`adamw_step_bound`) whatever the size of its
    gradient, in either direction where the gradient is within its rounding of zero (its sign can differ), so ``2 *
    sum_t c_t * lr_t``; the decoupled weight decay multiplies both runs' weights by ``1 - lr * wd`` (it shrinks the
    gap), and each run rounds each weight twice a step (``u`` of the ``largest_weight`` each time).

    This is the bound the gaps reach: SmolLM2-135M at TP 3 against one process, 3 steps at lr 1e-5, ended 1.04e-5
    apart in a weight. It is no check of the update itself (two AdamW runs from one start are within it whatever their
    gradients): :func:`adamw_rms_gap` is."""
    moves = 2 * sum(lr * adamw_step_bound(t) for t, lr in enumerate(lrs, start=1))
    return moves + 4 * len(lrs) * unit_roundoff(FP32) * largest_weight


def adamw_rms_gap(lrs: list[float], step_roundings: float, conditions: list[float] | None = None) -> float:
    """Bound on the root mean square over the weights of two AdamW runs' gap after steps of learning rates ``lrs``.

    A step moves weight ``i`` by ``lr * r_i``, ``r_i = m̂_i / sqrt(v̂_i)``; a gap ``δ_i`` of its gradient ``g_i``
    moves ``r_i`` by at most ``2 |δ_i| / |g_i|`` (first order in the gradients, whose square root ``v̂`` is of their
    size) and at most 2 (its sign). The gradients differ by the relative root mean square ``rho_t =
    rounding_gap(FP32, (t + 1) * step_roundings)`` times their ``conditions[t]`` (:func:`fp32_grad_norm_gap`); for
    gradients of root mean square ``σ`` spread with a density at most ``1 / σ`` (a normal's is ``0.40 / σ``, a
    Laplace's ``0.71 / σ``) and ``|δ| = rho_t σ``: ``mean_i min(4, 4 δ**2 / g_i**2) <= (1 / σ) (4 * 2 δ + 4 δ**2 * 2 /
    δ) = 16 rho_t``. So a step moves the weights' root mean square gap by ``4 * lr * sqrt(rho_t)`` at most (the
    steps' moves added, not in quadrature), over the few weights whose sign differs and the others' smaller moves
    together.

    Measured: 2.3e-7 at the tiny GPT-2's 4 steps at lr 1e-3 on 2 processes, where this is 3e-5; a step's update
    left out in one TP shard of one projection (2048 of 86400 weights, ``lr`` each) is 1.5e-4."""
    conditions = conditions or [1.0] * len(lrs)
    return sum(
        4 * lr * math.sqrt(rounding_gap(FP32, (t + 1) * step_roundings) * condition)
        for t, (lr, condition) in enumerate(zip(lrs, conditions, strict=True))
    )


def weight_drift(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The relative root mean square gap a training step's values get from weights that differ as ``got`` and
    ``want`` do (two runs' trained weights: the largest gap of their steps, which grows with them).

    A matrix ``T`` whose values are ``ε_T = norm(got_T - want_T) / norm(want_T)`` apart moves each product it enters
    by ``ε_T`` relative (and the gradient of the matrix it multiplies: a LoRA ``A``'s is linear in its ``B``), as
    ``3 ε_T**2 / u**2`` roundings would. A vector scales (a norm's weight) or shifts (a bias) values of the
    normalised stream's scale (root mean square 1): its gap relative to the larger of its norm and ``sqrt(n)`` (a
    bias whose gradient rounding alone moves, such as a key's, which softmax ignores, is not relative to its own
    size). A step's sums take each weight twice (the forward, the input gradients' backward): ``sqrt(2 * sum_T
    ε_T**2)``."""
    squares = 0.0
    for key, value in want.items():
        if not value.is_floating_point() or value.dim() == 0:
            continue
        gap, norm = (got[key].double() - value.double()).norm().item(), value.double().norm().item()
        if value.dim() == 1:
            norm = max(norm, math.sqrt(value.numel()))
        squares += 0.0 if gap == 0 else (gap / norm) ** 2 if norm else math.inf
    return math.sqrt(2 * squares)


def rms_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The root mean square of ``a - b`` over every element of the state dicts (fp64)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    squares = sum((a[k].double() - b[k].double()).pow(2).sum().item() for k in a)
    return math.sqrt(squares / max(sum(a[k].numel() for k in a), 1))


def output_scale(
    model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], states: tuple[dict[str, torch.Tensor], ...] = ()
) -> float:
    """``norm(∂L/∂z ⊙ z)`` over the logits ``z`` of a Transformers model's loss ``L = model(**batch).loss`` in fp32,
    the largest over ``batches`` and over ``model``'s weights and each of ``states``: what :func:`fp32_loss_gap`
    multiplies (:func:`tests.helpers.models.reference_run` records it for a reference's own steps)."""
    largest = 0.0
    for at_state in _at_each_state(model, states):
        for batch in batches:
            out = at_state(**batch)
            out.logits.retain_grad()
            out.loss.backward()
            largest = max(largest, (out.logits.grad.double() * out.logits.detach().double()).norm().item())
            at_state.zero_grad(set_to_none=True)
    return largest
