"""Per-token log-probabilities and entropies on vocabulary-sharded logits (DPO, GRPO), without processes: on a
one-rank mesh the sharded path must give the full logits' values and gradients; the gather of loss parallelism is
skipped inside `keep_logits_sharded`. The two-rank parity runs in tests/distributed/test_examples.py (examples/dpo.py
at TP 2 against one process)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

import lightning_tp
from lightning_tp.parallel.loss_parallel import _gather_logits_without_labels
from tests.helpers.process_group import one_rank_mesh


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    tokens[0, :2] = -100
    return logits, tokens, torch.randn(2, 5, generator=g)


def test_plain_logprobs_and_entropy_are_torch_s() -> None:
    logits, tokens, _ = _inputs()
    log_p = F.log_softmax(logits, dim=-1)
    expected = torch.where(tokens != -100, log_p.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    torch.testing.assert_close(lightning_tp.token_logprobs(logits, tokens), expected)
    torch.testing.assert_close(lightning_tp.token_entropy(logits), -(log_p.exp() * log_p).sum(-1))


def test_sharded_logprobs_and_entropy_equal_the_full_ones_in_value_and_gradient() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    logits, tokens, weights = _inputs()
    full = logits.clone().requires_grad_(True)
    expected = (lightning_tp.token_logprobs(full, tokens) * weights).sum() + lightning_tp.token_entropy(full).sum()
    expected.backward()
    with one_rank_mesh() as mesh:
        sharded = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_(True)
        value = lightning_tp.token_logprobs(sharded[:, :], tokens) * weights
        entropy = lightning_tp.token_entropy(sharded)
        assert not hasattr(value, "placements") and value.dtype == torch.float32  # plain fp32 per token
        total = value.sum() + entropy.sum()
        total.backward()
        torch.testing.assert_close(total, expected)
        torch.testing.assert_close(sharded.grad.full_tensor(), full.grad)


def test_keep_logits_sharded_skips_the_gather_of_a_forward_without_labels() -> None:
    with one_rank_mesh() as mesh:
        from torch.distributed.tensor import Shard, distribute_tensor

        def output() -> SimpleNamespace:
            return SimpleNamespace(logits=distribute_tensor(torch.randn(1, 3, 4), mesh, [Shard(-1)]))

        gathered = _gather_logits_without_labels(None, (), {}, output())
        assert not hasattr(gathered.logits, "placements")  # gathered to a plain tensor: generate, prediction
        with lightning_tp.keep_logits_sharded():
            kept = _gather_logits_without_labels(None, (), {}, output())
        assert hasattr(kept.logits, "placements")
        after = _gather_logits_without_labels(None, (), {}, output())
        assert not hasattr(after.logits, "placements")


def test_entropy_of_masked_logits_is_finite() -> None:
    """A -inf logit (a masked token) adds nothing to the entropy, on the full and on the sharded path."""
    from torch.distributed.tensor import Shard, distribute_tensor

    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0]])
    expected = lightning_tp.token_entropy(torch.tensor([[0.0, 1.0, 2.0]]))
    torch.testing.assert_close(lightning_tp.token_entropy(logits), expected)
    with one_rank_mesh() as mesh:
        torch.testing.assert_close(lightning_tp.token_entropy(distribute_tensor(logits, mesh, [Shard(-1)])), expected)
