"""The GTPO callback asks for old-policy entropy and replaces the advantages with the shaped ones."""

import torch

from lightning_rlvr.algorithms.gtpo import gtpo_advantages, gtpo_token_rewards
from lightning_rlvr.callbacks import GTPO

from .helpers import step_context


def test_shape_advantages_is_the_pure_function_of_old_entropy():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    entropy = torch.rand(4, 3)
    step = step_context([1, 0, 1, 0], mask, advantages=[9.0, 9.0, 9.0, 9.0], group_ids=[0, 0, 0, 0],
                        old_entropy=entropy)
    cb = GTPO(alpha_entropy=0.2, normalization="polarity")
    shaped = gtpo_token_rewards(step.batch.rewards, entropy, mask, step.batch.group_ids, 1.0, 0.2)
    expected = gtpo_advantages(shaped, step.batch.rewards, mask, step.batch.group_ids, normalization="polarity")
    torch.testing.assert_close(cb.shape_advantages(None, None, step), expected)
    assert cb.needs.old_stats
    assert "gtpo/shaped_reward_positive" in step.metrics.means()
