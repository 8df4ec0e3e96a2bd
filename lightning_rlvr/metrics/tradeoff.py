"""The entropy-performance trade-off of Cui et al. (arXiv 2505.22617): ``R = −a·exp(H) + b``.

Across RL training runs, Cui et al. find validation performance ``R`` and policy entropy ``H`` related by
``R = −a·e^H + b`` (their §2.4 and abstract; the §2 takeaway box's ``−a·exp(H + b)`` is a typo): performance is
bought with entropy, and the fitted curve predicts a ceiling ``R(H = 0) = b − a`` once entropy is spent.
:func:`exponential_tradeoff_fit` fits ``a`` and ``b`` by least squares on ``(H, R)`` pairs, e.g. held-out accuracy
at each evaluation against the token entropy of the steps before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["exponential_tradeoff_fit"]


def exponential_tradeoff_fit(entropy: Sequence[float], performance: Sequence[float]) -> dict[str, float]:
    """Least-squares ``R = −a·exp(H) + b`` over the finite pairs.

    With ``x = exp(H)`` this is the linear regression ``R = b − a·x``: ``a = −Cov(x, R) / Var(x)``,
    ``b = mean(R) + a·mean(x)``.

    Args:
        entropy: ``H`` per point (nats).
        performance: ``R`` per point (e.g. held-out accuracy).

    Returns:
        ``a``, ``b``, ``r2`` (the coefficient of determination of the fit), ``ceiling`` (``b − a``, the predicted
        performance at ``H = 0``) and ``n`` (pairs used); NaN (with ``n``) below two distinct entropies.

    Example::

        >>> fit = exponential_tradeoff_fit([0.1, 0.5, 1.0], [0.8, 0.6, 0.2])
        >>> round(fit["a"], 3), fit["n"]
        (0.372, 3.0)
    """
    if len(entropy) != len(performance):
        raise ValueError(f"{len(entropy)} entropies but {len(performance)} performances")
    pairs = [(math.exp(h), r) for h, r in zip(entropy, performance) if math.isfinite(h) and math.isfinite(r)]
    n = len(pairs)
    nan = {"a": math.nan, "b": math.nan, "r2": math.nan, "ceiling": math.nan, "n": float(n)}
    if n < 2:
        return nan
    mean_x = math.fsum(x for x, _ in pairs) / n
    mean_r = math.fsum(r for _, r in pairs) / n
    var_x = math.fsum((x - mean_x) ** 2 for x, _ in pairs)
    if var_x <= 0:
        return nan
    a = -math.fsum((x - mean_x) * (r - mean_r) for x, r in pairs) / var_x
    b = mean_r + a * mean_x
    total = math.fsum((r - mean_r) ** 2 for _, r in pairs)
    residual = math.fsum((r - (b - a * x)) ** 2 for x, r in pairs)
    r2 = 1.0 - residual / total if total > 0 else math.nan
    return {"a": a, "b": b, "r2": r2, "ceiling": b - a, "n": float(n)}
