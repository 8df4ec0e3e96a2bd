"""pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374).

With ``n`` samples of which ``c`` are correct,

.. math::
    \\text{pass@}k = 1 - \\binom{n - c}{k} \\Big/ \\binom{n}{k}

the probability that at least one of ``k`` samples drawn without replacement from the ``n`` is correct.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pass_at_k"]


def pass_at_k(num_samples: int, num_correct: Tensor, k: int) -> Tensor:
    """Unbiased pass@k per problem, computed as ``1 − Π_{i=n−c+1}^{n} (1 − k/i)`` for numerical stability.

    Args:
        num_samples: ``n``, samples per problem.
        num_correct: ``(M,)`` correct samples per problem.
        k: ``1 ≤ k ≤ n``.
    """
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    c = num_correct.long().tolist()
    out = []
    for ci in c:
        if num_samples - ci < k:
            out.append(1.0)
            continue
        prod = 1.0
        for i in range(num_samples - ci + 1, num_samples + 1):
            prod *= 1.0 - k / i
        out.append(1.0 - prod)
    return torch.tensor(out, dtype=torch.float32)
