"""Per-token KL estimators between the policy and a reference model (Schulman, "Approximating KL").

With ``x = log π_θ(a) − log π_ref(a)`` for the sampled token ``a``:

- ``k1``: ``x`` (unbiased, high variance, can be negative);
- ``abs``: ``|x|``;
- ``k2``: ``½ x²`` (verl "mse");
- ``k3``: ``exp(−x) + x − 1`` (verl "low_var_kl"; unbiased for KL(π‖ref), always ≥ 0), with ``−x`` clamped
  to [−20, 20] and the result to [−10, 10] as in verl;
- ``k3+``: the value of k3 with the gradient of k2 (straight-through), whose gradient is unbiased.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "abs", "k2", "k3", "k3+"]
__all__ = ["KLEstimator", "kl_penalty"]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token KL estimate (shape of the inputs); aggregate it with the same mode as the policy loss."""
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "abs":
        return x.abs()
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator in ("k3", "k3+"):
        neg = torch.clamp(-x, -20.0, 20.0).double()
        # e^{−x} + x − 1 in float64 (one value per token): in float32 the terms cancel, exactly to 0 for |x| below
        # ~5e-4, the whole KL of a policy one small step from its reference
        k3 = torch.clamp(torch.expm1(neg) - neg, -10.0, 10.0).to(x.dtype)
        if estimator == "k3":
            return k3
        k2 = 0.5 * x.square()
        return k2 - k2.detach() + k3.detach()
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of k1, abs, k2, k3, k3+")
