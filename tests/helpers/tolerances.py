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
    import copy

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    largest = 0.0
    for state in (None, *states):
        if state is not None:
            model = copy.deepcopy(model)
            model.load_state_dict(state)
        for batch in batches:
            with autocast:
                logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
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
