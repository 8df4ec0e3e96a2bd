"""EntropyBonus: −c·agg(H) with the gradient of the full-vocabulary entropy (checked with torch.distributions)."""

import pytest
import torch

from lightning_rlvr.callbacks import EntropyBonus
from lightning_rlvr.ops import token_logprobs_and_entropy

from .helpers import micro_context, step_context


def test_gradient_is_that_of_the_categorical_entropy():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    logits = torch.randn(2, 3, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    stats = token_logprobs_and_entropy(logits, labels, temperature=0.7, entropy_grad=True)
    ctx = micro_context(step_context([1, 0], mask), stats.logprobs, entropy=stats.entropy)
    term = EntropyBonus(coef=0.01).extra_loss(None, None, ctx)
    term.backward()

    reference_logits = logits.detach().clone().requires_grad_()
    entropy = torch.distributions.Categorical(logits=reference_logits / 0.7).entropy()
    expected = -0.01 * (entropy * mask).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(term, expected)
    torch.testing.assert_close(logits.grad, reference_logits.grad)
    assert EntropyBonus().needs.entropy_grad


def test_coefficient_must_be_positive():
    with pytest.raises(ValueError, match="coef"):
        EntropyBonus(coef=-1e-3)
