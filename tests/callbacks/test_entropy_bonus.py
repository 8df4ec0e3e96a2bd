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


def test_the_logged_bonus_is_the_whole_minibatchs_however_it_is_micro_batched():
    """On one on-policy update the bonus is −c · token-mean(H) over the batch, and H is the entropy the module logs
    as entropy/token_mean: the metric must equal −c · entropy/token_mean with 16 rows in micro-batches of 3."""
    import warnings

    import lightning.pytorch as pl

    from lightning_rlvr import BuiltinTask, RLVRModule, RolloutDataModule
    from lightning_rlvr.loggers import InMemoryLogger

    logger = InMemoryLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", max_steps=3, log_every_n_steps=1, logger=logger, limit_val_batches=0,
                   num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[EntropyBonus(coef=0.1)]).fit(
            RLVRModule(model="builtin:tiny", micro_batch_size=3, log_completions_every_n_steps=None),
            RolloutDataModule(source=BuiltinTask("addition"), prompts_per_step=4, group_size=4, val_samples=0))
    bonus, entropy = logger.history["entropy_bonus/loss"], logger.history["entropy/token_mean"]
    assert sorted(bonus) == [0, 1, 2]
    for step in bonus:
        assert bonus[step] == pytest.approx(-0.1 * entropy[step], rel=1e-5)
    assert bonus == pytest.approx(logger.history["loss/interventions"], rel=1e-5)
